//! From the macro's input to its output: read the profile, parse the expression,
//! derive, and emit — or emit every error found, with a fallback module.

use crate::cache::{self, Cache};
use crate::emit::{fallback, module, Facts};
use crate::input::{Input, Source};
use mpipe_core::advice::for_written;
use mpipe_core::bound::lower_bound;
use mpipe_core::derive::{derive, derive_str, resident_params, DeriveError, Derived, Request};
use mpipe_core::expr::Expr;
use mpipe_core::profile::{Profile, ProfileFormat};
use mpipe_core::program::Program;
use mpipe_core::simulate::{simulate, Mode, SimOptions};
use mpipe_core::verify::verify;
use proc_macro2::TokenStream;
use std::path::PathBuf;
use syn::LitStr;

/// Expand `schedule! { ... }`, with `auto`'s choices remembered where the
/// environment says ([`Cache::from_env`]).
pub fn schedule(tokens: TokenStream) -> TokenStream {
    schedule_with(tokens, Cache::from_env().as_ref())
}

/// Expand `schedule! { ... }`, with `auto`'s choices remembered in `cache` (none:
/// every `auto` searches).
pub fn schedule_with(tokens: TokenStream, cache: Option<&Cache>) -> TokenStream {
    let input = match syn::parse2::<Input>(tokens) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error(),
    };
    let mut errors = input.errors.clone();
    if let Some(src) = &input.program {
        let loaded = load_program(src, input.mode, &mut errors);
        return finish(&input, loaded, errors);
    }
    let profile = input
        .model
        .as_ref()
        .and_then(|src| load_profile(src, &mut errors));
    let expr = input
        .schedule
        .clone()
        .and_then(|ts| match mpipe_core::expr::parse(ts) {
            Ok(e) => Some(e),
            Err(es) => {
                errors.extend(es.into_iter().map(|e| syn::Error::new(e.span, e.message)));
                None
            }
        });
    let mut derived = None;
    if let (Some((profile, _)), Some((ranks, _)), Some((microbatches, _)), Some(expr)) =
        (&profile, input.ranks, input.microbatches, &expr)
    {
        let req = Request {
            mode: input.mode,
            ..Request::new(profile, ranks, microbatches)
        };
        let found = if expr.name() == "auto" && expr.args.is_empty() {
            auto(&req, expr, cache)
        } else {
            mpipe_core::search::for_macro(|| derive(&req, expr))
        };
        match found {
            Ok(d) if !d.program.prefetch.is_empty() => errors.push(syn::Error::new(
                expr.span,
                format!(
                    "`{}` prefetches encoder forwards for the next step, which generated code \
                     cannot run yet (the runtime's `Step` has no next-step forward); simulate \
                     it with `mpipe`, and emit `fill` or `transpose` instead",
                    d.expr
                ),
            )),
            Ok(d) => derived = Some(d),
            Err(es) => errors.extend(
                es.into_iter()
                    .map(|e| syn::Error::new(e.span, for_written(expr.name(), &e.message))),
            ),
        }
    }
    let path = profile.and_then(|(_, path)| path);
    finish(&input, derived.map(|d| (d, path)), errors)
}

/// `auto` as the macro runs it: the choice `cache` remembers for `req`, derived
/// alone, or else a search among the schedules the macro can emit (its threads
/// parse under `proc_macro2`'s fallback, see [`mpipe_core::search::for_macro`]),
/// whose choice is then remembered.
fn auto(req: &Request, expr: &Expr, cache: Option<&Cache>) -> Result<Derived, Vec<DeriveError>> {
    let key = cache.and_then(|_| cache::key(req));
    if let (Some(cache), Some(key)) = (cache, &key) {
        let remembered = cache
            .load(key)
            .and_then(|choice| derive_str(req, &choice).ok())
            .filter(|d| d.program.prefetch.is_empty());
        if let Some(d) = remembered {
            return Ok(d);
        }
    }
    let found = mpipe_core::search::for_macro(|| derive(req, expr));
    if let (Some(cache), Some(key), Ok(d)) = (cache, &key, &found) {
        cache.store(key, &d.expr);
    }
    found
}

/// The module for a derived (or loaded) program, or, if anything went wrong, the
/// fallback module followed by every error.
fn finish(
    input: &Input,
    derived: Option<(Derived, Option<PathBuf>)>,
    errors: Vec<syn::Error>,
) -> TokenStream {
    match derived {
        Some((d, path)) if errors.is_empty() => module(
            input,
            &Facts {
                derived: &d,
                profile_path: path.as_deref(),
            },
        ),
        _ => {
            let mut out = fallback(input);
            for e in errors {
                out.extend(e.to_compile_error());
            }
            out
        }
    }
}

/// The text of `src`: inline, or the file it names (then also its path).
fn text(
    src: &Source,
    what: &str,
    errors: &mut Vec<syn::Error>,
) -> Option<(String, Option<PathBuf>)> {
    match src {
        Source::Inline(lit) => Some((lit.value(), None)),
        Source::File(lit) => read(lit, what, errors).map(|(t, p)| (t, Some(p))),
    }
}

/// Read the file `lit` names, relative to the calling crate's manifest directory.
fn read(lit: &LitStr, what: &str, errors: &mut Vec<syn::Error>) -> Option<(String, PathBuf)> {
    let rel = PathBuf::from(lit.value());
    let base = std::env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from);
    let path = match (&base, rel.is_absolute()) {
        (Some(dir), false) => dir.join(&rel),
        _ => rel.clone(),
    };
    match std::fs::read_to_string(&path) {
        Ok(t) => Some((t, path)),
        Err(e) => {
            let hint = if rel.is_absolute() {
                ""
            } else {
                "; relative paths start at the calling crate's manifest directory (where its Cargo.toml is)"
            };
            errors.push(syn::Error::new(
                lit.span(),
                format!("cannot read {what} {}: {e}{hint}", rel.display()),
            ));
            None
        }
    }
}

/// Read a program, verify it (rules 1-5) and simulate it under `mode`.
fn load_program(
    src: &Source,
    mode: Mode,
    errors: &mut Vec<syn::Error>,
) -> Option<(Derived, Option<PathBuf>)> {
    let (text, path) = text(src, "program", errors)?;
    let lit = src.lit();
    let name = match src {
        Source::File(l) => l.value(),
        Source::Inline(_) => "the program".to_string(),
    };
    let program = match Program::from_json(&text) {
        Ok(p) => p,
        Err(e) => {
            errors.push(syn::Error::new(
                lit.span(),
                format!("{name} is not an mpipe-program/1 document: {e}"),
            ));
            return None;
        }
    };
    let violations = verify(&program);
    if !violations.is_empty() {
        for v in &violations {
            errors.push(syn::Error::new(lit.span(), format!("{name} breaks {v}")));
        }
        return None;
    }
    let opts = SimOptions {
        mode,
        ..SimOptions::default()
    };
    let report = match simulate(&program, &opts) {
        Ok(r) => r,
        Err(e) => {
            errors.push(syn::Error::new(
                lit.span(),
                format!("{name} does not run: {e}"),
            ));
            return None;
        }
    };
    let bound = lower_bound(
        &program.units,
        program.ranks,
        program.microbatches,
        opts.held_link(),
    );
    let params = resident_params(&program);
    Some((
        Derived {
            expr: program
                .source
                .as_ref()
                .map(|s| s.expr.clone())
                .unwrap_or_default(),
            program,
            report,
            bound,
            params,
        },
        path,
    ))
}

/// Read and parse a profile.
fn load_profile(src: &Source, errors: &mut Vec<syn::Error>) -> Option<(Profile, Option<PathBuf>)> {
    let (text, path) = text(src, "profile", errors)?;
    let lit = src.lit();
    let format = path
        .as_ref()
        .and_then(|p| p.extension())
        .and_then(|e| e.to_str())
        .and_then(ProfileFormat::from_extension)
        .unwrap_or(ProfileFormat::Toml);
    match Profile::parse(&text, format) {
        Ok(p) => Some((p, path)),
        Err(e) => {
            let name = match src {
                Source::File(l) => l.value(),
                Source::Inline(_) => "model_toml".to_string(),
            };
            errors.push(syn::Error::new(
                lit.span(),
                format!("bad profile {name}:\n{e}"),
            ));
            None
        }
    }
}
