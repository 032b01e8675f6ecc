//! `schedule = auto` with a cache: the second expansion reads the first's choice,
//! emits exactly what the search emitted, and a remembered choice is really used.

use mpipe_codegen::cache::{self, Cache};
use mpipe_codegen::{schedule, schedule_with};
use mpipe_core::derive::Request;
use mpipe_core::profile::{Profile, ProfileFormat};
use quote::quote;

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
    let file: syn::File = syn::parse2(tokens.clone()).expect("the expansion parses");
    let syn::Item::Mod(m) = &file.items[0] else {
        panic!("a module first")
    };
    for item in &m.content.as_ref().expect("an inline module").1 {
        if let syn::Item::Const(c) = item {
            if c.ident == "EXPR" {
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
    panic!("no EXPR in {tokens}")
}

fn key() -> String {
    let profile = Profile::parse(PROFILE, ProfileFormat::Toml).unwrap();
    cache::key(&Request::new(&profile, 2, 4)).unwrap()
}

#[test]
fn a_rebuild_emits_what_the_search_emitted() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    let searched = schedule_with(input(quote!(auto)), None).to_string();
    assert!(!searched.contains("compile_error"), "{searched}");
    let first = schedule_with(input(quote!(auto)), Some(&cache)).to_string();
    assert_eq!(first, searched);
    let files = std::fs::read_dir(dir.path()).unwrap().count();
    assert_eq!(files, 1, "one file for one choice");
    let chosen = expr_of(&first.parse().unwrap());
    assert_eq!(cache.load(&key()).as_deref(), Some(chosen.as_str()));
    let second = schedule_with(input(quote!(auto)), Some(&cache)).to_string();
    assert_eq!(second, searched);
}

#[test]
fn a_remembered_choice_is_derived_alone() {
    // Plant a choice the search would not make: the macro emits it, which shows a
    // hit skips the search (and that the file, not the search, decides a hit).
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    cache.store(&key(), "gpipe");
    let planted = schedule_with(input(quote!(auto)), Some(&cache));
    assert_eq!(expr_of(&planted), "gpipe");
    let direct = schedule(input(quote!(gpipe))).to_string();
    assert_eq!(planted.to_string(), direct);
}

#[test]
fn a_bad_remembered_choice_means_a_search() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Cache::at(dir.path());
    let searched = schedule_with(input(quote!(auto)), None).to_string();
    for bad in ["not an expression (", "transpose(nope, 1f1b)"] {
        cache.store(&key(), bad);
        let out = schedule_with(input(quote!(auto)), Some(&cache)).to_string();
        assert_eq!(out, searched, "after {bad:?}");
        // ... and the search's choice replaces it.
        assert_ne!(cache.load(&key()).as_deref(), Some(bad));
    }
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
