//! ABI check: `include/mpipe_ascend.h` against the real CANN headers.
//!
//! The headers come from the public torch-npu wheel (`torch_npu/include/third_party/`),
//! downloaded with pip (never installed, never committed) into `target/tmp`. A C++
//! translation unit includes them globally and our header inside `namespace mine`, and
//! statically asserts, for everything our header declares: each function's type
//! (parameter by parameter, mapping our enums and structs to theirs), each enumerator's
//! value, each constant, and each struct's size, alignment and field offsets.
//!
//! Ignored by default (it downloads ~26 MB once); `.ci/run` runs it with
//! `MPIPE_ABI_REQUIRED=1`, which turns "download impossible" from a skip into a failure:
//! `cargo test -p ascend-sys --release --test abi -- --ignored`.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The first torch-npu release whose hccl.h declares all of HcclBarrier, HcclGetRankSize,
/// HcclGetRankId and HcclGetErrorString is later than 2.8.0; 2.14.0 has them all.
const TORCH_NPU: &str = "2.14.0";

fn header() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/mpipe_ascend.h"))
        .expect("read mpipe_ascend.h")
}

/// Downloads the wheel and extracts the headers; `Err` when that is impossible.
/// The wheel's header directory, downloaded and extracted once per test binary
/// (the tests run in parallel; two extracting at once would race).
fn real_headers() -> Result<PathBuf, String> {
    static ONCE: std::sync::OnceLock<Result<PathBuf, String>> = std::sync::OnceLock::new();
    ONCE.get_or_init(fetch_headers).clone()
}

fn fetch_headers() -> Result<PathBuf, String> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("torch-npu-{TORCH_NPU}"));
    let include = dir.join("torch_npu/include");
    if include.join("third_party/hccl/inc/hccl/hccl.h").exists() {
        return Ok(include);
    }
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let py = if Command::new("python3").arg("--version").output().is_ok() {
        "python3"
    } else {
        "python"
    };
    let status = Command::new(py)
        .args([
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--only-binary",
            ":all:",
        ])
        .arg(format!("torch-npu=={TORCH_NPU}"))
        .arg("-d")
        .arg(&dir)
        .status()
        .map_err(|e| format!("cannot run {py} -m pip: {e}"))?;
    if !status.success() {
        return Err(format!(
            "pip download torch-npu=={TORCH_NPU} failed ({status})"
        ));
    }
    // Extract only the headers (zipfile is in Python's standard library).
    let script = "import glob,sys,zipfile\n\
        d=sys.argv[1]\n\
        w=glob.glob(d+'/torch_npu-*.whl')[0]\n\
        z=zipfile.ZipFile(w)\n\
        [z.extract(n,d) for n in z.namelist() if n.startswith('torch_npu/include/') and n.endswith('.h')]\n";
    let status = Command::new(py)
        .args(["-c", script])
        .arg(&dir)
        .status()
        .map_err(|e| e.to_string())?;
    if !status.success() {
        return Err("extracting the wheel's headers failed".into());
    }
    Ok(include)
}

/// Names declared by our header, read off its (regular, one-per-line) layout.
struct Decls {
    functions: Vec<String>,
    enums: Vec<(String, Vec<String>)>,
    constants: Vec<(String, String)>,
    structs: Vec<(String, Vec<String>)>,
}

fn parse(h: &str) -> Decls {
    let mut d = Decls {
        functions: vec![],
        enums: vec![],
        constants: vec![],
        structs: vec![],
    };
    let mut body: Option<(bool, Vec<String>)> = None; // (is_enum, members)
    for line in h.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("#define ") {
            let mut it = rest.split_whitespace();
            if let (Some(n), Some(v)) = (it.next(), it.next()) {
                if v.chars().all(|c| c.is_ascii_digit()) {
                    d.constants.push((n.to_string(), v.to_string()));
                }
            }
        } else if line.starts_with("typedef enum") {
            body = Some((true, vec![]));
        } else if line.starts_with("typedef struct") {
            body = Some((false, vec![]));
        } else if let Some(name) = line
            .strip_prefix('}')
            .map(|r| r.trim().trim_end_matches(';'))
        {
            if let Some((is_enum, members)) = body.take() {
                if is_enum {
                    d.enums.push((name.to_string(), members));
                } else {
                    d.structs.push((name.to_string(), members));
                }
            }
        } else if let Some((is_enum, members)) = body.as_mut() {
            let member = if *is_enum {
                line.split([' ', '=', ',']).next().unwrap_or("")
            } else {
                line.trim_end_matches(';')
                    .rsplit([' ', '*'])
                    .next()
                    .unwrap_or("")
                    .split('[')
                    .next()
                    .unwrap_or("")
            };
            if !member.is_empty() {
                members.push(member.to_string());
            }
        } else if let Some(open) = line.find('(') {
            let name = line[..open].rsplit([' ', '*']).next().unwrap_or("");
            if (name.starts_with("acl") || name.starts_with("Hccl")) && !line.starts_with("/*") {
                d.functions.push(name.to_string());
            }
        }
    }
    d
}

fn translation_unit(h: &Path, d: &Decls) -> String {
    let mut tu = String::from(
        "#include <cstddef>\n#include <cstdint>\n#include <type_traits>\n\
         #include \"third_party/hccl/inc/hccl/hccl.h\"\n\
         #include \"acl/acl.h\"\n\
         #include \"acl/acl_rt.h\"\n",
    );
    // Constants first: our macros would shadow theirs once our header is included.
    for (n, v) in &d.constants {
        let _ = writeln!(
            tu,
            "static_assert((long long)({n}) == {v}LL, \"constant {n}\");"
        );
    }
    let _ = writeln!(
        tu,
        "#define MPIPE_ASCEND_NO_EXTERN_C 1\nnamespace mine {{\n#include \"{}\"\n}}",
        h.display()
    );
    tu.push_str(
        "template <class A, class B> struct same : std::is_same<A, B> {};\n\
         template <class A, class B> struct same<A *, B *> : same<A, B> {};\n\
         template <class A, class B> struct same<const A, const B> : same<A, B> {};\n\
         template <class... T> struct list {};\n\
         template <class A, class B> struct same_list : std::false_type {};\n\
         template <> struct same_list<list<>, list<>> : std::true_type {};\n\
         template <class A, class... As, class B, class... Bs> struct same_list<list<A, As...>, list<B, Bs...>>\n\
           : std::integral_constant<bool, same<A, B>::value && same_list<list<As...>, list<Bs...>>::value> {};\n\
         template <class RA, class... PA, class RB, class... PB> struct same<RA(PA...), RB(PB...)>\n\
           : std::integral_constant<bool, same<RA, RB>::value && same_list<list<PA...>, list<PB...>>::value> {};\n",
    );
    for (name, _) in d.enums.iter().chain(&d.structs) {
        let _ = writeln!(
            tu,
            "template <> struct same<mine::{name}, ::{name}> : std::true_type {{}};"
        );
    }
    for (name, members) in &d.enums {
        let _ = writeln!(
            tu,
            "static_assert(sizeof(mine::{name}) == sizeof(::{name}), \"size of {name}\");"
        );
        let _ = writeln!(
            tu,
            "static_assert(std::is_signed<std::underlying_type<mine::{name}>::type>::value == \
             std::is_signed<std::underlying_type<::{name}>::type>::value, \"signedness of {name}\");"
        );
        for m in members {
            let _ = writeln!(
                tu,
                "static_assert((long long)mine::{m} == (long long)::{m}, \"value of {m}\");"
            );
        }
    }
    for (name, fields) in &d.structs {
        let _ = writeln!(
            tu,
            "static_assert(sizeof(mine::{name}) == sizeof(::{name}), \"size of {name}\");"
        );
        let _ = writeln!(
            tu,
            "static_assert(alignof(mine::{name}) == alignof(::{name}), \"alignment of {name}\");"
        );
        for f in fields {
            let _ = writeln!(
                tu,
                "static_assert(offsetof(mine::{name}, {f}) == offsetof(::{name}, {f}), \"offset of {name}.{f}\");\n\
                 static_assert(sizeof(mine::{name}::{f}) == sizeof(::{name}::{f}), \"size of {name}.{f}\");"
            );
        }
    }
    for f in &d.functions {
        let _ = writeln!(
            tu,
            "static_assert(same<decltype(mine::{f}), decltype(::{f})>::value, \"type of {f}\");"
        );
    }
    tu
}

/// Compiles our header (`h`'s text) against the real ones; `Err(compiler output)` on mismatch.
fn check(include: &Path, text: &str, tag: &str) -> Result<(), String> {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("abi-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let h = dir.join("mpipe_ascend.h");
    std::fs::write(&h, text).unwrap();
    let d = parse(text);
    assert!(
        d.functions.len() >= 35 && d.structs.len() == 2 && d.enums.len() >= 6,
        "parsed too little of the header"
    );
    let tu = dir.join("abi_check.cpp");
    std::fs::write(&tu, translation_unit(&h, &d)).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-fsyntax-only", "-w"])
        .arg(format!("-I{}", include.display()))
        .arg(format!(
            "-I{}",
            include.join("third_party/acl/inc").display()
        ))
        .arg(&tu)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx}: {e}"));
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

fn headers_or_skip() -> Option<PathBuf> {
    match real_headers() {
        Ok(p) => Some(p),
        Err(e) if std::env::var_os("MPIPE_ABI_REQUIRED").is_none() => {
            eprintln!("SKIPPED: ABI check: {e}");
            None
        }
        Err(e) => panic!("ABI check: {e} (MPIPE_ABI_REQUIRED is set)"),
    }
}

#[test]
#[ignore = "downloads the torch-npu wheel; run by .ci/run"]
fn header_matches_cann() {
    let Some(include) = headers_or_skip() else {
        return;
    };
    if let Err(e) = check(&include, &header(), "ours") {
        panic!("include/mpipe_ascend.h does not match CANN's headers:\n{e}");
    }
}

#[test]
#[ignore = "downloads the torch-npu wheel; run by .ci/run"]
fn wrong_declarations_are_caught() {
    let Some(include) = headers_or_skip() else {
        return;
    };
    let h = header();
    let mutations = [
        ("uint32_t destRank", "int32_t destRank", "type of HcclSend"),
        ("HCCL_E_TIMEOUT = 9", "HCCL_E_TIMEOUT = 10", "value of HCCL_E_TIMEOUT"),
        ("#define HCCL_ROOT_INFO_BYTES 4108", "#define HCCL_ROOT_INFO_BYTES 4096", "HCCL_ROOT_INFO_BYTES"),
        ("    uint64_t count;\n    HcclDataType", "    uint32_t count;\n    HcclDataType", "HcclSendRecvItem"),
        ("ACL_MEMCPY_DEVICE_TO_HOST = 2", "ACL_MEMCPY_DEVICE_TO_HOST = 3", "value of ACL_MEMCPY_DEVICE_TO_HOST"),
        ("size_t destMax, const void *src, size_t count,\n                     aclrtMemcpyKind kind);",
         "size_t destMax, const void *src, size_t count);", "type of aclrtMemcpy"),
    ];
    for (i, (from, to, expect)) in mutations.iter().enumerate() {
        assert!(h.contains(from), "mutation {i}: `{from}` not in the header");
        let err = check(&include, &h.replacen(from, to, 1), &format!("mut{i}"))
            .expect_err(&format!("mutation {i} ({from} -> {to}) was not caught"));
        assert!(
            err.contains(expect),
            "mutation {i}: expected a failure naming `{expect}`, got:\n{err}"
        );
    }
}
