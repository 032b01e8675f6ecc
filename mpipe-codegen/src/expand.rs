//! From the macro's input to its output: read the profile, parse the expression,
//! derive, and emit — or emit every error found, with a fallback module.

use crate::cache::{self, Cache, Choice};
use crate::emit::{fallback, module, Facts};
use crate::input::{Input, Source};
use crate::places;
use mpipe_core::advice::{for_written, memory_over_limit};
use mpipe_core::bound::lower_bound;
use mpipe_core::derive::{
    bound_for, derive, derive_auto, resident_params, DeriveError, Derived, Request,
};
use mpipe_core::expr::Expr;
use mpipe_core::policy::SearchPolicy;
use mpipe_core::profile::{Profile, ProfileFormat};
use mpipe_core::program::Program;
use mpipe_core::simulate::{simulate, Mode, SimOptions};
use mpipe_core::verify::verify;
use proc_macro2::{Span, TokenStream};
use quote::quote;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use syn::LitStr;

/// Expand `schedule! { ... }`, with `auto`'s choices remembered where the
/// environment says ([`Cache::from_env`]).
pub fn schedule(tokens: TokenStream) -> TokenStream {
    schedule_with(tokens, Cache::from_env().as_ref())
}

/// Expand `schedule! { ... }`, with `auto`'s choices remembered in `cache` (none:
/// every `auto` searches).
pub fn schedule_with(tokens: TokenStream, cache: Option<&Cache>) -> TokenStream {
    schedule_noting(tokens, cache, LONG_SEARCH)
}

/// [`schedule_with`], noting at compile time (a warning) any `auto` search that
/// spends `long` or more work ([`LONG_SEARCH`]).
pub fn schedule_noting(tokens: TokenStream, cache: Option<&Cache>, long: u64) -> TokenStream {
    let input = match syn::parse2::<Input>(tokens) {
        Ok(input) => input,
        Err(e) => return e.to_compile_error(),
    };
    let mut errors = input.errors.clone();
    if let Some(src) = &input.program {
        let loaded = load_program(src, input.mode, &mut errors);
        return finish(&input, loaded, errors, &[]);
    }
    let profile = input
        .model
        .as_ref()
        .and_then(|src| load_profile(src, &mut errors));
    // The expression's tokens as mpipe-core reads them; `places` maps the places of
    // its errors back to the compiler's spans.
    let (tokens, places) = input.schedule.clone().map(places::tokens).unzip();
    let places = places.unwrap_or_default();
    let expr = tokens.and_then(|ts| match mpipe_core::expr::parse(&ts) {
        Ok(e) => Some(e),
        Err(es) => {
            errors.extend(
                es.into_iter()
                    .map(|e| syn::Error::new(places.span(e.span), e.message)),
            );
            None
        }
    });
    let mut derived = None;
    let mut warnings = Vec::new();
    // The units of what was declared, when known even though something failed: the
    // fallback module keeps them, so code sized by `UNITS` sees no secondary errors.
    let mut shape: Option<Vec<String>> = None;
    if let (Some((profile, _)), Some((ranks, _)), Some((microbatches, _)), Some(expr)) =
        (&profile, input.ranks, input.microbatches, &expr)
    {
        // Among the schedules the macro can emit: not `prefetch`, whose next-step
        // forwards the generated code cannot run yet.
        let req = Request {
            mode: input.mode,
            policy: SearchPolicy {
                prefetch: false,
                ..SearchPolicy::DEFAULT
            },
            ..Request::new(profile, ranks, microbatches)
        };
        let found = if expr.name() == "auto" && expr.args.is_empty() {
            let (found, note) = auto(&req, expr, cache, long);
            warnings.extend(note.map(|n| (places.span(expr.span), n)));
            found
        } else {
            derive(&req, expr)
        };
        if let Ok(d) = &found {
            let encoders: Vec<&str> = profile.encoders.iter().map(|e| e.name.as_str()).collect();
            if let Some(w) = mpipe_core::advice::degenerate(&d.expr, &d.program, &encoders) {
                warnings.push((places.span(expr.span), w));
            }
        }
        shape = match &found {
            Ok(d) => Some(unit_names(&d.program)),
            Err(es) if expr.name() != "auto" => relaxed_units(&req, expr, es),
            Err(_) => None,
        };
        match found {
            Ok(d) if !d.program.prefetch.is_empty() => errors.push(syn::Error::new(
                places.span(expr.span),
                format!(
                    "`{}` prefetches encoder forwards for the next step, which generated code \
                     cannot run yet (the runtime's `Step` has no next-step forward); simulate \
                     it with `mpipe`, and emit `fill` or `transpose` instead",
                    d.expr
                ),
            )),
            Ok(d) => derived = Some(d),
            Err(es) => errors.extend(es.into_iter().map(|e| {
                syn::Error::new(places.span(e.span), for_written(expr.name(), &e.message))
            })),
        }
    }
    let path = profile.and_then(|(_, path)| path);
    let failed = derived.is_none() || !errors.is_empty();
    let out = finish(&input, derived.map(|d| (d, path)), errors, &warnings);
    match shape {
        Some(units) if failed => shaped(out, &units),
        _ => out,
    }
}

/// The unit names of `program`.
fn unit_names(program: &Program) -> Vec<String> {
    program.units.iter().map(|u| u.name.clone()).collect()
}

/// The units `expr` would have for `req` had it not failed with `errors`: first the
/// expression itself with room to derive (more micro-batches, no memory limit;
/// units depend on neither), for errors about sizes only; else what its writer most
/// likely meant ([`mpipe_core::algebra::repair::likely_meant`]: misspelt names
/// repaired, then its parts, then the plainest body), likewise relaxed. `None` when
/// nothing derives.
fn relaxed_units(req: &Request, expr: &Expr, errors: &[DeriveError]) -> Option<Vec<String>> {
    use mpipe_core::derive::ErrorKind;
    let mut profile = req.profile.clone();
    profile.memory = None;
    let relaxed = Request {
        profile: &profile,
        microbatches: req.microbatches.max(4 * req.ranks),
        ..*req
    };
    let units = |e: &Expr| derive(&relaxed, e).ok().map(|d| unit_names(&d.program));
    let sizes_only = !errors.is_empty()
        && errors
            .iter()
            .all(|e| matches!(e.kind, ErrorKind::Microbatches | ErrorKind::Memory));
    if sizes_only {
        if let Some(u) = units(expr) {
            return Some(u);
        }
    }
    let encoders: Vec<&str> = profile.encoders.iter().map(|e| e.name.as_str()).collect();
    mpipe_core::algebra::repair::likely_meant(expr, &encoders)
        .iter()
        .find_map(units)
}

/// `out`, a fallback module and its errors, with the fallback's `UNITS` and
/// `units` made those of `units` (the module's other items are kept as they are).
fn shaped(out: TokenStream, units: &[String]) -> TokenStream {
    let mut items = Vec::new();
    let mut rest = TokenStream::new();
    let Ok(file) = syn::parse2::<syn::File>(out.clone()) else {
        return out;
    };
    for (i, item) in file.items.into_iter().enumerate() {
        match item {
            syn::Item::Mod(mut m) if i == 0 => {
                if let Some((_, content)) = &mut m.content {
                    for inner in content.iter_mut() {
                        match inner {
                            syn::Item::Const(c) if c.ident == "UNITS" => {
                                let n = units.len();
                                *inner = syn::parse_quote! {
                                    pub const UNITS: [&str; #n] = [#(#units),*];
                                };
                            }
                            syn::Item::Mod(u) if u.ident == "units" => {
                                let consts = units.iter().enumerate().map(|(k, n)| {
                                    let id = quote::format_ident!("{}", crate::emit::const_name(n));
                                    let k = proc_macro2::Literal::u32_unsuffixed(k as u32);
                                    quote! { pub const #id: ::mpipe::runtime::UnitId = #k; }
                                });
                                *inner = syn::parse_quote! { pub mod units { #(#consts)* } };
                            }
                            _ => {}
                        }
                    }
                }
                items.push(quote!(#m));
            }
            other => rest.extend(quote!(#other)),
        }
    }
    let mut shaped: TokenStream = items.into_iter().collect();
    shaped.extend(rest);
    shaped
}

/// How much work (task visits, [`mpipe_core::search::Search::work`]) a search may
/// spend before the macro notes, at compile time, how to avoid running it again.
/// By work, not time, so that whether a build warns (and fails under `-D
/// warnings`) is the same on every machine and under any load. Above the small
/// searches of this repository's own tests and examples (4 ranks x 8 to 32
/// micro-batches), below a real model's (`profiles/qwen2vl-7b.toml` at 8 x 32,
/// whose search takes minutes in a dev build).
pub const LONG_SEARCH: u64 = 120_000_000;

/// `auto` as the macro runs it: the program `cache` remembers for `req`, checked
/// ([`remembered`]), or else a search among the schedules the macro can emit
/// (`req`'s policy has [`SearchPolicy::prefetch`] off), whose choice is then
/// remembered. A search
/// spending `long` work or more also returns a note for the user (how to skip it
/// next time).
fn auto(
    req: &Request,
    expr: &Expr,
    cache: Option<&Cache>,
    long: u64,
) -> (Result<Derived, Vec<DeriveError>>, Option<String>) {
    let key = cache.and_then(|_| cache::key(req));
    if let (Some(cache), Some(key)) = (cache, &key) {
        if let Some(d) = cache.load(key).and_then(|c| remembered(req, c)) {
            return (Ok(d), None);
        }
    }
    let started = Instant::now();
    let (found, work) = match derive_auto(req, expr) {
        Ok((d, work)) => (Ok(d), work),
        Err(es) => (Err(es), 0),
    };
    let took = started.elapsed();
    let stored = match (cache, &key, &found) {
        (Some(cache), Some(key), Ok(d)) => {
            let choice = Choice {
                expr: d.expr.clone(),
                program: d.program.clone(),
            };
            cache.store(key, &choice);
            // Only a file that reads back is worth naming.
            (cache.load(key).as_ref() == Some(&choice)).then(|| cache.dir().to_path_buf())
        }
        _ => None,
    };
    let note = match &found {
        Ok(d) if work >= long => Some(long_search_note(&d.expr, took, stored.as_deref())),
        _ => None,
    };
    (found, note)
}

/// The compile-time note for a search that took `took` and chose `chosen`,
/// remembered in `stored` (a directory) if it could be.
fn long_search_note(chosen: &str, took: Duration, stored: Option<&Path>) -> String {
    let cached = match stored {
        Some(dir) => format!(
            "the choice is cached in {} (MPIPE_AUTO_CACHE names another directory), so \
             rebuilds reuse it while the profile, sizes, mode and mpipe stay the same; keep \
             that directory between builds (CI caches)",
            dir.display()
        ),
        None => "it could not be cached (set MPIPE_AUTO_CACHE to a writable directory, \
                 not `off`, to keep it between builds)"
            .to_string(),
    };
    let pin = if chosen.contains("order =") {
        " (that re-runs its order search on every build; to skip all work, save \
         `PROGRAM_JSON` to a file and write `program = \"that-file.json\";` instead of \
         `model`, `ranks`, `microbatches` and `schedule`)"
    } else {
        ""
    };
    format!(
        "`auto` searched for {:.1} s and chose `{chosen}`; {cached}; or pin the choice: \
         write `schedule = {chosen};` in place of `auto`{pin}",
        took.as_secs_f64()
    )
}

/// A remembered choice as the derivation it stands for, if it holds for `req`: the
/// program has `req`'s sizes and the choice's expression as its source, breaks no
/// rule (rules 1-5, [`verify`]), runs under `req`'s semantics, fits the profile's
/// memory limit, and prefetches nothing. Anything else is `None` (a search).
fn remembered(req: &Request, choice: Choice) -> Option<Derived> {
    let Choice { expr, program } = choice;
    let fits = program.ranks == req.ranks
        && program.microbatches == req.microbatches
        && program.prefetch.is_empty()
        && program.source.as_ref().is_some_and(|s| s.expr == expr);
    if !fits || !verify(&program).is_empty() {
        return None;
    }
    let opts = req.sim_options(req.mode);
    let report = simulate(&program, &opts).ok()?;
    let params = resident_params(&program);
    if let Some(limit) = req.profile.memory.as_ref().map(|m| m.limit) {
        if memory_over_limit(&expr, &report.peak_memory, &params, limit).is_some() {
            return None;
        }
    }
    let bound = bound_for(req.profile, &program, &opts);
    Some(Derived {
        program,
        report,
        bound,
        params,
        expr,
    })
}

/// A compile-time warning at `span`. Procedural macros on stable Rust cannot emit
/// warnings, so this is the use of a deprecated constant whose deprecation note is
/// the message: rustc prints `warning: use of deprecated constant `_::warning`:
/// MESSAGE` at `span` (`#[allow(deprecated)]` silences it, `-D warnings` makes it an
/// error, like any warning).
pub fn warning(span: Span, message: &str) -> TokenStream {
    let name = syn::Ident::new("warning", span);
    quote! {
        const _: () = {
            #[deprecated(note = #message)]
            #[allow(non_upper_case_globals)]
            const #name: () = ();
            #name
        };
    }
}

/// The module for a derived (or loaded) program, or, if anything went wrong, the
/// fallback module followed by every error; then every warning.
fn finish(
    input: &Input,
    derived: Option<(Derived, Option<PathBuf>)>,
    errors: Vec<syn::Error>,
    warnings: &[(Span, String)],
) -> TokenStream {
    let mut out = finish_module(input, derived, errors);
    for (span, message) in warnings {
        out.extend(warning(*span, message));
    }
    out
}

fn finish_module(
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
            errors.push(syn::Error::new(
                lit.span(),
                format!(
                    "{name} breaks {v} (the rules: {})",
                    mpipe_core::verify::SPEC
                ),
            ));
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
