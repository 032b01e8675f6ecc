//! A derivation by name: an expression's plan derived, and the alternatives it
//! chooses among ([`alternatives`]: `transpose`'s other placements, a searched
//! list's fixed order, a `fill`'s pieces on a tie), the fastest program kept
//! ([`choose_placement`]). `derive` derives every expression this way, and `auto`
//! each of its candidates ([`derive_candidate`]), so `auto` is never behind an
//! expression of its space as the user would derive it. Below both: it knows
//! neither `derive`'s entry nor `auto`.

use crate::algebra::analysis::{dependencies, timing};
use crate::algebra::eval::{eval, plan_of, DeriveError, Request};
use crate::algebra::expr::{Arg, Expr, Ident, Value};
use crate::algebra::operators::fill::FillTies;
use crate::algebra::operators::transpose::{Place, PlaceRecord, Verdict};
use crate::ir::compare::{close, less, Score};
use crate::ir::plan::Plan;
use crate::judge::bound::lowering_floor;
use crate::judge::compare::span;
use crate::search::finish::{finish_checked, finish_checked_taking, Checked, Derived};

/// `f` under `req` with the records a derivation by name keeps: a `fill` that
/// cannot tell its placements apart records it (in the caller's record, if it gave
/// one; then both are derived, [`choose_placement`]); a `transpose` choosing its
/// placement records what it learnt of the placements [`choose_placement`] derives
/// besides (a record of this derivation's own: counted per derivation).
pub(crate) fn with_records<R>(req: &Request, f: impl FnOnce(&Request) -> R) -> R {
    let own = FillTies::new();
    let record = PlaceRecord::new(lowering_floor);
    f(&Request {
        fill_ties: Some(req.fill_ties.unwrap_or(&own)),
        place_record: Some(&record),
        ..*req
    })
}

/// `expr`, a candidate of `auto` (no `auto` nor `refine` in it), derived as
/// [`crate::search::derive::derive`] derives it by name: its plan, then [`choose_placement`] among its
/// [`alternatives`], except those whose plan's ideal step is above `within` (then
/// none of its programs can come in below `within`; `auto` gives the limit of its
/// own stop rule). Returns the alternative whose program was kept (`None`: the
/// expression's own plan's) and the derivation, named `expr` (derived by name,
/// `expr` gives the same program, or a faster one only through an alternative
/// above `within`). So `auto` is never behind an expression of its space as the
/// user would derive it.
pub(crate) fn derive_candidate(req: &Request, expr: &Expr, within: f64) -> Chosen {
    with_records(req, |req| match plan_of(req, expr) {
        Ok(plan) => choose_placement(req, plan, expr, false, within),
        Err(es) => Chosen::failed(es),
    })
}

/// What [`choose_placement`] kept.
pub(crate) struct Chosen {
    /// The plan kept, if the caller asked for it.
    pub(crate) plan: Option<Plan>,
    /// The alternative whose plan was kept; `None`: the expression's own.
    pub(crate) alternative: Option<Expr>,
    /// The ideal step of each alternative derived besides the expression's own
    /// plan (`None`: it could not be timed), in order: the work a caller that
    /// meters it counts.
    pub(crate) others_derived: Vec<Option<f64>>,
    /// The ideal step of each alternative that was the one kept at some point, in
    /// order: had the limit given been below one of them ([`within_limit`]), another
    /// plan might have been kept.
    pub(crate) kept_on_the_way: Vec<Option<f64>>,
    /// The kept plan's derivation.
    pub(crate) derived: Result<Derived, Vec<DeriveError>>,
}

impl Chosen {
    /// A derivation that failed before any plan was chosen.
    pub(crate) fn failed(errors: Vec<DeriveError>) -> Chosen {
        Chosen::kept(Err(errors))
    }

    /// `derived`, of the plan given, with no alternative derived.
    pub(crate) fn kept(derived: Result<Derived, Vec<DeriveError>>) -> Chosen {
        Chosen {
            plan: None,
            alternative: None,
            others_derived: Vec::new(),
            kept_on_the_way: Vec::new(),
            derived,
        }
    }
}

/// [`finish`] `plan`, the plan of `expr`; and where `expr` has a `transpose` whose
/// placement is the default (`place = best`: chosen by the plan's ideal timing, which
/// sees neither communication costs nor rendezvous), also the plans with the
/// authors' placement there (`place = prefix`) and with the late one (`place =
/// late`), keeping the one whose program is fastest (the first on a tie): so a user
/// who writes the paper's schedule never gets less than the paper's placement, nor
/// than `late`. Likewise where `expr` has a `zbv(list = search)` or
/// `zbh1(list = search)` (chosen by the plans' ideal timing too), also the plan
/// with the fixed order there (`list = fixed`): the searched body is never behind
/// `zbv` / `zbh1` in the same place, under either semantics. And where `expr` has a
/// `fill` that chooses its pieces (`pieces = best`: whole or layer by layer, by the
/// ideal timing), also the plans with `pieces = whole` and `pieces = layers` there,
/// but only those whose ideal step equals `plan`'s under the tolerance rule: where
/// the ideal timing cannot tell them apart, the simulation does (and elsewhere
/// nothing more is derived). An alternative whose plan's ideal step is above
/// `within` is not derived either. Returns the plan kept (if `keep_plan`), the
/// alternative it is the plan of (if not `expr`) and its derivation.
pub(crate) fn choose_placement(
    req: &Request,
    plan: Plan,
    expr: &Expr,
    keep_plan: bool,
    within: f64,
) -> Chosen {
    let text = expr.to_string();
    // Whether a `fill` recorded a tie: only then are its alternatives planned, and
    // derived where their ideal step ties `plan`'s (timed only then too).
    let fill_tied = req.fill_ties.is_some_and(FillTies::seen);
    let ideal = fill_tied.then(|| ideal_step(&plan)).flatten();
    // The plan kept, its score once derived (`None` inside: its derivation failed),
    // and its derivation while it is still held. Only one derivation is held at a
    // time: the kept plan's goes before an alternative is derived, and the kept plan
    // is derived again at the end if it was not the last derived (derivation is
    // deterministic). At 8 x 65536 a derivation is hundreds of MB; holding two
    // doubled the peak.
    let mut best = plan;
    let mut alternative: Option<Expr> = None;
    let mut others_derived = Vec::new();
    let mut kept_on_the_way = Vec::new();
    let mut score: Option<Option<Score>> = None;
    let mut held: Option<Result<Checked, Vec<DeriveError>>> = None;
    let others = alternatives(expr).filter(|a| fill_tied || !a.on_tie);
    // Where `expr` is the one `transpose` choosing its placement, its evaluation
    // (giving `plan`) compared the `prefix` and `late` placements' plans already and
    // recorded a verdict on each ([`PlaceRecord`]): the plan kept, or another with
    // its floor. Read before any alternative is evaluated (they record too).
    let verdicts = PLACEMENTS.map(|(_, place)| {
        let sole = default_transposes(expr) == 1 && chooses_place(expr);
        req.place_record
            .filter(|_| sole)
            .and_then(|r| r.verdict(place))
    });
    let verdict = |place: Option<Place>| match place? {
        Place::Prefix => verdicts[0],
        Place::Late => verdicts[1],
        _ => None,
    };
    // Whether `best` is still `plan` (the plan the verdicts were given against).
    let mut replaced = false;
    let floor = |p: &Plan| lowering_floor(p).unwrap_or(f64::NEG_INFINITY);
    // The kept plan's score, derived the first time it is asked for (its
    // derivation then held, for the end).
    let kept_score = |best: &Plan,
                      score: &mut Option<Option<Score>>,
                      held: &mut Option<Result<Checked, Vec<DeriveError>>>| {
        *score.get_or_insert_with(|| {
            let derived = finish_checked(req, best, &text, expr.span, None);
            let s = scored(&derived);
            *held = Some(derived);
            s
        })
    };
    for Alternative {
        expr: other,
        on_tie,
        place,
    } in others
    {
        // An alternative the record judged is not evaluated where its verdict
        // decides: its plan is the one kept (skipped, as below), or its floor is
        // above the kept program's makespan (cut, as below).
        match verdict(place) {
            Some(Verdict::Chosen) if !replaced => continue,
            Some(Verdict::Other(f)) => {
                let current = kept_score(&best, &mut score, &mut held);
                if current.is_some_and(|c| less(c.makespan, f.unwrap_or(f64::NEG_INFINITY))) {
                    continue;
                }
                // Not cut: the alternative is evaluated and derived below, with
                // no derivation held beside it (the kept one goes before its
                // derivation anyway).
                held = None;
            }
            _ => {}
        }
        let mut ignored = Vec::new();
        let alt = match eval(req, &other, &mut ignored) {
            Some(alt) if ignored.is_empty() && alt != best => alt,
            _ => continue,
        };
        // The alternative's ideal step (timed once: the rules below and the caller
        // ask for it).
        let alt_ideal = ideal_step(&alt);
        if on_tie && !ideal.is_some_and(|t| alt_ideal.is_some_and(|a| close(a, t))) {
            continue;
        }
        // No program of the plan comes in below its ideal step.
        if !within_limit(within, alt_ideal) {
            continue;
        }
        let current = kept_score(&best, &mut score, &mut held);
        // An alternative that cannot come in below the kept program's makespan is
        // not derived (it could not beat it).
        if current.is_some_and(|c| less(c.makespan, floor(&alt))) {
            continue;
        }
        held = None;
        others_derived.push(alt_ideal);
        let derived = finish_checked(req, &alt, &text, expr.span, None);
        let challenger = scored(&derived);
        let wins = match (current, challenger) {
            (Some(a), Some(b)) => b.beats(&a),
            (None, Some(_)) => true,
            (_, None) => false,
        };
        if wins {
            (best, score, held) = (alt, Some(challenger), Some(derived));
            alternative = Some(other);
            replaced = true;
            kept_on_the_way.push(alt_ideal);
        }
    }
    // Only the program kept needs its lower bound. A plan the caller does not keep
    // goes as soon as its derivation no longer needs it.
    let (best, derived) = match held {
        Some(derived) => (keep_plan.then_some(best), derived),
        None if keep_plan => {
            let derived = finish_checked(req, &best, &text, expr.span, None);
            (Some(best), derived)
        }
        None => (None, finish_checked_taking(req, best, &text, expr.span)),
    };
    Chosen {
        plan: best,
        alternative,
        others_derived,
        kept_on_the_way,
        derived: derived.map(|c| c.bounded(req)),
    }
}

/// The placements [`choose_placement`] tries besides `transpose`'s default, by
/// name and as the operator knows them.
const PLACEMENTS: [(&str, Place); 2] = [("prefix", Place::Prefix), ("late", Place::Late)];

/// An expression [`choose_placement`] derives besides the one it is given.
pub(crate) struct Alternative {
    /// The expression.
    pub(crate) expr: Expr,
    /// Whether it is derived only where its ideal step ties the given one's (a
    /// `fill`'s pieces).
    pub(crate) on_tie: bool,
    /// The placement it gives `transpose`, if it is one of [`PLACEMENTS`].
    place: Option<Place>,
}

impl Alternative {
    /// What it changes, as a pair comparable between expressions: whether it is
    /// derived only on a tie, and the placement it gives `transpose`.
    pub(crate) fn kind(&self) -> (bool, Option<Place>) {
        (self.on_tie, self.place)
    }
}

/// The expressions a derivation of `expr` by name ([`crate::search::derive::derive`]) also derives and
/// chooses among ([`choose_placement`]), in the order it tries them: `expr` with
/// each of `transpose`'s other placements, with the fixed order for a searched
/// `zbv` / `zbh1` list, and with each of a `fill`'s pieces (those only on an ideal
/// tie). `auto` searches them too (`search::auto`), so that it is never behind an
/// expression of its space as derived by name.
pub(crate) fn alternatives(expr: &Expr) -> impl Iterator<Item = Alternative> + '_ {
    PLACEMENTS
        .iter()
        .map_while(|&(name, place)| {
            with_placement(expr, name).map(|e| Alternative {
                expr: e,
                on_tie: false,
                place: Some(place),
            })
        })
        .chain(with_fixed_list(expr).map(|e| Alternative {
            expr: e,
            on_tie: false,
            place: None,
        }))
        .chain(
            ["whole", "layers"]
                .iter()
                .map_while(|pieces| with_fill_pieces(expr, pieces))
                .map(|e| Alternative {
                    expr: e,
                    on_tie: true,
                    place: None,
                }),
        )
}

/// The score a derivation is chosen on (its makespan), `None` if it failed.
fn scored(d: &Result<Checked, Vec<DeriveError>>) -> Option<Score> {
    d.as_ref().ok().map(|c| span(&c.report))
}

/// `e` with `place = PLACE` added to every `transpose` that leaves its placement to
/// the default (and does not ask for `owners = min`, whose placement is the
/// reference one already); `None` if there is none.
fn with_placement(e: &Expr, place: &str) -> Option<Expr> {
    let mut out = e.clone();
    let mut changed = false;
    for arg in &mut out.args {
        if let Arg::Expr(sub) = arg {
            if let Some(x) = with_placement(sub, place) {
                *sub = x;
                changed = true;
            }
        }
    }
    if chooses_place(e) {
        out.args.push(Arg::Key {
            key: Ident::new("place", e.span),
            value: Value::Name(Ident::new(place, e.span)),
            span: e.span,
        });
        changed = true;
    }
    changed.then_some(out)
}

/// Whether `e` is a `transpose` that leaves its placement to the default and does
/// not ask for `owners = min` (what [`with_placement`] changes).
fn chooses_place(e: &Expr) -> bool {
    e.name() == "transpose"
        && e.find_key("place").is_none()
        && e.find_key("owners").and_then(|v| v.as_name()) != Some("min")
}

/// How many `transpose`s in `e` choose their placement ([`chooses_place`]).
fn default_transposes(e: &Expr) -> usize {
    let inner: usize = e
        .args
        .iter()
        .map(|a| match a {
            Arg::Expr(sub) => default_transposes(sub),
            _ => 0,
        })
        .sum();
    inner + usize::from(chooses_place(e))
}

/// `e` with `pieces = PIECES` given to every `fill` that chooses its pieces (no
/// `pieces`, or `pieces = best`); `None` if there is none.
fn with_fill_pieces(e: &Expr, pieces: &str) -> Option<Expr> {
    let mut out = e.clone();
    let mut changed = false;
    let chooses = e.name() == "fill"
        && e.find_key("pieces")
            .is_none_or(|v| v.as_name() == Some("best"));
    for arg in &mut out.args {
        match arg {
            Arg::Expr(sub) => {
                if let Some(x) = with_fill_pieces(sub, pieces) {
                    *sub = x;
                    changed = true;
                }
            }
            Arg::Key { key, value, .. } if chooses && key.name == "pieces" => {
                *value = Value::Name(Ident::new(pieces, value.span()));
                changed = true;
            }
            Arg::Key { .. } => {}
        }
    }
    if chooses && e.find_key("pieces").is_none() {
        out.args.push(Arg::Key {
            key: Ident::new("pieces", e.span),
            value: Value::Name(Ident::new(pieces, e.span)),
            span: e.span,
        });
        changed = true;
    }
    changed.then_some(out)
}

/// Whether an alternative with this ideal step (`None`: it cannot be timed) is
/// derived under the limit `within` ([`choose_placement`]): no program of its plan
/// comes in below its ideal step, so above a finite limit it is not.
pub(crate) fn within_limit(within: f64, ideal: Option<f64>) -> bool {
    !within.is_finite() || ideal.is_some_and(|a| !less(within, a))
}

/// `plan`'s ideal (communication-free) step; `None` if it cannot be timed.
fn ideal_step(plan: &Plan) -> Option<f64> {
    let deps = dependencies(plan).ok()?;
    Some(timing(plan, &deps).ok()?.makespan())
}

/// `e` with every `zbv(list = search)` / `zbh1(list = search)` in the fixed order,
/// which is the default: the `list` argument dropped (so the expression reads, and
/// `auto`'s space dedupes it, as the plain body); `None` if there is none.
fn with_fixed_list(e: &Expr) -> Option<Expr> {
    let mut out = e.clone();
    let searched = matches!(e.name(), "zbv" | "zbh1")
        && e.find_key("list").and_then(|v| v.as_name()) == Some("search");
    let mut changed = searched;
    if searched {
        out.args
            .retain(|a| !matches!(a, Arg::Key { key, .. } if key.name == "list"));
    }
    for arg in &mut out.args {
        if let Arg::Expr(sub) = arg {
            if let Some(x) = with_fixed_list(sub) {
                *sub = x;
                changed = true;
            }
        }
    }
    changed.then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algebra::expr::parse_str;
    use crate::algebra::profile::Profile;
    use crate::ir::model::Mode;

    /// A `transpose` choosing its placement records, on `prefix` and `late`, what
    /// evaluating that placement would give: `Chosen` exactly where its plan is the
    /// plan chosen, else that plan's floor. Checked on the shipped profiles, frozen
    /// and trainable encoders, several bodies and sizes, with and without a memory
    /// limit.
    #[test]
    fn transpose_records_the_verdicts_its_placements_would_give() {
        let profiles = [
            include_str!("../../../profiles/encoder-heavy.toml"),
            include_str!("../../../profiles/qwen2vl-7b.toml"),
            include_str!("../../../profiles/eval-b-qwen2vl72b-frozen.toml"),
            include_str!("../../../profiles/eval-c-omni.toml"),
        ];
        let mut checked = 0;
        let mut others = 0;
        for text in profiles {
            let profile = Profile::from_toml_str(text).expect("shipped profile parses");
            let encoder = &profile.encoders[0].name;
            for body in ["1f1b", "zbv", "interleaved(v = 2)"] {
                for (ranks, mbs) in [(4, 8), (8, 16), (4, 3)] {
                    let record = PlaceRecord::new(lowering_floor);
                    let req = Request {
                        place_record: Some(&record),
                        ..Request::new(&profile, ranks, mbs)
                    };
                    let expr = format!("transpose({encoder}, {body})");
                    let Some(plan) = eval(&req, &parse_str(&expr).unwrap(), &mut Vec::new()) else {
                        continue;
                    };
                    for (name, place) in [("prefix", Place::Prefix), ("late", Place::Late)] {
                        let verdict = record.verdict(place).expect("one call recorded");
                        let alt = format!("transpose({encoder}, {body}, place = {name})");
                        let alt = eval(
                            &Request::new(&profile, ranks, mbs),
                            &parse_str(&alt).unwrap(),
                            &mut Vec::new(),
                        )
                        .expect("the placement evaluates where the choice did");
                        if alt == plan {
                            assert_eq!(verdict, Verdict::Chosen, "{expr} {name}");
                        } else {
                            assert_eq!(
                                verdict,
                                Verdict::Other(lowering_floor(&alt)),
                                "{expr} {name}"
                            );
                            others += 1;
                        }
                        checked += 1;
                    }
                }
            }
        }
        assert!(
            checked > 40 && others > 5,
            "{checked} verdicts checked, {others} other"
        );
    }

    /// [`lowering_floor`] is a theorem about every derivation: no program derived
    /// from a plan finishes before it. Checked on the shipped profiles, bodies and
    /// `transpose` under each placement, both semantics, 4 and 8 ranks.
    #[test]
    fn no_derived_program_beats_its_plans_floor() {
        let profiles = [
            include_str!("../../../profiles/encoder-heavy.toml"),
            include_str!("../../../profiles/qwen2vl-7b.toml"),
            include_str!("../../../profiles/eval-b-qwen2vl72b-frozen.toml"),
            include_str!("../../../profiles/eval-c-omni.toml"),
        ];
        let exprs = [
            "1f1b",
            "zbv",
            "zbh1",
            "interleaved(v = 2)",
            "zb2p(costs = unit)",
            "transpose(vision, 1f1b, place = prefix)",
            "transpose(vision, 1f1b, place = late)",
            "transpose(vision, zbv, place = idle)",
            "fill(vision, 1f1b)",
        ];
        let mut checked = 0;
        for text in profiles {
            let profile = Profile::from_toml_str(text).expect("shipped profile parses");
            for (ranks, mbs) in [(4, 8), (8, 16)] {
                for mode in [Mode::Rendezvous, Mode::Eager] {
                    let req = Request {
                        mode,
                        ..Request::new(&profile, ranks, mbs)
                    };
                    for e in exprs {
                        let expr = parse_str(e).expect("parses");
                        let Some(plan) = eval(&req, &expr, &mut Vec::new()) else {
                            continue;
                        };
                        let Ok(d) = finish_checked(&req, &plan, e, expr.span, None) else {
                            continue;
                        };
                        let floor = lowering_floor(&plan).expect("the plan resolves");
                        let span = d.report.makespan;
                        assert!(
                            !less(span, floor),
                            "{e} at {ranks} x {mbs} ({mode:?}): derived {span} below its \
                             floor {floor}"
                        );
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 100, "only {checked} derivations checked");
    }
}
