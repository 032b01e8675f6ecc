//! The macro's input: `ATTRS VIS mod NAME { key = value; ... }`.
//!
//! Keys: `model` (a path string, relative to the calling crate's manifest
//! directory), `ranks`, `microbatches` (integers) and `schedule` (an expression in
//! the language of `docs/spec/model-format.md`, kept as tokens so its errors point
//! into it); optionally `mode` (`rendezvous`, the default, or `eager`: the transfer
//! semantics the schedule is chosen for and timed under). Every problem is
//! collected; parsing goes on past each one.

use mpipe_core::simulate::Mode;
use proc_macro2::{Span, TokenStream, TokenTree};
use syn::parse::{Parse, ParseStream};
use syn::{Attribute, Ident, LitInt, LitStr, Token, Visibility};

/// The keys `schedule!` understands.
pub const KEYS: [&str; 8] = [
    "model",
    "model_toml",
    "ranks",
    "microbatches",
    "schedule",
    "mode",
    "program",
    "program_json",
];

/// Where a file-or-inline input comes from.
#[derive(Clone)]
pub enum Source {
    /// A path, relative to the calling crate's manifest directory.
    File(LitStr),
    /// The text itself, written in the macro.
    Inline(LitStr),
}

impl Source {
    pub fn lit(&self) -> &LitStr {
        match self {
            Source::File(l) | Source::Inline(l) => l,
        }
    }
}

/// A parsed input; fields are `None` where the input lacked them or was wrong (an
/// error then says why).
pub struct Input {
    pub attrs: Vec<Attribute>,
    pub vis: Visibility,
    pub name: Ident,
    pub model: Option<Source>,
    pub ranks: Option<(usize, Span)>,
    pub microbatches: Option<(usize, Span)>,
    pub schedule: Option<TokenStream>,
    /// A program (`mpipe-program/1` JSON) to compile instead of deriving one.
    pub program: Option<Source>,
    /// The transfer semantics the schedule is chosen for and timed under.
    pub mode: Mode,
    pub errors: Vec<syn::Error>,
}

impl Parse for Input {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let attrs = input.call(Attribute::parse_outer)?;
        let vis: Visibility = input.parse()?;
        input.parse::<Token![mod]>().map_err(|e| {
            syn::Error::new(e.span(), "expected `mod NAME { ... }`, as in `pub mod plan { model = \"m.toml\"; ranks = 4; microbatches = 8; schedule = 1f1b; }`")
        })?;
        let name: Ident = input.parse()?;
        let body;
        syn::braced!(body in input);
        let mut out = Input {
            attrs,
            vis,
            name,
            model: None,
            ranks: None,
            microbatches: None,
            schedule: None,
            program: None,
            mode: Mode::Rendezvous,
            errors: Vec::new(),
        };
        let mut seen: Vec<String> = Vec::new();
        while !body.is_empty() {
            let key: Ident = body.parse()?;
            body.parse::<Token![=]>()?;
            // The value: every token up to the next `;` (or the end).
            let mut value = TokenStream::new();
            while !body.is_empty() && !body.peek(Token![;]) {
                let tt: TokenTree = body.parse()?;
                value.extend([tt]);
            }
            if !body.is_empty() {
                body.parse::<Token![;]>()?;
            }
            let k = key.to_string();
            if seen.contains(&k) {
                out.errors.push(syn::Error::new(
                    key.span(),
                    format!("`{k}` is given twice; keep one"),
                ));
                continue;
            }
            seen.push(k.clone());
            if value.is_empty() {
                out.errors
                    .push(syn::Error::new(key.span(), format!("`{k}` has no value")));
                continue;
            }
            match k.as_str() {
                "model_toml" => match syn::parse2::<LitStr>(value) {
                    Ok(s) => out.model = Some(Source::Inline(s)),
                    Err(e) => out.errors.push(syn::Error::new(
                        e.span(),
                        "`model_toml` is the profile's TOML text as a string, e.g. `model_toml = r#\"[llm] ...\"#;`",
                    )),
                },
                "program_json" => match syn::parse2::<LitStr>(value) {
                    Ok(s) => out.program = Some(Source::Inline(s)),
                    Err(e) => out.errors.push(syn::Error::new(
                        e.span(),
                        "`program_json` is a program's JSON text as a string",
                    )),
                },
                "model" => match syn::parse2::<LitStr>(value) {
                    Ok(s) => out.model = Some(Source::File(s)),
                    Err(e) => out.errors.push(syn::Error::new(
                        e.span(),
                        "`model` is the profile's path as a string, e.g. `model = \"profiles/qwen2vl-7b.toml\";`",
                    )),
                },
                "ranks" | "microbatches" => match syn::parse2::<LitInt>(value) {
                    Ok(n) => match n.base10_parse::<usize>() {
                        Ok(0) | Err(_) => out.errors.push(syn::Error::new(
                            n.span(),
                            format!("`{k}` must be a whole number of at least 1"),
                        )),
                        Ok(v) => {
                            let slot = if k == "ranks" { &mut out.ranks } else { &mut out.microbatches };
                            *slot = Some((v, n.span()));
                        }
                    },
                    Err(e) => out.errors.push(syn::Error::new(
                        e.span(),
                        format!("`{k}` must be an integer literal, e.g. `{k} = 8;`"),
                    )),
                },
                "schedule" => out.schedule = Some(value),
                "mode" => match syn::parse2::<Ident>(value.clone())
                    .ok()
                    .and_then(|id| Mode::from_name(&id.to_string()))
                {
                    Some(mode) => out.mode = mode,
                    None => out.errors.push(syn::Error::new_spanned(
                        value,
                        "`mode` is `rendezvous` (the default: a send waits for its receive, as HCCL's do) \
                         or `eager` (a send never waits), e.g. `mode = eager;`",
                    )),
                },
                "program" => match syn::parse2::<LitStr>(value) {
                    Ok(s) => out.program = Some(Source::File(s)),
                    Err(e) => out.errors.push(syn::Error::new(
                        e.span(),
                        "`program` is a program file's path as a string, e.g. `program = \"schedules/mine.json\";`",
                    )),
                },
                other => {
                    let hint = mpipe_core::derive::did_you_mean(other, &KEYS)
                        .map(|s| format!(" (did you mean `{s}`?)"))
                        .unwrap_or_default();
                    out.errors.push(syn::Error::new(
                        key.span(),
                        format!("unknown key `{other}`{hint}; expected one of: {}", KEYS.join(", ")),
                    ));
                }
            }
        }
        // A program file replaces the derivation: then only it is required.
        let required: &[&str] = if out.program.is_some() {
            &[]
        } else {
            &["model", "ranks", "microbatches", "schedule"]
        };
        let given = |k: &str| seen.iter().any(|s| s == k);
        if given("model") && given("model_toml") {
            out.errors.push(syn::Error::new(
                out.name.span(),
                "give `model` (a file) or `model_toml` (inline text), not both",
            ));
        }
        if given("program") && given("program_json") {
            out.errors.push(syn::Error::new(
                out.name.span(),
                "give `program` (a file) or `program_json` (inline text), not both",
            ));
        }
        if out.program.is_some() {
            for k in ["model", "model_toml", "ranks", "microbatches", "schedule"] {
                if seen.iter().any(|s| s == k) {
                    out.errors.push(syn::Error::new(
                        out.name.span(),
                        format!("`{k}` cannot be combined with `program`: a program file already fixes the schedule; remove one"),
                    ));
                }
            }
        }
        for &k in required {
            let present = given(k) || (k == "model" && given("model_toml"));
            if !present {
                let example = match k {
                    "model" => "model = \"profiles/model.toml\";",
                    "ranks" => "ranks = 4;",
                    "microbatches" => "microbatches = 8;",
                    _ => "schedule = 1f1b;",
                };
                out.errors.push(syn::Error::new(
                    out.name.span(),
                    format!("missing `{k}`: add `{example}`"),
                ));
            }
        }
        Ok(out)
    }
}
