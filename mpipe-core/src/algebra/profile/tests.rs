//! Tests of the profile parsers and rules, through the public API.

use super::*;

/// The example of the first agreed model format, verbatim: profiles of that version
/// still read (`docs/spec/model-format.md`, "Changes from the first agreed version").
const SPEC_TOML: &str = r#"
# Costs are per micro-batch, in one unit of time of your choice (ms measured
# on the target device is typical). Memory is in one unit of your choice.

[[encoder]]              # zero or more modality encoders, each feeding the LLM
name = "vision"
layers = 32
forward = 0.21           # F per layer
backward = 0.42          # B (input gradient) per layer
weight = 0.21            # W (weight gradient) per layer; omit for a frozen encoder
activation = 0.05        # activation memory kept per layer for its backward
params = 0.6             # parameter memory of the whole encoder
trainable = false

[llm]
layers = 28
forward = 1.0
backward = 1.0
weight = 1.0
activation = 1.0
params = 0.25            # per layer
first_stage_extra = { forward = 0.3, backward = 0.3, weight = 0.3 }   # embedding
last_stage_extra  = { forward = 1.5, backward = 1.5, weight = 1.5 }   # LM head + loss

[memory]
limit = 80.0             # per rank; a derived program that exceeds it is rejected
"#;

const SPEC_JSON: &str = r#"{
  "encoder": [
{"name": "vision", "layers": 32, "forward": 0.21, "backward": 0.42, "weight": 0.21,
 "activation": 0.05, "params": 0.6, "trainable": false}
  ],
  "llm": {
"layers": 28, "forward": 1.0, "backward": 1.0, "weight": 1.0, "activation": 1.0,
"params": 0.25,
"first_stage_extra": {"forward": 0.3, "backward": 0.3, "weight": 0.3},
"last_stage_extra": {"forward": 1.5, "backward": 1.5, "weight": 1.5}
  },
  "memory": {"limit": 80.0}
}"#;

const MINIMAL_LLM: &str =
    "[llm]\nlayers = 8\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n";

fn spec_profile() -> Profile {
    let extra = |x: f64| Extra {
        forward: x,
        backward: x,
        weight: x,
        activation: 0.0,
        params: 0.0,
    };
    Profile {
        encoders: vec![EncoderProfile {
            name: "vision".into(),
            layers: 32,
            forward: 0.21,
            backward: 0.42,
            weight: Some(0.21),
            activation: 0.05,
            params: 0.6,
            trainable: false,
            output: 0.0,
        }],
        llm: LlmProfile {
            layers: 28,
            forward: 1.0,
            backward: 1.0,
            weight: 1.0,
            activation: 1.0,
            params: 0.25,
            output: 0.0,
            first_stage_extra: Some(extra(0.3)),
            last_stage_extra: Some(extra(1.5)),
            layout: None,
            split: Default::default(),
        },
        memory: Some(MemoryProfile { limit: 80.0 }),
        link: None,
        units: None,
    }
}

fn issues_toml(text: &str) -> Vec<ProfileIssue> {
    match Profile::from_toml_str(text) {
        Err(ProfileError::Invalid(issues)) => issues,
        other => panic!("expected validation issues, got {other:?}"),
    }
}

fn issue<'a>(issues: &'a [ProfileIssue], path: &str) -> &'a ProfileIssue {
    issues
        .iter()
        .find(|i| i.path == path)
        .unwrap_or_else(|| panic!("no issue at `{path}` in {issues:#?}"))
}

#[test]
fn spec_example_toml() {
    let p = Profile::from_toml_str(SPEC_TOML).unwrap();
    assert_eq!(p, spec_profile());
    assert_eq!(p.encoder("vision").map(|e| e.layers), Some(32));
    assert!(p.encoder("audio").is_none());
}

#[test]
fn spec_example_json_is_equivalent() {
    assert_eq!(Profile::from_json_str(SPEC_JSON).unwrap(), spec_profile());
    assert_eq!(
        Profile::parse(SPEC_JSON, ProfileFormat::Json).unwrap(),
        Profile::parse(SPEC_TOML, ProfileFormat::Toml).unwrap()
    );
}

#[test]
fn serde_round_trip_reads_back() {
    let p = spec_profile();
    let json = serde_json::to_string(&p).unwrap();
    assert_eq!(Profile::from_json_str(&json).unwrap(), p);
    assert_eq!(serde_json::from_str::<Profile>(&json).unwrap(), p);
    let toml_text = toml::to_string(&p).unwrap();
    assert_eq!(Profile::from_toml_str(&toml_text).unwrap(), p);
}

#[test]
fn shipped_example_profiles_are_valid() {
    let heavy = Profile::from_toml_str(include_str!("../../../../profiles/encoder-heavy.toml"))
        .unwrap_or_else(|e| panic!("encoder-heavy.toml: {e}"));
    let vision = heavy.encoder("vision").unwrap();
    // The encoder's forward is 9x one of 4 stages' F + B + W.
    let stage = f64::from(heavy.llm.layers / 4)
        * (heavy.llm.forward + heavy.llm.backward + heavy.llm.weight);
    assert_eq!(f64::from(vision.layers) * vision.forward, 9.0 * stage);
    let qwen = Profile::from_toml_str(include_str!("../../../../profiles/qwen2vl-7b.toml"))
        .unwrap_or_else(|e| panic!("qwen2vl-7b.toml: {e}"));
    assert_eq!((qwen.encoders[0].layers, qwen.llm.layers), (32, 28));
    assert!(qwen.memory.is_some() && qwen.link.is_some());
}

#[test]
fn encoders_and_optional_tables_may_be_absent() {
    let p = Profile::from_toml_str(MINIMAL_LLM).unwrap();
    assert!(p.encoders.is_empty());
    assert_eq!(p.memory, None);
    assert_eq!(p.link, None);
    assert_eq!(p.llm.params, 0.0);
    assert_eq!(p.llm.output, 0.0);
}

#[test]
fn integers_are_accepted_as_costs() {
    let p = Profile::from_toml_str(
        "[llm]\nlayers = 8\nforward = 1\nbackward = 2\nweight = 1\nactivation = 1\n\
         [link]\nlatency = 0\nbandwidth = 10\n",
    )
    .unwrap();
    assert_eq!(p.llm.backward, 2.0);
    assert_eq!(p.link.unwrap().bandwidth, 10.0);
}

#[test]
fn missing_key_names_path_and_line() {
    let text = "[[encoder]]\nname = \"vision\"\nlayers = 2\nbackward = 1.0\nactivation = 0.1\n\n\
                [llm]\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n";
    let issues = issues_toml(text);
    let f = issue(&issues, "encoder[0].forward");
    assert!(f.message.contains("missing key `forward`"), "{f}");
    assert!(f.message.contains("expected the forward (F) time"), "{f}");
    assert_eq!(f.line, Some(1));
    let l = issue(&issues, "llm.layers");
    assert_eq!(l.line, Some(7));
    assert!(l
        .to_string()
        .starts_with("llm.layers: missing key `layers`"));
    assert_eq!(issues.len(), 2, "{issues:#?}");
}

#[test]
fn missing_llm_table() {
    let issues = issues_toml("[memory]\nlimit = 1.0\n");
    assert_eq!(issues.len(), 1, "{issues:#?}");
    assert_eq!(issues[0].path, "llm");
    assert!(issues[0].message.contains("`[llm]` table"));
}

#[test]
fn unknown_key_suggests_the_right_one() {
    let text = "[[encoder]]\nname = \"vision\"\nlayers = 2\nfowrard = 1.0\nforward = 1.0\n\
                backward = 1.0\nactivation = 0.1\n\n"
        .to_string()
        + MINIMAL_LLM;
    let issues = issues_toml(&text);
    assert_eq!(issues.len(), 1, "{issues:#?}");
    let i = &issues[0];
    assert_eq!(i.path, "encoder[0].fowrard");
    assert_eq!(i.line, Some(4));
    assert!(
        i.message
            .contains("unknown key `fowrard`; did you mean `forward`?"),
        "{i}"
    );
    assert!(
        i.message.contains("expected one of `name`, `layers`"),
        "{i}"
    );
}

#[test]
fn missing_key_next_to_its_misspelling_points_at_it() {
    let text = MINIMAL_LLM.replace("weight = 1.0", "wieght = 1.0");
    let issues = issues_toml(&text);
    assert_eq!(issues.len(), 2, "{issues:#?}");
    assert_eq!(issues[0].path, "llm.wieght");
    assert!(issues[0].message.contains("did you mean `weight`?"));
    assert_eq!(issues[1].path, "llm.weight");
    assert!(issues[1]
        .message
        .contains("`wieght` is not a key: a misspelling?"));
    assert_eq!(issues[1].line, Some(5));
}

#[test]
fn unknown_top_level_and_nested_keys() {
    let text = "[[encoders]]\nname = \"v\"\n\n".to_string()
        + MINIMAL_LLM
        + "first_stage_extra = { forward = 1, backward = 1, weight = 1, activaton = 1 }\n\
           [memory]\nlimt = 3\n";
    let issues = issues_toml(&text);
    let top = issue(&issues, "encoders");
    assert!(top.message.contains("did you mean `encoder`?"), "{top}");
    let nested = issue(&issues, "llm.first_stage_extra.activaton");
    assert!(nested.message.contains("did you mean `activation`?"));
    // The unknown `limt` and the missing `limit` are both reported.
    assert!(issue(&issues, "memory.limt").message.contains("`limit`"));
    assert!(issue(&issues, "memory.limit")
        .message
        .contains("missing key"));
    // A key far from every valid one gets no suggestion.
    let issues = issues_toml(&(MINIMAL_LLM.to_string() + "xyzzy = 1\n"));
    let i = issue(&issues, "llm.xyzzy");
    assert!(!i.message.contains("did you mean"), "{i}");
}

#[test]
fn negative_and_non_finite_costs() {
    let text = "[[encoder]]\nname = \"v\"\nlayers = 2\nforward = -1.0\nbackward = nan\n\
                activation = inf\n\n"
        .to_string()
        + MINIMAL_LLM
        + "output = -0.5\nlast_stage_extra = { forward = 1, backward = -2, weight = 1 }\n";
    let issues = issues_toml(&text);
    for path in [
        "encoder[0].forward",
        "encoder[0].backward",
        "encoder[0].activation",
        "llm.output",
        "llm.last_stage_extra.backward",
    ] {
        let i = issue(&issues, path);
        assert!(i.message.contains("expected a finite number >= 0"), "{i}");
    }
    assert_eq!(issue(&issues, "encoder[0].forward").line, Some(4));
    assert_eq!(issues.len(), 5, "{issues:#?}");
}

#[test]
fn zero_layers() {
    let issues = issues_toml(&MINIMAL_LLM.replace("layers = 8", "layers = 0"));
    assert_eq!(issues.len(), 1);
    assert_eq!(
        issues[0].to_string(),
        "llm.layers: found 0 layers; expected a whole number >= 1 (line 2)"
    );
}

#[test]
fn wrong_types() {
    let text = "[[encoder]]\nname = 3\nlayers = 2.5\nforward = \"1.0\"\nbackward = 1\n\
                activation = 0\ntrainable = \"yes\"\n\n"
        .to_string()
        + &MINIMAL_LLM.replace("layers = 8", "layers = -3");
    let issues = issues_toml(&text);
    assert!(issue(&issues, "encoder[0].name")
        .message
        .contains("expected a string"));
    assert!(issue(&issues, "encoder[0].layers")
        .message
        .contains("found the number `2.5`"));
    assert!(issue(&issues, "encoder[0].forward")
        .message
        .contains("found the string `\"1.0\"`"));
    assert!(issue(&issues, "encoder[0].trainable")
        .message
        .contains("`true` or `false`"));
    assert!(issue(&issues, "llm.layers")
        .message
        .contains("found the integer `-3`"));
    assert_eq!(issues.len(), 5, "{issues:#?}");
}

#[test]
fn encoder_must_be_an_array_of_tables() {
    let issues = issues_toml(&("[encoder]\nname = \"v\"\n".to_string() + MINIMAL_LLM));
    let i = issue(&issues, "encoder");
    assert!(i.message.contains("`[[encoder]]`"), "{i}");
    assert!(i.message.contains("found a table"), "{i}");
}

fn encoder_toml(name: &str, extra: &str) -> String {
    format!(
        "[[encoder]]\nname = \"{name}\"\nlayers = 2\nforward = 1.0\nbackward = 1.0\n\
         activation = 0.1\n{extra}\n"
    )
}

#[test]
fn duplicate_and_bad_encoder_names() {
    let text = encoder_toml("vision", "")
        + &encoder_toml("audio", "")
        + &encoder_toml("vision", "")
        + &encoder_toml("llm", "")
        + &encoder_toml("llm.3", "")
        + &encoder_toml("vision-tower", "")
        + &encoder_toml("2d", "")
        + &encoder_toml("", "")
        + MINIMAL_LLM;
    let issues = issues_toml(&text);
    let dup = issue(&issues, "encoder[2].name");
    assert!(
        dup.message.contains("duplicate encoder name `vision`"),
        "{dup}"
    );
    assert!(dup.message.contains("encoder[0]"), "{dup}");
    assert!(issue(&issues, "encoder[3].name")
        .message
        .contains("collides with the LLM's unit names"));
    assert!(issue(&issues, "encoder[4].name")
        .message
        .contains("collides with the LLM's unit names"));
    assert!(issue(&issues, "encoder[5].name")
        .message
        .contains("not a plain identifier"));
    assert!(issue(&issues, "encoder[6].name")
        .message
        .contains("not a plain identifier"));
    assert!(issue(&issues, "encoder[7].name").message.contains("empty"));
    assert_eq!(issues.len(), 6, "{issues:#?}");
}

#[test]
fn trainable_encoder_needs_weight() {
    let text = encoder_toml("vision", "trainable = true") + MINIMAL_LLM;
    let issues = issues_toml(&text);
    assert_eq!(issues.len(), 1);
    assert_eq!(issues[0].path, "encoder[0].weight");
    assert!(issues[0].message.contains("add `weight = ...`"));
    assert!(issues[0].message.contains("set `trainable = false`"));
    let ok = encoder_toml("vision", "trainable = true\nweight = 0.5") + MINIMAL_LLM;
    assert!(Profile::from_toml_str(&ok).unwrap().encoders[0].trainable);
}

#[test]
fn memory_and_link_limits() {
    let text =
        MINIMAL_LLM.to_string() + "[memory]\nlimit = 0\n[link]\nlatency = -1\nbandwidth = 0.0\n";
    let issues = issues_toml(&text);
    assert!(issue(&issues, "memory.limit")
        .message
        .contains("expected a finite number > 0"));
    assert!(issue(&issues, "link.latency")
        .message
        .contains("expected a finite number >= 0"));
    assert!(issue(&issues, "link.bandwidth")
        .message
        .contains("expected a finite number > 0"));
    assert_eq!(issues.len(), 3);
}

#[test]
fn all_errors_are_collected_in_document_order() {
    let text = encoder_toml("llm", "fowrard = 2")
        + &MINIMAL_LLM.replace("= 8", "= 0")
        + "[memory]\nlimit = -4\n";
    let err = Profile::from_toml_str(&text).unwrap_err();
    let paths: Vec<&str> = err.issues().iter().map(|i| i.path.as_str()).collect();
    assert_eq!(
        paths,
        [
            "encoder[0].name",
            "encoder[0].fowrard",
            "llm.layers",
            "memory.limit"
        ]
    );
    let shown = err.to_string();
    assert_eq!(shown.lines().count(), 4, "{shown}");
    assert!(shown.lines().all(|l| l.contains(": ")));
}

#[test]
fn json_errors_name_paths() {
    let text = r#"{"encoder": [{"name": "v", "layers": 0, "forward": 1, "backward": 1,
        "activation": 1, "trainable": true}],
        "llm": {"layers": 2, "forward": 1, "backward": 1, "weight": 1, "activation": 1,
                "paramz": 1},
        "link": {"latency": 0, "bandwidth": -1}}"#;
    let err = Profile::from_json_str(text).unwrap_err();
    let issues = err.issues();
    for path in [
        "encoder[0].layers",
        "encoder[0].weight",
        "llm.paramz",
        "link.bandwidth",
    ] {
        let i = issue(issues, path);
        assert_eq!(i.line, None);
    }
    assert!(issue(issues, "llm.paramz")
        .message
        .contains("did you mean `params`?"));
    // JSON null counts as an absent optional key.
    let p = Profile::from_json_str(
        r#"{"llm": {"layers": 2, "forward": 1, "backward": 1, "weight": 1,
            "activation": 1, "first_stage_extra": null}, "memory": null}"#,
    )
    .unwrap();
    assert_eq!(p.llm.first_stage_extra, None);
    assert_eq!(p.memory, None);
}

#[test]
fn syntax_errors() {
    match Profile::from_toml_str("[llm\nlayers = 2\n") {
        Err(ProfileError::Syntax {
            format: ProfileFormat::Toml,
            line: Some(1),
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    match Profile::from_json_str("{\n  \"llm\": ,\n}") {
        Err(e @ ProfileError::Syntax { line: Some(2), .. }) => {
            assert!(
                e.to_string().starts_with("JSON syntax error at line 2"),
                "{e}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        Profile::from_json_str(""),
        Err(ProfileError::Syntax { .. })
    ));
}

#[test]
fn odd_documents_do_not_panic() {
    for text in [
        "",
        "llm = 3",
        "llm = []",
        "encoder = 3",
        "encoder = [1, \"x\", {}]",
        "d = 1979-05-27\n[llm]\nlayers = 1979-05-27",
        "[llm]\nlayers = 99999999999999999999",
        "[llm]\nlayers = 4294967296",
    ] {
        let err = Profile::from_toml_str(text).unwrap_err();
        assert!(!err.to_string().is_empty());
    }
    for text in [
        "[]",
        "3",
        "null",
        "{\"llm\": {\"layers\": 1e400}}",
        "{\"llm\": 1}",
    ] {
        assert!(Profile::from_json_str(text).is_err(), "{text}");
    }
    let issues = issues_toml("encoder = [1, {}]\n");
    assert!(issue(&issues, "encoder[0]")
        .message
        .contains("found the integer `1`"));
    assert!(issue(&issues, "encoder[1].name")
        .message
        .contains("missing key"));
    assert!(issue(&issues, "llm").message.contains("missing key `llm`"));
    let issues = match Profile::from_json_str("[]") {
        Err(ProfileError::Invalid(issues)) => issues,
        other => panic!("{other:?}"),
    };
    assert!(issue(&issues, "(document)")
        .message
        .contains("found an array"));
    assert_eq!(issues.len(), 1, "{issues:#?}");
}

#[test]
fn validate_on_a_constructed_profile() {
    let mut p = spec_profile();
    assert_eq!(p.validate(), Ok(()));
    p.encoders[0].trainable = true;
    p.encoders[0].weight = None;
    p.llm.layers = 0;
    let err = p.validate().unwrap_err();
    let paths: Vec<&str> = err.issues().iter().map(|i| i.path.as_str()).collect();
    assert_eq!(paths, ["encoder[0].weight", "llm.layers"]);
}

#[test]
fn format_from_extension() {
    assert_eq!(
        ProfileFormat::from_extension("TOML"),
        Some(ProfileFormat::Toml)
    );
    assert_eq!(
        ProfileFormat::from_extension("json"),
        Some(ProfileFormat::Json)
    );
    assert_eq!(ProfileFormat::from_extension("yaml"), None);
}

/// `[units]` (issue 38 item 7): optional names for tables; old profiles read as
/// before, bad names are errors naming the key.
#[test]
fn units_are_optional_names() {
    let base = "[llm]\nlayers = 4\nforward = 1.0\nbackward = 1.0\nweight = 1.0\nactivation = 1.0\n";
    let old = Profile::from_toml_str(base).unwrap();
    assert_eq!(old.units, None);
    assert_eq!((old.time_unit(), old.memory_unit()), ("units", "units"));
    assert!(!old.declares_units());
    let p = Profile::from_toml_str(&format!("{base}[units]\ntime = \"ms\"\nmemory = \"GiB\"\n"))
        .unwrap();
    assert_eq!((p.time_unit(), p.memory_unit()), ("ms", "GiB"));
    assert!(p.declares_units());
    let half = Profile::from_toml_str(&format!("{base}[units]\ntime = \"s\"\n")).unwrap();
    assert_eq!((half.time_unit(), half.memory_unit()), ("s", "units"));
    let json = r#"{"llm": {"layers": 4, "forward": 1, "backward": 1, "weight": 1,
        "activation": 1}, "units": {"memory": "MB"}}"#;
    assert_eq!(Profile::from_json_str(json).unwrap().memory_unit(), "MB");
    for bad in [
        "time = 3",
        "time = \"\"",
        "time = \"a-very-long-unit-name\"",
        "tme = \"ms\"",
    ] {
        let e = Profile::from_toml_str(&format!("{base}[units]\n{bad}\n")).unwrap_err();
        assert!(e.to_string().contains("units."), "{bad}: {e}");
    }
    // A profile written back with serde keeps its units (and old ones gain none).
    let text = toml::to_string(&p).unwrap();
    assert!(text.contains("[units]"), "{text}");
    assert!(!toml::to_string(&old).unwrap().contains("units"));
}
