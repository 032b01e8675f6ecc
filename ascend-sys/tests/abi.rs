//! ABI check: `include/mpipe_ascend.h` against the real CANN headers.
//!
//! The headers come from the public torch-npu wheel (`torch_npu/include/third_party/`),
//! downloaded with pip (never installed, never committed) into `target/tmp`. A C++
//! translation unit includes them globally and our header inside `namespace mine`, and
//! statically asserts, for everything our header declares: each function's type
//! (parameter by parameter, mapping our enums and structs to theirs), each enumerator's
//! value, each constant, and each struct's size, alignment and field offsets.
//!
//! The aclnn table of `src/aclnn.rs` (Rust function-pointer types, outside that header)
//! is compared with whatever of it the wheel declares (see the section below and
//! docs/guide/ascend.md): `aclGetRecentErrMsg` and the `aclDataType`/`aclFormat` values
//! with CANN's headers; the tensor, scalar and array calls and every operator's second
//! phase with torch_npu's own typedefs; the first phases (`aclnnXxxGetWorkspaceSize`)
//! and the executor calls are unchecked (the wheel declares them nowhere). The
//! comparison itself is tested on a fixture header written by the test, in every run.
//!
//! The wheel tests are compiled only with the `abi-wheel` feature (they download ~26 MB
//! once, so the README's test command leaves them out rather than skipping them);
//! with it, a download that cannot be made is a failure. `.ci/run` runs them:
//! `cargo test -p ascend-sys --release --features abi-wheel --test abi`.

#![cfg_attr(not(feature = "abi-wheel"), allow(dead_code))]

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

/// `same<A, B>`: `std::is_same`, except that it recurses through pointers, `const` and
/// function types, so that a specialisation can declare two distinct types equal (our
/// enum stand-ins and CANN's enums).
const SAME: &str = "template <class A, class B> struct same : std::is_same<A, B> {};\n\
    template <class A, class B> struct same<A *, B *> : same<A, B> {};\n\
    template <class A, class B> struct same<const A, const B> : same<A, B> {};\n\
    template <class... T> struct list {};\n\
    template <class A, class B> struct same_list : std::false_type {};\n\
    template <> struct same_list<list<>, list<>> : std::true_type {};\n\
    template <class A, class... As, class B, class... Bs> struct same_list<list<A, As...>, list<B, Bs...>>\n\
      : std::integral_constant<bool, same<A, B>::value && same_list<list<As...>, list<Bs...>>::value> {};\n\
    template <class RA, class... PA, class RB, class... PB> struct same<RA(PA...), RB(PB...)>\n\
      : std::integral_constant<bool, same<RA, RB>::value && same_list<list<PA...>, list<PB...>>::value> {};\n";

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
    tu.push_str(SAME);
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

/// The wheel's headers; a failure when they cannot be had (the feature asked for them).
fn wheel_headers() -> PathBuf {
    real_headers().unwrap_or_else(|e| {
        panic!("ABI check: {e} (the `abi-wheel` feature needs the torch-npu wheel's headers)")
    })
}

#[test]
#[cfg(feature = "abi-wheel")]
fn header_matches_cann() {
    let include = wheel_headers();
    if let Err(e) = check(&include, &header(), "ours") {
        panic!("include/mpipe_ascend.h does not match CANN's headers:\n{e}");
    }
}

#[test]
#[cfg(feature = "abi-wheel")]
fn wrong_declarations_are_caught() {
    let include = wheel_headers();
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

// ---------------------------------------------------------------------------------
// The aclnn table (`src/aclnn.rs`) against whatever of it the wheel declares.
//
// Our aclnn declarations are Rust function-pointer types, not part of the bindgen
// header. The wheel has no aclnn operator headers (`aclnnop/`, `aclnn/acl_meta.h`), so
// for most of the table there is nothing to compare with. What it has:
// - CANN's `acl/acl_rt.h` declares `aclGetRecentErrMsg`, and `acl/acl_base_rt.h` the
//   `aclDataType` and `aclFormat` enums whose values `src/aclnn.rs` copies;
// - torch_npu's op-plugin (`op_plugin/utils/op_api_common_base.h`, the code that calls
//   aclnn in production) declares function-pointer types for the tensor, scalar and
//   array calls of `libnnopbase.so` (`_aclCreateTensor`, ...) and `OpApiFunc`, the
//   second phase of every operator (`aclnnXxx(workspace, size, executor, stream)`).
// Each symbol of the table is compared with a C declaration of it when a CANN header
// under `acl/`, `aclnn/` or `aclnnop/` has one (so a later wheel that ships the
// operator headers is checked without changes here), else with torch_npu's typedef
// `_<symbol>` when the op-plugin header has one; the second phases with `OpApiFunc`.
// Whatever has neither is reported unchecked.

/// A Rust type of `src/aclnn.rs` as C++ (`aliases`: the file's `type X = Y;`).
fn c_type(rust: &str, aliases: &[(String, String)]) -> Result<String, String> {
    let t = rust.trim();
    if let Some(inner) = t.strip_prefix("*const ") {
        return Ok(format!("{} const *", c_type(inner, aliases)?));
    }
    if let Some(inner) = t.strip_prefix("*mut ") {
        return Ok(format!("{} *", c_type(inner, aliases)?));
    }
    Ok(match t {
        "i8" => "int8_t".into(),
        "i32" => "int32_t".into(),
        "i64" => "int64_t".into(),
        "u8" => "uint8_t".into(),
        "u32" => "uint32_t".into(),
        "u64" => "uint64_t".into(),
        "f32" => "float".into(),
        "f64" => "double".into(),
        "bool" => "bool".into(),
        "c_void" => "void".into(),
        "c_char" => "char".into(),
        // `crate::aclrtStream` (the bindings' `*mut c_void`).
        "aclrtStream" => "void *".into(),
        // `i32` in Rust, enums in C: stand-ins declared equal to CANN's (same size and
        // signedness asserted), so that an `i32` where CANN has the enum still fails.
        "aclDataType" | "aclFormat" => format!("mine::{t}"),
        "aclTensor" | "aclScalar" | "aclIntArray" | "aclBoolArray" | "aclOpExecutor" => {
            format!("::{t}")
        }
        _ => match aliases.iter().find(|(n, _)| n == t) {
            Some((_, to)) => c_type(to, aliases)?,
            None => return Err(format!("no C++ type for the Rust type `{t}`")),
        },
    })
}

/// What `src/aclnn.rs` declares: each symbol of its table with its function type as
/// C++ (`R(P...)`), which of them are operators' second phases, and its `aclDataType`
/// and `aclFormat` constants.
struct AclnnDecls {
    symbols: Vec<(String, String)>,
    second_phases: Vec<String>,
    run_type: String,
    constants: Vec<(String, String)>,
}

fn parse_aclnn(src: &str) -> Result<AclnnDecls, String> {
    // Statements: `type X = Y;` aliases and `pub type X_t = unsafe extern "C" fn(..) -> R;`.
    let code: String = src
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
        .collect::<Vec<_>>()
        .join("\n");
    let mut aliases: Vec<(String, String)> = Vec::new();
    let mut fns: Vec<(String, String)> = Vec::new();
    let mut constants = Vec::new();
    for stmt in code.split(';') {
        let stmt = stmt.split('}').next_back().unwrap_or("").trim();
        let stmt = stmt.strip_prefix("pub ").unwrap_or(stmt);
        if let Some(rest) = stmt.strip_prefix("const ") {
            // `const ACL_FLOAT: aclDataType = 0`
            if let Some((name, rest)) = rest.split_once(':') {
                if let Some((ty, v)) = rest.split_once('=') {
                    let ty = ty.trim();
                    if ty == "aclDataType" || ty == "aclFormat" {
                        constants.push((name.trim().to_string(), v.trim().to_string()));
                    }
                }
            }
            continue;
        }
        let Some(rest) = stmt.strip_prefix("type ") else {
            continue;
        };
        let Some((name, def)) = rest.split_once('=') else {
            continue;
        };
        let (name, def) = (name.trim().to_string(), def.trim());
        let Some(f) = def.strip_prefix("unsafe extern \"C\" fn(") else {
            aliases.push((name, def.to_string()));
            continue;
        };
        fns.push((name, f.to_string()));
    }
    let function = |f: &str| -> Result<String, String> {
        let (params, ret) = f
            .rsplit_once(')')
            .ok_or_else(|| format!("no `)` in `{f}`"))?;
        let ret = match ret.trim().strip_prefix("->") {
            Some(r) => c_type(r, &aliases)?,
            None => "void".into(),
        };
        let params = params
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (_, ty) = p
                    .split_once(':')
                    .ok_or_else(|| format!("parameter `{p}` has no type"))?;
                c_type(ty, &aliases)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(format!("{ret}({})", params.join(", ")))
    };
    let fn_type = |name: &str| -> Result<String, String> {
        let (_, f) = fns
            .iter()
            .find(|(n, _)| n == name)
            .ok_or_else(|| format!("`{name}` is not a function type of src/aclnn.rs"))?;
        function(f)
    };
    // The table: `sym: Type_t,` in `nnopbase { }` and `acl { }`, `op: gws: Type_t,` in `ops { }`.
    let table = code
        .split("\ntable! {")
        .nth(1)
        .ok_or("no `table! {` invocation in src/aclnn.rs")?;
    let mut symbols = Vec::new();
    let mut second_phases = Vec::new();
    for section in ["nnopbase", "acl", "ops"] {
        let body = table
            .split(&format!("{section} {{"))
            .nth(1)
            .and_then(|b| b.split('}').next())
            .ok_or_else(|| format!("no `{section} {{ }}` in the table"))?;
        for entry in body.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let parts: Vec<&str> = entry.split(':').map(str::trim).collect();
            match parts.as_slice() {
                [sym, ty] => symbols.push((sym.to_string(), fn_type(ty)?)),
                [op, gws, ty] => {
                    symbols.push((gws.to_string(), fn_type(ty)?));
                    second_phases.push(op.to_string());
                }
                _ => return Err(format!("table entry `{entry}` not understood")),
            }
        }
    }
    Ok(AclnnDecls {
        symbols,
        second_phases,
        run_type: fn_type("aclnnRun_t")?,
        constants,
    })
}

/// Where a symbol's declaration was found.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Theirs {
    /// A C declaration in this CANN header (relative to the include directory).
    Cann(String),
    /// torch_npu's function-pointer typedef `_<symbol>`.
    TorchNpu,
    /// torch_npu's `OpApiFunc` (the second phase of every operator).
    OpApiFunc,
}

/// The op-plugin header with torch_npu's typedefs (relative to the include directory).
const OP_PLUGIN: &str = "third_party/op-plugin/op_plugin/utils/op_api_common_base.h";

/// Every `.h` under `dir`, recursively.
fn headers_under(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            headers_under(&p, out);
        } else if p.extension().is_some_and(|e| e == "h") {
            out.push(p);
        }
    }
}

/// Whether `text` declares a function `name` (`name` as a whole word followed by `(`,
/// outside comments and not a macro).
fn declares(text: &str, name: &str) -> bool {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.starts_with("//") && !l.starts_with('*') && !l.starts_with("/*"))
        .filter(|l| !l.starts_with('#'))
        .any(|l| {
            l.match_indices(name).any(|(i, _)| {
                let before = l[..i].chars().next_back();
                let after = l[i + name.len()..].trim_start();
                !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_')
                    && after.starts_with('(')
                    && !l[..i].trim_end().ends_with('.')
                    && !l[..i].trim_end().ends_with("->")
            })
        })
}

/// torch_npu's typedef statements (`typedef R (*_x)(...);` and `using OpApiFunc = ...;`)
/// from the op-plugin header's text.
fn torch_npu_typedefs(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for stmt in text.split(';') {
        let stmt = stmt.trim();
        let stmt = stmt.rsplit('\n').collect::<Vec<_>>();
        // The statement starts at its last line beginning with `typedef` or `using`.
        let Some(k) = stmt.iter().position(|l| {
            let l = l.trim_start();
            l.starts_with("typedef ") || l.starts_with("using OpApiFunc")
        }) else {
            continue;
        };
        let full: String = stmt[..=k]
            .iter()
            .rev()
            .copied()
            .collect::<Vec<_>>()
            .join("\n");
        if let Some(name) = full
            .split("(*")
            .nth(1)
            .and_then(|r| r.split(')').next())
            .filter(|n| n.starts_with('_'))
        {
            out.push((name.trim().to_string(), format!("{full};")));
        } else if full.trim_start().starts_with("using OpApiFunc") {
            out.push(("OpApiFunc".into(), format!("{full};")));
        }
    }
    out
}

/// The result of comparing the aclnn table with the headers under `include`.
struct AclnnCheck {
    /// Each symbol compared, with where its declaration was found.
    checked: Vec<(String, Theirs)>,
    /// The table's symbols with no declaration to compare with.
    unchecked: Vec<String>,
    /// The `aclDataType`/`aclFormat` constants compared.
    constants: Vec<String>,
    /// `Err(compiler output)` when something differs.
    result: Result<(), String>,
}

/// Compares the aclnn table of `src` (the text of `src/aclnn.rs`) with the headers
/// under `include` (the wheel's `torch_npu/include`, or a fixture of the same layout).
fn check_aclnn(include: &Path, src: &str, tag: &str) -> AclnnCheck {
    let d = parse_aclnn(src).unwrap_or_else(|e| panic!("reading src/aclnn.rs: {e}"));
    assert!(
        d.symbols.len() >= 30 && d.second_phases.len() >= 20 && d.constants.len() >= 8,
        "parsed too little of src/aclnn.rs"
    );
    let mut cann = Vec::new();
    for sub in ["acl", "aclnn", "aclnnop"] {
        headers_under(&include.join(sub), &mut cann);
    }
    let cann: Vec<(String, String)> = cann
        .iter()
        .filter_map(|p| {
            let text = std::fs::read_to_string(p).ok()?;
            let rel = p.strip_prefix(include).ok()?.to_string_lossy().into_owned();
            Some((rel, text))
        })
        .collect();
    let plugin = std::fs::read_to_string(include.join(OP_PLUGIN)).unwrap_or_default();
    let typedefs = torch_npu_typedefs(&plugin);

    let mut checked = Vec::new();
    let mut unchecked = Vec::new();
    for (sym, _) in &d.symbols {
        if let Some((rel, _)) = cann.iter().find(|(_, t)| declares(t, sym)) {
            checked.push((sym.clone(), Theirs::Cann(rel.clone())));
        } else if typedefs.iter().any(|(n, _)| *n == format!("_{sym}")) {
            checked.push((sym.clone(), Theirs::TorchNpu));
        } else {
            unchecked.push(sym.clone());
        }
    }
    let op_api = typedefs.iter().any(|(n, _)| n == "OpApiFunc");
    for op in &d.second_phases {
        if let Some((rel, _)) = cann.iter().find(|(_, t)| declares(t, op)) {
            checked.push((op.clone(), Theirs::Cann(rel.clone())));
        } else if op_api {
            checked.push((op.clone(), Theirs::OpApiFunc));
        } else {
            unchecked.push(op.clone());
        }
    }

    let mut tu = String::from(
        "#include <cstddef>\n#include <cstdint>\n#include <type_traits>\n\
         #include \"acl/acl_base.h\"\n#include \"acl/acl_rt.h\"\n",
    );
    let mut included = vec!["acl/acl_base.h".to_string(), "acl/acl_rt.h".to_string()];
    for (_, t) in &checked {
        if let Theirs::Cann(rel) = t {
            if !included.contains(rel) {
                let _ = writeln!(tu, "#include \"{rel}\"");
                included.push(rel.clone());
            }
        }
    }
    for o in [
        "aclTensor",
        "aclScalar",
        "aclIntArray",
        "aclBoolArray",
        "aclOpExecutor",
    ] {
        let _ = writeln!(tu, "typedef struct {o} {o};");
    }
    tu.push_str("namespace theirs {\n");
    // Only the typedefs compared (the others name types this unit does not declare).
    for (name, text) in &typedefs {
        let used = checked.iter().any(|(sym, t)| match t {
            Theirs::TorchNpu => *name == format!("_{sym}"),
            Theirs::OpApiFunc => name == "OpApiFunc",
            Theirs::Cann(_) => false,
        });
        if used {
            let _ = writeln!(tu, "{text}");
        }
    }
    tu.push_str("}\nnamespace mine {\nenum class aclDataType : int32_t {};\nenum class aclFormat : int32_t {};\n}\n");
    tu.push_str(SAME);
    let mut constants = Vec::new();
    for e in ["aclDataType", "aclFormat"] {
        let _ = writeln!(
            tu,
            "template <> struct same<mine::{e}, ::{e}> : std::true_type {{}};\n\
             static_assert(sizeof(::{e}) == sizeof(int32_t) && \
             std::is_signed<std::underlying_type<::{e}>::type>::value, \"{e} is not an i32\");"
        );
    }
    for (name, v) in &d.constants {
        let _ = writeln!(
            tu,
            "static_assert((long long)::{name} == {v}LL, \"value of {name}\");"
        );
        constants.push(name.clone());
    }
    for (sym, theirs) in &checked {
        let ours = if d.second_phases.contains(sym) {
            &d.run_type
        } else {
            &d.symbols
                .iter()
                .find(|(s, _)| s == sym)
                .expect("a symbol")
                .1
        };
        let decl = match theirs {
            Theirs::Cann(_) => format!("decltype(::{sym})"),
            Theirs::TorchNpu => format!("std::remove_pointer<theirs::_{sym}>::type"),
            Theirs::OpApiFunc => "std::remove_pointer<theirs::OpApiFunc>::type".into(),
        };
        let _ = writeln!(
            tu,
            "static_assert(same<{ours}, {decl}>::value, \"type of {sym}\");"
        );
    }

    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("abi-aclnn-{tag}"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("aclnn_check.cpp");
    std::fs::write(&file, tu).unwrap();
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let out = Command::new(&cxx)
        .args(["-std=c++17", "-fsyntax-only", "-w"])
        .arg(format!("-I{}", include.display()))
        .arg(format!(
            "-I{}",
            include.join("third_party/acl/inc").display()
        ))
        .arg(&file)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cxx}: {e}"));
    let result = if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    };
    AclnnCheck {
        checked,
        unchecked,
        constants,
        result,
    }
}

fn aclnn_source() -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/aclnn.rs"))
        .expect("read src/aclnn.rs")
}

/// A wheel-shaped include directory with a few declarations written here: a CANN
/// runtime header, one aclnn operator header (which the real wheel lacks), torch_npu's
/// typedefs for two tensor calls and the second phase.
/// Returns the directory and whether `edit` changed anything.
fn fixture(tag: &str, edit: impl Fn(String) -> String) -> (PathBuf, bool) {
    let root = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("aclnn-fixture-{tag}"));
    let files = [
        (
            "acl/acl_base.h",
            "#include <stdint.h>\n#include <stdbool.h>\n\
             typedef enum { ACL_DT_UNDEFINED = -1, ACL_FLOAT = 0, ACL_FLOAT16 = 1, ACL_INT8 = 2,\n\
             ACL_INT32 = 3, ACL_UINT8 = 4, ACL_INT16 = 6, ACL_UINT16 = 7, ACL_UINT32 = 8,\n\
             ACL_INT64 = 9, ACL_UINT64 = 10, ACL_DOUBLE = 11, ACL_BOOL = 12 } aclDataType;\n\
             typedef enum { ACL_FORMAT_UNDEFINED = -1, ACL_FORMAT_NCHW = 0, ACL_FORMAT_NHWC = 1,\n\
             ACL_FORMAT_ND = 2 } aclFormat;\n",
        ),
        (
            "acl/acl_rt.h",
            "#include \"acl/acl_base.h\"\ntypedef void *aclrtStream;\n\
             const char *aclGetRecentErrMsg();\n",
        ),
        (
            "aclnnop/aclnn_add.h",
            "#include \"acl/acl_rt.h\"\ntypedef int32_t aclnnStatus;\n\
             typedef struct aclTensor aclTensor;\ntypedef struct aclScalar aclScalar;\n\
             typedef struct aclOpExecutor aclOpExecutor;\n\
             /* aclnnAddGetWorkspaceSize(x) in a comment is not a declaration */\n\
             aclnnStatus aclnnAddGetWorkspaceSize(const aclTensor *self, const aclTensor *other,\n\
                 const aclScalar *alpha, aclTensor *out, uint64_t *workspaceSize,\n\
                 aclOpExecutor **executor);\n\
             aclnnStatus aclnnAdd(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,\n\
                 aclrtStream stream);\n",
        ),
        (
            OP_PLUGIN,
            "typedef struct aclTensor aclTensor;\n\
             typedef aclTensor* (*_aclCreateTensor)(\n    const int64_t* view_dims,\n\
                 uint64_t view_dims_num,\n    aclDataType data_type,\n    const int64_t* stride,\n\
                 int64_t offset,\n    aclFormat format,\n    const int64_t* storage_dims,\n\
                 uint64_t storage_dims_num,\n    void* tensor_data);\n\
             typedef int (*_aclDestroyTensor)(const aclTensor* tensor);\n\
             using OpApiFunc = int (*)(void*, uint64_t, aclOpExecutor*, const aclrtStream);\n",
        ),
    ];
    let mut changed = false;
    for (rel, text) in files {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let text = format!("#pragma once\n{text}");
        let edited = edit(text.clone());
        changed |= edited != text;
        std::fs::write(&p, edited).unwrap();
    }
    (root, changed)
}

/// Whether the C++ compiler runs; without one the fixture test skips with a message,
/// except under CI (`CI` set), where it fails.
fn cxx_or_skip() -> bool {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    match Command::new(&cxx).arg("--version").output() {
        Ok(o) if o.status.success() => true,
        _ if std::env::var_os("CI").is_some() => {
            panic!("cannot run the C++ compiler `{cxx}` (CI is set; install g++ or set CXX)")
        }
        _ => {
            eprintln!("SKIPPED: the aclnn ABI check's fixture test: cannot run `{cxx}`");
            false
        }
    }
}

#[test]
fn the_aclnn_check_compares_what_a_header_declares() {
    if !cxx_or_skip() {
        return;
    }
    let src = aclnn_source();
    let d = parse_aclnn(&src).expect("src/aclnn.rs parses");
    let c = check_aclnn(&fixture("ok", |t| t).0, &src, "fixture-ok");
    if let Err(e) = &c.result {
        panic!("the fixture declares what src/aclnn.rs does, yet:\n{e}");
    }
    let cann = |h: &str| Theirs::Cann(h.to_string());
    let mut want = vec![
        ("aclCreateTensor".to_string(), Theirs::TorchNpu),
        ("aclDestroyTensor".to_string(), Theirs::TorchNpu),
        ("aclGetRecentErrMsg".to_string(), cann("acl/acl_rt.h")),
        (
            "aclnnAddGetWorkspaceSize".to_string(),
            cann("aclnnop/aclnn_add.h"),
        ),
    ];
    for op in &d.second_phases {
        let theirs = if op == "aclnnAdd" {
            cann("aclnnop/aclnn_add.h")
        } else {
            Theirs::OpApiFunc
        };
        want.push((op.clone(), theirs));
    }
    let mut got = c.checked.clone();
    got.sort_by(|a, b| a.0.cmp(&b.0));
    want.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, want, "what the fixture lets the check compare");
    assert_eq!(
        c.unchecked.len(),
        d.symbols.len() + d.second_phases.len() - want.len()
    );
    assert!(c.constants.contains(&"ACL_INT64".to_string()));

    // Each wrong declaration, in the headers or in src/aclnn.rs, is caught and named.
    let header_mutations: [(&str, &str, &str); 5] = [
        (
            "const aclScalar *alpha",
            "const aclTensor *alpha",
            "type of aclnnAddGetWorkspaceSize",
        ),
        (
            "int64_t offset",
            "int32_t offset",
            "type of aclCreateTensor",
        ),
        // An `i32` where CANN has the enum is a difference too.
        (
            "aclDataType data_type",
            "int32_t data_type",
            "type of aclCreateTensor",
        ),
        ("(void*, uint64_t,", "(void*, uint32_t,", "type of aclnnMul"),
        ("ACL_INT64 = 9", "ACL_INT64 = 8", "value of ACL_INT64"),
    ];
    for (i, (from, to, expect)) in header_mutations.iter().enumerate() {
        let (include, changed) = fixture(&format!("mut{i}"), |t| t.replacen(from, to, 1));
        assert!(changed, "header mutation {i}: `{from}` not in the fixture");
        let c = check_aclnn(&include, &src, &format!("fixture-mut{i}"));
        let err = c.result.expect_err(&format!(
            "header mutation {i} ({from} -> {to}) was not caught"
        ));
        assert!(
            err.contains(expect),
            "header mutation {i}: expected a failure naming `{expect}`, got:\n{err}"
        );
    }
    let (include, _) = fixture("ok", |t| t);
    let src_mutations: [(&str, &str, &str); 2] = [
        (
            "    offset: i64,",
            "    offset: i32,",
            "type of aclCreateTensor",
        ),
        (
            "aclnnAddGetWorkspaceSize_t = unsafe extern \"C\" fn(\n    self_: T,\n    other: T,\n    alpha: *const aclScalar,",
            "aclnnAddGetWorkspaceSize_t = unsafe extern \"C\" fn(\n    self_: T,\n    other: T,\n    alpha: T,",
            "type of aclnnAddGetWorkspaceSize",
        ),
    ];
    for (i, (from, to, expect)) in src_mutations.iter().enumerate() {
        assert!(
            src.contains(from),
            "src mutation {i}: `{from}` not in src/aclnn.rs"
        );
        let c = check_aclnn(&include, &src.replacen(from, to, 1), &format!("src-mut{i}"));
        let err = c
            .result
            .expect_err(&format!("src mutation {i} ({from} -> {to}) was not caught"));
        assert!(
            err.contains(expect),
            "src mutation {i}: expected a failure naming `{expect}`, got:\n{err}"
        );
    }
}

/// What the torch-npu wheel lets the check compare (docs/guide/ascend.md lists it; a
/// wheel that declares more fails here until the list and the guide are updated).
const WHEEL_TORCH_NPU_TYPEDEFS: [&str; 8] = [
    "aclCreateTensor",
    "aclDestroyTensor",
    "aclCreateScalar",
    "aclDestroyScalar",
    "aclCreateIntArray",
    "aclDestroyIntArray",
    "aclCreateBoolArray",
    "aclDestroyBoolArray",
];

#[test]
#[cfg(feature = "abi-wheel")]
fn aclnn_table_matches_what_the_wheel_declares() {
    let include = wheel_headers();
    let src = aclnn_source();
    let d = parse_aclnn(&src).expect("src/aclnn.rs parses");
    let c = check_aclnn(&include, &src, "wheel");
    if let Err(e) = &c.result {
        panic!("src/aclnn.rs does not match the wheel's declarations:\n{e}");
    }
    for (sym, theirs) in &c.checked {
        let ok = match theirs {
            Theirs::Cann(h) => sym == "aclGetRecentErrMsg" && h == "acl/acl_rt.h",
            Theirs::TorchNpu => WHEEL_TORCH_NPU_TYPEDEFS.contains(&sym.as_str()),
            Theirs::OpApiFunc => d.second_phases.contains(sym),
        };
        assert!(
            ok,
            "checked {sym} against {theirs:?}: update the guide's list"
        );
    }
    // Unchecked: exactly the executor calls and every operator's first phase.
    let mut unchecked = c.unchecked.clone();
    unchecked.sort();
    let mut want: Vec<String> = d
        .symbols
        .iter()
        .map(|(s, _)| s.clone())
        .filter(|s| s.ends_with("GetWorkspaceSize") || s.contains("AclOpExecutor"))
        .collect();
    want.sort();
    assert_eq!(
        unchecked, want,
        "unchecked symbols: update the guide's list"
    );
    assert_eq!(
        c.checked.len(),
        1 + WHEEL_TORCH_NPU_TYPEDEFS.len() + d.second_phases.len()
    );
    // Every constant compared (with CANN's acl_base_rt.h).
    assert_eq!(c.constants.len(), d.constants.len());

    let mutations: [(&str, &str, &str); 3] = [
        (
            "unsafe extern \"C\" fn(value: *const i64, size: u64)",
            "unsafe extern \"C\" fn(value: *const i64, size: u32)",
            "type of aclCreateIntArray",
        ),
        (
            "pub const ACL_INT64: aclDataType = 9;",
            "pub const ACL_INT64: aclDataType = 8;",
            "value of ACL_INT64",
        ),
        (
            "    workspace_size: u64,\n    executor: *mut aclOpExecutor,",
            "    workspace_size: u32,\n    executor: *mut aclOpExecutor,",
            "type of aclnnMatmul",
        ),
    ];
    for (i, (from, to, expect)) in mutations.iter().enumerate() {
        assert!(
            src.contains(from),
            "mutation {i}: `{from}` not in src/aclnn.rs"
        );
        let c = check_aclnn(
            &include,
            &src.replacen(from, to, 1),
            &format!("wheel-mut{i}"),
        );
        let err = c
            .result
            .expect_err(&format!("mutation {i} ({from} -> {to}) was not caught"));
        assert!(
            err.contains(expect),
            "mutation {i}: expected a failure naming `{expect}`, got:\n{err}"
        );
    }
}
