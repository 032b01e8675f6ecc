//! A user crate outside the repository, made as the driver chapter
//! (docs/guide/driver.md) says: `cargo new`, the blocks marked
//! `<!-- driver-crate: PATH -->` as its files, and `auto` on
//! `profiles/qwen2vl-7b.toml` at 8 ranks x 32 micro-batches. With `auto`'s choice
//! in the cache, the crate builds and runs, and a rebuild after a change to an
//! unrelated file takes under 5 s in the dev profile (issue 38).
//!
//! The cache is seeded here, by the same expansion the macro runs
//! (`mpipe_codegen::schedule_with`, in this release test binary): searching in
//! the dev-profile macro would take minutes. The crate's build directory is kept
//! (`$CARGO_TARGET_DIR/user-crate`, else `target/user-crate`), so only the first run
//! compiles its dependencies.

use mpipe_codegen::cache::Cache;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime};

/// The repository's root.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("mpipe-codegen is in the repository")
        .to_path_buf()
}

/// One file block of the chapter: its path in the crate, whether it is appended to
/// the file `cargo new` made, and its text.
struct Block {
    path: String,
    append: bool,
    text: String,
}

/// The chapter's blocks marked `<!-- driver-crate: [append ]PATH -->`, in order. (Their
/// Rust blocks are fenced as `rs`, which rustdoc does not take for doctests: they are
/// compiled here, in a crate of their own, not as doctests of the `mpipe` crate.)
fn blocks(chapter: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut lines = chapter.lines();
    while let Some(line) = lines.next() {
        let Some(spec) = line
            .trim()
            .strip_prefix("<!-- driver-crate:")
            .and_then(|s| s.strip_suffix("-->"))
        else {
            continue;
        };
        let spec = spec.trim();
        let (append, path) = match spec.strip_prefix("append ") {
            Some(p) => (true, p.trim()),
            None => (false, spec),
        };
        let fence = lines.next().expect("a code block after the marker");
        assert!(
            fence.starts_with("```"),
            "a fence after {line}, not {fence}"
        );
        let mut text = String::new();
        for l in lines.by_ref() {
            if l.starts_with("```") {
                break;
            }
            text.push_str(l);
            text.push('\n');
        }
        out.push(Block {
            path: path.to_string(),
            append,
            text,
        });
    }
    out
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn show(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `cargo build` (dev profile) of `krate`, timed.
fn build(krate: &Path, target: &Path, cache: &Path) -> (Output, Duration) {
    let started = Instant::now();
    let out = cargo()
        .arg("build")
        .current_dir(krate)
        .env("CARGO_TARGET_DIR", target)
        .env("MPIPE_AUTO_CACHE", cache)
        .env_remove("CARGO_MANIFEST_DIR")
        .output()
        .expect("cargo runs");
    (out, started.elapsed())
}

#[test]
fn a_user_crate_with_auto_rebuilds_in_seconds() {
    let repo = repo();
    let chapter = std::fs::read_to_string(repo.join("docs/guide/driver.md")).unwrap();
    let blocks = blocks(&chapter);
    let paths: Vec<&str> = blocks.iter().map(|b| b.path.as_str()).collect();
    for needed in ["Cargo.toml", "my-model.toml", "src/main.rs", "src/qwen.rs"] {
        assert!(
            paths.contains(&needed),
            "the chapter gives {needed}: {paths:?}"
        );
    }

    // cargo new, then the chapter's files.
    let dir = tempfile::tempdir().unwrap();
    let out = cargo()
        .args(["new", "--vcs", "none", "my-trainer"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let krate = dir.path().join("my-trainer");
    for b in &blocks {
        let path = krate.join(&b.path);
        // The dependency names the clone: this repository.
        let text = b
            .text
            .replace("\"../mpipe\"", &format!("{:?}", repo.display().to_string()));
        if b.append {
            let before = std::fs::read_to_string(&path).unwrap();
            std::fs::write(&path, before + &text).unwrap();
        } else {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, text).unwrap();
        }
    }
    // The repository's lock file: the same dependency versions as the repository's
    // own builds (already downloaded; a user's `cargo build` would pick the newest).
    std::fs::copy(repo.join("Cargo.lock"), krate.join("Cargo.lock")).unwrap();
    // "Copy profiles/qwen2vl-7b.toml from the repository next to Cargo.toml."
    std::fs::copy(
        repo.join("profiles/qwen2vl-7b.toml"),
        krate.join("qwen2vl-7b.toml"),
    )
    .unwrap();

    // Seed the cache with the macro's own expansion of src/qwen.rs (the profile
    // named by its absolute path: the key holds the profile's content, not its path).
    let cache_dir = dir.path().join("auto-cache");
    let qwen = std::fs::read_to_string(krate.join("src/qwen.rs")).unwrap();
    let file: syn::File = syn::parse_str(&qwen).expect("src/qwen.rs parses");
    let syn::Item::Macro(mac) = &file.items[0] else {
        panic!("src/qwen.rs starts with mpipe::schedule!")
    };
    let absolute = krate.join("qwen2vl-7b.toml").display().to_string();
    let tokens: proc_macro2::TokenStream = mac
        .mac
        .tokens
        .to_string()
        .replace("\"qwen2vl-7b.toml\"", &format!("{absolute:?}"))
        .parse()
        .unwrap();
    let started = Instant::now();
    let expanded = mpipe_codegen::schedule_with(tokens, Some(&Cache::at(&cache_dir))).to_string();
    eprintln!("seeding search: {:.1?}", started.elapsed());
    assert!(!expanded.contains("compile_error"), "{expanded:.2000}");
    assert_eq!(std::fs::read_dir(&cache_dir).unwrap().count(), 1);

    // The first build: dependencies (once per build directory) and the crate.
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo.join("target"))
        .join("user-crate");
    let (out, took) = build(&krate, &target, &cache_dir);
    assert!(out.status.success(), "{}", show(&out));
    eprintln!("first build (seeded cache): {took:.1?}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !stderr.contains("searched for"),
        "the cache was used:\n{stderr}"
    );
    assert!(
        !stderr.contains("--> src/"),
        "the chapter's crate builds clean:\n{stderr}"
    );

    // It runs: the chapter's checks pass.
    let run = Command::new(target.join("debug").join("my-trainer"))
        .current_dir(&krate)
        .output()
        .unwrap();
    assert!(run.status.success(), "{}", show(&run));
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains("the pipelined gradients equal the sequential ones"),
        "{stdout}"
    );

    // A change to an unrelated file: src/main.rs (the qwen module is untouched).
    // The whole crate is compiled again, both macros expand again, and `auto`'s
    // choice comes from the cache. Machines under load vary: the best of 3 counts.
    let mut times = Vec::new();
    for _ in 0..3 {
        std::fs::File::options()
            .append(true)
            .open(krate.join("src/main.rs"))
            .unwrap()
            .set_modified(SystemTime::now())
            .unwrap();
        let (out, took) = build(&krate, &target, &cache_dir);
        assert!(out.status.success(), "{}", show(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("Compiling my-trainer"),
            "rebuilt:\n{stderr}"
        );
        assert!(!stderr.contains("searched for"), "{stderr}");
        times.push(took);
        if took < Duration::from_secs(5) {
            break;
        }
    }
    eprintln!("rebuilds after touching src/main.rs: {times:.2?}");
    assert!(
        times.iter().any(|t| *t < Duration::from_secs(5)),
        "a rebuild took {times:.2?}, not under 5 s"
    );

    // A mistake in the chapter's schedule, or a profile that is not there, is one
    // error: the fallback module keeps the rest of the crate compiling.
    let main = std::fs::read_to_string(krate.join("src/main.rs")).unwrap();
    for (what, broken) in [
        (
            "a misspelt encoder",
            main.replace("transpose(vision, 1f1b)", "transpose(visoin, 1f1b)"),
        ),
        (
            "a missing profile",
            main.replace("\"my-model.toml\"", "\"no-such-model.toml\""),
        ),
    ] {
        assert_ne!(broken, main, "{what}: the chapter's code changed");
        std::fs::write(krate.join("src/main.rs"), &broken).unwrap();
        let (out, _) = build(&krate, &target, &cache_dir);
        assert!(!out.status.success(), "{what}: {}", show(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        let errors: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("error") && !l.starts_with("error: could not compile"))
            .collect();
        assert_eq!(errors.len(), 1, "{what}: one error, not\n{stderr}");
    }
    std::fs::write(krate.join("src/main.rs"), &main).unwrap();
}
