//! Cases the search is judged on, shared by `tests/search.rs` and the
//! `ratio_report` example: the peer schedules, `auto` against them, and random
//! profiles.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use proptest::prelude::*;

/// The peer schedules of the evaluation: each body with every encoder inline, and
/// with every encoder transposed.
pub(crate) fn peers(profile: &Profile) -> Vec<String> {
    let bodies = ["1f1b", "interleaved(v = 2)", "zbh1", "zbv", "dualpipev"];
    let mut out: Vec<String> = bodies.iter().map(|b| b.to_string()).collect();
    for b in bodies {
        // Every encoder transposed, in either nesting order.
        let mut e = b.to_string();
        for enc in &profile.encoders {
            e = format!("transpose({}, {e})", enc.name);
        }
        out.push(e);
        if profile.encoders.len() == 2 {
            let mut e = b.to_string();
            for enc in profile.encoders.iter().rev() {
                e = format!("transpose({}, {e})", enc.name);
            }
            out.push(e);
        }
    }
    out
}

/// `auto`'s step time, and every derivable peer's.
pub(crate) fn auto_and_peers(
    profile: &Profile,
    p: usize,
    m: usize,
) -> (f64, String, f64, Vec<(String, f64)>) {
    let req = Request::new(profile, p, m);
    let auto = derive_str(&req, "auto").unwrap_or_else(|e| panic!("auto: {e:?}"));
    let peers = peers(profile)
        .into_iter()
        .filter_map(|e| derive_str(&req, &e).ok().map(|d| (e, d.report.makespan)))
        .collect();
    (auto.report.makespan, auto.expr, auto.bound.value(), peers)
}

/// A random multimodal profile: a vision encoder, sometimes an audio encoder too,
/// each frozen or trainable, before a 16-layer LLM; and a size: 2, 4 or 8 ranks,
/// 1 to 4 micro-batches per rank.
pub(crate) fn random_profile() -> impl Strategy<Value = (String, usize, usize)> {
    (
        (1u32..33, 0.05f64..2.0, 0.05f64..2.0, 0.0f64..1.0, any::<bool>()),
        prop::option::of((1u32..13, 0.05f64..1.0, any::<bool>())),
        (0.2f64..2.0, 0.2f64..2.0, 0.0f64..1.5),
        prop::sample::select(vec![2usize, 4, 8]),
        1usize..5,
    )
        .prop_map(|((vl, vf, vb, vw, vt), audio, (lf, lb, lw), p, k)| {
            let mut text = format!(
                "[[encoder]]\nname = \"vision\"\nlayers = {vl}\nforward = {vf}\nbackward = {vb}\n\
                 weight = {vw}\nactivation = 0.1\ntrainable = {vt}\n\n"
            );
            if let Some((al, af, at)) = audio {
                text += &format!(
                    "[[encoder]]\nname = \"audio\"\nlayers = {al}\nforward = {af}\nbackward = {af}\n\
                     weight = {}\nactivation = 0.1\ntrainable = {at}\n\n",
                    af / 2.0
                );
            }
            text += &format!(
                "[llm]\nlayers = 16\nforward = {lf}\nbackward = {lb}\nweight = {lw}\nactivation = 1.0\n"
            );
            (text, p, p * k)
        })
}
