//! Fingerprints this crate's source for `mpipe_core::SOURCE_FINGERPRINT`: a hash of
//! every file under `src/` (paths and contents, in path order), so that anything
//! remembering a result of this code (the `schedule!` macro's `auto` cache) can tell
//! when the code that produced it changed, also between commits of one version.

use std::path::{Path, PathBuf};

/// FNV-1a, 64 bits: stable across toolchains (unlike `DefaultHasher`).
fn fnv(hash: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *hash ^= u64::from(b);
        *hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn main() {
    let root = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());
    let src = root.join("src");
    println!("cargo:rerun-if-changed=src");
    let mut paths = Vec::new();
    files(&src, &mut paths);
    paths.sort();
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for path in &paths {
        let rel = path.strip_prefix(&root).unwrap_or(path);
        fnv(&mut hash, rel.to_string_lossy().as_bytes());
        fnv(&mut hash, &[0]);
        fnv(&mut hash, &std::fs::read(path).unwrap_or_default());
        fnv(&mut hash, &[0]);
    }
    println!("cargo:rustc-env=MPIPE_CORE_SOURCE_HASH={hash:016x}");
}
