//! Reading a program document with errors a person can act on.
//!
//! `Program::from_json` stops at the first problem and names it by line and column
//! only. When it fails, this module walks the document itself and reports every
//! structural problem it finds by key path (`programs[1][4].op`, `units[0].cost.F`),
//! with the rank and action index where there is one. Only the shape of the
//! document is checked here (keys present, of the right JSON type); whether the
//! values make sense is the verifier's job.

use mpipe_core::expr::{MAX_EXPR_LEN, MAX_NAME_LEN};
use mpipe_core::program::Program;
use serde_json::Value;

use crate::failure::snippet;

/// Stop listing after this many problems (a broken generator can produce thousands).
const MAX_LISTED: usize = 20;

/// Parse `text` as an `mpipe-program/1` document; on failure every problem found,
/// one message each (the last may say how many more were left out).
pub(crate) fn decode_program(text: &str) -> Result<Program, Vec<String>> {
    let first = match Program::from_json(text) {
        Ok(p) => return check_names(p),
        Err(e) => e,
    };
    if first.is_syntax() || first.is_eof() {
        let mut msg = format!(
            "not valid JSON: {}",
            strip_position(&first.to_string(), first.line(), first.column())
        );
        msg.push_str(&format!(
            " (line {}, column {})",
            first.line(),
            first.column()
        ));
        if let Some(s) = snippet(text, first.line(), Some(first.column())) {
            msg.push('\n');
            msg.push_str(&s);
        }
        return Err(vec![msg]);
    }
    let value: Value = match serde_json::from_str(text) {
        Ok(v) => v,
        Err(e) => return Err(vec![format!("not valid JSON: {e}")]),
    };
    let mut w = Walker::default();
    w.document(&value);
    if w.problems.is_empty() {
        // The walk missed what serde saw: fall back to serde's own words.
        w.problems.push(first.to_string());
    }
    if w.problems.len() > MAX_LISTED {
        let more = w.problems.len() - MAX_LISTED;
        w.problems.truncate(MAX_LISTED);
        w.problems.push(format!("... and {more} more problems"));
    }
    Err(w.problems)
}

/// Every unit name a program uses (its units, their inputs, its actions, its
/// prefetches) is at most [`MAX_NAME_LEN`] characters, and its source expression at
/// most [`MAX_EXPR_LEN`] bytes: names are repeated in every message, plan and table.
fn check_names(p: Program) -> Result<Program, Vec<String>> {
    let mut problems = Vec::new();
    let mut long = |at: String, name: &str| {
        let n = name.chars().count();
        if n > MAX_NAME_LEN && problems.len() <= MAX_LISTED {
            let head: String = name.chars().take(24).collect();
            problems.push(format!(
                "{at}: the unit name `{}...` is {n} characters long; expected at most \
                 {MAX_NAME_LEN} (MAX_NAME_LEN, mpipe's limit on unit names)",
                head.escape_debug()
            ));
        }
    };
    for (i, u) in p.units.iter().enumerate() {
        long(format!("units[{i}].name"), &u.name);
        for (j, input) in u.inputs.iter().enumerate() {
            long(format!("units[{i}].inputs[{j}]"), input);
        }
    }
    for (k, pf) in p.prefetch.iter().enumerate() {
        long(format!("prefetch[{k}].unit"), &pf.unit);
    }
    for (r, actions) in p.programs.iter().enumerate() {
        for (i, a) in actions.iter().enumerate() {
            long(format!("programs[{r}][{i}].unit"), a.unit());
        }
    }
    if let Some(source) = &p.source {
        if source.expr.len() > MAX_EXPR_LEN {
            problems.push(format!(
                "source.expr: the expression is {} bytes long; expected at most \
                 {MAX_EXPR_LEN} (MAX_EXPR_LEN)",
                source.expr.len()
            ));
        }
    }
    if problems.len() > MAX_LISTED {
        problems.truncate(MAX_LISTED);
        problems.push("... and more names over the limit".to_string());
    }
    if problems.is_empty() {
        Ok(p)
    } else {
        Err(problems)
    }
}

/// serde_json appends ` at line L column C`; the caller prints the position itself.
fn strip_position(msg: &str, line: usize, column: usize) -> String {
    let suffix = format!(" at line {line} column {column}");
    msg.strip_suffix(&suffix).unwrap_or(msg).to_string()
}

/// A JSON value described for a message: `the string "x"`, `the number -3`, ...
fn describe(v: &Value) -> String {
    let mut s = match v {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("`{b}`"),
        Value::Number(n) => format!("the number {n}"),
        Value::String(s) => format!("the string {}", Value::String(s.clone())),
        Value::Array(a) => format!("an array of {} element(s)", a.len()),
        Value::Object(_) => "an object".to_string(),
    };
    if s.chars().count() > 60 {
        s = s.chars().take(57).collect::<String>() + "...";
    }
    s
}

/// The JSON shapes the document uses.
#[derive(Clone, Copy)]
enum Kind {
    Str,
    /// A whole number >= 0.
    Count,
    /// Any finite number.
    Num,
    Bool,
}

impl Kind {
    fn accepts(self, v: &Value) -> bool {
        match self {
            Kind::Str => v.is_string(),
            Kind::Count => v.is_u64(),
            Kind::Num => v.is_number(),
            Kind::Bool => v.is_boolean(),
        }
    }

    fn expected(self) -> &'static str {
        match self {
            Kind::Str => "a string",
            Kind::Count => "a whole number >= 0",
            Kind::Num => "a number",
            Kind::Bool => "`true` or `false`",
        }
    }
}

const OPS: [&str; 9] = ["F", "B", "W", "BW", "RF", "SEND", "RECV", "BCAST", "REDUCE"];
const TENSORS: [&str; 3] = ["act", "grad", "input"];

#[derive(Default)]
struct Walker {
    problems: Vec<String>,
}

impl Walker {
    fn problem(&mut self, at: &str, msg: impl std::fmt::Display) {
        self.problems.push(format!("{at}: {msg}"));
    }

    /// Check `obj[key]` has the `kind` shape; `required` says a missing key is an error.
    fn field<'v>(
        &mut self,
        obj: &'v serde_json::Map<String, Value>,
        at: &str,
        key: &str,
        kind: Kind,
        required: bool,
    ) -> Option<&'v Value> {
        let path = format!("{at}.{key}");
        match obj.get(key) {
            None if required => {
                self.problem(at, format!("missing key `{key}` ({})", kind.expected()));
                None
            }
            None => None,
            Some(v) if kind.accepts(v) => Some(v),
            Some(Value::Null) if !required => None,
            Some(v) => {
                self.problem(
                    &path,
                    format!("expected {}, found {}", kind.expected(), describe(v)),
                );
                None
            }
        }
    }

    /// `obj[key]` must be one of `choices`.
    fn choice(
        &mut self,
        obj: &serde_json::Map<String, Value>,
        at: &str,
        key: &str,
        choices: &[&str],
    ) -> Option<String> {
        let v = obj.get(key);
        match v.and_then(Value::as_str) {
            Some(s) if choices.contains(&s) => Some(s.to_string()),
            _ => {
                let found = v.map_or("nothing (the key is missing)".to_string(), describe);
                self.problem(
                    &format!("{at}.{key}"),
                    format!(
                        "expected one of {}, found {found}",
                        choices
                            .iter()
                            .map(|c| format!("\"{c}\""))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                );
                None
            }
        }
    }

    fn array<'v>(
        &mut self,
        obj: &'v serde_json::Map<String, Value>,
        at: &str,
        key: &str,
        what: &str,
    ) -> Option<&'v Vec<Value>> {
        match obj.get(key) {
            None => {
                self.problem(at, format!("missing key `{key}` ({what})"));
                None
            }
            Some(Value::Array(a)) => Some(a),
            Some(v) => {
                self.problem(
                    &format!("{at}.{key}"),
                    format!("expected {what}, found {}", describe(v)),
                );
                None
            }
        }
    }

    fn document(&mut self, v: &Value) {
        let Some(doc) = v.as_object() else {
            self.problems.push(format!(
                "the document must be a JSON object with the keys format, ranks, \
                 microbatches, units and programs; found {}",
                describe(v)
            ));
            return;
        };
        let at = "document";
        self.field(doc, at, "format", Kind::Str, true);
        self.field(doc, at, "ranks", Kind::Count, true);
        self.field(doc, at, "microbatches", Kind::Count, true);
        if let Some(units) = self.array(doc, at, "units", "an array of units") {
            for (i, u) in units.iter().enumerate() {
                self.unit(&format!("units[{i}]"), u);
            }
        }
        if let Some(p) = doc.get("prefetch") {
            self.prefetch(p);
        }
        if let Some(ranks) = self.array(
            doc,
            at,
            "programs",
            "an array with one action list per rank",
        ) {
            for (r, list) in ranks.iter().enumerate() {
                let Some(list) = list.as_array() else {
                    self.problem(
                        &format!("programs[{r}]"),
                        format!(
                            "expected rank {r}'s action list (an array), found {}",
                            describe(list)
                        ),
                    );
                    continue;
                };
                for (i, a) in list.iter().enumerate() {
                    self.action(r, i, a);
                }
            }
        }
    }

    fn unit(&mut self, at: &str, v: &Value) {
        let Some(u) = v.as_object() else {
            self.problem(
                at,
                format!("expected a unit (an object), found {}", describe(v)),
            );
            return;
        };
        // Name the unit in the path when it has a name, to find it in the file.
        let at = match u.get("name").and_then(Value::as_str) {
            Some(name) => format!("{at} (`{name}`)"),
            None => at.to_string(),
        };
        self.field(u, &at, "name", Kind::Str, true);
        if let Some(inputs) = self.array(u, &at, "inputs", "an array of unit names") {
            for (k, x) in inputs.iter().enumerate() {
                if !x.is_string() {
                    self.problem(
                        &format!("{at}.inputs[{k}]"),
                        format!("expected a unit name (a string), found {}", describe(x)),
                    );
                }
            }
        }
        self.field(u, &at, "home", Kind::Count, true);
        self.field(u, &at, "trainable", Kind::Bool, true);
        match u.get("cost") {
            None => self.problem(&at, "missing key `cost` (an object {\"F\", \"B\", \"W\"})"),
            Some(Value::Object(c)) => {
                let cat = format!("{at}.cost");
                for k in ["F", "B", "W"] {
                    self.field(c, &cat, k, Kind::Num, true);
                }
            }
            Some(x) => self.problem(
                &format!("{at}.cost"),
                format!(
                    "expected an object {{\"F\", \"B\", \"W\"}}, found {}",
                    describe(x)
                ),
            ),
        }
        self.field(u, &at, "act", Kind::Num, true);
        for key in ["bytes", "params"] {
            // Optional, but a number when present (`null` is not "absent" here).
            if u.get(key) == Some(&Value::Null) {
                self.problem(
                    &format!("{at}.{key}"),
                    "expected a number (or leave the key out), found null",
                );
            }
            self.field(u, &at, key, Kind::Num, false);
        }
    }

    /// The optional `prefetch` list: `{"unit": NAME, "mb": N}` entries.
    fn prefetch(&mut self, v: &Value) {
        let Some(list) = v.as_array() else {
            self.problem(
                "document.prefetch",
                format!(
                    "expected an array of {{\"unit\", \"mb\"}} entries, found {}",
                    describe(v)
                ),
            );
            return;
        };
        for (i, e) in list.iter().enumerate() {
            let at = format!("prefetch[{i}]");
            match e.as_object() {
                Some(o) => {
                    self.field(o, &at, "unit", Kind::Str, true);
                    self.field(o, &at, "mb", Kind::Count, true);
                }
                None => self.problem(
                    &at,
                    format!(
                        "expected an entry {{\"unit\", \"mb\"}} (an object), found {}",
                        describe(e)
                    ),
                ),
            }
        }
    }

    fn action(&mut self, r: usize, i: usize, v: &Value) {
        let at = format!("programs[{r}][{i}] (rank {r}, action {i})");
        let Some(a) = v.as_object() else {
            self.problem(
                &at,
                format!("expected an action (an object), found {}", describe(v)),
            );
            return;
        };
        let Some(op) = self.choice(a, &at, "op", &OPS) else {
            return;
        };
        self.field(a, &at, "unit", Kind::Str, true);
        match op.as_str() {
            "SEND" | "RECV" => {
                self.choice(a, &at, "tensor", &TENSORS);
                self.field(a, &at, "mb", Kind::Count, true);
                self.field(a, &at, "peer", Kind::Count, true);
                self.field(a, &at, "batch", Kind::Count, false);
            }
            "BCAST" | "REDUCE" => {
                self.field(a, &at, "root", Kind::Count, true);
                if let Some(group) = self.array(a, &at, "group", "an array of ranks") {
                    for (k, x) in group.iter().enumerate() {
                        if !x.is_u64() {
                            self.problem(
                                &format!("{at}.group[{k}]"),
                                format!(
                                    "expected a rank (a whole number >= 0), found {}",
                                    describe(x)
                                ),
                            );
                        }
                    }
                }
            }
            _ => {
                self.field(a, &at, "mb", Kind::Count, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A well-formed program whose unit names are 80,000 characters long is refused
    /// with the limit named, in short messages (one per place, at most MAX_LISTED).
    #[test]
    fn long_unit_names_are_refused_with_the_limit() {
        let program = |name: &str| {
            format!(
                r#"{{"format": "mpipe-program/1", "ranks": 1, "microbatches": 1,
                  "units": [{{"name": "{name}", "inputs": [], "home": 0, "trainable": true,
                             "cost": {{"F": 1, "B": 1, "W": 1}}, "act": 1}}],
                  "programs": [[{{"op": "F", "unit": "{name}", "mb": 0}},
                                {{"op": "BW", "unit": "{name}", "mb": 0}}]]}}"#
            )
        };
        let e = decode_program(&program(&"u".repeat(80_000))).unwrap_err();
        assert_eq!(e.len(), 3, "{e:?}");
        assert!(e[0].starts_with("units[0].name: "), "{}", e[0]);
        assert!(e[1].starts_with("programs[0][0].unit: "), "{}", e[1]);
        for p in &e {
            assert!(p.contains("80000 characters long"), "{p}");
            assert!(p.contains(&format!("at most {MAX_NAME_LEN}")), "{p}");
            assert!(p.len() < 300, "{p}");
        }
        assert!(decode_program(&program(&"u".repeat(MAX_NAME_LEN))).is_ok());
    }

    #[test]
    fn syntax_errors_point_at_the_spot() {
        let e = decode_program("{\n  \"ranks\": 2,,\n}").unwrap_err();
        assert_eq!(e.len(), 1);
        assert!(e[0].contains("line 2"), "{}", e[0]);
        assert!(e[0].contains("2 |   \"ranks\": 2,,"), "{}", e[0]);
        assert!(e[0].contains('^'), "{}", e[0]);
    }

    #[test]
    fn every_structural_problem_is_named_by_path() {
        let text = r#"{"format": "mpipe-program/1", "ranks": "two", "microbatches": 1,
          "units": [{"name": "a", "inputs": [], "home": 0, "trainable": true,
                     "cost": {"F": 1, "B": "x", "W": 1}, "act": 1}],
          "programs": [[{"op": "Z", "unit": "a", "mb": 0},
                        {"op": "SEND", "tensor": "acts", "unit": "a", "mb": 0, "peer": 1}]]}"#;
        let e = decode_program(text).unwrap_err();
        let all = e.join("\n");
        assert!(
            all.contains("document.ranks: expected a whole number"),
            "{all}"
        );
        assert!(
            all.contains("units[0] (`a`).cost.B: expected a number, found the string \"x\""),
            "{all}"
        );
        assert!(
            all.contains("programs[0][0] (rank 0, action 0).op: expected one of"),
            "{all}"
        );
        assert!(
            all.contains("programs[0][1] (rank 0, action 1).tensor"),
            "{all}"
        );
        assert_eq!(e.len(), 4, "{all}");
    }

    #[test]
    fn extension_keys_are_named_by_path_too() {
        let text = r#"{"format": "mpipe-program/1", "ranks": 1, "microbatches": 1,
          "units": [{"name": "a", "inputs": [], "home": 0, "trainable": true,
                     "cost": {"F": 1, "B": 1, "W": 1}, "act": 1, "params": null}],
          "programs": [[]], "prefetch": [1, {"unit": "a"}]}"#;
        let e = decode_program(text).unwrap_err();
        let all = e.join("\n");
        assert!(
            all.contains(
                "units[0] (`a`).params: expected a number (or leave the key out), found null"
            ),
            "{all}"
        );
        assert!(all.contains("prefetch[0]: expected an entry"), "{all}");
        assert!(all.contains("prefetch[1]: missing key `mb`"), "{all}");
        assert_eq!(e.len(), 3, "{all}");
        let null = text.replace("[1, {\"unit\": \"a\"}]", "null");
        let e = decode_program(&null).unwrap_err().join("\n");
        assert!(e.contains("document.prefetch: expected an array"), "{e}");
    }

    #[test]
    fn not_an_object() {
        let e = decode_program("[1, 2]").unwrap_err();
        assert!(e[0].contains("must be a JSON object"), "{e:?}");
    }
}
