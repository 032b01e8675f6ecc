//! Megatron-LM `pipeline_model_parallel_layout` strings (`mpipe_core::megatron`) and
//! `llm.layout` in a profile: the grammar, Megatron's rules, the caret messages, the
//! rank x chunk order, and `build_units` honouring the layout.

use mpipe_core::derive::{derive_str, Request};
use mpipe_core::megatron::{LayerKind, MegatronLayout};
use mpipe_core::plan::Layout;
use mpipe_core::profile::{Profile, ProfileError};
use mpipe_core::units::{build_units, stage_rank, UnitsError};
use mpipe_core::verify::verify;
use proptest::prelude::*;

/// Per stage: (transformer layers, MTP layers, has E, has L).
fn shape(text: &str) -> Vec<(usize, usize, bool, bool)> {
    let layout = MegatronLayout::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
    layout
        .stages()
        .iter()
        .map(|s| (s.transformer(), s.mtp(), s.has_embedding(), s.has_loss()))
        .collect()
}

fn parse_err(text: &str) -> String {
    match MegatronLayout::parse(text) {
        Ok(l) => panic!("{text:?} parsed as {l}"),
        Err(e) => e.to_string(),
    }
}

/// Index of the caret in the error's last line, relative to the string line.
fn caret(text: &str) -> usize {
    let msg = parse_err(text);
    let lines: Vec<&str> = msg.lines().collect();
    assert_eq!(lines.len(), 3, "{msg}");
    assert_eq!(lines[1], format!("    {text}"), "{msg}");
    lines[2].find('^').expect("a caret") - 4
}

// ---------------------------------------------------------------------------
// Grammar
// ---------------------------------------------------------------------------

#[test]
fn deepseek_v3_example_from_the_megatron_docs() {
    // 61 decoder layers + 1 MTP layer on PP16 x VPP2.
    let layout = MegatronLayout::parse("Et*3|(tt|)*29,m|L").unwrap();
    assert_eq!(layout.num_stages(), 32);
    assert_eq!(layout.transformer_layers(), 61);
    assert_eq!(layout.mtp_layers(), 1);
    assert_eq!(layout.chunks(16), Some(2));
    let s = layout.stages();
    assert_eq!(
        s[0].layers,
        [
            LayerKind::Embedding,
            LayerKind::Transformer,
            LayerKind::Transformer,
            LayerKind::Transformer
        ]
    );
    assert!(s[1..30]
        .iter()
        .all(|st| st.transformer() == 2 && st.mtp() == 0));
    assert_eq!(s[30].layers, [LayerKind::Mtp]);
    assert_eq!(s[31].layers, [LayerKind::Loss]);
    // Megatron's table: rank 0 chunk 0 = E + 3t, rank 0 chunk 1 = 2t,
    // rank 14 chunk 1 = mtp, rank 15 chunk 1 = loss.
    assert_eq!(layout.stage(16, 0, 0).unwrap().transformer(), 3);
    assert!(layout.stage(16, 0, 0).unwrap().has_embedding());
    assert_eq!(layout.stage(16, 0, 1).unwrap().transformer(), 2);
    assert_eq!(layout.stage(16, 14, 1).unwrap().layers, [LayerKind::Mtp]);
    assert_eq!(layout.stage(16, 15, 1).unwrap().layers, [LayerKind::Loss]);
    assert_eq!(layout.stage(16, 15, 0).unwrap().transformer(), 2);
    assert!(layout.stage(16, 16, 0).is_none());
    assert!(layout.stage(16, 0, 2).is_none());
    assert_eq!((layout.embedding_stage(), layout.loss_stage()), (0, 31));
    // The issue's spelling with written-out layers is the same layout.
    assert_eq!(MegatronLayout::parse("Ettt|(tt|)*29,m|L").unwrap(), layout);
}

#[test]
fn commas_are_ignored_everywhere() {
    assert_eq!(shape("E,t,t|t,t,L"), shape("Ett|ttL"));
    assert_eq!(shape(",,Et|tL,"), shape("Et|tL"));
    // Megatron deletes commas before expanding: even inside a count.
    assert_eq!(shape("Et*1,0|L"), shape("Et*10|L"));
}

#[test]
fn repetitions_expand_layers_groups_and_separators() {
    assert_eq!(shape("Et*3|L"), shape("Ettt|L"));
    assert_eq!(shape("E(t|)*3L"), shape("Et|t|t|L"));
    assert_eq!(shape("E|(tt|)*2,L"), shape("E|tt|tt|L"));
    assert_eq!(shape("(Et|)*1,tL"), shape("Et|tL"));
    // Repetitions inside a group.
    assert_eq!(shape("E|(t*2|)*2L"), shape("E|tt|tt|L"));
    // `|*N` repeats the separator (empty stages), `*0` removes.
    assert_eq!(shape("Et|*3tL"), shape("Et|||tL"));
    assert_eq!(shape("Et*0|(t|)*0tL"), shape("E|tL"));
    assert_eq!(shape("Ett*01|L"), shape("Ett|L"));
}

#[test]
fn empty_stages_are_allowed() {
    assert_eq!(
        shape("E||t|L"),
        [
            (0, 0, true, false),
            (0, 0, false, false),
            (1, 0, false, false),
            (0, 0, false, true)
        ]
    );
    // E need only be the first layer, not on the first stage.
    assert_eq!(
        shape("|Et|L"),
        [
            (0, 0, false, false),
            (1, 0, true, false),
            (0, 0, false, true)
        ]
    );
}

#[test]
fn display_is_canonical_and_parses_back() {
    let layout = MegatronLayout::parse("Ettt|(tt|)*2,m|L").unwrap();
    assert_eq!(layout.to_string(), "Et*3|t*2|t*2|m|L");
    assert_eq!(MegatronLayout::parse(&layout.to_string()).unwrap(), layout);
    assert_eq!(
        "E||t|L".parse::<MegatronLayout>().unwrap().to_string(),
        "E||t|L"
    );
}

#[test]
fn stage_index_is_chunk_major_like_megatron_and_matches_looped_placement() {
    // Megatron: stage i of the list is chunk i / p of rank i % p, which is mpipe's
    // looped placement of pipeline stage i.
    for p in 1..6 {
        for v in 1..4 {
            for rank in 0..p {
                for chunk in 0..v {
                    let i = MegatronLayout::stage_index(p, rank, chunk);
                    assert_eq!((i % p, i / p), (rank, chunk));
                    assert_eq!(stage_rank(Layout::Looped, p, i), rank);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Errors, with carets
// ---------------------------------------------------------------------------

#[test]
fn unknown_symbol_is_pointed_at() {
    let text = "Ettt|(tt|)*29,x|L";
    let msg = parse_err(text);
    assert!(
        msg.starts_with("unknown symbol `x`; expected `E` (embedding)"),
        "{msg}"
    );
    assert!(msg.contains("(at character 15)"), "{msg}");
    assert_eq!(caret(text), 14);
    assert_eq!(
        msg.lines().nth(2).unwrap(),
        format!("    {}^", " ".repeat(14))
    );
}

#[test]
fn syntax_errors_name_their_position() {
    let cases: &[(&str, usize, &str)] = &[
        ("Et t|L", 2, "whitespace is not allowed"),
        ("E(t|*2L", 1, "this `(` is never closed"),
        ("Et)|L", 2, "this `)` closes no `(`"),
        ("E((t|)*2)*2L", 2, "groups cannot be nested"),
        ("E()*2|tL", 1, "empty group"),
        ("E(t|)tL", 4, "a group must be followed by a repeat count"),
        ("E*|tL", 2, "expected a repeat count"),
        ("*2Et|L", 0, "`*` must follow"),
        ("Et3|L", 2, "unexpected digit `3`"),
        ("Et*2*3|L", 4, "a repetition cannot be repeated"),
        ("Et|L|é", 5, "unknown symbol `é`"),
        ("Et*99999999999999999999999|L", 2, "repeat count too large"),
        ("E(t|)*9999999L", 5, "expands the layout past"),
        ("ET|L", 1, "unknown symbol `T`"),
    ];
    for &(text, at, needle) in cases {
        let msg = parse_err(text);
        assert!(msg.contains(needle), "{text:?}: {msg}");
        assert!(
            msg.contains(&format!("(at character {})", at + 1)),
            "{text:?}: {msg}"
        );
        assert_eq!(caret(text), at, "{text:?}: {msg}");
    }
}

#[test]
fn a_star_at_the_end_points_past_the_string() {
    let msg = parse_err("Et|L*");
    assert!(msg.contains("expected a repeat count"), "{msg}");
    assert!(msg.ends_with(&format!("    {}^", " ".repeat(5))), "{msg}");
}

#[test]
fn megatron_rules_on_embedding_loss_and_mtp() {
    let cases: &[(&str, Option<usize>, &str)] = &[
        ("", None, "has no layers"),
        ("|||", None, "has no layers"),
        ("tt|L", None, "has no `E`"),
        ("Ett|tt", None, "has no `L`"),
        ("Et|EtL", Some(3), "a second `E`"),
        ("EtL|tL", Some(5), "a second `L`"),
        (
            "tE|tL",
            Some(0),
            "the first layer is a transformer layer `t`",
        ),
        (
            "Et|Lt",
            Some(4),
            "the last layer is a transformer layer `t`",
        ),
        (
            "Etm|tL",
            Some(4),
            "a transformer layer `t` after an MTP layer `m`",
        ),
    ];
    for &(text, at, needle) in cases {
        let msg = parse_err(text);
        assert!(msg.contains(needle), "{text:?}: {msg}");
        match at {
            Some(a) => assert_eq!(caret(text), a, "{text:?}: {msg}"),
            None => assert_eq!(msg.lines().count(), 1, "{text:?}: {msg}"),
        }
    }
    // MTP after every decoder layer is fine, even on its own stage.
    assert_eq!(
        shape("Et|tm|mL"),
        [
            (1, 0, true, false),
            (1, 1, false, false),
            (0, 1, false, true)
        ]
    );
}

// ---------------------------------------------------------------------------
// Profiles
// ---------------------------------------------------------------------------

const BASE: &str = "[llm]
layers = 8
forward = 1.0
backward = 2.0
weight = 1.0
activation = 1.0
params = 0.5
first_stage_extra = { forward = 0.25, backward = 0.25, weight = 0.25, activation = 0.5 }
last_stage_extra = { forward = 3.0, backward = 3.0, weight = 3.0, params = 4.0 }
";

fn with_layout(layout: &str) -> Profile {
    let text = format!("{BASE}layout = {layout:?}\n");
    Profile::from_toml_str(&text).unwrap_or_else(|e| panic!("{text}\n{e}"))
}

fn issues(text: &str) -> Vec<String> {
    match Profile::from_toml_str(text) {
        Err(ProfileError::Invalid(issues)) => issues.iter().map(ToString::to_string).collect(),
        other => panic!("expected issues, got {other:?}"),
    }
}

#[test]
fn profile_reads_the_layout_from_toml_and_json() {
    let p = with_layout("Et*3|t*3|t|tL");
    assert_eq!(p.llm.layout.as_deref(), Some("Et*3|t*3|t|tL"));
    let json = r#"{"llm": {"layers": 8, "forward": 1, "backward": 1, "weight": 1,
        "activation": 1, "layout": "Et*3|t*3|t|tL"}}"#;
    let q = Profile::from_json_str(json).unwrap();
    assert_eq!(q.llm.layout, p.llm.layout);
    // And it survives serde.
    let back: Profile = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
    assert_eq!(back, p);
    // Absent by default, and not written when absent.
    let plain = Profile::from_toml_str(BASE).unwrap();
    assert_eq!(plain.llm.layout, None);
    assert!(!serde_json::to_string(&plain).unwrap().contains("layout"));
}

#[test]
fn profile_rejects_a_bad_layout_with_line_and_caret() {
    let text = format!("{BASE}layout = \"Et*3|t*3,x|tL\"\n");
    let all = issues(&text);
    assert_eq!(all.len(), 1, "{all:?}");
    let msg = &all[0];
    assert!(
        msg.starts_with("llm.layout: not a valid Megatron pipeline layout: unknown symbol `x`"),
        "{msg}"
    );
    assert!(msg.contains("(at character 10)"), "{msg}");
    assert!(msg.contains("\n    Et*3|t*3,x|tL\n             ^"), "{msg}");
    assert!(msg.ends_with("(line 10)"), "{msg}");
}

#[test]
fn profile_rejects_a_layout_with_the_wrong_layer_count_among_other_problems() {
    let text = format!("{BASE}layout = \"Et*3|t*3|L\"\noutput = -1\n");
    let all = issues(&text);
    assert_eq!(all.len(), 2, "{all:?}");
    assert_eq!(
        all[0],
        "llm.layout: the layout has 6 transformer layers (`t`) but llm.layers = 8; \
         expected the two to match (change one of them) (line 10)"
    );
    assert!(all[1].starts_with("llm.output"), "{all:?}");
}

#[test]
fn profile_rejects_a_layout_that_is_not_a_string() {
    let all = issues(&format!("{BASE}layout = 3\n"));
    assert_eq!(all.len(), 1, "{all:?}");
    assert!(
        all[0].starts_with("llm.layout: expected a Megatron-LM pipeline layout string"),
        "{all:?}"
    );
    // A misspelt key is suggested.
    let all = issues(&format!("{BASE}layuot = \"Et*8|L\"\n"));
    assert!(all[0].contains("did you mean `layout`?"), "{all:?}");
}

// ---------------------------------------------------------------------------
// build_units
// ---------------------------------------------------------------------------

/// (layers-equivalent F, has first extra, has last extra) recovered from each LLM unit.
fn llm_units(
    p: &Profile,
    ranks: usize,
    chunks: usize,
    layout: Layout,
) -> Vec<mpipe_core::program::Unit> {
    build_units(p, ranks, chunks, layout)
        .unwrap()
        .into_iter()
        .filter(|u| u.name.starts_with("llm."))
        .collect()
}

#[test]
fn build_units_follows_the_layout_not_the_even_split() {
    let p = with_layout("Et*3|t*3|t|tL");
    let units = llm_units(&p, 4, 1, Layout::Looped);
    let f: Vec<f64> = units.iter().map(|u| u.cost.f).collect();
    assert_eq!(f, [3.25, 3.0, 1.0, 4.0]);
    let b: Vec<f64> = units.iter().map(|u| u.cost.b).collect();
    assert_eq!(b, [6.25, 6.0, 2.0, 5.0]);
    let act: Vec<f64> = units.iter().map(|u| u.act).collect();
    assert_eq!(act, [3.5, 3.0, 1.0, 1.0]);
    let params: Vec<f64> = units.iter().map(|u| u.params).collect();
    assert_eq!(params, [1.5, 1.5, 0.5, 4.5]);
    // Without the layout: the even split, 2 layers each.
    let mut even = p.clone();
    even.llm.layout = None;
    let f: Vec<f64> = llm_units(&even, 4, 1, Layout::Looped)
        .iter()
        .map(|u| u.cost.f)
        .collect();
    assert_eq!(f, [2.25, 2.0, 2.0, 5.0]);
}

#[test]
fn embedding_and_loss_extras_sit_where_the_layout_puts_them() {
    // E on stage 1 (stage 0 empty), L on stage 2 (stage 3 empty).
    let p = with_layout("|Et*4|t*4L|");
    let units = llm_units(&p, 2, 2, Layout::Looped);
    let f: Vec<f64> = units.iter().map(|u| u.cost.f).collect();
    assert_eq!(f, [0.0, 4.25, 7.0, 0.0]);
    let homes: Vec<usize> = units.iter().map(|u| u.home).collect();
    assert_eq!(homes, [0, 1, 0, 1]);
}

#[test]
fn mtp_layers_cost_one_layer_each_and_do_not_count_as_llm_layers() {
    let p = with_layout("Et*4|t*4m|mL");
    let f: Vec<f64> = llm_units(&p, 3, 1, Layout::Looped)
        .iter()
        .map(|u| u.cost.f)
        .collect();
    assert_eq!(f, [4.25, 5.0, 4.0]);
}

#[test]
fn v_shape_reads_the_layout_in_pipeline_order() {
    let p = with_layout("Et|t*2|t*3|t*2L");
    let units = llm_units(&p, 2, 2, Layout::VShape);
    let f: Vec<f64> = units.iter().map(|u| u.cost.f).collect();
    assert_eq!(f, [1.25, 2.0, 3.0, 5.0]);
    let homes: Vec<usize> = units.iter().map(|u| u.home).collect();
    assert_eq!(homes, [0, 1, 1, 0]);
}

#[test]
fn stage_count_mismatch_names_both_numbers_and_the_fixes() {
    let p = with_layout("Et*3|t*3|t|tL");
    let err = build_units(&p, 2, 1, Layout::Looped).unwrap_err();
    assert!(matches!(
        err,
        UnitsError::LayoutStages {
            layout: 4,
            stages: 2,
            ranks: 2,
            chunks: 1,
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "llm.layout has 4 stages but the schedule needs 2 ranks x 1 chunks = 2 stages; \
         write the layout with 2 `|`-separated stages (chunk 0 of ranks 0..1, then chunk 1, ..), \
         or run it on 4 ranks, \
         or use a schedule with 2 chunks per rank (such as `interleaved(v = 2)` or `zbv`) on 2 ranks"
    );
    let err = build_units(&p, 8, 2, Layout::Looped)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "llm.layout has 4 stages but the schedule needs 8 ranks x 2 chunks = 16 stages"
        ),
        "{err}"
    );
    assert!(err.contains("or run it on 2 ranks"), "{err}");
    assert!(!err.contains("chunks per rank"), "{err}");
    let err = build_units(&p, 3, 1, Layout::Looped)
        .unwrap_err()
        .to_string();
    assert!(
        err.ends_with("then chunk 1, ..), or run it on 4 ranks"),
        "{err}"
    );
}

#[test]
fn layer_count_mismatch_and_bad_strings_in_a_constructed_profile() {
    // A profile built in code skips validation: build_units checks again.
    let mut p = with_layout("Et*3|t*3|t|tL");
    p.llm.layers = 9;
    let err = build_units(&p, 4, 1, Layout::Looped).unwrap_err();
    assert_eq!(
        err,
        UnitsError::LayoutLayers {
            layout: 8,
            layers: 9
        }
    );
    assert_eq!(
        err.to_string(),
        "llm.layout has 8 transformer layers (`t`) but llm.layers = 9; \
         change the layout or llm.layers so they agree"
    );
    p.llm.layout = Some("Et*3|t*3|t|tL|q".into());
    let err = build_units(&p, 4, 1, Layout::Looped).unwrap_err();
    assert!(matches!(err, UnitsError::Layout(_)));
    assert!(
        err.to_string()
            .starts_with("llm.layout is not a valid Megatron pipeline layout: unknown symbol `q`"),
        "{err}"
    );
}

#[test]
fn a_layout_with_empty_stages_beats_too_few_layers() {
    // Without a layout, 2 layers cannot fill 4 stages; with one, empty stages are fine.
    let text = "[llm]\nlayers = 2\nforward = 1\nbackward = 1\nweight = 1\nactivation = 1\n";
    let p = Profile::from_toml_str(text).unwrap();
    assert!(matches!(
        build_units(&p, 4, 1, Layout::Looped),
        Err(UnitsError::TooFewLayers { .. })
    ));
    let p = Profile::from_toml_str(&format!("{text}layout = \"E||t|tL\"\n")).unwrap();
    let f: Vec<f64> = llm_units(&p, 4, 1, Layout::Looped)
        .iter()
        .map(|u| u.cost.f)
        .collect();
    assert_eq!(f, [0.0, 0.0, 1.0, 1.0]);
}

#[test]
fn derived_programs_with_a_layout_verify() {
    let p = with_layout("Et*3|t*3|t|tL");
    for (ranks, expr) in [
        (4, "1f1b"),
        (4, "zbh1"),
        (2, "interleaved(v = 2)"),
        (2, "zbv"),
    ] {
        let req = Request::new(&p, ranks, 4);
        let d = derive_str(&req, expr).unwrap_or_else(|e| panic!("{expr}: {e:?}"));
        assert!(verify(&d.program).is_empty(), "{expr}");
    }
    // Empty stages too.
    let p = with_layout("E|t*4|t*4|L");
    let req = Request::new(&p, 4, 4);
    let d = derive_str(&req, "1f1b").unwrap();
    assert!(verify(&d.program).is_empty());
    // And a mismatch reaches the user through derivation.
    let req = Request::new(&p, 2, 4);
    let errs = derive_str(&req, "1f1b").unwrap_err();
    let text = format!("{errs:?}");
    assert!(text.contains("llm.layout has 4 stages"), "{text}");
}

// ---------------------------------------------------------------------------
// Properties
// ---------------------------------------------------------------------------

proptest! {
    /// Any list of stage sizes written as a layout reads back as those sizes, the
    /// canonical text round-trips, and build_units spends exactly the layers.
    #[test]
    fn written_layouts_read_back(sizes in proptest::collection::vec(0usize..6, 1..9)) {
        let n = sizes.len();
        let mut text = String::from("E");
        for (k, &s) in sizes.iter().enumerate() {
            if k > 0 {
                text.push('|');
            }
            if s > 0 {
                text.push_str(&format!("t*{s}"));
            }
        }
        text.push('L');
        let layout = MegatronLayout::parse(&text).unwrap();
        let got: Vec<usize> = layout.stages().iter().map(|s| s.transformer()).collect();
        prop_assert_eq!(&got, &sizes);
        prop_assert_eq!(MegatronLayout::parse(&layout.to_string()).unwrap(), layout.clone());
        let total: usize = sizes.iter().sum();
        prop_assume!(total > 0);
        let p = Profile::from_toml_str(&format!(
            "[llm]\nlayers = {total}\nforward = 1\nbackward = 1\nweight = 1\nactivation = 1\nlayout = {text:?}\n"
        )).unwrap();
        let units = build_units(&p, n, 1, Layout::Looped).unwrap();
        let f: Vec<f64> = units.iter().map(|u| u.cost.f).collect();
        let want: Vec<f64> = sizes.iter().map(|&s| s as f64).collect();
        prop_assert_eq!(f, want);
    }

    /// No string makes the parser panic.
    #[test]
    fn parser_never_panics(text in "[EtmL|()*0-9, x]{0,24}") {
        let _ = MegatronLayout::parse(&text).map(|l| l.to_string()).map_err(|e| e.to_string());
    }
}
