//! Reading a profile's text: TOML or JSON into a generic tree (with byte spans, for
//! TOML), then the tree into a [`Profile`], collecting every structural problem
//! (unknown key with a did-you-mean, missing key, wrong type) together with the
//! value rules of [`super::check`], each with its key path and, for TOML, its line.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;

use serde::Deserialize;

use crate::ir::text::edit_distance;

use super::{
    check, EncoderProfile, Extra, LinkProfile, LlmProfile, MemoryProfile, Profile, ProfileError,
    ProfileFormat, ProfileIssue, UnitsProfile, MAX_ENCODERS, MAX_UNIT_NAME_LEN,
};

/// Parse and validate TOML text.
pub(super) fn from_toml(text: &str) -> Result<Profile, ProfileError> {
    let root: toml::Spanned<TomlNode> = toml::from_str(text).map_err(|e| {
        let (line, column) = match e.span() {
            Some(span) => {
                let (l, c) = LineIndex::new(text).line_col(text, span.start);
                (Some(l), Some(c))
            }
            None => (None, None),
        };
        ProfileError::Syntax {
            format: ProfileFormat::Toml,
            message: one_line(e.message()),
            line,
            column,
        }
    })?;
    Decoder::new(Some((text, LineIndex::new(text)))).run(&SNode::from(root))
}

/// Parse and validate JSON text.
pub(super) fn from_json(text: &str) -> Result<Profile, ProfileError> {
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| ProfileError::Syntax {
            format: ProfileFormat::Json,
            message: strip_json_position(&e.to_string()),
            line: (e.line() > 0).then_some(e.line()),
            column: (e.line() > 0).then_some(e.column()),
        })?;
    Decoder::new(None).run(&SNode::from_json(value))
}

// ---------------------------------------------------------------------------
// Generic document tree (TOML with byte spans, or JSON without)
// ---------------------------------------------------------------------------

#[derive(Debug)]
enum Node {
    Null,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Datetime(String),
    Array(Vec<SNode>),
    Table(Vec<(String, SNode)>),
}

#[derive(Debug)]
struct SNode {
    node: Node,
    /// Byte range in the source text (TOML only).
    span: Option<Range<usize>>,
}

impl SNode {
    fn from_json(v: serde_json::Value) -> SNode {
        use serde_json::Value as J;
        let node = match v {
            J::Null => Node::Null,
            J::Bool(b) => Node::Bool(b),
            J::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Node::Int(i128::from(i))
                } else if let Some(u) = n.as_u64() {
                    Node::Int(i128::from(u))
                } else {
                    Node::Float(n.as_f64().unwrap_or(f64::NAN))
                }
            }
            J::String(s) => Node::Str(s),
            J::Array(a) => Node::Array(a.into_iter().map(SNode::from_json).collect()),
            J::Object(m) => Node::Table(
                m.into_iter()
                    .map(|(k, v)| (k, SNode::from_json(v)))
                    .collect(),
            ),
        };
        SNode { node, span: None }
    }
}

/// A TOML value whose children carry their spans (via [`toml::Spanned`]).
struct TomlNode(Node);

impl From<toml::Spanned<TomlNode>> for SNode {
    fn from(s: toml::Spanned<TomlNode>) -> SNode {
        let span = s.span();
        SNode {
            node: s.into_inner().0,
            span: Some(span),
        }
    }
}

/// The key toml uses to pass a datetime through serde.
const TOML_DATETIME_KEY: &str = "$__toml_private_datetime";

impl<'de> Deserialize<'de> for TomlNode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TomlNode, D::Error> {
        use serde::de::{MapAccess, SeqAccess, Visitor};
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TomlNode;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a TOML value")
            }
            fn visit_bool<E>(self, v: bool) -> Result<TomlNode, E> {
                Ok(TomlNode(Node::Bool(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<TomlNode, E> {
                Ok(TomlNode(Node::Int(i128::from(v))))
            }
            fn visit_u64<E>(self, v: u64) -> Result<TomlNode, E> {
                Ok(TomlNode(Node::Int(i128::from(v))))
            }
            fn visit_f64<E>(self, v: f64) -> Result<TomlNode, E> {
                Ok(TomlNode(Node::Float(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<TomlNode, E> {
                Ok(TomlNode(Node::Str(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<TomlNode, E> {
                Ok(TomlNode(Node::Str(v)))
            }
            fn visit_unit<E>(self) -> Result<TomlNode, E> {
                Ok(TomlNode(Node::Null))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut a: A) -> Result<TomlNode, A::Error> {
                let mut items = Vec::new();
                while let Some(x) = a.next_element::<toml::Spanned<TomlNode>>()? {
                    items.push(SNode::from(x));
                }
                Ok(TomlNode(Node::Array(items)))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut a: A) -> Result<TomlNode, A::Error> {
                let mut entries = Vec::new();
                while let Some(k) = a.next_key::<String>()? {
                    if k == TOML_DATETIME_KEY {
                        let text: String = a.next_value()?;
                        return Ok(TomlNode(Node::Datetime(text)));
                    }
                    let v = a.next_value::<toml::Spanned<TomlNode>>()?;
                    entries.push((k, SNode::from(v)));
                }
                Ok(TomlNode(Node::Table(entries)))
            }
        }
        d.deserialize_any(V)
    }
}

/// A short description of a value, for "found ..." in messages.
fn describe(node: &Node) -> String {
    match node {
        Node::Null => "null".to_string(),
        Node::Bool(b) => format!("the boolean `{b}`"),
        Node::Int(i) => format!("the integer `{i}`"),
        Node::Float(x) => format!("the number `{x:?}`"),
        Node::Str(s) => {
            let shown: String = s.chars().take(40).collect();
            let ellipsis = if shown.len() < s.len() { "..." } else { "" };
            format!("the string `{:?}`{ellipsis}", shown)
        }
        Node::Datetime(d) => format!("the date-time `{d}`"),
        Node::Array(_) => "an array".to_string(),
        Node::Table(_) => "a table".to_string(),
    }
}

/// Where every line of a text starts, so that the line of any byte offset is a binary
/// search (a profile has a value per line; scanning from the start for each one made
/// decoding quadratic in the number of keys).
struct LineIndex {
    /// Byte offset of the start of line 1, 2, ...
    starts: Vec<usize>,
}

impl LineIndex {
    fn new(text: &str) -> LineIndex {
        let mut starts = vec![0];
        starts.extend(
            text.bytes()
                .enumerate()
                .filter(|&(_, b)| b == b'\n')
                .map(|(i, _)| i + 1),
        );
        LineIndex { starts }
    }

    /// 1-based line of byte offset `at`.
    fn line(&self, at: usize) -> usize {
        self.starts.partition_point(|&s| s <= at).max(1)
    }

    /// 1-based line and column (in characters) of byte offset `at` in `text` (the
    /// column counts the characters of its line before `at`: used once, for a syntax
    /// error).
    fn line_col(&self, text: &str, at: usize) -> (usize, usize) {
        let mut at = at.min(text.len());
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let line = self.line(at);
        let line_start = self.starts[line - 1];
        let column = text[line_start..at].chars().count() + 1;
        (line, column)
    }
}

/// A multi-line parser message as one line.
fn one_line(message: &str) -> String {
    let parts: Vec<&str> = message
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    parts.join("; ")
}

/// serde_json appends " at line L column C"; the error reports those separately.
fn strip_json_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

// ---------------------------------------------------------------------------
// Decoding the tree into a Profile, collecting every structural problem
// ---------------------------------------------------------------------------

const TOP_KEYS: &[&str] = &["encoder", "llm", "memory", "link", "units"];
const ENCODER_KEYS: &[&str] = &[
    "name",
    "layers",
    "forward",
    "backward",
    "weight",
    "activation",
    "params",
    "trainable",
    "output",
];
const LLM_KEYS: &[&str] = &[
    "layers",
    "forward",
    "backward",
    "weight",
    "activation",
    "params",
    "output",
    "first_stage_extra",
    "last_stage_extra",
    "layout",
];
const EXTRA_KEYS: &[&str] = &["forward", "backward", "weight", "activation", "params"];
const MEMORY_KEYS: &[&str] = &["limit"];
const LINK_KEYS: &[&str] = &["latency", "bandwidth"];
const UNITS_KEYS: &[&str] = &["time", "memory"];

/// What a key holds, for "expected ..." in messages.
fn expectation(key: &str) -> &'static str {
    match key {
        "name" => "a string, the encoder's unit name (such as \"vision\")",
        "layers" => "the number of layers, a whole number >= 1",
        "forward" => "the forward (F) time, a number >= 0",
        "backward" => "the input-gradient backward (B) time, a number >= 0",
        "weight" => "the weight-gradient backward (W) time, a number >= 0",
        "activation" => "the activation memory kept for the backward, a number >= 0",
        "params" => "the parameter memory, a number >= 0",
        "output" => "the output activation size per micro-batch, a number >= 0",
        "trainable" => "`true` or `false`",
        "first_stage_extra" | "last_stage_extra" => {
            "a table with forward, backward, weight (and optionally activation, params)"
        }
        "layout" => "a Megatron-LM pipeline layout string, such as \"Et*3|(tt|)*29,m|L\"",
        "limit" => "the memory per rank, a number > 0",
        "latency" => "the fixed time per transfer, a number >= 0",
        "bandwidth" => "the size moved per unit of time, a number > 0",
        "llm" => "an `[llm]` table with layers, forward, backward, weight and activation",
        "memory" => "a `[memory]` table with `limit`",
        "link" => "a `[link]` table with `latency` and `bandwidth`",
        "units" => "a `[units]` table with `time` and/or `memory`, such as `time = \"ms\"`",
        "unit" => "a unit name, such as \"ms\" or \"GiB\": 1 to 16 printable characters",
        _ => "a value",
    }
}

/// A table being decoded: its fields, key path and valid keys.
struct Tbl<'n> {
    fields: &'n [(String, SNode)],
    path: String,
    keys: &'static [&'static str],
}

struct Decoder<'t> {
    /// The TOML source and its line index (none for JSON).
    text: Option<(&'t str, LineIndex)>,
    issues: Vec<ProfileIssue>,
    /// Paths whose value (or table) is missing or malformed: semantic checks of the
    /// placeholder values under them are not reported.
    bad: Vec<String>,
    /// Line of every value seen (or of the table of a missing key).
    lines: BTreeMap<String, usize>,
}

impl<'t> Decoder<'t> {
    fn new(text: Option<(&'t str, LineIndex)>) -> Self {
        Decoder {
            text,
            issues: Vec::new(),
            bad: Vec::new(),
            lines: BTreeMap::new(),
        }
    }

    fn line(&self, node: &SNode) -> Option<usize> {
        let (text, index) = self.text.as_ref()?;
        let span = node.span.as_ref()?;
        // The document root has the empty span 0..0: no useful line.
        if span.is_empty() && span.start == 0 {
            return None;
        }
        Some(index.line(span.start.min(text.len())))
    }

    /// The line of `path`, or of the nearest enclosing table that has one.
    fn line_of(&self, path: &str) -> Option<usize> {
        let mut p = path;
        loop {
            if let Some(l) = self.lines.get(p) {
                return Some(*l);
            }
            p = &p[..p.rfind(['.', '['])?];
        }
    }

    fn issue(&mut self, path: &str, line: Option<usize>, message: String, bad: bool) {
        if bad {
            self.bad.push(path.to_string());
        }
        self.issues.push(ProfileIssue {
            path: path.to_string(),
            message,
            line,
        });
    }

    fn run(mut self, root: &SNode) -> Result<Profile, ProfileError> {
        let profile = self.profile(root);
        let mut issues = std::mem::take(&mut self.issues);
        for mut issue in check::issues(&profile) {
            if self.bad.iter().any(|b| covers(b, &issue.path)) {
                continue;
            }
            issue.line = self.line_of(&issue.path);
            issues.push(issue);
        }
        if issues.is_empty() {
            return Ok(profile);
        }
        // Document order where lines are known; stable, so ties keep check order.
        issues.sort_by_key(|i| i.line.unwrap_or(usize::MAX));
        Err(ProfileError::Invalid(issues))
    }

    /// Check that `node` is a table with only `keys`, reporting every other key.
    fn table<'n>(
        &mut self,
        node: &'n SNode,
        path: &str,
        keys: &'static [&'static str],
        expected: &str,
    ) -> Option<Tbl<'n>> {
        let line = self.line(node);
        if let Some(l) = line {
            self.lines.insert(path.to_string(), l);
        }
        let Node::Table(fields) = &node.node else {
            let (p, shown) = if path.is_empty() {
                ("(document)", "the document")
            } else {
                (path, path)
            };
            self.issue(
                p,
                line,
                format!(
                    "expected {expected} for {shown}, found {}",
                    describe(&node.node)
                ),
                true,
            );
            return None;
        };
        for (key, value) in fields {
            if keys.contains(&key.as_str()) {
                continue;
            }
            let suggestion = match did_you_mean(key, keys) {
                Some(s) => format!("did you mean `{s}`? "),
                None => String::new(),
            };
            let l = self.line(value).or(line);
            let listed: Vec<String> = keys.iter().map(|k| format!("`{k}`")).collect();
            // A key as long as a file is named by its start (and its line).
            let key = &check::shortened(key);
            self.issue(
                &join(path, key),
                l,
                format!(
                    "unknown key `{key}`; {suggestion}expected one of {}",
                    listed.join(", ")
                ),
                false,
            );
        }
        Some(Tbl {
            fields,
            path: path.to_string(),
            keys,
        })
    }

    /// The value of `key` (a JSON `null` counts as absent), recording its line.
    fn get<'n>(&mut self, t: &Tbl<'n>, key: &str) -> Option<&'n SNode> {
        let node = t
            .fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
            .filter(|v| !matches!(v.node, Node::Null))?;
        if let Some(l) = self.line(node) {
            self.lines.insert(join(&t.path, key), l);
        }
        Some(node)
    }

    fn missing(&mut self, t: &Tbl<'_>, key: &str) {
        let p = join(&t.path, key);
        let mut line = self.lines.get(&t.path).copied();
        // A misspelling of the missing key: point at it.
        let mut hint = String::new();
        for (k, v) in t.fields {
            if !t.keys.contains(&k.as_str()) && did_you_mean(k, t.keys) == Some(key) {
                hint = format!(" (`{k}` is not a key: a misspelling?)");
                line = self.line(v).or(line);
                break;
            }
        }
        if let Some(l) = line {
            self.lines.insert(p.clone(), l);
        }
        let table = if t.path.is_empty() {
            "the document".to_string()
        } else {
            format!("`{}`", t.path)
        };
        self.issue(
            &p,
            line,
            format!(
                "missing key `{key}` in {table}{hint}; expected {}",
                expectation(key)
            ),
            true,
        );
    }

    fn wrong_type(&mut self, t: &Tbl<'_>, key: &str, node: &SNode, expected: &str) {
        let line = self.line(node);
        self.issue(
            &join(&t.path, key),
            line,
            format!("expected {expected}, found {}", describe(&node.node)),
            true,
        );
    }

    fn opt_f64(&mut self, t: &Tbl<'_>, key: &str) -> Option<f64> {
        let node = self.get(t, key)?;
        match node.node {
            Node::Float(x) => Some(x),
            // Integers are exact in f64 up to 2^53; beyond that, rounding is harmless.
            Node::Int(i) => Some(i as f64),
            _ => {
                self.wrong_type(t, key, node, expectation(key));
                None
            }
        }
    }

    fn f64(&mut self, t: &Tbl<'_>, key: &str, required: bool) -> f64 {
        if required && self.get(t, key).is_none() {
            self.missing(t, key);
            return 0.0;
        }
        self.opt_f64(t, key).unwrap_or(0.0)
    }

    fn layers(&mut self, t: &Tbl<'_>) -> u32 {
        let Some(node) = self.get(t, "layers") else {
            self.missing(t, "layers");
            return 0;
        };
        let expected = match node.node {
            Node::Int(i) => match u32::try_from(i) {
                Ok(n) => return n,
                Err(_) => "the number of layers, a whole number between 1 and 4294967295",
            },
            _ => "the number of layers, a whole number >= 1 (no decimal point)",
        };
        self.wrong_type(t, "layers", node, expected);
        0
    }

    fn profile(&mut self, root: &SNode) -> Profile {
        let mut profile = Profile {
            encoders: Vec::new(),
            llm: placeholder_llm(),
            memory: None,
            link: None,
            units: None,
        };
        let Some(top) = self.table(root, "", TOP_KEYS, "a table of profile keys") else {
            return profile;
        };

        if let Some(node) = self.get(&top, "encoder") {
            if let Node::Array(items) = &node.node {
                if items.len() > MAX_ENCODERS {
                    // Refused before any is decoded: thousands of encoder tables would
                    // each be checked for nothing.
                    let line = self.line(node);
                    self.issue(
                        "encoder",
                        line,
                        format!(
                            "found {} encoders; expected at most {MAX_ENCODERS} (mpipe's limit)",
                            items.len()
                        ),
                        true,
                    );
                } else {
                    for (i, item) in items.iter().enumerate() {
                        profile
                            .encoders
                            .push(self.encoder(item, &format!("encoder[{i}]")));
                    }
                }
            } else {
                self.wrong_type(
                    &top,
                    "encoder",
                    node,
                    "an array of encoder tables (`[[encoder]]` in TOML, a list of objects in JSON)",
                );
            }
        }

        match self.get(&top, "llm") {
            Some(node) => profile.llm = self.llm(node),
            None => self.missing(&top, "llm"),
        }
        if let Some(node) = self.get(&top, "memory") {
            if let Some(t) = self.table(node, "memory", MEMORY_KEYS, expectation("memory")) {
                profile.memory = Some(MemoryProfile {
                    limit: self.f64(&t, "limit", true),
                });
            }
        }
        if let Some(node) = self.get(&top, "link") {
            if let Some(t) = self.table(node, "link", LINK_KEYS, expectation("link")) {
                profile.link = Some(LinkProfile {
                    latency: self.f64(&t, "latency", true),
                    bandwidth: self.f64(&t, "bandwidth", true),
                });
            }
        }
        if let Some(node) = self.get(&top, "units") {
            if let Some(t) = self.table(node, "units", UNITS_KEYS, expectation("units")) {
                profile.units = Some(UnitsProfile {
                    time: self.unit_name(&t, "time"),
                    memory: self.unit_name(&t, "memory"),
                });
            }
        }
        profile
    }

    /// An optional unit name in `[units]`: 1 to [`MAX_UNIT_NAME_LEN`] characters, none
    /// of them a control character (it is printed in tables' headers).
    fn unit_name(&mut self, t: &Tbl<'_>, key: &str) -> Option<String> {
        match self.get(t, key)? {
            SNode {
                node: Node::Str(s), ..
            } if !s.is_empty()
                && s.chars().count() <= MAX_UNIT_NAME_LEN
                && !s.chars().any(char::is_control) =>
            {
                Some(s.clone())
            }
            node @ SNode {
                node: Node::Str(s), ..
            } => {
                let line = self.line(node);
                let shown: String = s.chars().take(MAX_UNIT_NAME_LEN).collect();
                self.issue(
                    &join(&t.path, key),
                    line,
                    format!(
                        "expected {}, found {:?}{}",
                        expectation("unit"),
                        shown,
                        if s.chars().count() > MAX_UNIT_NAME_LEN {
                            "..."
                        } else {
                            ""
                        }
                    ),
                    true,
                );
                None
            }
            other => {
                self.wrong_type(t, key, other, expectation("unit"));
                None
            }
        }
    }

    fn encoder(&mut self, node: &SNode, path: &str) -> EncoderProfile {
        let mut enc = EncoderProfile {
            name: String::new(),
            layers: 0,
            forward: 0.0,
            backward: 0.0,
            weight: None,
            activation: 0.0,
            params: 0.0,
            trainable: false,
            output: 0.0,
        };
        let Some(t) = self.table(
            node,
            path,
            ENCODER_KEYS,
            "an encoder table (name, layers, forward, backward, activation, ...)",
        ) else {
            return enc;
        };
        match self.get(&t, "name") {
            Some(SNode {
                node: Node::Str(s), ..
            }) => enc.name = s.clone(),
            Some(other) => self.wrong_type(&t, "name", other, expectation("name")),
            None => self.missing(&t, "name"),
        }
        enc.layers = self.layers(&t);
        enc.forward = self.f64(&t, "forward", true);
        enc.backward = self.f64(&t, "backward", true);
        enc.weight = self.opt_f64(&t, "weight");
        enc.activation = self.f64(&t, "activation", true);
        enc.params = self.f64(&t, "params", false);
        match self.get(&t, "trainable") {
            Some(SNode {
                node: Node::Bool(b),
                ..
            }) => enc.trainable = *b,
            Some(other) => {
                self.wrong_type(&t, "trainable", other, expectation("trainable"));
                // Do not also complain that a (maybe) trainable encoder lacks `weight`.
                self.bad.push(join(path, "weight"));
            }
            None => {}
        }
        enc.output = self.f64(&t, "output", false);
        enc
    }

    fn llm(&mut self, node: &SNode) -> LlmProfile {
        let mut llm = placeholder_llm();
        let Some(t) = self.table(node, "llm", LLM_KEYS, expectation("llm")) else {
            return llm;
        };
        llm.layers = self.layers(&t);
        llm.forward = self.f64(&t, "forward", true);
        llm.backward = self.f64(&t, "backward", true);
        llm.weight = self.f64(&t, "weight", true);
        llm.activation = self.f64(&t, "activation", true);
        llm.params = self.f64(&t, "params", false);
        llm.output = self.f64(&t, "output", false);
        llm.first_stage_extra = self.extra(&t, "first_stage_extra");
        llm.last_stage_extra = self.extra(&t, "last_stage_extra");
        match self.get(&t, "layout") {
            Some(SNode {
                node: Node::Str(s), ..
            }) => llm.layout = Some(s.clone()),
            Some(other) => self.wrong_type(&t, "layout", other, expectation("layout")),
            None => {}
        }
        llm
    }

    fn extra(&mut self, llm: &Tbl<'_>, key: &str) -> Option<Extra> {
        let node = self.get(llm, key)?;
        let t = self.table(node, &format!("llm.{key}"), EXTRA_KEYS, expectation(key))?;
        Some(Extra {
            forward: self.f64(&t, "forward", true),
            backward: self.f64(&t, "backward", true),
            weight: self.f64(&t, "weight", true),
            activation: self.f64(&t, "activation", false),
            params: self.f64(&t, "params", false),
        })
    }
}

fn placeholder_llm() -> LlmProfile {
    LlmProfile {
        layers: 0,
        forward: 0.0,
        backward: 0.0,
        weight: 0.0,
        activation: 0.0,
        params: 0.0,
        output: 0.0,
        first_stage_extra: None,
        last_stage_extra: None,
        layout: None,
        split: Default::default(),
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// Whether the problem at `bad` makes any check of `path` meaningless: `path` is
/// `bad` or lies under it. The empty path (the document) covers everything.
fn covers(bad: &str, path: &str) -> bool {
    bad.is_empty()
        || bad == "(document)"
        || path == bad
        || path
            .strip_prefix(bad)
            .is_some_and(|rest| rest.starts_with('.') || rest.starts_with('['))
}

/// The valid key closest to `key`, if it is close enough to be a likely typo.
fn did_you_mean<'k>(key: &str, valid: &[&'k str]) -> Option<&'k str> {
    // No valid key is within a typo of a much longer one (and the distance's table
    // grows with the product of the lengths).
    let longest = valid.iter().map(|k| k.len()).max().unwrap_or(0);
    if key.len() > 2 * longest + 2 {
        return None;
    }
    let lower = key.to_ascii_lowercase();
    let mut best: Option<(usize, &'k str)> = None;
    for &candidate in valid {
        let d = edit_distance(&lower, candidate);
        let limit = (candidate.chars().count() / 3).max(1);
        let better = match best {
            None => true,
            Some((bd, _)) => d < bd,
        };
        if d <= limit && better {
            best = Some((d, candidate));
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edit_distance_counts_transpositions_once() {
        assert_eq!(edit_distance("fowrard", "forward"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(did_you_mean("Forward", ENCODER_KEYS), Some("forward"));
        assert_eq!(did_you_mean("x", ENCODER_KEYS), None);
    }
}
