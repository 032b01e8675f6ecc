//! What a derivation error says to do: one message per cause, whatever the number of
//! ranks it touches, with advice that fits the schedule the user wrote.

use crate::algebra::eval::body_names;
use crate::ir::compare::at_most;

/// Bodies that keep the fewest micro-batches in flight (at most one per stage
/// still to come): nothing of the family stores fewer activations.
const FEWEST_IN_FLIGHT: [&str; 2] = ["1f1b", "zbh1"];

/// How the advice to keep fewer micro-batches in flight starts.
const IN_FLIGHT: &str = "use a schedule that keeps fewer micro-batches in flight";

/// What to do when no schedule's order helps.
const NO_SCHEDULE_HELPS: &str = "use more ranks (fewer layers each), smaller micro-batches \
    (a lower `activation` in the profile), or a larger limit";

/// `ranks` (sorted, distinct) as the shortest list of runs: `0-3`, `0-1, 5`, `2`.
pub fn rank_list(ranks: &[usize]) -> String {
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        runs.push(if j == i {
            ranks[i].to_string()
        } else {
            format!("{}-{}", ranks[i], ranks[j])
        });
        i = j + 1;
    }
    runs.join(", ")
}

/// `rank 2` or `ranks 0-3`.
pub fn ranks_phrase(ranks: &[usize]) -> String {
    let noun = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{noun} {}", rank_list(ranks))
}

/// The body schedules named in expression `text` (`transpose(vision, 1f1b)` ->
/// `["1f1b"]`).
fn bodies_in(text: &str) -> Vec<&'static str> {
    let words: Vec<&str> = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    body_names().filter(|b| words.contains(b)).collect()
}

/// The one error for schedule `text` when some ranks' peak memory (`activations[r]`
/// + `params[r]`) exceeds `limit`, or `None` when every rank fits. It names every
///   rank over the limit once, the worst one's figures, and advice that fits `text`:
///   schedules that keep fewer micro-batches in flight only when the one written is
///   not already among them, and no schedule at all when parameters alone overflow.
pub fn memory_over_limit(
    text: &str,
    activations: &[f64],
    params: &[f64],
    limit: f64,
) -> Option<String> {
    let need = |r: usize| activations[r] + params.get(r).copied().unwrap_or(0.0);
    let over: Vec<usize> = (0..activations.len())
        .filter(|&r| !at_most(need(r), limit))
        .collect();
    let worst = *over
        .iter()
        .max_by(|&&a, &&b| need(a).total_cmp(&need(b)).then(b.cmp(&a)))?;
    let (act, par) = (
        activations[worst],
        params.get(worst).copied().unwrap_or(0.0),
    );
    let are = if over.len() == 1 { "is" } else { "are" };
    let most = if over.len() == 1 {
        format!("it needs {:.2}", act + par)
    } else {
        format!("rank {worst} needs the most, {:.2}", act + par)
    };
    let advice = if !at_most(par, limit) {
        format!(
            "its parameters alone ({par:.2}) are over the limit, which no schedule changes: \
             use more ranks (fewer layers each) or a larger limit"
        )
    } else {
        let bodies = bodies_in(text);
        let fewer: Vec<String> = FEWEST_IN_FLIGHT
            .iter()
            .filter(|f| !bodies.contains(f))
            .map(|f| format!("`{f}`"))
            .collect();
        let already_fewest =
            !bodies.is_empty() && bodies.iter().all(|b| FEWEST_IN_FLIGHT.contains(b));
        if already_fewest || fewer.is_empty() {
            format!(
                "`{}` already keeps the fewest micro-batches in flight: {NO_SCHEDULE_HELPS}",
                bodies.first().copied().unwrap_or(text)
            )
        } else {
            format!(
                "{IN_FLIGHT} ({}), more ranks, or a larger limit",
                fewer.join(", ")
            )
        }
    };
    Some(format!(
        "{} {are} over memory.limit = {limit} with `{text}`: {most} (activations {act:.2} + \
         parameters {par:.2}); {advice}",
        ranks_phrase(&over)
    ))
}

/// `message`, a derivation error of expression `written`, with advice that fits what
/// was written: when `written` is `auto`, which tried every schedule it could and
/// reports one candidate's failure, the advice to switch schedules becomes what is
/// left to do. Other messages are returned as they are.
pub fn for_written(written: &str, message: &str) -> String {
    let is_auto = written
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .any(|w| w == "auto");
    match message.find(IN_FLIGHT) {
        Some(at) if is_auto => format!(
            "{}`auto` tried the schedules that keep fewer in flight too: {NO_SCHEDULE_HELPS}",
            &message[..at]
        ),
        _ => message.to_string(),
    }
}

/// Ranks of `program` that compute nothing of the encoders (units that are, by
/// their role, one of `encoders` or a chunk or layer of one).
pub fn ranks_without_encoder_work(
    program: &crate::ir::program::Program,
    encoders: &[&str],
) -> Vec<usize> {
    let of_encoder: std::collections::BTreeSet<&str> = program
        .units
        .iter()
        .filter(|u| {
            u.role
                .encoder(&u.name)
                .is_some_and(|e| encoders.contains(&e))
        })
        .map(|u| u.name.as_str())
        .collect();
    let is_encoder = |unit: &str| of_encoder.contains(unit);
    program
        .programs
        .iter()
        .enumerate()
        .filter(|(_, list)| {
            !list.iter().any(
                |a| matches!(a.view(), crate::ir::program::ActionRef::Compute(c) if is_encoder(c.unit)),
            )
        })
        .map(|(r, _)| r)
        .collect()
}

/// A warning for a valid but degenerate schedule: `transpose` meant to spread the
/// encoders over the ranks, and some ranks own no encoder work (fewer micro-batches
/// than ranks, typically). `None` when nothing is degenerate.
pub fn degenerate(
    text: &str,
    program: &crate::ir::program::Program,
    encoders: &[&str],
) -> Option<String> {
    let transposed = text
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .any(|w| w == "transpose");
    if !transposed || encoders.is_empty() {
        return None;
    }
    let idle = ranks_without_encoder_work(program, encoders);
    if idle.is_empty() {
        return None;
    }
    let fix = if program.microbatches < program.ranks {
        format!(
            " ({} micro-batches on {} ranks): use at least {} micro-batches, or keep the \
             encoders inline",
            program.microbatches, program.ranks, program.ranks
        )
    } else {
        String::new()
    };
    Some(format!(
        "`{text}` leaves {} of {} with no encoder work{fix}",
        ranks_phrase(&idle),
        program.ranks
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_runs() {
        assert_eq!(rank_list(&[0, 1, 2, 3]), "0-3");
        assert_eq!(rank_list(&[0, 1, 5]), "0-1, 5");
        assert_eq!(rank_list(&[2]), "2");
        assert_eq!(ranks_phrase(&[2]), "rank 2");
        assert_eq!(ranks_phrase(&[0, 2, 3]), "ranks 0, 2-3");
    }

    #[test]
    fn one_message_names_every_rank_over() {
        let m = memory_over_limit("gpipe", &[32.0, 30.0, 5.0, 31.0], &[0.0; 4], 10.0).unwrap();
        assert!(
            m.starts_with("ranks 0-1, 3 are over memory.limit = 10"),
            "{m}"
        );
        assert!(m.contains("rank 0 needs the most, 32.00"), "{m}");
        assert!(m.contains("`1f1b`, `zbh1`"), "{m}");
        assert!(memory_over_limit("gpipe", &[1.0, 2.0], &[0.0; 2], 10.0).is_none());
    }

    #[test]
    fn advice_never_names_the_schedule_written() {
        for text in ["1f1b", "transpose(vision, 1f1b)", "refine(zbh1, order = 3)"] {
            let m = memory_over_limit(text, &[12.0], &[1.0], 10.0).unwrap();
            assert!(m.contains("already keeps the fewest"), "{m}");
            assert!(!m.contains("`1f1b`, `zbh1`"), "{m}");
        }
        let m = memory_over_limit("zbv", &[12.0], &[1.0], 10.0).unwrap();
        assert!(m.contains("(`1f1b`, `zbh1`)"), "{m}");
        let after = for_written("auto", &format!("`auto` found no schedule; {m}"));
        assert!(!after.contains("`1f1b`, `zbh1`"), "{after}");
        assert!(
            after.contains("`auto` tried") && after.contains("more ranks"),
            "{after}"
        );
        assert_eq!(for_written("zbv", &m), m);
        let m = memory_over_limit("1f1b", &[1.0], &[12.0], 10.0).unwrap();
        assert!(m.contains("parameters alone (12.00)"), "{m}");
        assert!(!m.contains("in flight"), "{m}");
    }
}
