//! Finds CANN (AscendCL + HCCL) and decides what the bindings link against.
//!
//! Order: `ASCEND_INCLUDE_DIR` + `ASCEND_LIB_DIR`, then `ASCEND_HOME_PATH`, then
//! `ASCEND_TOOLKIT_HOME`, then the standard install paths. When CANN is found the crate
//! links `ascendcl` and `hccl` (`cfg(ascend_cann)`); otherwise, with the `emulator`
//! feature (on by default), the host emulator in `src/emulator/` provides the symbols
//! (`cfg(ascend_emulator)`); otherwise the build fails and says what to install or set.
//! `ASCEND_SYS_USE_EMULATOR=1` picks the emulator even when CANN is installed.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};

#[cfg(feature = "buildtime-bindgen")]
include!("bindgen_config.rs");

const STANDARD_ROOTS: &[&str] = &[
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/latest",
    "/opt/Ascend/ascend-toolkit/latest",
];

/// Reads a variable and asks Cargo to rerun when it changes (openssl-sys's `env` habit).
fn env_var(name: &str) -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed={name}");
    env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

struct Cann {
    include: PathBuf,
    lib: PathBuf,
    how: String,
}

/// A toolkit root is usable when it has the AscendCL header and library.
fn cann_at_root(root: &Path, how: &str) -> Option<Cann> {
    let include = root.join("include");
    let lib = ["lib64", "lib"]
        .iter()
        .map(|d| root.join(d))
        .find(|d| d.join("libascendcl.so").exists())?;
    include.join("acl").join("acl.h").exists().then(|| Cann {
        include,
        lib,
        how: how.to_string(),
    })
}

fn find_cann() -> Result<Option<Cann>, String> {
    let include = env_var("ASCEND_INCLUDE_DIR");
    let lib = env_var("ASCEND_LIB_DIR");
    match (include, lib) {
        (Some(include), Some(lib)) => {
            return Ok(Some(Cann {
                include,
                lib,
                how: "ASCEND_INCLUDE_DIR/ASCEND_LIB_DIR".into(),
            }))
        }
        (Some(_), None) | (None, Some(_)) => {
            return Err(
                "only one of ASCEND_INCLUDE_DIR and ASCEND_LIB_DIR is set: set both \
                        (the directory holding acl/acl.h and hccl/hccl.h, and the one holding \
                        libascendcl.so and libhccl.so), or neither"
                    .into(),
            )
        }
        (None, None) => {}
    }
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(root) = env_var(var) {
            return match cann_at_root(&root, var) {
                Some(c) => Ok(Some(c)),
                None => Err(format!(
                    "{var}={} has no include/acl/acl.h with lib64/libascendcl.so: point it at a \
                     CANN toolkit (e.g. /usr/local/Ascend/ascend-toolkit/latest, which \
                     `source .../set_env.sh` does) or unset it",
                    root.display()
                )),
            };
        }
    }
    Ok(STANDARD_ROOTS
        .iter()
        .find_map(|r| cann_at_root(Path::new(r), r)))
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=bindgen_config.rs");
    println!("cargo:rerun-if-changed=include/mpipe_ascend.h");
    println!("cargo:rerun-if-changed=src/bindings.rs");
    println!("cargo:rustc-check-cfg=cfg(ascend_cann, ascend_emulator)");
    let manifest = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("set by Cargo"));
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("set by Cargo"));
    let emulator = env::var_os("CARGO_FEATURE_EMULATOR").is_some();
    let force_emulator = env_var("ASCEND_SYS_USE_EMULATOR").is_some_and(|v| v != Path::new("0"));

    let cann = match find_cann() {
        Ok(c) => c,
        Err(msg) => panic!("ascend-sys: {msg}"),
    };
    let cann = if force_emulator { None } else { cann };
    match (&cann, emulator) {
        (Some(c), _) => {
            println!("cargo:rustc-link-search=native={}", c.lib.display());
            println!("cargo:rustc-link-lib=dylib=ascendcl");
            println!("cargo:rustc-link-lib=dylib=hccl");
            println!("cargo:rustc-cfg=ascend_cann");
            println!("cargo:include={}", c.include.display());
            println!("cargo:lib={}", c.lib.display());
            println!("cargo:backend=cann ({})", c.how);
        }
        (None, true) => {
            println!("cargo:rustc-cfg=ascend_emulator");
            println!("cargo:include={}", manifest.join("include").display());
            println!("cargo:backend=emulator");
        }
        (None, false) => panic!(
            "ascend-sys: no CANN toolkit found and the `emulator` feature is off.\n\
             Looked at ASCEND_INCLUDE_DIR + ASCEND_LIB_DIR, ASCEND_HOME_PATH, \
             ASCEND_TOOLKIT_HOME and {}.\n\
             Either install the CANN toolkit (Ascend-cann-toolkit_<version>_linux-<arch>.run \
             --install, then `source /usr/local/Ascend/ascend-toolkit/set_env.sh`), or set \
             ASCEND_HOME_PATH to its root, or enable the `emulator` feature of ascend-sys to \
             run on CPUs.",
            STANDARD_ROOTS.join(", ")
        ),
    }

    let dest = out.join("bindings.rs");
    #[cfg(feature = "buildtime-bindgen")]
    {
        let wrapper = out.join("wrapper.h");
        let (header, args): (PathBuf, Vec<String>) = match &cann {
            Some(c) => {
                fs::write(&wrapper, "#include <acl/acl.h>\n#include <hccl/hccl.h>\n")
                    .expect("write wrapper.h");
                // The CANN headers compile only as C++.
                (
                    wrapper,
                    vec![
                        "-x".into(),
                        "c++".into(),
                        format!("-I{}", c.include.display()),
                    ],
                )
            }
            None => (manifest.join("include").join("mpipe_ascend.h"), Vec::new()),
        };
        ascend_bindgen_builder(header.to_str().expect("UTF-8 path"))
            .clang_args(args)
            .generate()
            .expect("bindgen failed (it needs libclang: apt-get install libclang-dev)")
            .write_to_file(&dest)
            .expect("write bindings.rs");
    }
    #[cfg(not(feature = "buildtime-bindgen"))]
    fs::copy(manifest.join("src").join("bindings.rs"), &dest).expect("copy src/bindings.rs");
}
