//! A unit's role in the model: what the passes ask (is it pinned to its home as part
//! of the pipeline? which encoder is it part of?) instead of reading names.
//!
//! Every unit carries its [`Role`] ([`crate::ir::program::Unit::role`]): the unit builders and operators
//! that make units set it. A program file may state it (the `role` key of a unit,
//! an extension of the program format); where it does not, it is read from the
//! unit's name by mpipe's naming convention ([`Role::of_name`]), once, when the file
//! is read, and it is written to a file only where it differs from what the name
//! says, so programs that follow the convention keep their bytes.

use serde::{Deserialize, Serialize};

/// What a unit is in the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// LLM pipeline stage `k` (`llm.k`), pinned to its home rank.
    Stage(usize),
    /// One layer of the LLM (or a stage's extra work) cut by `layers` (`llm/N`,
    /// `llm/first_stage_extra`, `llm/last_stage_extra`); pinned as its stage is.
    StageLayer,
    /// A whole encoder (or any other unit mpipe may move between ranks).
    Encoder,
    /// A layer chunk of the named encoder (`vision.0`): `chain` and the woven
    /// `zb2p` bodies make them.
    EncoderChunk(String),
    /// One layer of the named encoder (`vision/3`), cut by `layers`.
    EncoderLayer(String),
}

impl Role {
    /// The role mpipe's naming convention gives `name`: `llm.k` a stage, `llm/..` a
    /// stage layer, `X.k` a chunk and `X/..` (or `X.k/..`) a layer of encoder `X`,
    /// anything else an encoder. For programs that do not state their units' roles.
    pub fn of_name(name: &str) -> Role {
        let digits = |n: &str| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit());
        if let Some(k) = name.strip_prefix("llm.").filter(|k| digits(k)) {
            if let Ok(k) = k.parse() {
                return Role::Stage(k);
            }
        }
        if name
            .strip_prefix("llm/")
            .is_some_and(|n| digits(n) || n == "first_stage_extra" || n == "last_stage_extra")
        {
            return Role::StageLayer;
        }
        match name.split_once(['.', '/']) {
            // A layer of a chunk (`vision.0/1`) is a layer of the encoder.
            Some((of, _)) if !of.is_empty() && of != "llm" => {
                if name.contains('/') {
                    Role::EncoderLayer(of.to_string())
                } else {
                    Role::EncoderChunk(of.to_string())
                }
            }
            _ => Role::Encoder,
        }
    }

    /// Whether the unit is part of the LLM pinned to its home in a pipeline-parallel
    /// program: a stage or one of its layers.
    pub fn is_stage(&self) -> bool {
        matches!(self, Role::Stage(_) | Role::StageLayer)
    }

    /// The encoder a unit named `name` with this role is (part of); `None` for the
    /// LLM's units.
    pub fn encoder<'a>(&'a self, name: &'a str) -> Option<&'a str> {
        match self {
            Role::Encoder => Some(name),
            Role::EncoderChunk(of) | Role::EncoderLayer(of) => Some(of),
            Role::Stage(_) | Role::StageLayer => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_naming_convention_reads_as_mpipe_names_units() {
        for (name, role) in [
            ("llm.0", Role::Stage(0)),
            ("llm.12", Role::Stage(12)),
            ("llm/3", Role::StageLayer),
            ("llm/first_stage_extra", Role::StageLayer),
            ("llm/last_stage_extra", Role::StageLayer),
            ("vision", Role::Encoder),
            ("vision.2", Role::EncoderChunk("vision".into())),
            ("vision/5", Role::EncoderLayer("vision".into())),
            ("vision.0/1", Role::EncoderLayer("vision".into())),
            ("llm.x", Role::Encoder),
            ("llm", Role::Encoder),
            (".0", Role::Encoder),
        ] {
            assert_eq!(Role::of_name(name), role, "{name}");
        }
    }
}
