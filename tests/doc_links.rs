//! Every relative link in the project's Markdown resolves: README.md,
//! ARCHITECTURE.md, CHANGELOG.md, ascend-sys/README.md and every `.md` under `docs/`.
//!
//! A link or image (`[text](target)`, `![alt](target)`, a reference definition
//! `[id]: target`, an HTML `href`/`src`) whose target is relative (no scheme such as
//! `https:` or `mailto:`) must name a file or directory that exists, relative to the
//! linking file (a target starting with `/`: relative to the repository's root).
//! A `#fragment` into a Markdown file (or a bare `#fragment`, into the linking file)
//! must be the GitHub-style slug of one of its headings, or an HTML `id`/`name` in it.
//! Code (fenced blocks and inline spans) is not read for links.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A link found in a Markdown text: its 1-based line and its target as written.
#[derive(Debug, PartialEq)]
struct Link {
    line: usize,
    target: String,
}

/// The Markdown files whose links are checked, relative to `root`.
fn doc_files(root: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = [
        "README.md",
        "ARCHITECTURE.md",
        "CHANGELOG.md",
        "ascend-sys/README.md",
    ]
    .iter()
    .map(PathBuf::from)
    .filter(|p| root.join(p).is_file())
    .collect();
    let mut dirs = vec![PathBuf::from("docs")];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(root.join(&dir)) else {
            continue;
        };
        let mut names: Vec<_> = entries.flatten().map(|e| e.file_name()).collect();
        names.sort();
        for name in names {
            let rel = dir.join(&name);
            if root.join(&rel).is_dir() {
                dirs.push(rel);
            } else if rel.extension().is_some_and(|e| e == "md") {
                files.push(rel);
            }
        }
    }
    files
}

/// The lines of `text` outside fenced code blocks, with inline code spans blanked:
/// `(line number, text)`.
fn prose_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    for (i, line) in text.lines().enumerate() {
        let t = line.trim_start();
        let run = |c: char| t.chars().take_while(|&x| x == c).count();
        let opener = ['`', '~']
            .into_iter()
            .map(|c| (c, run(c)))
            .find(|&(_, n)| n >= 3);
        match (fence, opener) {
            (None, Some(open)) => fence = Some(open),
            (Some((c, n)), Some((c2, n2))) if c == c2 && n2 >= n && t[n2..].trim().is_empty() => {
                fence = None
            }
            (None, None) => out.push((i + 1, blank_code_spans(line))),
            _ => {}
        }
    }
    out
}

/// `line` with the contents of its inline code spans (`` `x` ``, ``` ``x`` ```)
/// replaced by spaces.
fn blank_code_spans(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    let mut i = 0;
    while i < chars.len() {
        if chars[i] != '`' {
            out.push(chars[i]);
            i += 1;
            continue;
        }
        let n = chars[i..].iter().take_while(|&&c| c == '`').count();
        // The closing run of exactly `n` backticks, if any.
        let mut j = i + n;
        let mut close = None;
        while j < chars.len() {
            let m = chars[j..].iter().take_while(|&&c| c == '`').count();
            if m == n {
                close = Some(j);
                break;
            }
            j += m.max(1);
        }
        match close {
            Some(j) => {
                out.extend(std::iter::repeat_n(' ', j + n - i));
                i = j + n;
            }
            None => {
                out.extend(std::iter::repeat_n('`', n));
                i += n;
            }
        }
    }
    out
}

/// The target of an inline link starting right after its `(`: `<...>`, or up to
/// whitespace or the `)` that closes the link (balanced parentheses allowed).
fn inline_target(rest: &str) -> Option<String> {
    let rest = rest.trim_start();
    if let Some(r) = rest.strip_prefix('<') {
        return r.find('>').map(|end| r[..end].to_string());
    }
    let mut depth = 0usize;
    for (k, c) in rest.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => return Some(rest[..k].to_string()),
            ')' => depth -= 1,
            c if c.is_whitespace() => return Some(rest[..k].to_string()),
            _ => {}
        }
    }
    None
}

/// Every link target in `text` (see the module documentation).
fn links(text: &str) -> Vec<Link> {
    let mut out = Vec::new();
    for (line, prose) in prose_lines(text) {
        let mut push = |target: String| {
            if !target.is_empty() {
                out.push(Link { line, target });
            }
        };
        // Reference definitions: `[id]: target`.
        let t = prose.trim_start();
        if prose.len() - t.len() <= 3 && t.starts_with('[') && !t.starts_with("[^") {
            if let Some(end) = t.find("]:") {
                if let Some(target) = t[end + 2..].split_whitespace().next() {
                    push(target.trim_matches(|c| c == '<' || c == '>').to_string());
                }
                continue;
            }
        }
        for (at, _) in prose.match_indices("](") {
            if let Some(target) = inline_target(&prose[at + 2..]) {
                push(target);
            }
        }
        for attr in ["href=\"", "src=\""] {
            for (at, _) in prose.match_indices(attr) {
                let rest = &prose[at + attr.len()..];
                if let Some(end) = rest.find('"') {
                    push(rest[..end].to_string());
                }
            }
        }
    }
    out
}

/// GitHub's anchor for a heading's text: the rendered text lower-cased, every
/// character but letters, digits, `-`, `_` and spaces dropped, each space a `-`.
fn slug(heading: &str) -> String {
    // Render the inline Markdown that matters: links and images keep their text,
    // code spans their contents, HTML tags nothing.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        text.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        match after.find("](") {
            Some(close) => match inline_target(&after[close + 2..]) {
                Some(target) => {
                    text.push_str(&after[..close]);
                    let skip = after[close + 2..].find(&target).unwrap_or(0) + target.len();
                    let tail = &after[close + 2 + skip..];
                    rest = tail.split_once(')').map_or("", |(_, t)| t);
                }
                None => {
                    text.push('[');
                    rest = after;
                }
            },
            None => {
                text.push('[');
                rest = after;
            }
        }
    }
    text.push_str(rest);
    let mut plain = String::new();
    let mut in_tag = false;
    for c in text.chars() {
        match c {
            '<' => in_tag = true,
            '>' if in_tag => in_tag = false,
            _ if in_tag => {}
            _ => plain.push(c),
        }
    }
    plain
        .trim()
        .to_lowercase()
        .chars()
        .filter(|&c| c.is_alphanumeric() || c == '-' || c == '_' || c == ' ')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown text: its headings' slugs (a repeated slug gets `-1`,
/// `-2`, ... as on GitHub) and its HTML `id`s and `name`s.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut fence: Option<char> = None;
    for line in text.lines() {
        let t = line.trim_start();
        for c in ['`', '~'] {
            if t.starts_with(&c.to_string().repeat(3)) {
                fence = match fence {
                    None => Some(c),
                    Some(f) if f == c => None,
                    f => f,
                };
            }
        }
        if fence.is_some() || line.len() - t.len() > 3 {
            continue;
        }
        for attr in ["id=\"", "name=\""] {
            for (at, _) in line.match_indices(attr) {
                let rest = &line[at + attr.len()..];
                if let Some(end) = rest.find('"') {
                    out.insert(rest[..end].to_string());
                }
            }
        }
        let hashes = t.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !t[hashes..].starts_with([' ', '\t']) {
            continue;
        }
        let heading = t[hashes..].trim().trim_end_matches('#').trim_end();
        let base = slug(heading);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// `%XX` escapes decoded (as a browser does before asking for the file).
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
            if let Ok(b) = u8::from_str_radix(hex, 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Whether `target` names another resource by a scheme (`https:`, `mailto:`, ...).
fn is_external(target: &str) -> bool {
    let scheme: String = target.chars().take_while(|&c| c != ':').collect();
    scheme.len() < target.len()
        && scheme
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic())
        && scheme
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
}

/// Every broken relative link of the Markdown `files` under `root`, one line each:
/// `FILE:LINE: TARGET: why`.
fn broken_links(root: &Path, files: &[PathBuf]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut anchor_cache: BTreeMap<PathBuf, BTreeSet<String>> = BTreeMap::new();
    let mut anchors_of = |path: &Path| -> BTreeSet<String> {
        anchor_cache
            .entry(path.to_path_buf())
            .or_insert_with(|| anchors(&std::fs::read_to_string(path).unwrap_or_default()))
            .clone()
    };
    for file in files {
        let full = root.join(file);
        let text = std::fs::read_to_string(&full)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", full.display()));
        for link in links(&text) {
            if is_external(&link.target) {
                continue;
            }
            let (path, fragment) = match link.target.split_once('#') {
                Some((p, f)) => (p, Some(f)),
                None => (link.target.as_str(), None),
            };
            let path = percent_decode(path);
            let resolved = if path.is_empty() {
                full.clone()
            } else if let Some(from_root) = path.strip_prefix('/') {
                root.join(from_root)
            } else {
                full.parent().unwrap_or(root).join(&path)
            };
            let at = format!("{}:{}: {}", file.display(), link.line, link.target);
            if !resolved.exists() {
                problems.push(format!("{at}: no such file or directory"));
                continue;
            }
            let Some(fragment) = fragment.filter(|f| !f.is_empty()) else {
                continue;
            };
            if resolved.is_file() && resolved.extension().is_some_and(|e| e == "md") {
                let fragment = percent_decode(fragment);
                let known = anchors_of(&resolved);
                if !known.contains(&fragment) {
                    problems.push(format!(
                        "{at}: no heading of {} has the anchor `#{fragment}`",
                        if path.is_empty() {
                            "this file".to_string()
                        } else {
                            path.clone()
                        }
                    ));
                }
            }
        }
    }
    problems
}

#[test]
fn every_relative_link_in_the_docs_resolves() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = doc_files(root);
    for must in [
        "README.md",
        "ARCHITECTURE.md",
        "docs/guide/README.md",
        "docs/spec/program-format.md",
    ] {
        assert!(
            files.iter().any(|f| f == Path::new(must)),
            "{must} is not among the files checked: {files:?}"
        );
    }
    let checked: usize = files
        .iter()
        .map(|f| links(&std::fs::read_to_string(root.join(f)).unwrap()).len())
        .sum();
    assert!(
        checked > 50,
        "only {checked} links found: is the parser blind?"
    );
    let problems = broken_links(root, &files);
    assert!(
        problems.is_empty(),
        "{} broken link(s):\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// The checker itself, on a small tree with one good and several broken links.
#[test]
fn broken_links_and_anchors_are_reported_with_file_and_line() {
    let dir = std::env::temp_dir().join(format!("mpipe-doc-links-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("docs/sub")).unwrap();
    std::fs::write(
        dir.join("docs/sub/target.md"),
        "# Title\n\n## `refine(SCHEDULE, order = N)`\n\n## Usage\n\n## Usage\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("README.md"),
        "# Top\n\
         [ok](docs/sub/target.md) ![ok](docs/sub/) [ok](docs/sub/target.md#usage-1)\n\
         [ok](docs/sub/target.md#refineschedule-order--n) [ok](#top) [web](https://x.y/z)\n\
         [gone](docs/missing.md)\n\
         [bad anchor](docs/sub/target.md#nowhere)\n\
         `[in code](not/checked.md)`\n\
         ```\n[in a block](not/checked.md)\n```\n\
         [bad self](#nope)\n\
         [ref]: docs/also-missing.png\n",
    )
    .unwrap();
    let problems = broken_links(&dir, &[PathBuf::from("README.md")]);
    assert_eq!(
        problems,
        vec![
            "README.md:4: docs/missing.md: no such file or directory".to_string(),
            "README.md:5: docs/sub/target.md#nowhere: no heading of docs/sub/target.md has the anchor `#nowhere`".to_string(),
            "README.md:10: #nope: no heading of this file has the anchor `#nope`".to_string(),
            "README.md:11: docs/also-missing.png: no such file or directory".to_string(),
        ]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn slugs_are_githubs() {
    assert_eq!(slug("`refine(SCHEDULE)`"), "refineschedule");
    assert_eq!(
        slug("`zb2p`, `zb2p(v = N)`, `zb2p(encoders = spread | chain | ramp)`"),
        "zb2p-zb2pv--n-zb2pencoders--spread--chain--ramp"
    );
    assert_eq!(
        slug("Changes from the first agreed version"),
        "changes-from-the-first-agreed-version"
    );
    assert_eq!(slug("5.2 Communication"), "52-communication");
    assert_eq!(
        slug("The [guide](docs/guide/README.md) and `mpipe`"),
        "the-guide-and-mpipe"
    );
    assert_eq!(slug("snake_case <em>too</em>"), "snake_case-too");
}

/// The repository paths a text names in inline code (`mpipe-core/src/judge/bound.rs`,
/// `docs/spec/program-format.md`): spans that start with a workspace member's
/// directory, `docs/` or `profiles/` (paths a reader resolves from the repository's
/// root whatever file names them; a crate's own `src/...` or `tests/...` is left
/// out, being relative to a crate the text only implies), and hold no space, glob or
/// placeholder. With the 1-based line each is on.
fn code_paths(text: &str) -> Vec<(usize, String)> {
    const ROOTS: [&str; 8] = [
        "mpipe-core/",
        "mpipe-codegen/",
        "mpipe-macros/",
        "mpipe-runtime/",
        "ascend-sys/",
        "examples/mllm",
        "docs/",
        "profiles/",
    ];
    let mut out = Vec::new();
    let mut fence = false;
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fence = !fence;
            continue;
        }
        if fence {
            continue;
        }
        for (k, span) in line.split('`').enumerate() {
            let plain = span
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "/._-".contains(c));
            if k % 2 == 1 && plain && ROOTS.iter().any(|r| span.starts_with(r)) {
                out.push((i + 1, span.trim_end_matches('.').to_string()));
            }
        }
    }
    out
}

#[test]
fn every_repository_path_the_docs_name_in_code_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut missing = Vec::new();
    let mut seen = 0;
    for file in doc_files(root) {
        let text = std::fs::read_to_string(root.join(&file)).unwrap();
        for (line, path) in code_paths(&text) {
            seen += 1;
            if !root.join(&path).exists() {
                missing.push(format!("{}:{line}: `{path}`", file.display()));
            }
        }
    }
    assert!(
        seen > 20,
        "the docs name repository paths; found only {seen}"
    );
    assert!(
        missing.is_empty(),
        "paths named in the docs that do not exist (moved? renamed?):\n{}",
        missing.join("\n")
    );
}

#[test]
fn code_paths_are_read_from_inline_code_outside_fences() {
    let text = "see `mpipe-core/src/judge/bound.rs` and `cargo test`\n```\n`docs/x.md`\n```\n`docs/a b.md` `docs/*.md` `src/main.rs`";
    assert_eq!(
        code_paths(text),
        vec![(1, "mpipe-core/src/judge/bound.rs".to_string())]
    );
}
