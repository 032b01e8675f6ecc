//! `schedule = auto` with a cache: the second expansion reads the first's choice (the
//! program itself), emits exactly what the search emitted without deriving anything,
//! a remembered program is checked before it is used, and a long search leaves a
//! compile-time note.

use mpipe_codegen::cache::{self, Cache, Choice};
use mpipe_codegen::{schedule, schedule_noting, schedule_with};
use mpipe_core::derive::{derive_auto, derive_str, Request};
use mpipe_core::profile::{Profile, ProfileFormat};
use mpipe_core::program::{Program, Source};
use quote::quote;
use std::time::{Duration, Instant};

const PROFILE: &str = r#"
[[encoder]]
name = "vision"
layers = 4
forward = 3.0
backward = 3.0
weight = 1.5
activation = 0.1
trainable = true

[llm]
layers = 8
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
"#;

fn input(expr: proc_macro2::TokenStream) -> proc_macro2::TokenStream {
    quote! {
        pub mod plan { model_toml = #PROFILE; ranks = 2; microbatches = 4; schedule = #expr; }
    }
}

/// The `EXPR` constant of an expansion.
fn expr_of(tokens: &proc_macro2::TokenStream) -> String {
    const_str(tokens, "EXPR")
}

/// The value of the string constant `name` of an expansion.
fn const_str(tokens: &proc_macro2::TokenStream, name: &str) -> String {
    let file: syn::File = syn::parse2(tokens.clone()).expect("the expansion parses");
    let syn::Item::Mod(m) = &file.items[0] else {
        panic!("a module first")
    };
    for item in &m.content.as_ref().expect("an inline module").1 {
        if let syn::Item::Const(c) = item {
            if c.ident == name {
                if let syn::Expr::Lit(syn::ExprLit {
                    lit: syn::Lit::Str(s),
                    ..
                }) = &*c.expr
                {
                    return s.value();
                }
            }
        }
    }
    panic!("no {name} in {tokens}")
}

fn profile() -> Profile {
    Profile::parse(PROFILE, ProfileFormat::Toml).unwrap()
}

fn key() -> String {
    cache::key(&Request::new(&profile(), 2, 4)).unwrap()
}

/// What deriving `expr` for `ranks` gives, as a choice.
fn derived(expr: &str, ranks: usize) -> Choice {
    let p = profile();
    let d = derive_str(&Request::new(&p, ranks, 4), expr).unwrap();
    Choice {
        expr: d.expr,
        program: d.program,
    }
}

#[test]
fn a_rebuild_emits_what_the_search_emitted() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    let searched = schedule_with(input(quote!(auto)), None);
    let searched_text = searched.to_string();
    assert!(!searched_text.contains("compile_error"), "{searched}");
    let first = schedule_with(input(quote!(auto)), Some(&cache)).to_string();
    assert_eq!(first, searched_text);
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files, 1, "one file for one choice");
    // The file holds the program the search emitted, and its expression.
    let remembered = cache.load(&key()).expect("a remembered choice");
    assert_eq!(remembered.expr, expr_of(&searched));
    assert_eq!(
        remembered.program,
        Program::from_json(&const_str(&searched, "PROGRAM_JSON")).unwrap()
    );
    let second = schedule_with(input(quote!(auto)), Some(&cache)).to_string();
    assert_eq!(second, searched_text);
}

#[test]
fn a_remembered_program_is_emitted_without_deriving() {
    // Plant gpipe's program under an expression whose derivation would run an order
    // search of a billion simulations: the macro emits the program at once, which
    // shows that a hit neither searches nor derives.
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    let slow = "refine(gpipe, order = 1000000000)";
    let mut planted = derived("gpipe", 2);
    planted.expr = slow.to_string();
    planted.program.source = Some(Source {
        expr: slow.to_string(),
    });
    cache.store(&key(), &planted);
    let started = Instant::now();
    let out = schedule_with(input(quote!(auto)), Some(&cache));
    assert!(started.elapsed() < Duration::from_secs(10));
    assert_eq!(expr_of(&out), slow);
    assert_eq!(
        Program::from_json(&const_str(&out, "PROGRAM_JSON")).unwrap(),
        planted.program
    );
    // Everything but the expression's text is what `gpipe` itself emits.
    let direct = schedule(input(quote!(gpipe))).to_string();
    assert_eq!(out.to_string().replace(slow, "gpipe"), direct);
}

#[test]
fn a_bad_remembered_choice_means_a_search() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    let searched = schedule_with(input(quote!(auto)), None).to_string();
    let good = derived("gpipe", 2);
    // Another request's program (4 ranks, not 2).
    let other_sizes = derived("gpipe", 4);
    // A program that breaks a rule: rank 0 loses its last action.
    let mut broken = good.clone();
    broken.program.programs[0].pop();
    // An expression that is not the program's source.
    let mut relabelled = good.clone();
    relabelled.expr = "1f1b".to_string();
    for (what, bad) in [
        ("other sizes", other_sizes),
        ("broken", broken),
        ("relabelled", relabelled),
    ] {
        cache.store(&key(), &bad);
        assert!(cache.load(&key()).is_some(), "{what}: stored");
        let out = schedule_with(input(quote!(auto)), Some(&cache)).to_string();
        assert_eq!(out, searched, "after {what}");
        // ... and the search's choice replaces it.
        assert_ne!(cache.load(&key()), Some(bad), "{what}");
    }
    // A file cut short.
    let text = std::fs::read_to_string(cache.file(&key())).unwrap();
    std::fs::write(cache.file(&key()), &text[..text.len() - 40]).unwrap();
    let out = schedule_with(input(quote!(auto)), Some(&cache)).to_string();
    assert_eq!(out, searched, "after a torn file");
}

/// A search that spends much work leaves a compile-time note (a deprecated item's
/// use) naming the choice, the cache and how to pin it; a small one (this 2 x 4
/// search, at the macro's own threshold) and a cached rebuild leave none, however
/// loaded the machine.
#[test]
fn a_long_search_leaves_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    let quiet = schedule_with(input(quote!(auto)), None).to_string();
    assert!(!quiet.contains("deprecated"), "{quiet}");
    let out = schedule_noting(input(quote!(auto)), Some(&cache), 0);
    let chosen = expr_of(&out);
    let text = out.to_string();
    assert!(text.starts_with(&quiet), "the module is unchanged");
    let note = &text[quiet.len()..];
    assert!(note.contains("deprecated"), "{note}");
    assert!(note.contains("`auto` searched for"), "{note}");
    assert!(
        note.contains(&format!("write `schedule = {chosen};` in place of `auto`")),
        "{note}"
    );
    assert!(note.contains(&dir.path().display().to_string()), "{note}");
    // The note compiles as a warning: it parses as items.
    syn::parse_str::<syn::File>(note).expect("the note is items");
    // Rebuilt from the cache: no search, no note.
    let hit = schedule_noting(input(quote!(auto)), Some(&cache), 0).to_string();
    assert_eq!(hit, quiet);
    // Without a cache, the note says how to get one.
    let uncached = schedule_noting(input(quote!(auto)), None, 0).to_string();
    assert!(uncached.contains("MPIPE_AUTO_CACHE"), "{uncached}");
}

/// The threshold sits below a real model's search: `auto` as the macro runs it
/// (no `prefetch`) on `profiles/qwen2vl-7b.toml` at 8 x 32 spends more work, so its
/// first build says how to skip the search next time.
#[test]
fn a_real_models_search_is_long() {
    let text = include_str!("../../profiles/qwen2vl-7b.toml");
    let profile = Profile::from_toml_str(text).expect("the shipped profile");
    let req = Request {
        policy: mpipe_core::policy::SearchPolicy {
            prefetch: false,
            ..mpipe_core::policy::SearchPolicy::DEFAULT
        },
        ..Request::new(&profile, 8, 32)
    };
    let auto = mpipe_core::expr::parse_str("auto").expect("parses");
    let (_, work) = derive_auto(&req, &auto).expect("auto derives");
    assert!(
        work >= mpipe_codegen::expand::LONG_SEARCH,
        "{work} task visits, below the threshold"
    );
}

#[test]
fn errors_are_not_remembered() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    let tokens = quote! {
        pub mod plan { model_toml = #PROFILE; ranks = 2; microbatches = 4; schedule = auto(v = 2); }
    };
    let out = schedule_with(tokens, Some(&cache)).to_string();
    assert!(out.contains("`auto` takes no arguments"), "{out}");
    assert_eq!(
        std::fs::read_dir(dir.path())
            .map(|d| d.count())
            .unwrap_or(0),
        0
    );
}
