//! The model profile: what the model computes and what each part costs
//! (`docs/spec/model-format.md`, "The profile").
//!
//! A profile is read from TOML ([`Profile::from_toml_str`]) or from JSON with the same
//! keys ([`Profile::from_json_str`]). Costs are per micro-batch and per layer (except
//! where a key says otherwise), in one unit of time of the user's choice; memory is in
//! one unit of the user's choice.
//!
//! Promises:
//! - the two parsers accept exactly the keys of the spec and reject every other key
//!   (a misspelt key is an error that suggests the closest valid key);
//! - a profile they return has passed [`Profile::validate`];
//! - on failure they report **every** problem they can find, not just the first, each
//!   naming its key path (`encoder[1].forward`, `llm.layers`, `memory.limit`), saying
//!   what is wrong and what is expected, and, for TOML, the line it is on;
//! - no input makes them panic, and the same input always gives the same result
//!   (problems are listed in document order for TOML, in key order for JSON).
//!
//! The `Serialize`/`Deserialize` implementations use the same key names, so a
//! profile written with `serde` reads back with the parsers. Deserializing with
//! `serde` directly skips [`Profile::validate`] and the friendlier messages.
//!
//! Whether a profile fits a given rank count (more stages than LLM layers, for
//! example) is not a property of the profile and is checked by the derivation.

mod check;
mod decode;
#[cfg(test)]
mod tests;

use std::fmt;

use serde::{Deserialize, Serialize};

/// The largest cost, size, memory limit or latency a profile may give (in its own
/// units): sums over a step of figures much larger lose the precision that ordering
/// a schedule's events needs.
pub const MAX_FIGURE: f64 = 1e9;

/// The smallest positive figure a profile may give where zero is not allowed (a
/// bandwidth, a memory limit).
pub const MIN_FIGURE: f64 = 1e-9;

/// The most layers an encoder or the LLM may have: the deepest published models
/// have a few hundred; layer-by-layer passes (`layers`, the bound) grow with it.
pub const MAX_LAYERS: u32 = 1024;

/// The most encoders a profile may list.
pub const MAX_ENCODERS: usize = 8;

/// The longest unit (encoder) name, in characters; expressions' names have the same
/// limit. Names are repeated in every program, plan and message: unbounded ones made
/// a small profile cost minutes and gigabytes.
pub const MAX_NAME_LEN: usize = 64;

/// The longest `llm.layout` string, in characters (a layout with one `t` per stage,
/// for the most layers a profile may have, needs about 2,000).
pub const MAX_LAYOUT_LEN: usize = 16_384;

/// A model: zero or more modality encoders feeding one LLM, with optional memory
/// and interconnect descriptions.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    /// The modality encoders (TOML: `[[encoder]]` tables; may be absent).
    #[serde(rename = "encoder", default, skip_serializing_if = "Vec::is_empty")]
    pub encoders: Vec<EncoderProfile>,
    /// The LLM body, split into pipeline stages by the derivation.
    pub llm: LlmProfile,
    /// Per-rank memory capacity, if the derivation should enforce one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemoryProfile>,
    /// Interconnect between ranks, if transfers should cost time.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<LinkProfile>,
    /// The names of the profile's time and memory units, for tables' headers
    /// (`[units]`, optional: without it, figures are in "units").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub units: Option<UnitsProfile>,
}

/// The names of a profile's units (`docs/spec/model-format.md` §1.1): only what
/// tables print beside the figures; the figures mean the same without them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UnitsProfile {
    /// The unit of every time (`forward`, `latency`, ...), such as `"ms"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
    /// The unit of every memory and size (`activation`, `params`, `output`,
    /// `limit`), such as `"GiB"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<String>,
}

/// The longest unit name `[units]` may give, in characters.
pub const MAX_UNIT_NAME_LEN: usize = 16;

/// What a unit is called when the profile does not say.
pub const DEFAULT_UNIT: &str = "units";

impl Profile {
    /// The name of the profile's time unit: `units.time`, or [`DEFAULT_UNIT`].
    pub fn time_unit(&self) -> &str {
        self.units
            .as_ref()
            .and_then(|u| u.time.as_deref())
            .unwrap_or(DEFAULT_UNIT)
    }

    /// The name of the profile's memory unit: `units.memory`, or [`DEFAULT_UNIT`].
    pub fn memory_unit(&self) -> &str {
        self.units
            .as_ref()
            .and_then(|u| u.memory.as_deref())
            .unwrap_or(DEFAULT_UNIT)
    }

    /// Whether the profile names any unit (tables then print them in headers).
    pub fn declares_units(&self) -> bool {
        self.units
            .as_ref()
            .is_some_and(|u| u.time.is_some() || u.memory.is_some())
    }
}

/// One modality encoder. Costs are per layer (the encoder's total `F` is
/// `layers * forward`, and so on), except `params` and `output`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EncoderProfile {
    /// Unit name of the encoder: a plain identifier, distinct from `llm` and `llm.N`.
    pub name: String,
    /// Number of layers (at least 1).
    pub layers: u32,
    /// Forward (`F`) time per layer.
    pub forward: f64,
    /// Input-gradient backward (`B`) time per layer.
    pub backward: f64,
    /// Weight-gradient backward (`W`) time per layer; required when `trainable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    /// Activation memory kept per layer for its backward.
    pub activation: f64,
    /// Parameter memory of the whole encoder.
    #[serde(default)]
    pub params: f64,
    /// Whether the encoder's parameters are trained.
    #[serde(default)]
    pub trainable: bool,
    /// Size of the encoder's output activation per micro-batch (communication model).
    #[serde(default)]
    pub output: f64,
}

/// The LLM body. Costs are per layer.
/// How the LLM's layers are split into stages when the profile gives no `layout`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Split {
    /// Every stage the same number of layers; the remainder to stages `1, 2, ..`.
    #[default]
    Even,
    /// Layers placed so that every stage's work (`F + B + W`, with the first and last
    /// stages' extras) is as even as possible.
    Balanced,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmProfile {
    /// Number of transformer layers (at least 1), split into pipeline stages.
    pub layers: u32,
    /// Forward (`F`) time per layer.
    pub forward: f64,
    /// Input-gradient backward (`B`) time per layer.
    pub backward: f64,
    /// Weight-gradient backward (`W`) time per layer.
    pub weight: f64,
    /// Activation memory kept per layer for its backward.
    pub activation: f64,
    /// Parameter memory per layer.
    #[serde(default)]
    pub params: f64,
    /// Size of the hidden state passed between stages per micro-batch
    /// (communication model).
    #[serde(default)]
    pub output: f64,
    /// Extra work on the first stage (the embedding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_stage_extra: Option<Extra>,
    /// Extra work on the last stage (LM head and loss).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_stage_extra: Option<Extra>,
    /// How the layers map to stages, as a Megatron-LM `pipeline_model_parallel_layout`
    /// string (such as `"Et*3|(tt|)*29,m|L"`; see [`crate::algebra::megatron`]). When present it
    /// replaces the even split: it fixes each stage's transformer layers (`t`, which
    /// must number `layers`; each MTP layer `m` costs one more layer) and the stages
    /// of the embedding `E` (`first_stage_extra`) and the loss `L` (`last_stage_extra`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// How layers are split into stages without a `layout`: evenly per stage (the
    /// default), or balanced per stage (the `balance(BODY)` operator sets this).
    #[serde(skip)]
    pub split: Split,
}

/// Extra work on one pipeline stage, added to its layers' costs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Extra {
    pub forward: f64,
    pub backward: f64,
    pub weight: f64,
    #[serde(default)]
    pub activation: f64,
    #[serde(default)]
    pub params: f64,
}

/// Per-rank memory capacity.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemoryProfile {
    /// Memory available on each rank (positive); a program exceeding it is rejected.
    pub limit: f64,
}

/// The interconnect between ranks: moving `bytes` costs `latency + bytes / bandwidth`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkProfile {
    /// Fixed time per transfer (`>= 0`).
    pub latency: f64,
    /// Size moved per unit of time (`> 0`).
    pub bandwidth: f64,
}

/// The text format of a profile.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ProfileFormat {
    Toml,
    Json,
}

impl ProfileFormat {
    /// The format a file extension names (`toml` or `json`, any case), if any.
    pub fn from_extension(ext: &str) -> Option<ProfileFormat> {
        if ext.eq_ignore_ascii_case("toml") {
            Some(ProfileFormat::Toml)
        } else if ext.eq_ignore_ascii_case("json") {
            Some(ProfileFormat::Json)
        } else {
            None
        }
    }
}

impl fmt::Display for ProfileFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProfileFormat::Toml => "TOML",
            ProfileFormat::Json => "JSON",
        })
    }
}

/// One problem with a profile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProfileIssue {
    /// Key path of the offending value, e.g. `encoder[1].forward` or `llm.layers`.
    pub path: String,
    /// What is wrong and what is expected.
    pub message: String,
    /// 1-based line of the value (or of its table, for a missing key), when known.
    pub line: Option<usize>,
}

impl fmt::Display for ProfileIssue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path, self.message)?;
        if let Some(line) = self.line {
            write!(f, " (line {line})")?;
        }
        Ok(())
    }
}

/// Why a profile could not be read.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum ProfileError {
    /// The text is not well-formed TOML or JSON.
    #[error("{format} syntax error{}: {message}", position(*.line, *.column))]
    Syntax {
        format: ProfileFormat,
        message: String,
        /// 1-based line, when known.
        line: Option<usize>,
        /// 1-based column, when known.
        column: Option<usize>,
    },
    /// The text is well-formed but does not describe a valid profile; every problem
    /// found, one per line when displayed.
    #[error("{}", list_issues(.0))]
    Invalid(Vec<ProfileIssue>),
}

impl ProfileError {
    /// The validation problems (empty for a syntax error).
    pub fn issues(&self) -> &[ProfileIssue] {
        match self {
            ProfileError::Invalid(issues) => issues,
            ProfileError::Syntax { .. } => &[],
        }
    }
}

fn position(line: Option<usize>, column: Option<usize>) -> String {
    match (line, column) {
        (Some(l), Some(c)) => format!(" at line {l}, column {c}"),
        (Some(l), None) => format!(" at line {l}"),
        _ => String::new(),
    }
}

fn list_issues(issues: &[ProfileIssue]) -> String {
    let lines: Vec<String> = issues.iter().map(ToString::to_string).collect();
    lines.join("\n")
}

impl Profile {
    /// The simulator's communication model of the profile's `[link]`, if it has one.
    pub fn comm_model(&self) -> Option<crate::ir::model::CommModel> {
        self.link.as_ref().map(|l| crate::ir::model::CommModel {
            latency: l.latency,
            bandwidth: l.bandwidth,
        })
    }

    /// Read and validate a profile written in TOML.
    ///
    /// # Errors
    /// [`ProfileError::Syntax`] for text that is not TOML; [`ProfileError::Invalid`]
    /// listing every unknown, missing, mistyped or out-of-range key otherwise.
    pub fn from_toml_str(text: &str) -> Result<Profile, ProfileError> {
        decode::from_toml(text)
    }

    /// Read and validate a profile written in JSON (the same keys as TOML).
    ///
    /// # Errors
    /// As [`Profile::from_toml_str`]; JSON problems carry no line numbers.
    pub fn from_json_str(text: &str) -> Result<Profile, ProfileError> {
        decode::from_json(text)
    }

    /// Read and validate a profile in the given format.
    ///
    /// # Errors
    /// As [`Profile::from_toml_str`].
    pub fn parse(text: &str, format: ProfileFormat) -> Result<Profile, ProfileError> {
        match format {
            ProfileFormat::Toml => Profile::from_toml_str(text),
            ProfileFormat::Json => Profile::from_json_str(text),
        }
    }

    /// Check every rule a profile's values must satisfy (the parsers call this).
    ///
    /// # Errors
    /// [`ProfileError::Invalid`] listing every problem found (without line numbers:
    /// a constructed profile has no source text).
    pub fn validate(&self) -> Result<(), ProfileError> {
        let issues = check::issues(self);
        if issues.is_empty() {
            Ok(())
        } else {
            Err(ProfileError::Invalid(issues))
        }
    }

    /// The encoder called `name`, if any.
    pub fn encoder(&self, name: &str) -> Option<&EncoderProfile> {
        self.encoders.iter().find(|e| e.name == name)
    }
}
