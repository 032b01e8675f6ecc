//! The value rules of a profile ([`Profile::validate`]): one small function per rule,
//! each pushing a [`ProfileIssue`] that names the key path, what is wrong and what is
//! expected. Collects every problem; never stops at the first.

use std::collections::BTreeMap;

use super::{
    Profile, ProfileIssue, MAX_ENCODERS, MAX_FIGURE, MAX_LAYERS, MAX_LAYOUT_LEN, MAX_NAME_LEN,
    MIN_FIGURE,
};
use crate::algebra::megatron::MegatronLayout;

/// Every rule broken by `profile`, in key order (the parser fills in lines).
pub(super) fn issues(profile: &Profile) -> Vec<ProfileIssue> {
    let mut out = Vec::new();
    if profile.encoders.len() > MAX_ENCODERS {
        push(
            &mut out,
            "encoder".to_string(),
            format!(
                "found {} encoders; expected at most {MAX_ENCODERS} (mpipe's limit)",
                profile.encoders.len()
            ),
        );
    }
    let mut first_use: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, enc) in profile.encoders.iter().enumerate() {
        let p = format!("encoder[{i}]");
        let named = check_name(&mut out, &format!("{p}.name"), &enc.name);
        if named {
            if let Some(first) = first_use.get(enc.name.as_str()) {
                push(
                    &mut out,
                    format!("{p}.name"),
                    format!(
                        "duplicate encoder name `{}` (encoder[{first}] already uses it); \
                         expected every encoder to have its own name",
                        enc.name
                    ),
                );
            } else {
                first_use.insert(&enc.name, i);
            }
        }
        check_layers(&mut out, &format!("{p}.layers"), enc.layers);
        check_cost(&mut out, &p, "forward", enc.forward);
        check_cost(&mut out, &p, "backward", enc.backward);
        if let Some(w) = enc.weight {
            check_cost(&mut out, &p, "weight", w);
        } else if enc.trainable {
            push(
                &mut out,
                format!("{p}.weight"),
                format!(
                    "encoder `{}` is trainable but has no weight-gradient cost; \
                     add `weight = ...` (W time per layer) or set `trainable = false`",
                    shortened(&enc.name)
                ),
            );
        }
        check_cost(&mut out, &p, "activation", enc.activation);
        check_cost(&mut out, &p, "params", enc.params);
        check_cost(&mut out, &p, "output", enc.output);
    }

    let llm = &profile.llm;
    check_layers(&mut out, "llm.layers", llm.layers);
    check_cost(&mut out, "llm", "forward", llm.forward);
    check_cost(&mut out, "llm", "backward", llm.backward);
    check_cost(&mut out, "llm", "weight", llm.weight);
    check_cost(&mut out, "llm", "activation", llm.activation);
    check_cost(&mut out, "llm", "params", llm.params);
    check_cost(&mut out, "llm", "output", llm.output);
    for (key, extra) in [
        ("first_stage_extra", &llm.first_stage_extra),
        ("last_stage_extra", &llm.last_stage_extra),
    ] {
        if let Some(x) = extra {
            let p = format!("llm.{key}");
            check_cost(&mut out, &p, "forward", x.forward);
            check_cost(&mut out, &p, "backward", x.backward);
            check_cost(&mut out, &p, "weight", x.weight);
            check_cost(&mut out, &p, "activation", x.activation);
            check_cost(&mut out, &p, "params", x.params);
        }
    }

    if let Some(text) = &llm.layout {
        let n = text.chars().count();
        if n > MAX_LAYOUT_LEN {
            push(
                &mut out,
                "llm.layout".to_string(),
                format!(
                    "the layout is {n} characters long; expected at most {MAX_LAYOUT_LEN} \
                     (MAX_LAYOUT_LEN): write repeated stages with `*` (such as `(tt|)*29`)"
                ),
            );
        } else {
            check_layout(&mut out, text, llm.layers);
        }
    }

    if let Some(m) = &profile.memory {
        check_positive(&mut out, "memory.limit", m.limit, "memory per rank");
    }
    if let Some(l) = &profile.link {
        check_cost(&mut out, "link", "latency", l.latency);
        check_positive(
            &mut out,
            "link.bandwidth",
            l.bandwidth,
            "size moved per unit of time",
        );
    }
    out
}

fn push(out: &mut Vec<ProfileIssue>, path: String, message: String) {
    out.push(ProfileIssue {
        path,
        message,
        line: None,
    });
}

fn check_cost(out: &mut Vec<ProfileIssue>, table: &str, key: &str, v: f64) {
    if !v.is_finite() || v < 0.0 {
        push(
            out,
            format!("{table}.{key}"),
            format!("found {}; expected a finite number >= 0", shown(v)),
        );
    } else if v > MAX_FIGURE {
        push(
            out,
            format!("{table}.{key}"),
            format!(
                "found {}; expected at most {MAX_FIGURE:e} (sums of such figures lose \
                 the precision a schedule's timing needs): use larger units",
                shown(v)
            ),
        );
    }
}

fn check_positive(out: &mut Vec<ProfileIssue>, path: &str, v: f64, what: &str) {
    if !v.is_finite() || v <= 0.0 {
        push(
            out,
            path.to_string(),
            format!("found {}; expected a finite number > 0 ({what})", shown(v)),
        );
    } else if !(MIN_FIGURE..=MAX_FIGURE).contains(&v) {
        push(
            out,
            path.to_string(),
            format!(
                "found {}; expected a number from {MIN_FIGURE:e} to {MAX_FIGURE:e} \
                 ({what}): use other units",
                shown(v)
            ),
        );
    }
}

/// `v` as a person reads it: plain, or in scientific notation when very large or
/// very small.
fn shown(v: f64) -> String {
    if v != 0.0 && v.is_finite() && !(1e-6..1e10).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// `llm.layout` must be a valid Megatron layout with `layers` transformer layers.
fn check_layout(out: &mut Vec<ProfileIssue>, text: &str, layers: u32) {
    match MegatronLayout::parse(text) {
        Err(e) => push(
            out,
            "llm.layout".to_string(),
            format!("not a valid Megatron pipeline layout: {e}"),
        ),
        Ok(layout) => {
            let t = layout.transformer_layers();
            if layers > 0 && t != layers as usize {
                push(
                    out,
                    "llm.layout".to_string(),
                    format!(
                        "the layout has {t} transformer layers (`t`) but llm.layers = {layers}; \
                         expected the two to match (change one of them)"
                    ),
                );
            }
        }
    }
}

fn check_layers(out: &mut Vec<ProfileIssue>, path: &str, layers: u32) {
    if layers == 0 {
        push(
            out,
            path.to_string(),
            "found 0 layers; expected a whole number >= 1".to_string(),
        );
    } else if layers > MAX_LAYERS {
        push(
            out,
            path.to_string(),
            format!(
                "found {layers} layers; expected at most {MAX_LAYERS} (mpipe's limit; \
                 describe several layers as one if your model has more)"
            ),
        );
    }
}

/// Whether `name` is one of the LLM's unit names (`llm`, `llm.0`, `llm.1`, ...).
fn is_llm_unit_name(name: &str) -> bool {
    name == "llm"
        || name
            .strip_prefix("llm.")
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// A plain ASCII identifier: letters, digits and `_`, not starting with a digit,
/// not `_` alone.
fn is_plain_identifier(name: &str) -> bool {
    let mut chars = name.chars();
    match chars.next() {
        Some(c) if c.is_ascii_alphabetic() || c == '_' => {}
        _ => return false,
    }
    name != "_" && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// `name` cut to a length fit for a message.
pub(super) fn shortened(name: &str) -> String {
    if name.chars().count() <= MAX_NAME_LEN {
        name.to_string()
    } else {
        let head: String = name.chars().take(24).collect();
        format!("{head}...")
    }
}

/// Report what is wrong with an encoder's name; whether it is fit to compare with
/// the others (not empty, not over the length limit).
fn check_name(out: &mut Vec<ProfileIssue>, path: &str, name: &str) -> bool {
    let n = name.chars().count();
    let message = if n > MAX_NAME_LEN {
        let message = format!(
            "the name `{}` is {n} characters long; expected at most {MAX_NAME_LEN} \
             (MAX_NAME_LEN, mpipe's limit on unit names): use a shorter name",
            shortened(name).escape_debug()
        );
        push(out, path.to_string(), message);
        return false;
    } else if name.is_empty() {
        "the name is empty; expected a plain identifier such as `vision`".to_string()
    } else if is_llm_unit_name(name) {
        format!(
            "`{name}` collides with the LLM's unit names (`llm`, `llm.0`, `llm.1`, ...); \
             expected another name, such as `vision`"
        )
    } else if !is_plain_identifier(name) {
        format!(
            "`{}` is not a plain identifier; expected ASCII letters, digits and `_`, \
             not starting with a digit (such as `vision` or `audio_tower`)",
            name.escape_debug()
        )
    } else {
        return true;
    };
    push(out, path.to_string(), message);
    !name.is_empty()
}
