//! `auto`'s choices, remembered between builds.
//!
//! The compiler expands `schedule!` again every time the calling crate is rebuilt,
//! and `auto`'s search takes seconds (tens of seconds at 16 ranks x 128
//! micro-batches; see the search-time table of docs/guide/results.md). The search is deterministic:
//! its choice is a function of the profile, the ranks, the micro-batches, the
//! semantics and mpipe-core's code ([`mpipe_core::SOURCE_FINGERPRINT`]) and of
//! nothing else (not the number of cores). So the macro keeps each choice in a file,
//! as the chosen *program* (`mpipe-program/1` JSON) with its expression for display,
//! and, when all of those inputs are the same again, verifies and simulates that
//! program instead of deriving anything: no search, and no re-derivation either
//! (which for a choice like `refine(..., order = 12000)` would run its order search
//! again). `tests/schedule_macro.rs` checks that deriving `EXPR` reproduces the
//! emitted program.
//!
//! - **Key.** The inputs in full, as text ([`key`]); the file is named by a hash of
//!   the key and holds the key itself, and a hit needs the whole key equal, so a
//!   hash collision or a hand-edited file is a miss, never a wrong choice.
//! - **Where.** `MPIPE_AUTO_CACHE` if set (a directory; `off` turns the cache off),
//!   else `$CARGO_TARGET_DIR/mpipe-auto`, else `target/mpipe-auto` in the nearest
//!   ancestor of the calling crate's manifest directory that holds a `Cargo.lock`
//!   (the workspace root; none found: no cache). `cargo clean` clears it.
//! - **Failures.** A file that cannot be read or parsed, a program that does not
//!   verify, does not fit the request or the memory limit, or does not run, means a
//!   search, as without a cache: the cache can make the macro faster, never change
//!   what it emits or make it fail (the checks are in `expand`). Only successful
//!   searches are remembered; errors are found again, with their spans.
//! - **Writes** go to a temporary file renamed into place, so concurrent builds see
//!   a whole file or none.

use mpipe_core::derive::Request;
use mpipe_core::program::Program;
use std::path::{Path, PathBuf};

/// A directory of remembered `auto` choices.
#[derive(Clone, Debug)]
pub struct Cache {
    dir: PathBuf,
}

/// What `auto` chose: the expression (for `EXPR` and messages) and the program it
/// derived, which a rebuild emits after checking it.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub expr: String,
    pub program: Program,
}

/// Separates a file's key from the chosen expression that follows it.
const CHOICE: &str = "\n-- choice --\n";
/// Separates the chosen expression from the chosen program.
const PROGRAM: &str = "\n-- program --\n";

impl Cache {
    /// A cache in `dir` (created on the first store).
    pub fn at(dir: impl Into<PathBuf>) -> Cache {
        Cache { dir: dir.into() }
    }

    /// The cache the environment names (see the module documentation), if any.
    pub fn from_env() -> Option<Cache> {
        if let Some(dir) = std::env::var_os("MPIPE_AUTO_CACHE") {
            return (dir != "off" && !dir.is_empty()).then(|| Cache::at(dir));
        }
        if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
            return Some(Cache::at(Path::new(&dir).join("mpipe-auto")));
        }
        let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
        manifest
            .ancestors()
            .find(|d| d.join("Cargo.lock").is_file())
            .map(|root| Cache::at(root.join("target").join("mpipe-auto")))
    }

    /// The directory the choices are kept in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The file for `key`.
    pub fn file(&self, key: &str) -> PathBuf {
        // FNV-1a: the name only spreads keys; the file's content decides a hit.
        let mut hash = 0xcbf2_9ce4_8422_2325_u64;
        for &b in key.as_bytes() {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
        }
        self.dir.join(format!("{hash:016x}.txt"))
    }

    /// The choice remembered for `key`, if a file holds exactly this key, an
    /// expression and a program that parses (not yet checked against the request:
    /// the caller verifies it).
    pub fn load(&self, key: &str) -> Option<Choice> {
        let text = std::fs::read_to_string(self.file(key)).ok()?;
        let (stored, rest) = text.split_once(CHOICE)?;
        let (expr, program) = rest.split_once(PROGRAM)?;
        let expr = expr.trim();
        if stored != key || expr.is_empty() {
            return None;
        }
        let program = Program::from_json(program).ok()?;
        Some(Choice {
            expr: expr.to_string(),
            program,
        })
    }

    /// Remember `choice` for `key`; silently does nothing if the directory cannot be
    /// written (the next build searches again).
    pub fn store(&self, key: &str, choice: &Choice) {
        let Ok(program) = serde_json::to_string(&choice.program) else {
            return;
        };
        let path = self.file(key);
        if std::fs::create_dir_all(&self.dir).is_err() {
            return;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let written = std::fs::write(
            &tmp,
            format!("{key}{CHOICE}{}{PROGRAM}{program}\n", choice.expr),
        )
        .and_then(|()| std::fs::rename(&tmp, &path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
}

/// Everything `auto`'s choice for `req` depends on, as text: mpipe-core's
/// fingerprint, the semantics, the ranks, the micro-batches and the profile (as
/// parsed, so comments and layout do not matter). `None` if the profile cannot be
/// written out (then there is no caching).
pub fn key(req: &Request) -> Option<String> {
    let profile = serde_json::to_string(req.profile).ok()?;
    Some(format!(
        "mpipe schedule! auto/2\ncore {}\nmode {:?}\nranks {}\nmicrobatches {}\nprofile {profile}",
        mpipe_core::SOURCE_FINGERPRINT,
        req.mode,
        req.ranks,
        req.microbatches,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mpipe_core::profile::{Profile, ProfileFormat};
    use mpipe_core::simulate::Mode;

    const PROFILE: &str = "[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\n\
                           weight = 1.0\nactivation = 1.0\n";

    fn profile(text: &str) -> Profile {
        Profile::parse(text, ProfileFormat::Toml).expect("a valid profile")
    }

    #[test]
    fn the_key_holds_every_input_and_not_the_layout() {
        let p = profile(PROFILE);
        let base = key(&Request::new(&p, 4, 8)).unwrap();
        assert!(base.contains(mpipe_core::SOURCE_FINGERPRINT));
        let commented = profile(&format!("# a comment\n{PROFILE}"));
        assert_eq!(key(&Request::new(&commented, 4, 8)).unwrap(), base);
        let other = profile(&PROFILE.replace("layers = 8", "layers = 9"));
        let eager = Request {
            mode: Mode::Eager,
            ..Request::new(&p, 4, 8)
        };
        for k in [
            key(&Request::new(&p, 2, 8)),
            key(&Request::new(&p, 4, 16)),
            key(&Request::new(&other, 4, 8)),
            key(&eager),
        ] {
            assert_ne!(k.unwrap(), base);
        }
    }

    /// A real choice: the program `gpipe` derives for the test profile.
    fn choice(expr: &str) -> Choice {
        let p = profile(PROFILE);
        let d = mpipe_core::derive::derive_str(&Request::new(&p, 2, 4), expr).unwrap();
        Choice {
            expr: d.expr,
            program: d.program,
        }
    }

    #[test]
    fn a_stored_choice_comes_back_for_its_key_only() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("nested"));
        assert_eq!(cache.load("k1"), None);
        let gpipe = choice("gpipe");
        cache.store("k1", &gpipe);
        assert_eq!(cache.load("k1"), Some(gpipe.clone()));
        assert_eq!(cache.load("k2"), None);
        let whole = std::fs::read_to_string(cache.file("k1")).unwrap();
        // A file under k1's name that holds another key (a collision, an edit).
        std::fs::write(cache.file("k1"), whole.replacen("k1", "k2", 1)).unwrap();
        assert_eq!(cache.load("k1"), None);
        // Torn, empty or program-less files are misses.
        let (head, _) = whole.split_at(whole.len() / 2);
        for torn in [
            "k1".to_string(),
            format!("k1{CHOICE}"),
            format!("k1{CHOICE}gpipe\n"),
            format!("k1{CHOICE}{PROGRAM}{}", gpipe.program.to_json()),
            head.to_string(),
        ] {
            std::fs::write(cache.file("k1"), &torn).unwrap();
            assert_eq!(cache.load("k1"), None, "{torn:.60}");
        }
        // No temporary file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path().join("nested"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }

    #[test]
    fn an_unwritable_directory_is_no_error() {
        let dir = tempfile::tempdir().unwrap();
        let blocker = dir.path().join("file");
        std::fs::write(&blocker, "not a directory").unwrap();
        let cache = Cache::at(blocker.join("cache"));
        cache.store("k", &choice("gpipe"));
        assert_eq!(cache.load("k"), None);
    }
}
