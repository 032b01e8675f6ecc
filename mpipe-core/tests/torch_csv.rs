//! PyTorch schedule CSVs in and out (`mpipe_core::torch_csv`): hand-written files in
//! the style torchtitan loads, round trips over every body generator, and the
//! deadlock users hit when two ranks each send before they receive.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::profile::Profile;
use mpipe_core::program::{Action, ActionRef, CollKind, Program};
use mpipe_core::torch_csv::{export, import, import_with, Batching, Form, ImportOptions};
use mpipe_core::verify::{verify, Rule};

fn fixture(name: &str) -> String {
    let path = format!("{}/tests/torch_csv/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// Compute actions of each rank, in order.
fn compute(p: &Program) -> Vec<Vec<Action>> {
    p.programs
        .iter()
        .map(|l| {
            l.iter()
                .filter(|a| matches!(a.view(), ActionRef::Compute(_)))
                .cloned()
                .collect()
        })
        .collect()
}

/// An LLM-only profile: `layers` layers of F = B = W = 1, activation 1.
fn llm_only(layers: usize) -> Profile {
    Profile::from_toml_str(&format!(
        "[llm]\nlayers = {layers}\nforward = 1.0\nbackward = 1.5\nweight = 0.5\nactivation = 1.0\n"
    ))
    .unwrap()
}

const CANONICAL: [&str; 5] = [
    "1f1b_2ranks.csv",
    "1f1b_2ranks_comms.csv",
    "interleaved_2ranks.csv",
    "vshape_2ranks.csv",
    "deadlock_2ranks.csv",
];

#[test]
fn canonical_files_round_trip_byte_for_byte() {
    for name in CANONICAL {
        let text = fixture(name);
        let p = import(&text, None).unwrap_or_else(|e| panic!("{name}: {e}"));
        let form = if text.contains("SEND") {
            Form::WithComm
        } else {
            Form::ComputeOnly
        };
        assert_eq!(export(&p, form).unwrap(), text, "{name}");
    }
}

#[test]
fn valid_files_import_to_valid_programs() {
    for name in CANONICAL.iter().filter(|n| !n.starts_with("deadlock")) {
        let p = import(&fixture(name), None).unwrap();
        let vs = verify(&p);
        assert!(vs.is_empty(), "{name}: {vs:?}");
    }
}

#[test]
fn placement_is_inferred_loop_or_v() {
    let homes = |name: &str| -> Vec<usize> {
        let p = import(&fixture(name), None).unwrap();
        let names: Vec<&str> = p.units.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names[0], "llm.0");
        p.units.iter().map(|u| u.home).collect()
    };
    assert_eq!(homes("interleaved_2ranks.csv"), [0, 1, 0, 1]);
    assert_eq!(homes("vshape_2ranks.csv"), [0, 1, 1, 0]);
    let p = import(&fixture("1f1b_2ranks.csv"), None).unwrap();
    assert_eq!(p.microbatches, 4);
    assert_eq!(p.units[1].inputs, ["llm.0"]);
    assert_eq!(p.units[0].cost.f, 1.0);
}

#[test]
fn fsdp_actions_overlap_crlf_spaces_and_idle_cells() {
    // UNSHARD/RESHARD/REDUCE_GRAD are ignored, OVERLAP_F_B is its two sub-actions in
    // order, CRLF line ends and spaces are accepted, empty cells are idle.
    let p = import(&fixture("fsdp_overlap_2ranks.csv"), None).unwrap();
    assert_eq!(
        export(&p, Form::ComputeOnly).unwrap(),
        fixture("1f1b_2ranks.csv")
    );
}

#[test]
fn costs_from_a_profile() {
    let profile = llm_only(8);
    let p = import(&fixture("vshape_2ranks.csv"), Some(&profile)).unwrap();
    assert_eq!(p.units.len(), 4);
    assert_eq!(p.units[2].cost.f, 2.0); // 8 layers over 4 stages
    assert_eq!(p.units[2].home, 1);
    assert!(verify(&p).is_empty());
    // A profile whose layers cannot cover the stages is an error, said plainly.
    let e = import(&fixture("vshape_2ranks.csv"), Some(&llm_only(2))).unwrap_err();
    assert!(e.message.contains("profile does not fit"), "{e}");
}

#[test]
fn errors_have_lines_and_columns() {
    let e = import("0F0,0F1\n1F0,1X1\n", None).unwrap_err();
    assert_eq!((e.line, e.column), (Some(2), Some(6)));
    assert!(e.to_string().starts_with("line 2, column 6: `1X1`"), "{e}");
    let e = import("0F0,0F\n", None).unwrap_err();
    assert_eq!((e.line, e.column), (Some(1), Some(7)));
    assert!(e.message.contains("micro-batch index"), "{e}");
    let e = import("0F0,1F0\n1F1\n", None).unwrap_err();
    assert_eq!((e.line, e.column), (Some(2), Some(1)));
    assert!(e.message.contains("stage 1"), "{e}");
    let e = import("0F0\n1F0,0SEND_F0\n", None).unwrap_err();
    assert_eq!((e.line, e.column), (Some(2), Some(5)));
    let e = import("0F0,(0F1;0SEND_F1)OVERLAP_F_B\n", None).unwrap_err();
    assert_eq!((e.line, e.column), (Some(1), Some(10)));
    let e = import("0F0,2F0\n", None).unwrap_err();
    assert!(e.message.contains("stage 1 has no compute"), "{e}");
    assert!(import("", None).is_err());
    let e = import("0F0,0SEND_F0\n", None).unwrap_err();
    assert!(e.message.contains("no next stage"), "{e}");
    // A compute-only order that contradicts the data dependencies.
    let e = import("0B0,0F0\n", None).unwrap_err();
    assert!(e.message.contains("cannot run"), "{e}");
}

#[test]
fn deadlock_under_rendezvous_names_rule_5_ranks_and_actions() {
    // Both ranks send before they receive, each transfer its own call, as in
    // pytorch/pytorch#172668 and Megatron-LM#750: rank 0 waits in its SEND of
    // micro-batch 1's activation, rank 1 in its SEND of micro-batch 0's gradient.
    let p = import(&fixture("deadlock_2ranks.csv"), None).unwrap();
    let vs = verify(&p);
    assert!(!vs.is_empty());
    assert!(vs.iter().all(|v| v.rule == Rule::Termination), "{vs:?}");
    let text: Vec<String> = vs.iter().map(|v| v.to_string()).collect();
    assert_eq!(vs.len(), 2, "{text:?}");
    assert_eq!(vs[0].rank, Some(0));
    assert!(
        text[0].starts_with("rule 5 (termination): rank 0, action 3 `SEND act(llm.0,1)->1`"),
        "{}",
        text[0]
    );
    assert!(text[0].contains("deadlock"), "{}", text[0]);
    assert_eq!(vs[1].rank, Some(1));
    assert!(
        text[1].starts_with("rule 5 (termination): rank 1, action 3 `SEND grad(llm.1,0)->0`"),
        "{}",
        text[1]
    );
    // Posting each rank's crossing transfers together (one batch) resolves it.
    let batched = import_with(
        &fixture("deadlock_2ranks.csv"),
        &ImportOptions {
            profile: None,
            batching: Batching::Adjacent,
        },
    )
    .unwrap();
    assert!(verify(&batched).is_empty());
}

/// Every body generator on an encoder-free profile.
const BODIES: [&str; 6] = [
    "gpipe",
    "1f1b",
    "interleaved(v = 2)",
    "zbh1",
    "zbv",
    "dualpipev",
];

fn derived(profile: &Profile, ranks: usize, m: usize, expr: &str) -> Program {
    let req = Request::new(profile, ranks, m);
    let mut p = derive_str(&req, expr)
        .unwrap_or_else(|e| panic!("{expr}: {e:?}"))
        .program;
    p.source = None;
    p
}

#[test]
fn generators_round_trip_with_communication() {
    for (ranks, m) in [(2, 4), (4, 8), (4, 12)] {
        let profile = llm_only(4 * ranks);
        for expr in BODIES {
            let p = derived(&profile, ranks, m, expr);
            let csv = export(&p, Form::WithComm).unwrap_or_else(|e| panic!("{expr}: {e}"));
            // Read back with mpipe's batching: the same program, exactly.
            let opts = ImportOptions {
                profile: Some(&profile),
                batching: Batching::Adjacent,
            };
            let q = import_with(&csv, &opts).unwrap_or_else(|e| panic!("{expr}: {e}"));
            assert_eq!(q.units, p.units, "{expr}");
            for (r, (a, b)) in q.programs.iter().zip(&p.programs).enumerate() {
                let at = a.iter().zip(b).position(|(x, y)| x != y);
                assert!(
                    at.is_none() && a.len() == b.len(),
                    "{expr} p={ranks} m={m}: rank {r} differs at {at:?}: {:?} vs {:?}",
                    at.map(|i| &a[i.saturating_sub(2)..(i + 3).min(a.len())]),
                    at.map(|i| &b[i.saturating_sub(2)..(i + 3).min(b.len())]),
                );
            }
            assert_eq!(q, p, "{expr} p={ranks} m={m}");
            // And the file is canonical: exporting the import gives it back.
            assert_eq!(export(&q, Form::WithComm).unwrap(), csv, "{expr}");
            let unbatched = import(&csv, Some(&profile)).unwrap();
            assert_eq!(export(&unbatched, Form::WithComm).unwrap(), csv, "{expr}");
        }
    }
}

#[test]
fn generators_round_trip_compute_only() {
    for (ranks, m) in [(2, 4), (4, 8), (4, 12)] {
        let profile = llm_only(4 * ranks);
        for expr in BODIES {
            let p = derived(&profile, ranks, m, expr);
            let csv = export(&p, Form::ComputeOnly).unwrap();
            assert!(!csv.contains("SEND") && !csv.contains("RECV"));
            let q = import(&csv, Some(&profile)).unwrap_or_else(|e| panic!("{expr}: {e}"));
            assert_eq!(compute(&q), compute(&p), "{expr} p={ranks} m={m}");
            assert_eq!(q.units, p.units, "{expr}");
            let vs = verify(&q);
            assert!(vs.is_empty(), "{expr}: {vs:?}");
            assert_eq!(export(&q, Form::ComputeOnly).unwrap(), csv, "{expr}");
        }
    }
}

/// A trainable 2-layer `vision` encoder before an 8-layer LLM.
fn with_vision() -> Profile {
    Profile::from_toml_str(
        "[[encoder]]\nname = \"vision\"\nlayers = 2\nforward = 3.0\nbackward = 3.0\nweight = 1.0\n\
         activation = 1.0\ntrainable = true\n\n\
         [llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n",
    )
    .unwrap()
}

/// An encoder inline on the first stage's rank is folded into stage 0: the file is
/// the one of the same program without the encoder, for every body.
#[test]
fn export_folds_an_inline_encoder_into_stage_0() {
    let with = with_vision();
    let without = llm_only(8);
    for expr in [
        "1f1b",
        "gpipe",
        "zbh1",
        "interleaved(v = 2)",
        "zbv",
        "dualpipev",
    ] {
        let p = derived(&with, 4, 8, expr);
        // The program with the encoder's unit and actions taken out writes the same.
        let mut stripped = p.clone();
        stripped.units.retain(|u| u.name != "vision");
        stripped.units[0].inputs.clear();
        for list in &mut stripped.programs {
            list.retain(|a| a.unit() != "vision");
        }
        for form in [Form::ComputeOnly, Form::WithComm] {
            assert_eq!(
                export(&p, form).unwrap(),
                export(&stripped, form).unwrap(),
                "{expr} {form:?}"
            );
        }
        // Bodies whose order does not depend on the costs: the LLM alone's file.
        if expr != "zbv" && expr != "dualpipev" {
            let b = export(&derived(&without, 4, 8, expr), Form::ComputeOnly).unwrap();
            assert_eq!(export(&p, Form::ComputeOnly).unwrap(), b, "{expr}");
        }
    }
}

#[test]
fn export_refuses_what_torch_cannot_express() {
    let profile = with_vision();
    let p = derived(&profile, 4, 8, "transpose(vision, 1f1b)");
    let e = export(&p, Form::WithComm).unwrap_err();
    assert!(
        e.message
            .contains("unit `vision` is an encoder placed away from the first stage's rank"),
        "{e}"
    );
    assert!(e
        .message
        .contains("torch's schedule CSV has no action for it"));
    let e = export(
        &derived(&profile, 4, 8, "fill(vision, 1f1b)"),
        Form::ComputeOnly,
    )
    .unwrap_err();
    assert!(e.message.contains("placed away"), "{e}");
    let mut frozen = profile.clone();
    frozen.encoders[0].trainable = false;
    frozen.encoders[0].weight = None;
    let p = derived(&frozen, 4, 8, "prefetch(vision, 1f1b)");
    assert!(!p.prefetch.is_empty());
    let e = export(&p, Form::ComputeOnly).unwrap_err();
    assert!(e.message.contains("no step index"), "{e}");
    // Recompute and collectives are refused with the rank and action.
    let mut p = derived(&llm_only(8), 4, 8, "1f1b");
    p.programs[1].insert(
        0,
        Action::RF {
            unit: "llm.1".into(),
            mb: 0,
        },
    );
    let e = export(&p, Form::ComputeOnly).unwrap_err();
    assert_eq!((e.rank, e.index), (Some(1), Some(0)));
    assert!(e.message.contains("recompute"), "{e}");
    p.programs[1][0] = Action::coll(CollKind::Bcast, "llm.1", 1, vec![0, 1]);
    assert!(export(&p, Form::WithComm)
        .unwrap_err()
        .message
        .contains("collective"));
}
