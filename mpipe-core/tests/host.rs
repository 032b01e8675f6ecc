//! `host(ENCODER, BODY, rank = N | spare)`: the encoder moves, parameters and all.

mod common;

use common::BODIES;
use mpipe_core::derive::{derive_str, Derived, ErrorKind, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{Action, ActionRef};
use proptest::prelude::*;

/// Two encoders (`audio` trainable or not, `vision` frozen) before a 16-layer LLM
/// with a heavy LM head on the last stage.
fn profile(audio: (u32, f64, bool), vision_layers: u32, limit: Option<f64>) -> Profile {
    let (layers, f, trainable) = audio;
    let memory = limit.map_or(String::new(), |l| format!("\n[memory]\nlimit = {l}\n"));
    Profile::from_toml_str(&format!(
        "[[encoder]]\nname = \"audio\"\nlayers = {layers}\nforward = {f}\nbackward = {b}\nweight = {w}\n\
         activation = 0.1\nparams = 1.0\ntrainable = {trainable}\n\n\
         [[encoder]]\nname = \"vision\"\nlayers = {vision_layers}\nforward = 0.5\nbackward = 0.5\n\
         activation = 0.0\nparams = 1.0\ntrainable = false\n\n\
         [llm]\nlayers = 16\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\nparams = 0.5\n\
         last_stage_extra = {{ forward = 2.0, backward = 2.0, weight = 2.0 }}\n{memory}",
        b = f * 1.2,
        w = f * 0.8,
    ))
    .unwrap()
}

/// Ranks that compute `unit`, and whether any collective moves its parameters.
fn where_computed(d: &Derived, unit: &str) -> (Vec<usize>, bool) {
    let mut ranks = Vec::new();
    let mut collective = false;
    for (r, list) in d.program.programs.iter().enumerate() {
        for a in list {
            match a.view() {
                ActionRef::Compute(c) if c.unit == unit && !ranks.contains(&r) => ranks.push(r),
                _ => {}
            }
            if let Action::BCAST { unit: u, .. } | Action::REDUCE { unit: u, .. } = a {
                collective |= u.as_ref() == unit;
            }
        }
    }
    (ranks, collective)
}

fn home(d: &Derived, unit: &str) -> usize {
    d.program
        .units
        .iter()
        .find(|u| u.name == unit)
        .map(|u| u.home)
        .unwrap()
}

/// On the given rank: the encoder's home moves there, all its work runs there, and
/// no broadcast or reduction of its parameters is needed.
#[test]
fn a_hosted_encoder_lives_on_its_rank() {
    let profile = profile((4, 1.0, true), 4, None);
    let req = Request::new(&profile, 4, 8);
    for rank in 0..4 {
        let expr = format!("host(audio, zbv, rank = {rank})");
        let d = derive_str(&req, &expr).unwrap_or_else(|e| panic!("{expr}: {e:?}"));
        assert_eq!(home(&d, "audio"), rank, "{expr}");
        assert_eq!(where_computed(&d, "audio"), (vec![rank], false), "{expr}");
    }
    // `transpose` spreads the work but keeps the home: it needs the collectives.
    let t = derive_str(&req, "transpose(audio, zbv)").unwrap();
    assert_eq!(home(&t, "audio"), 0);
    assert!(where_computed(&t, "audio").1);
}

/// `spare` takes the rank with the least other work: in a V the first rank also
/// holds the last stage (with the heavy LM head), so the encoder leaves it; and two
/// hosted encoders go to two different ranks.
#[test]
fn spare_hosts_avoid_the_busy_ranks() {
    let profile = profile((4, 1.0, true), 4, None);
    let req = Request::new(&profile, 4, 8);
    let d = derive_str(&req, "host(audio, zbv)").unwrap();
    let a = home(&d, "audio");
    assert_ne!(a, 0);
    let both = derive_str(&req, "host(vision, host(audio, zbv))").unwrap();
    let (a, v) = (home(&both, "audio"), home(&both, "vision"));
    assert!(a != 0 && v != 0 && a != v, "audio on {a}, vision on {v}");
    assert_eq!(where_computed(&both, "vision").0, vec![v]);
}

/// Bad arguments are errors at the argument, all of them reported.
#[test]
fn bad_hosts_are_reported_where_written() {
    let profile = profile((4, 1.0, true), 4, None);
    let req = Request::new(&profile, 4, 8);
    let errors = derive_str(&req, "host(audoi, zbv, rank = 4)").unwrap_err();
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors
        .iter()
        .all(|e| matches!(e.kind, ErrorKind::BadArgument | ErrorKind::UnknownName)));
    assert!(
        errors[0].message.contains("rank 4 does not exist"),
        "{errors:?}"
    );
    assert!(
        errors[1].message.contains("did you mean `audio`"),
        "{errors:?}"
    );
    for (expr, says) in [
        (
            "host(audio, zbv, rank = left)",
            "expected a rank number or `spare`",
        ),
        (
            "host(audio, zbv, on = 1)",
            "unknown argument `on` of `host`",
        ),
        ("host(audio)", "takes an encoder and a body"),
    ] {
        let errors = derive_str(&req, expr).unwrap_err();
        assert!(
            errors.iter().any(|e| e.message.contains(says)),
            "{expr}: {errors:?}"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Over every body, either encoder, any rank: the program derives (so it is
    /// verified: valid, deadlock-free, within the memory limit it was given) and the
    /// encoder computes only on its host.
    #[test]
    fn host_composes_with_every_body(
        body in 0..BODIES.len(),
        layers in 1u32..8,
        f in 0.2f64..3.0,
        trainable: bool,
        vision: bool,
        rank in 0usize..4,
        m in 8usize..13,
    ) {
        let profile = profile((layers, f, trainable), 3, None);
        let req = Request::new(&profile, 4, m);
        let enc = if vision { "vision" } else { "audio" };
        let body = BODIES[body].expr();
        let expr = format!("host({enc}, {body}, rank = {rank})");
        let d = match derive_str(&req, &expr) {
            Ok(d) => d,
            Err(e) => {
                // Only a body that needs more micro-batches may refuse.
                prop_assert!(e.iter().all(|x| x.kind == ErrorKind::Microbatches), "{expr}: {e:?}");
                return Ok(());
            }
        };
        prop_assert_eq!(home(&d, enc), rank);
        prop_assert_eq!(where_computed(&d, enc), (vec![rank], false), "{}", expr);
    }
}

/// Under a memory limit the hosted encoder's activations count on its rank: a limit
/// the host rank cannot meet is an error naming that rank.
#[test]
fn the_host_rank_carries_the_encoders_memory() {
    // Every micro-batch's audio activations (40 layers x 0.1) held on the host.
    let roomy = profile((40, 0.1, true), 1, None);
    let req = Request::new(&roomy, 4, 8);
    let d = derive_str(&req, "host(audio, 1f1b, rank = 3)").unwrap();
    let peak = d.report.peak_memory[3];
    let tight = profile((40, 0.1, true), 1, Some(peak + d.params[3] - 0.5));
    let req = Request::new(&tight, 4, 8);
    let errors = derive_str(&req, "host(audio, 1f1b, rank = 3)").unwrap_err();
    // One error for the cause, naming the host rank as the one over the limit.
    assert_eq!(errors.len(), 1, "{errors:?}");
    assert!(
        errors[0].message.starts_with("rank 3 is over memory.limit"),
        "{errors:?}"
    );
}

/// On profile (c), where the trainable audio encoder's parameter state takes 70 ms
/// to broadcast, hosting it beats filling its work into every rank's idle time
/// (which pays the broadcast and the reduction). (`transpose`'s warm-up placement
/// spreads it over fewer ranks' idle and can beat both.)
#[test]
fn hosting_beats_filling_when_parameters_are_dear() {
    let profile = Profile::from_toml_str(include_str!("../../profiles/eval-c-omni.toml")).unwrap();
    let req = Request::new(&profile, 8, 16);
    let t = |expr: &str| {
        derive_str(&req, expr)
            .unwrap_or_else(|e| panic!("{expr}: {e:?}"))
            .report
            .makespan
    };
    let host = t("prefetch(vision, host(audio, zb2p(layout = v), rank = 2))");
    let fill = t("prefetch(vision, fill(audio, zb2p(layout = v)))");
    assert!(host < fill, "host {host}, fill {fill}");
}
