//! Every example in `mpipe --help` and in each subcommand's `--help` runs.
//!
//! An example is a line of a help text that starts (after indentation) with
//! `mpipe ` or `$ mpipe `. Its words are split as a POSIX shell splits them (single
//! and double quotes; an unquoted `#` starts a comment) and run with the built
//! binary from the repository's root. It must exit 0, unless its comment says
//! `exit status N`; the only such status allowed is 1, for `check` of an invalid
//! program, and then the program must exit with exactly that.

use std::path::Path;
use std::process::{Command, Output};

fn mpipe(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_mpipe"))
        .args(args)
        .current_dir(Path::new(env!("CARGO_MANIFEST_DIR")))
        .output()
        .expect("run mpipe")
}

/// `line` split into words as a shell would, and its comment (after an unquoted
/// `#` that starts a word), if any.
fn shell_words(line: &str) -> (Vec<String>, Option<String>) {
    let mut words = Vec::new();
    let mut word: Option<String> = None;
    let mut chars = line.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        match c {
            '#' if word.is_none() => return (words, Some(line[i + 1..].trim().to_string())),
            c if c.is_whitespace() => words.extend(word.take()),
            '\'' => {
                let w = word.get_or_insert_with(String::new);
                for (_, q) in chars.by_ref() {
                    if q == '\'' {
                        break;
                    }
                    w.push(q);
                }
            }
            '"' => {
                let w = word.get_or_insert_with(String::new);
                while let Some((_, q)) = chars.next() {
                    match q {
                        '"' => break,
                        '\\' => w.extend(chars.next().map(|(_, e)| e)),
                        q => w.push(q),
                    }
                }
            }
            '\\' => word
                .get_or_insert_with(String::new)
                .extend(chars.next().map(|(_, e)| e)),
            c => word.get_or_insert_with(String::new).push(c),
        }
    }
    words.extend(word);
    (words, None)
}

/// One example of a help text: the line as written, the arguments after `mpipe`
/// and the exit status it documents.
#[derive(Debug, PartialEq)]
struct Example {
    line: String,
    args: Vec<String>,
    status: i32,
}

fn examples(help: &str) -> Vec<Example> {
    help.lines()
        .filter_map(|line| {
            let t = line.trim_start();
            let t = t.strip_prefix("$ ").unwrap_or(t);
            if !t.starts_with("mpipe ") {
                return None;
            }
            let (mut words, comment) = shell_words(t);
            words.remove(0);
            let status = comment
                .as_deref()
                .and_then(|c| c.split("exit status ").nth(1))
                .and_then(|rest| {
                    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                    digits.parse().ok()
                })
                .unwrap_or(0);
            Some(Example {
                line: t.to_string(),
                args: words,
                status,
            })
        })
        .collect()
}

/// The subcommands `mpipe --help` lists (its `Commands:` section), `help` aside.
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_string)
        .collect()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn every_example_in_the_help_texts_runs() {
    let top = mpipe(&["--help".to_string()]);
    assert!(top.status.success(), "{}", text(&top));
    let top = String::from_utf8_lossy(&top.stdout).into_owned();
    let subs = subcommands(&top);
    assert!(
        subs.len() >= 10 && subs.iter().any(|s| s == "compare"),
        "the Commands: section was not read: {subs:?}"
    );
    let mut helps = vec![("mpipe --help".to_string(), top.clone())];
    for sub in &subs {
        let out = mpipe(&[sub.clone(), "--help".to_string()]);
        assert!(out.status.success(), "mpipe {sub} --help: {}", text(&out));
        helps.push((
            format!("mpipe {sub} --help"),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ));
    }
    let all: Vec<(&str, Example)> = helps
        .iter()
        .flat_map(|(which, help)| examples(help).into_iter().map(move |e| (which.as_str(), e)))
        .collect();
    assert!(
        !examples(&top).is_empty(),
        "mpipe --help shows no example:\n{top}"
    );
    assert!(all.len() >= 8, "only {} examples found", all.len());
    let mut failures = Vec::new();
    for (which, e) in &all {
        if e.status != 0 {
            assert!(
                e.status == 1 && e.args.iter().any(|a| a == "check"),
                "{which}: `{}` documents exit status {}; only `check` of an invalid program \
                 may document one (1)",
                e.line,
                e.status
            );
        }
        let out = mpipe(&e.args);
        let got = out.status.code().unwrap_or(-1);
        if got != e.status {
            let shown = text(&out);
            let tail: Vec<&str> = shown.lines().rev().take(12).collect();
            failures.push(format!(
                "{which}: `{}` exited with {got}, expected {}:\n{}",
                e.line,
                e.status,
                tail.into_iter().rev().collect::<Vec<_>>().join("\n")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

#[test]
fn examples_are_split_as_a_shell_splits_them() {
    let (words, comment) = shell_words(
        r#"mpipe simulate --model "a b.toml" 'transpose(vision, zbv)' x\ y  # exit status 1"#,
    );
    assert_eq!(
        words,
        [
            "mpipe",
            "simulate",
            "--model",
            "a b.toml",
            "transpose(vision, zbv)",
            "x y"
        ]
    );
    assert_eq!(comment.as_deref(), Some("exit status 1"));
    let found =
        examples("Examples:\n  $ mpipe check f.json   # invalid: exit status 1\n  not mpipe x\n");
    assert_eq!(
        found,
        vec![Example {
            line: "mpipe check f.json   # invalid: exit status 1".to_string(),
            args: vec!["check".to_string(), "f.json".to_string()],
            status: 1,
        }]
    );
}
