//! Tokens for a derived schedule: the module of constants and per-rank functions.
//!
//! Each rank's action list is first re-rolled (`mpipe_core::rolled`) so regular
//! stretches become `for` loops over affine micro-batch indices (nested where a
//! period holds repetitions); each action becomes
//! one call on the runtime's `Step`. Output is deterministic (program order, unit
//! order), so expansion snapshots are stable.

use crate::input::Input;
use mpipe_core::derive::Derived;
use mpipe_core::program::{CollKind, Dir, Op, Tensor};
use mpipe_core::rolled::{roll, Affine, Block, Op as ROp, P2p, COUNTERS};
use proc_macro2::{Literal, TokenStream};
use quote::{format_ident, quote};
use std::path::Path;

/// What the module is emitted from.
pub struct Facts<'a> {
    pub derived: &'a Derived,
    /// The profile file, made a build dependency with `include_bytes!`.
    pub profile_path: Option<&'a Path>,
}

/// The module's outer shell: attributes, visibility, name, and the contents.
fn shell(input: &Input, contents: TokenStream) -> TokenStream {
    let (attrs, vis, name) = (&input.attrs, &input.vis, &input.name);
    quote! {
        #(#attrs)*
        #[allow(clippy::all, clippy::pedantic, unused_parens)]
        #vis mod #name {
            #contents
        }
    }
}

/// The module for a derived schedule.
pub fn module(input: &Input, facts: &Facts) -> TokenStream {
    let d = facts.derived;
    let p = &d.program;
    let ranks = p.ranks;
    let microbatches = p.microbatches;
    let rolled = match roll(p) {
        Ok(r) => r,
        Err(e) => {
            let msg = format!(
                "internal error: cannot re-roll the derived program: {e}; please report it"
            );
            let mut out = fallback(input);
            out.extend(syn::Error::new(input.name.span(), msg).to_compile_error());
            return out;
        }
    };
    let unit_names: Vec<&str> = p.units.iter().map(|u| u.name.as_str()).collect();
    let unit_consts = unit_names.iter().enumerate().map(|(i, n)| {
        let id = format_ident!("{}", const_name(n));
        let i = Literal::u32_unsuffixed(i as u32);
        let doc = format!("Unit `{n}`.");
        quote! { #[doc = #doc] pub const #id: ::mpipe::runtime::UnitId = #i; }
    });
    let n_units = unit_names.len();
    let makespan = d.report.makespan;
    let mode = mode_tokens(input);
    let bubble = d.report.bubble;
    let bound = d.bound.value();
    let peaks = d
        .report
        .peak_memory
        .iter()
        .map(|&x| Literal::f64_suffixed(x));
    let expr = p
        .source
        .as_ref()
        .map(|s| s.expr.clone())
        .unwrap_or_default();
    let json = p.to_json();
    let include = facts.profile_path.map(|path| {
        let path = path.display().to_string();
        quote! {
            /// The profile this schedule was derived from (so Cargo rebuilds when it changes).
            pub const PROFILE: &[u8] = include_bytes!(#path);
        }
    });
    let rank_fns = rolled.ranks.iter().enumerate().map(|(r, blocks)| {
        let name = format_ident!("rank_{}", r);
        let body = blocks.iter().map(|b| block(b, 0));
        let doc = format!("Rank {r}'s actions for one step, in program order.");
        quote! {
            #[doc = #doc]
            pub fn #name<S: ::mpipe::runtime::Step + ?Sized>(step: &mut S) -> ::core::result::Result<(), S::Error> {
                use ::mpipe::runtime::{P2p, Tensor};
                #(#body)*
                ::core::result::Result::Ok(())
            }
        }
    });
    let batch_consts = tables(&rolled);
    let arms = (0..p.ranks).map(|r| {
        let name = format_ident!("rank_{}", r);
        let r = lit(r);
        quote! { #r => #name(step), }
    });
    let (ranks, microbatches, n_units) = (lit(ranks), lit(microbatches), lit(n_units));
    let contents = quote! {
        /// Number of pipeline ranks.
        pub const RANKS: usize = #ranks;
        /// Micro-batches per step.
        pub const MICROBATCHES: usize = #microbatches;
        /// The schedule expression, in canonical form (for `auto`, the one it chose).
        pub const EXPR: &str = #expr;
        /// Unit names, indexed by `UnitId`.
        pub const UNITS: [&str; #n_units] = [#(#unit_names),*];
        /// Unit ids by name (`llm.0` is `LLM_0`).
        pub mod units {
            #(#unit_consts)*
        }
        /// The transfer semantics the schedule was chosen for and is timed under
        /// (`mode = ...`; run the ranks' transfers with the same, e.g.
        /// `HostComm::set_mode(MODE)` on the host backend).
        pub const MODE: ::mpipe::core::simulate::Mode = #mode;
        /// Predicted step time (under `MODE`, the profile's link model).
        pub const MAKESPAN: f64 = #makespan;
        /// Predicted bubble ratio.
        pub const BUBBLE: f64 = #bubble;
        /// Lower bound on any schedule's step time for this profile.
        pub const LOWER_BOUND: f64 = #bound;
        /// Predicted peak activation memory per rank.
        pub const PEAK_MEMORY: [f64; #ranks] = [#(#peaks),*];
        /// The derived program, as `mpipe-program/1` JSON.
        pub const PROGRAM_JSON: &str = #json;
        #include
        #batch_consts
        #(#rank_fns)*
        /// Run `rank`'s actions for one step.
        pub fn run<S: ::mpipe::runtime::Step + ?Sized>(rank: usize, step: &mut S) -> ::core::result::Result<(), S::Error> {
            match rank {
                #(#arms)*
                _ => ::core::result::Result::Err(step.no_such_rank(rank, RANKS)),
            }
        }
    };
    shell(input, contents)
}

/// Enough of the module for the rest of the crate to type-check when the
/// derivation failed (the compile errors say why).
pub fn fallback(input: &Input) -> TokenStream {
    let ranks = input.ranks.map_or(1, |(r, _)| r);
    let mbs = input.microbatches.map_or(1, |(m, _)| m);
    let mode = mode_tokens(input);
    let rank_fns = (0..ranks).map(|r| {
        let name = format_ident!("rank_{}", r);
        quote! {
            pub fn #name<S: ::mpipe::runtime::Step + ?Sized>(step: &mut S) -> ::core::result::Result<(), S::Error> {
                let _ = step;
                ::core::result::Result::Ok(())
            }
        }
    });
    shell(
        input,
        quote! {
            pub const RANKS: usize = #ranks;
            pub const MICROBATCHES: usize = #mbs;
            pub const EXPR: &str = "";
            pub const UNITS: [&str; 0] = [];
            pub mod units {}
            pub const MODE: ::mpipe::core::simulate::Mode = #mode;
            pub const MAKESPAN: f64 = 0.0;
            pub const BUBBLE: f64 = 0.0;
            pub const LOWER_BOUND: f64 = 0.0;
            pub const PEAK_MEMORY: [f64; #ranks] = [0.0; #ranks];
            pub const PROGRAM_JSON: &str = "";
            pub const BATCHES: [&[::mpipe::runtime::batches::Entry]; #ranks] = [&[]; #ranks];
            #(#rank_fns)*
            pub fn run<S: ::mpipe::runtime::Step + ?Sized>(rank: usize, step: &mut S) -> ::core::result::Result<(), S::Error> {
                let _ = rank;
                let _ = step;
                ::core::result::Result::Ok(())
            }
        },
    )
}

/// The path of the input's `mode`.
fn mode_tokens(input: &Input) -> TokenStream {
    let variant = format_ident!("{}", format!("{:?}", input.mode));
    quote! { ::mpipe::core::simulate::Mode::#variant }
}

/// `llm.0` -> `LLM_0`, `vision` -> `VISION`.
pub fn const_name(unit: &str) -> String {
    let mut s: String = unit
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .collect();
    if s.starts_with(|c: char| c.is_ascii_digit()) || s.is_empty() {
        s.insert(0, '_');
    }
    s
}

/// `b`, inside `depth` loops.
fn block(b: &Block, depth: usize) -> TokenStream {
    match b {
        Block::Op(op) => one(op, depth),
        Block::Loop { count, body } => {
            let var = if body.iter().any(|b| uses_counter(b, 0)) {
                let v = counter(depth);
                quote!(#v)
            } else {
                quote!(_)
            };
            let body = body.iter().map(|b| block(b, depth + 1));
            quote! {
                for #var in 0..#count {
                    #(#body)*
                }
            }
        }
    }
}

/// Whether a micro-batch number of `b` depends on the counter of the loop `up` levels
/// around `b` (0: the loop whose body holds `b`).
fn uses_counter(b: &Block, up: usize) -> bool {
    match b {
        Block::Op(ROp::Compute { mb, .. }) => mb.strides[up] != 0,
        Block::Op(ROp::Batch(items)) => items.iter().any(|x| x.mb.strides[up] != 0),
        Block::Op(ROp::Coll { .. }) => false,
        Block::Loop { body, .. } => body.iter().any(|b| uses_counter(b, up + 1)),
    }
}

/// The counter of the loop at nesting level `level` (0: outermost): `i`, `j`, ...
fn counter(level: usize) -> proc_macro2::Ident {
    format_ident!("{}", COUNTERS[level])
}

fn lit(n: usize) -> Literal {
    Literal::usize_unsuffixed(n)
}

/// The micro-batch expression of `a` inside `depth` loops, simplified: `base`, then
/// `stride * counter` for each loop from the outermost, the positive terms added
/// before the negative ones are subtracted (so no intermediate value is below the
/// result, which is a micro-batch the program runs); `i` alone for `0 + i`.
fn affine(a: &Affine, depth: usize) -> TokenStream {
    let base = lit(a.base.unsigned_abs() as usize);
    let (mut pos, mut neg) = (Vec::new(), Vec::new());
    for level in 0..depth {
        let s = a.strides[depth - 1 - level];
        let v = counter(level);
        let term = match s.unsigned_abs() {
            0 => continue,
            1 => quote!(#v),
            k => {
                let k = lit(k as usize);
                quote!(#k * #v)
            }
        };
        if s > 0 {
            pos.push(term);
        } else {
            neg.push(term);
        }
    }
    let mut pos = pos.into_iter();
    let mut expr = match (a.base, pos.len()) {
        (0, 1..) => pos.next().expect("a positive term"),
        _ => quote!(#base),
    };
    for t in pos {
        expr = quote!(#expr + #t);
    }
    for t in neg {
        expr = quote!(#expr - #t);
    }
    expr
}

/// Step `op`, inside `depth` loops.
fn one(op: &ROp, depth: usize) -> TokenStream {
    match op {
        ROp::Compute { op, unit, mb } => {
            let method = match op {
                Op::F => quote!(forward),
                Op::B => quote!(backward_input),
                Op::W => quote!(backward_weight),
                Op::BW => quote!(backward),
                Op::RF => quote!(recompute),
            };
            let (unit, mb) = (Literal::u32_unsuffixed(*unit), affine(mb, depth));
            quote! { step.#method(#unit, #mb)?; }
        }
        ROp::Batch(items) => {
            let items = items.iter().map(|x| p2p(x, depth));
            quote! { step.p2p(&[#(#items),*])?; }
        }
        ROp::Coll {
            kind,
            unit,
            root,
            group,
        } => {
            let method = match kind {
                CollKind::Bcast => quote!(broadcast),
                CollKind::Reduce => quote!(reduce),
            };
            let (unit, root) = (Literal::u32_unsuffixed(*unit), lit(*root));
            let group = group.iter().map(|&g| lit(g));
            quote! { step.#method(#unit, #root, &[#(#group),*])?; }
        }
    }
}

fn p2p(x: &P2p, depth: usize) -> TokenStream {
    let ctor = match x.dir {
        Dir::Send => quote!(send),
        Dir::Recv => quote!(recv),
    };
    let tensor = match x.tensor {
        Tensor::Act => quote!(Act),
        Tensor::Grad => quote!(Grad),
        Tensor::Input => quote!(Input),
    };
    let (unit, mb, peer) = (
        Literal::u32_unsuffixed(x.unit),
        affine(&x.mb, depth),
        lit(x.peer),
    );
    quote! { P2p::#ctor(Tensor::#tensor, #unit, #mb, #peer) }
}

/// `BATCHES`: per rank, each transfer batch of the program in program order, rolled
/// into the same loops as the rank's function (so its size does not grow with the
/// micro-batch count): `Skip(n)` for `n` actions that are not transfers, `Batch` for a
/// batch's items, `Loop` for a loop. Element counts are not known here (the profile's
/// sizes are abstract): each item's count source follows from its tensor, resolved by
/// the runtime from the model at start-up (`mpipe_runtime::batches`).
fn tables(rolled: &mpipe_core::rolled::Rolled) -> TokenStream {
    fn transfer(x: &P2p, depth: usize) -> TokenStream {
        let dir = match x.dir {
            Dir::Send => quote!(Send),
            Dir::Recv => quote!(Recv),
        };
        let tensor = match x.tensor {
            Tensor::Act => quote!(Act),
            Tensor::Grad => quote!(Grad),
            Tensor::Input => quote!(Input),
        };
        let unit = Literal::u32_unsuffixed(x.unit);
        let base = Literal::i64_unsuffixed(x.mb.base);
        let peer = lit(x.peer);
        if x.mb.strides[1..].iter().all(|&s| s == 0) {
            let stride = Literal::i64_unsuffixed(x.mb.strides[0]);
            quote! { X::new(D::#dir, T::#tensor, #unit, #base, #stride, #peer) }
        } else {
            // Inside nested loops: a stride per enclosing loop, innermost first.
            let strides = x.mb.strides[..depth]
                .iter()
                .map(|&s| Literal::i64_unsuffixed(s));
            quote! { X::nested(D::#dir, T::#tensor, #unit, #base, [#(#strides),*], #peer) }
        }
    }
    fn entries(blocks: &[Block], depth: usize, out: &mut Vec<TokenStream>, skip: &mut usize) {
        for b in blocks {
            match b {
                Block::Op(ROp::Batch(items)) => {
                    flush(out, skip);
                    let items = items.iter().map(|x| transfer(x, depth));
                    out.push(quote! { E::Batch(&[#(#items),*]) });
                }
                Block::Op(ROp::Compute { .. } | ROp::Coll { .. }) => *skip += 1,
                Block::Loop { count, body } => {
                    flush(out, skip);
                    let (mut inner, mut inner_skip) = (Vec::new(), 0);
                    entries(body, depth + 1, &mut inner, &mut inner_skip);
                    flush(&mut inner, &mut inner_skip);
                    let count = lit(*count);
                    out.push(quote! { E::Loop { count: #count, body: &[#(#inner),*] } });
                }
            }
        }
    }
    fn flush(out: &mut Vec<TokenStream>, skip: &mut usize) {
        if *skip > 0 {
            let n = lit(*skip);
            out.push(quote! { E::Skip(#n) });
            *skip = 0;
        }
    }
    let per_rank = rolled.ranks.iter().map(|blocks| {
        let (mut out, mut skip) = (Vec::new(), 0);
        // Actions after the last batch need no entry.
        entries(blocks, 0, &mut out, &mut skip);
        quote! { &[#(#out),*] }
    });
    quote! {
        /// Per rank, each transfer batch of the program in order, rolled into the loops
        /// of the rank's function (`Skip(n)`: `n` actions that are not transfers): each
        /// item's direction, tensor, unit, micro-batch (`base + stride * i`) and peer;
        /// its element count's source and type follow from the tensor. Counts are filled
        /// from the model at start-up (`mpipe::runtime::batches::{check, sizes}`).
        pub const BATCHES: [&[::mpipe::runtime::batches::Entry]; RANKS] = {
            use ::mpipe::runtime::batches::{Entry as E, Transfer as X};
            use ::mpipe::runtime::{Dir as D, Tensor as T};
            [#(#per_rank),*]
        };
    }
}
