//! How big the emitted code is: the module without the program's JSON constant
//! (static data that necessarily grows with the micro-batch count).

use proc_macro2::{TokenStream, TokenTree};

/// Size of an expansion, JSON constant left out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodeSize {
    /// Leaf tokens (identifiers, punctuation, literals): independent of how wide
    /// the numbers in it are.
    pub tokens: usize,
    /// Lines once pretty-printed.
    pub lines: usize,
}

/// The size of `expansion`; `None` if the tokens are not a Rust file.
pub fn code_size(expansion: TokenStream) -> Option<CodeSize> {
    let mut file: syn::File = syn::parse2(expansion).ok()?;
    for item in &mut file.items {
        if let syn::Item::Mod(m) = item {
            if let Some((_, items)) = &mut m.content {
                items.retain(|i| !matches!(i, syn::Item::Const(c) if c.ident == "PROGRAM_JSON"));
            }
        }
    }
    let text = prettyplease::unparse(&file);
    let tokens = count(quote::ToTokens::to_token_stream(&file));
    Some(CodeSize {
        tokens,
        lines: text.lines().count(),
    })
}

fn count(ts: TokenStream) -> usize {
    ts.into_iter()
        .map(|tt| match tt {
            TokenTree::Group(g) => count(g.stream()),
            _ => 1,
        })
        .sum()
}
