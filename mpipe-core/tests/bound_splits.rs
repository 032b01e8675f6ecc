//! The profile's bound holds for the programs mpipe derives: each program, whatever
//! stage split its expression chose (even, balanced, looped, a V, or the split
//! `zb2p(encoders = ramp)` picks for the profile), is bounded below by the bound of
//! its own units, so the figure every schedule is compared with, the least over the
//! splits, must not exceed that: else a schedule's ratio to it would overstate how
//! close it is (and could fall below 1).

use mpipe_core::bound::{lower_bound, profile_bound};
use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::simulate::Mode;

const PROFILES: [(&str, &str); 4] = [
    ("qwen2vl-7b", include_str!("../../profiles/qwen2vl-7b.toml")),
    (
        "eval-a-internvit6b",
        include_str!("../../profiles/eval-a-internvit6b.toml"),
    ),
    (
        "eval-c-omni",
        include_str!("../../profiles/eval-c-omni.toml"),
    ),
    (
        "encoder-heavy",
        include_str!("../../profiles/encoder-heavy.toml"),
    ),
];

const EXPRS: [&str; 6] = [
    "1f1b",
    "zbv",
    "interleaved(v = 2)",
    "zb2p(encoders = ramp, costs = unit)",
    "balance(zb2p(encoders = ramp))",
    "zb2p(v = 2, encoders = ramp)",
];

#[test]
fn the_profile_bound_is_below_every_derived_programs_own_bound() {
    for (name, text) in PROFILES {
        let profile = Profile::from_toml_str(text).unwrap();
        for (ranks, microbatches) in [(4, 8), (8, 16)] {
            let req = Request::new(&profile, ranks, microbatches);
            for mode in [Mode::Rendezvous, Mode::Eager] {
                let link = req.sim_options(mode).held_link();
                let bound = profile_bound(&profile, ranks, microbatches, link)
                    .expect("the shipped profiles split over 4 and 8 ranks")
                    .value();
                for expr in EXPRS {
                    // An expression a profile cannot take (two encoders for a ramp,
                    // say) is not this test's concern.
                    let Ok(derived) = derive_str(&req, expr) else {
                        continue;
                    };
                    let own = lower_bound(&derived.program.units, ranks, microbatches, link);
                    assert!(
                        bound <= own.value() * (1.0 + 1e-12),
                        "{name} at {ranks} x {microbatches} ({mode:?}): the profile's \
                         bound {bound} exceeds the bound {} of `{expr}`'s own split",
                        own.value()
                    );
                }
            }
        }
    }
}
