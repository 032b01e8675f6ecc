//! The floors of mpipe-core: every module refers only to its own floor and the ones
//! below, and no modules refer to one another in a cycle.
//!
//! A *module* here is one source file (`a/mod.rs` is module `a`, `a/b.rs` module
//! `a::b`); inline `mod tests { ... }` blocks belong to their file. A module's floor
//! is its top folder under `src/` (see [`FLOORS`]); `lib.rs` is the crate root and
//! only declares and re-exports, so it is not checked.
//!
//! A reference is a path in code (comments, doc comments, string and character
//! literals stripped) that starts with `crate::`, `super::` or `self::`, including
//! every branch of a `use crate::{...}` tree, or with the name of a child module
//! the file declares (`mod child;` then `child::f()`). Each is resolved to the
//! longest module prefix that names a file. Doc links do not count: they are
//! comments.

use std::collections::BTreeMap;
use std::path::Path;

/// The floors, lowest first: a module in folder `FLOORS[i].0` may refer to modules
/// of floors `0..=i` only.
const FLOORS: [(&str, usize); 6] = [
    ("ir", 0),
    ("algebra", 1),
    ("judge", 2),
    ("search", 3),
    ("interop", 4),
    ("render", 4),
];

/// The floor of `module` (its path segments), or `None` when it is in no floor folder.
fn floor_of(module: &[String]) -> Option<usize> {
    let top = module.first()?;
    FLOORS
        .iter()
        .find(|(name, _)| name == top)
        .map(|&(_, floor)| floor)
}

/// One source file: its path under `src/` (with `/`) and its text.
struct Source {
    path: String,
    text: String,
}

/// The module path of a file under `src/`: `a/b.rs` -> `[a, b]`, `a/mod.rs` -> `[a]`,
/// `lib.rs` -> `[]`.
fn module_of(path: &str) -> Vec<String> {
    let path = path.strip_suffix(".rs").unwrap_or(path);
    let mut segs: Vec<String> = path.split('/').map(str::to_string).collect();
    if segs.last().is_some_and(|s| s == "mod" || s == "lib") {
        segs.pop();
    }
    segs
}

/// `text` with comments, string and character literals replaced by spaces (newlines
/// kept, so line numbers stay right).
fn strip(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |out: &mut String, ch: char| out.push(if ch == '\n' { '\n' } else { ' ' });
    let mut i = 0;
    while i < c.len() {
        let at = |k: usize| c.get(i + k).copied().unwrap_or('\0');
        if at(0) == '/' && at(1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if at(0) == '/' && at(1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && c.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if c[i] == '*' && c.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, c[i]);
                    i += 1;
                }
            }
        } else if at(0) == 'r'
            && (at(1) == '"' || (at(1) == '#' && (at(2) == '"' || at(2) == '#')))
            && !(i > 0 && (c[i - 1].is_alphanumeric() || c[i - 1] == '_'))
        {
            // Raw string r#"..."#.
            let mut hashes = 0;
            let mut j = i + 1;
            while c.get(j) == Some(&'#') {
                hashes += 1;
                j += 1;
            }
            j += 1; // the opening quote
            loop {
                if j >= c.len() {
                    break;
                }
                if c[j] == '"' && (0..hashes).all(|h| c.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            for &ch in &c[i..j.min(c.len())] {
                blank(&mut out, ch);
            }
            i = j;
        } else if at(0) == '"' {
            let mut j = i + 1;
            while j < c.len() && c[j] != '"' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            for &ch in &c[i..(j + 1).min(c.len())] {
                blank(&mut out, ch);
            }
            i = j + 1;
        } else if at(0) == '\'' && (at(1) == '\\' || at(2) == '\'') {
            // A character literal (a lifetime has no closing quote after one char).
            let mut j = i + 1;
            while j < c.len() && c[j] != '\'' {
                j += if c[j] == '\\' { 2 } else { 1 };
            }
            for &ch in &c[i..(j + 1).min(c.len())] {
                blank(&mut out, ch);
            }
            i = j + 1;
        } else {
            out.push(at(0));
            i += 1;
        }
    }
    out
}

/// A token of stripped code: an identifier, `::`, or one punctuation character.
#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    Path,
    Punct(char),
}

/// The tokens of stripped code, each with its line (1-based).
fn tokens(code: &str) -> Vec<(Tok, usize)> {
    let c: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let (mut i, mut line) = (0, 1);
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch.is_alphanumeric() || ch == '_' {
            let start = i;
            while i < c.len() && (c[i].is_alphanumeric() || c[i] == '_') {
                i += 1;
            }
            out.push((Tok::Ident(c[start..i].iter().collect()), line));
        } else if ch == ':' && c.get(i + 1) == Some(&':') {
            out.push((Tok::Path, line));
            i += 2;
        } else {
            out.push((Tok::Punct(ch), line));
            i += 1;
        }
    }
    out
}

/// Every path of a use tree or expression path starting at `toks[i]` (an identifier
/// followed by `::`), with the line it starts on: `a::b::{c, d::e}` gives `a::b::c`
/// and `a::b::d::e`.
fn paths_at(toks: &[(Tok, usize)], i: usize) -> Vec<Vec<String>> {
    fn tree(
        toks: &[(Tok, usize)],
        mut i: usize,
        prefix: &[String],
        out: &mut Vec<Vec<String>>,
    ) -> usize {
        let mut path = prefix.to_vec();
        loop {
            match toks.get(i).map(|t| &t.0) {
                Some(Tok::Ident(name)) => {
                    path.push(name.clone());
                    i += 1;
                    if toks.get(i).map(|t| &t.0) == Some(&Tok::Path) {
                        i += 1;
                        continue;
                    }
                    out.push(path);
                    return i;
                }
                Some(Tok::Punct('{')) => {
                    i += 1;
                    loop {
                        match toks.get(i).map(|t| &t.0) {
                            Some(Tok::Punct('}')) | None => return i + 1,
                            Some(Tok::Punct(',')) => i += 1,
                            Some(Tok::Punct('*')) => {
                                out.push(path.clone());
                                i += 1;
                            }
                            _ => {
                                let next = tree(toks, i, &path, out);
                                // `as` renames and anything else up to `,` or `}`.
                                i = next;
                                while !matches!(
                                    toks.get(i).map(|t| &t.0),
                                    Some(Tok::Punct(',')) | Some(Tok::Punct('}')) | None
                                ) {
                                    i += 1;
                                }
                            }
                        }
                    }
                }
                _ => {
                    out.push(path);
                    return i;
                }
            }
        }
    }
    let mut out = Vec::new();
    tree(toks, i, &[], &mut out);
    out
}

/// Whether `toks[i..]` starts with `#[cfg(test)]`.
fn is_cfg_test(toks: &[(Tok, usize)], i: usize) -> bool {
    let want = [
        Tok::Punct('#'),
        Tok::Punct('['),
        Tok::Ident("cfg".into()),
        Tok::Punct('('),
        Tok::Ident("test".into()),
        Tok::Punct(')'),
        Tok::Punct(']'),
    ];
    toks.len() >= i + want.len() && toks[i..i + want.len()].iter().map(|t| &t.0).eq(want.iter())
}

/// The index just past the item starting at `toks[i]`: up to its `;` or the `}`
/// that closes its first `{`.
fn skip_item(toks: &[(Tok, usize)], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < toks.len() {
        match toks[i].0 {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            Tok::Punct(';') if depth == 0 => return i + 1,
            _ => {}
        }
        i += 1;
    }
    i
}

/// Files declared only for tests (`#[cfg(test)] mod name;`), as module paths.
fn test_only(files: &[Source]) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for f in files {
        let toks = tokens(&strip(&f.text));
        for i in 0..toks.len() {
            if let (true, Some(Tok::Ident(m)), Some(Tok::Ident(name)), Some(Tok::Punct(';'))) = (
                is_cfg_test(&toks, i),
                toks.get(i + 7).map(|t| &t.0),
                toks.get(i + 8).map(|t| &t.0),
                toks.get(i + 9).map(|t| &t.0),
            ) {
                if m == "mod" {
                    let mut p = module_of(&f.path);
                    p.push(name.clone());
                    out.push(p);
                }
            }
        }
    }
    out
}

/// One reference from a module to another.
#[derive(Clone, Debug, PartialEq)]
struct Arrow {
    from: Vec<String>,
    file: String,
    line: usize,
    to: Vec<String>,
    /// The path as written.
    written: String,
}

/// Resolve `path` (absolute segments, no `crate`) to the longest prefix in `modules`.
fn resolve(path: &[String], modules: &[Vec<String>]) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|p| modules.contains(p))
}

/// Every reference each file makes to another module.
fn arrows(files: &[Source]) -> Vec<Arrow> {
    let modules: Vec<Vec<String>> = files.iter().map(|f| module_of(&f.path)).collect();
    let mut all = Vec::new();
    for (f, file) in files.iter().enumerate() {
        let me = &modules[f];
        let toks = tokens(&strip(&file.text));
        // Child modules declared by `mod name;`.
        let children: Vec<String> = toks
            .windows(3)
            .filter_map(|w| match (&w[0].0, &w[1].0, &w[2].0) {
                (Tok::Ident(m), Tok::Ident(name), Tok::Punct(';')) if m == "mod" => {
                    Some(name.clone())
                }
                _ => None,
            })
            .collect();
        // Inline `mod name {` blocks: (name, brace depth inside it).
        let mut inline: Vec<(String, usize)> = Vec::new();
        let mut depth = 0usize;
        let mut i = 0;
        while i < toks.len() {
            let (tok, line) = &toks[i];
            if is_cfg_test(&toks, i) {
                i = skip_item(&toks, i + 7);
                continue;
            }
            match tok {
                Tok::Punct('{') => {
                    depth += 1;
                    if i >= 2 {
                        if let (Tok::Ident(m), Tok::Ident(name)) = (&toks[i - 2].0, &toks[i - 1].0)
                        {
                            if m == "mod" {
                                inline.push((name.clone(), depth));
                            }
                        }
                    }
                    i += 1;
                    continue;
                }
                Tok::Punct('}') => {
                    if inline.last().is_some_and(|(_, d)| *d == depth) {
                        inline.pop();
                    }
                    depth = depth.saturating_sub(1);
                    i += 1;
                    continue;
                }
                _ => {}
            }
            let starts_path = matches!(tok, Tok::Ident(_))
                && toks.get(i + 1).map(|t| &t.0) == Some(&Tok::Path)
                && !(i > 0 && toks[i - 1].0 == Tok::Path);
            if !starts_path {
                i += 1;
                continue;
            }
            let Tok::Ident(head) = tok else {
                unreachable!()
            };
            let mut here: Vec<String> = me.clone();
            here.extend(inline.iter().map(|(n, _)| n.clone()));
            for path in paths_at(&toks, i) {
                let written = path.join("::");
                let absolute: Option<Vec<String>> = match head.as_str() {
                    "crate" => Some(path[1..].to_vec()),
                    "self" => Some(
                        here.iter()
                            .cloned()
                            .chain(path[1..].iter().cloned())
                            .collect(),
                    ),
                    "super" => {
                        let mut base = here.clone();
                        let mut rest = &path[..];
                        while rest.first().is_some_and(|s| s == "super") {
                            base.pop();
                            rest = &rest[1..];
                        }
                        Some(base.into_iter().chain(rest.iter().cloned()).collect())
                    }
                    h if children.iter().any(|c| c == h) && inline.is_empty() => {
                        Some(me.iter().cloned().chain(path.iter().cloned()).collect())
                    }
                    _ => None,
                };
                let flat = head == "crate"
                    && !path
                        .get(1)
                        .is_some_and(|f| FLOORS.iter().any(|(name, _)| name == f));
                let to = absolute.and_then(|p| resolve(&p, &modules));
                // A `crate::` path outside the floor folders goes through the root's
                // flat re-exports: reported as a reference to the root.
                let to = if flat { Some(Vec::new()) } else { to };
                if let Some(to) = to {
                    if &to != me {
                        all.push(Arrow {
                            from: me.clone(),
                            file: file.path.clone(),
                            line: *line,
                            to,
                            written,
                        });
                    }
                }
            }
            // Skip past this path's tokens.
            i += 1;
            while i < toks.len() && matches!(toks[i].0, Tok::Path | Tok::Ident(_)) {
                i += 1;
            }
        }
    }
    all
}

/// Strongly connected components with more than one module (Tarjan's algorithm).
fn cycles(nodes: &[Vec<String>], edges: &BTreeMap<usize, Vec<usize>>) -> Vec<Vec<usize>> {
    struct T<'a> {
        edges: &'a BTreeMap<usize, Vec<usize>>,
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(t: &mut T, v: usize) {
        t.index[v] = Some(t.next);
        t.low[v] = t.next;
        t.next += 1;
        t.stack.push(v);
        t.on[v] = true;
        for &w in t.edges.get(&v).map(Vec::as_slice).unwrap_or(&[]) {
            match t.index[w] {
                None => {
                    visit(t, w);
                    t.low[v] = t.low[v].min(t.low[w]);
                }
                Some(iw) if t.on[w] => t.low[v] = t.low[v].min(iw),
                _ => {}
            }
        }
        if Some(t.low[v]) == t.index[v] {
            let mut scc = Vec::new();
            while let Some(w) = t.stack.pop() {
                t.on[w] = false;
                scc.push(w);
                if w == v {
                    break;
                }
            }
            if scc.len() > 1 {
                scc.sort();
                t.out.push(scc);
            }
        }
    }
    let n = nodes.len();
    let mut t = T {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if t.index[v].is_none() {
            visit(&mut t, v);
        }
    }
    t.out
}

/// The module a file-level module path belongs to: in a floor folder, the file
/// directly in it (`search/auto.rs` -> `search::auto`) or the whole sub-folder
/// (`algebra/generators/zb2p.rs` -> `algebra::generators`); and `None` for a root
/// (`lib.rs`, a floor folder's `mod.rs`), which only declares and re-exports.
fn module_key(m: &[String]) -> Option<Vec<String>> {
    let depth = if FLOORS
        .iter()
        .any(|(f, _)| m.first().is_some_and(|t| t == f))
    {
        2
    } else {
        1 // outside every floor folder a file is its own module (and is reported)
    };
    (m.len() >= depth).then(|| m[..depth].to_vec())
}

/// Every breach of the floors in `files`, one line each: arrows up, modules in no
/// floor, references to a root, and cycles (with the arrows inside each).
fn breaches(files: &[Source]) -> Vec<String> {
    let tests = test_only(files);
    let files: Vec<&Source> = files
        .iter()
        .filter(|f| !tests.contains(&module_of(&f.path)))
        .collect();
    let mut out = Vec::new();
    let name = |m: &[String]| {
        if m.is_empty() {
            "crate".to_string()
        } else {
            m.join("::")
        }
    };
    let mut nodes: Vec<Vec<String>> = Vec::new();
    for f in &files {
        let m = module_of(&f.path);
        if let Some(k) = module_key(&m) {
            if floor_of(&k).is_none() {
                out.push(format!(
                    "{}: module `{}` is in no floor folder",
                    f.path,
                    name(&k)
                ));
            }
            if !nodes.contains(&k) {
                nodes.push(k);
            }
        }
    }
    let owned: Vec<Source> = files
        .iter()
        .map(|f| Source {
            path: f.path.clone(),
            text: f.text.clone(),
        })
        .collect();
    let arrows = arrows(&owned);
    let mut edges: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    let mut inside: Vec<(usize, usize, String)> = Vec::new();
    for a in &arrows {
        let Some(from) = module_key(&a.from) else {
            continue; // a root declares and re-exports
        };
        let Some(to) = module_key(&a.to) else {
            out.push(format!(
                "{}:{}: `{}` refers to `{}` through the root `{}`: refer to the module that defines it",
                a.file,
                a.line,
                name(&from),
                a.written,
                name(&a.to)
            ));
            continue;
        };
        if from == to {
            continue;
        }
        if let (Some(f), Some(t)) = (floor_of(&from), floor_of(&to)) {
            if t > f {
                out.push(format!(
                    "{}:{}: arrow up: `{}` (floor {f}) -> `{}` (floor {t}) via `{}`",
                    a.file,
                    a.line,
                    name(&from),
                    name(&to),
                    a.written
                ));
            }
        }
        let (Some(u), Some(v)) = (
            nodes.iter().position(|n| *n == from),
            nodes.iter().position(|n| *n == to),
        ) else {
            continue;
        };
        let e = edges.entry(u).or_default();
        if !e.contains(&v) {
            e.push(v);
        }
        inside.push((
            u,
            v,
            format!(
                "    {}:{}: {} -> {} via `{}`",
                a.file,
                a.line,
                name(&from),
                name(&to),
                a.written
            ),
        ));
    }
    for scc in cycles(&nodes, &edges) {
        let names: Vec<String> = scc.iter().map(|&v| name(&nodes[v])).collect();
        let lines: Vec<&str> = inside
            .iter()
            .filter(|(u, v, _)| scc.contains(u) && scc.contains(v))
            .map(|(_, _, l)| l.as_str())
            .collect();
        out.push(format!(
            "cycle between {}:\n{}",
            names.join(", "),
            lines.join("\n")
        ));
    }
    out
}

/// Every `.rs` file under `dir`, with its path relative to `root`.
fn read_tree(root: &Path, dir: &Path, out: &mut Vec<Source>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("read src dir")
        .map(|e| e.expect("dir entry").path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            read_tree(root, &p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            let rel = p.strip_prefix(root).expect("under src");
            let path = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push(Source {
                path,
                text: std::fs::read_to_string(&p).expect("read source"),
            });
        }
    }
}

#[test]
fn arrows_point_down_and_no_module_cycles() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    read_tree(&root, &root, &mut files);
    assert!(files.len() > 20, "found only {} source files", files.len());
    // The reader sees the tree's references (not an empty graph that passes).
    let seen = arrows(&files);
    assert!(seen.len() > 200, "found only {} references", seen.len());
    let found = breaches(&files);
    assert!(
        found.is_empty(),
        "{} breach(es) of mpipe-core's floors (see the crate doc of lib.rs):\n{}",
        found.len(),
        found.join("\n")
    );
}

fn src(path: &str, text: &str) -> Source {
    Source {
        path: path.to_string(),
        text: text.to_string(),
    }
}

#[test]
fn an_upward_use_is_caught_with_its_file_and_line() {
    let files = [
        src(
            "ir/program.rs",
            "pub struct Program;\n\nuse crate::search::auto::run;\n",
        ),
        src(
            "search/auto.rs",
            "use crate::ir::program::Program;\npub fn run() {}\n",
        ),
    ];
    let found = breaches(&files);
    assert!(
        found
            .iter()
            .any(|b| b.starts_with("ir/program.rs:3: arrow up")
                && b.contains("`ir::program` (floor 0) -> `search::auto` (floor 3)")),
        "{found:#?}"
    );
    // And it closes a cycle.
    assert!(
        found
            .iter()
            .any(|b| b.starts_with("cycle between ir::program, search::auto")),
        "{found:#?}"
    );
}

#[test]
fn use_trees_super_children_roots_and_cycles_are_resolved() {
    let files = [
        src(
            "algebra/mod.rs",
            "pub mod expr;\npub mod lower;\npub mod units;\n",
        ),
        src(
            "algebra/expr/mod.rs",
            "mod parse;\npub fn f() { parse::g() }\n",
        ),
        src(
            "algebra/expr/parse.rs",
            "use super::{f, super::lower::{h}};\npub fn g() {}\n",
        ),
        src(
            "algebra/lower.rs",
            "pub fn h() { crate::judge::sim::s(); crate::algebra::units::u() }\n",
        ),
        src("algebra/units.rs", "pub fn u() { super::lower::h() }\n"),
        src(
            "judge/sim.rs",
            "pub fn s() {}\n#[cfg(test)]\nmod tests { use super::s; use crate::search::auto; }\n",
        ),
        src(
            "search/auto.rs",
            "use crate::algebra::Thing;\nuse crate::simulate::run;\n",
        ),
    ];
    let a = arrows(&files);
    let has = |from: &str, to: &str| {
        a.iter()
            .any(|x| x.from.join("::") == from && x.to.join("::") == to)
    };
    // A child named bare, `super` and `super::super` inside a use tree.
    assert!(has("algebra::expr", "algebra::expr::parse"), "{a:#?}");
    assert!(has("algebra::expr::parse", "algebra::expr"), "{a:#?}");
    assert!(has("algebra::expr::parse", "algebra::lower"), "{a:#?}");
    let found = breaches(&files);
    // A folder is one module: expr and expr::parse make no cycle.
    assert!(
        !found
            .iter()
            .any(|b| b.contains("cycle between algebra::expr")),
        "{found:#?}"
    );
    // The planted upward call, and the cycle between two files of a floor.
    assert!(
        found
            .iter()
            .any(|b| b.starts_with("algebra/lower.rs:1: arrow up")
                && b.contains("`algebra::lower` (floor 1) -> `judge::sim` (floor 2)")),
        "{found:#?}"
    );
    assert!(
        found
            .iter()
            .any(|b| b.starts_with("cycle between algebra::lower, algebra::units")),
        "{found:#?}"
    );
    // Code under `#[cfg(test)]` is not counted: no arrow from judge up to search.
    assert!(
        !found
            .iter()
            .any(|b| b.contains("`judge::sim` (floor 2) -> `search")),
        "{found:#?}"
    );
    // Through a floor's root, or the crate root's flat re-exports: refused.
    assert!(
        found.iter().any(|b| b.starts_with("search/auto.rs:1:") && b.contains("through the root `algebra`")),
        "{found:#?}"
    );
    assert!(
        found
            .iter()
            .any(|b| b.starts_with("search/auto.rs:2:") && b.contains("through the root `crate`")),
        "{found:#?}"
    );
}

#[test]
fn comments_and_strings_are_not_references() {
    let files = [
        src(
            "ir/plan.rs",
            "//! See [`crate::search::auto`].\n/// [`crate::search::auto`]\nconst S: &str = \"crate::search::auto\";\n/* crate::search::auto */\nconst R: &str = r#\"crate::search::auto\"#;\nconst C: char = '\"'; fn f<'a>(x: &'a str) {}\n",
        ),
        src("search/auto.rs", "pub fn run() {}\n"),
    ];
    assert_eq!(breaches(&files), Vec::<String>::new());
}
