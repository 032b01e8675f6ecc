//! One function per subcommand.

use crate::failure::{Collect, Failure, Problem, MAX_SHOWN};
use crate::source::{
    check_link_args, conditions, derive_one, derive_schedule, file_label, link_override, load,
    load_inputs, load_keeping_report, load_profile, read_program, Loaded,
};
use crate::table::{num, pct, Table, PEAK_MEMORY_MEANS};
use crate::{ScheduleArgs, SourceArgs};
use mpipe_core::program::ActionRef;
use mpipe_core::render::svg::{gantt_svg, SvgOptions};
use mpipe_core::render::trace::{write_chrome_trace, TraceOptions};
use mpipe_core::simulate::{simulate as run, Mode, SimOptions, SimReport};
use mpipe_core::verify::verify_mode;
use mpipe_core::waits::{waits, Waits};
use serde_json::{json, Value};
use std::path::Path;

fn write(path: Option<&Path>, text: &str) -> Result<(), Failure> {
    match path {
        Some(p) => std::fs::write(p, text).map_err(|e| {
            let message = format!("cannot write {}: {e}", p.display());
            Failure {
                code: 2,
                problems: vec![Problem {
                    json: vec![
                        json!({"kind": "io", "file": p.display().to_string(), "message": message}),
                    ],
                    text: message,
                }],
            }
        })?,
        None => outln!("{text}"),
    }
    Ok(())
}

fn pretty(v: &Value) -> String {
    serde_json::to_string_pretty(v).unwrap_or_default()
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// The program of `label` cannot be executed (a deadlock, most often).
fn sim_failure(label: &str, e: impl std::fmt::Display) -> Failure {
    let message = format!("`{label}` does not run to completion:\n{e}");
    Failure {
        code: 1,
        problems: vec![Problem {
            json: vec![json!({"kind": "simulation", "schedule": label, "message": e.to_string()})],
            text: message,
        }],
    }
}

/// The largest peak memory and the rank it is on.
fn max_peak(peaks: &[f64]) -> Option<(usize, f64)> {
    peaks
        .iter()
        .copied()
        .enumerate()
        .fold(None, |best, (r, m)| match best {
            Some((_, b)) if b >= m => best,
            _ => Some((r, m)),
        })
}

/// Per rank: peak activations plus resident parameters (what "peak memory" means in
/// every table, [`PEAK_MEMORY_MEANS`]).
fn with_params(activations: &[f64], params: &[f64]) -> Vec<f64> {
    activations
        .iter()
        .enumerate()
        .map(|(r, a)| a + params.get(r).copied().unwrap_or(0.0))
        .collect()
}

fn peak_text(peaks: &[f64]) -> String {
    match max_peak(peaks) {
        Some((r, m)) => format!("{} (rank {r})", num(m)),
        None => "-".into(),
    }
}

pub(crate) fn derive(s: &ScheduleArgs, output: Option<&Path>) -> Result<u8, Failure> {
    let loaded = derive_schedule(s)?;
    write(output, &loaded.program.to_json())?;
    if let Some(p) = output {
        errln!(
            "wrote {} ({} ranks, {} micro-batches)",
            p.display(),
            loaded.program.ranks,
            loaded.program.microbatches
        );
    }
    Ok(0)
}

/// Verify a program file. With `--json`, prints exactly the keys `valid`, `errors`,
/// `makespan`, `bubble` and `peak_memory`, even when the file cannot be read (then
/// `valid` is false, the figures null, and the exit status 2).
pub(crate) fn check(file: &str, mode: Mode, as_json: bool) -> Result<u8, Failure> {
    let label = file_label(file);
    let program = match read_program(file) {
        Ok(p) => p,
        Err(f) if as_json => {
            let errors: Vec<Value> = f
                .json_errors()
                .iter()
                .map(|e| e.get("message").cloned().unwrap_or(Value::Null))
                .collect();
            outln!(
                "{}",
                pretty(&json!({
                    "valid": false,
                    "errors": errors,
                    "makespan": null,
                    "bubble": null,
                    "peak_memory": null,
                }))
            );
            errln!("{}", f.terminal());
            return Ok(f.code);
        }
        Err(f) => return Err(f),
    };
    let violations = verify_mode(&program, mode);
    let report = run(&program, &SimOptions { mode, comm: None }).ok();
    let valid = violations.is_empty();
    if as_json {
        let out = json!({
            "valid": valid,
            "errors": violations.iter().map(|v| v.to_string()).collect::<Vec<_>>(),
            "makespan": report.as_ref().map(|r| r.makespan),
            "bubble": report.as_ref().map(|r| r.bubble),
            "peak_memory": report.as_ref().map(|r| r.peak_memory.clone()),
        });
        outln!("{}", pretty(&out));
    } else if valid {
        let actions: usize = program.programs.iter().map(Vec::len).sum();
        outln!(
            "{label}: valid ({}, {}, {})",
            plural(program.ranks, "rank", "ranks"),
            plural(program.microbatches, "micro-batch", "micro-batches"),
            plural(actions, "action", "actions"),
        );
        if let Some(r) = &report {
            outln!(
                "makespan {}, bubble {}, peak memory {}; {}",
                num(r.makespan),
                pct(r.bubble),
                peak_text(&with_params(
                    &r.peak_memory,
                    &mpipe_core::derive::resident_params(&program)
                )),
                conditions(mode, None)
            );
        }
    } else {
        errln!(
            "{label}: invalid, {} of {}'s validity rules (termination checked under {} \
             semantics):",
            plural(violations.len(), "violation", "violations"),
            mpipe_core::verify::SPEC,
            mode.name()
        );
        for v in &violations {
            errln!("  {v}");
        }
    }
    Ok(if valid { 0 } else { 1 })
}

fn report_json(l: &Loaded, r: &SimReport, mode: Mode) -> Value {
    json!({
        "schedule": l.label,
        // The expression derived (for `auto`, the one it chose), if any.
        "expr": l.program.source.as_ref().map(|s| s.expr.as_str()),
        "ranks": l.program.ranks,
        "microbatches": l.program.microbatches,
        "mode": mode.name(),
        "makespan": r.makespan,
        "bubble": r.bubble,
        "peak_memory": r.peak_memory,
        "params": l.params,
        "compute": r.compute,
        // Per rank: idle before its first stage forward, between, after its last
        // stage forward.
        "idle": r.timeline.idle(&l.program, r.makespan),
        // Per rank: the same idle time by cause (waiting for each partner, in
        // transfers, done before the step ended).
        "waits": waits(&l.program, &r.timeline, r.makespan),
        "lower_bound": l.bound.value(),
    })
}

/// A program file that breaks the validity rules still simulates; say so.
fn warn_if_invalid(l: &Loaded, mode: Mode) {
    if !l.from_file {
        return;
    }
    let n = verify_mode(&l.program, mode).len();
    if n > 0 {
        errln!(
            "warning: {} breaks the validity rules ({}); the figures below may mean little \
             (run `mpipe check` for the list)",
            l.label,
            plural(n, "violation", "violations")
        );
    }
}

pub(crate) fn simulate(s: &SourceArgs, mode: Mode, as_json: bool) -> Result<u8, Failure> {
    let loaded = load(s, mode)?;
    let r =
        run(&loaded.program, &loaded.options(mode)).map_err(|e| sim_failure(&loaded.label, e))?;
    warn_if_invalid(&loaded, mode);
    let bound = loaded.bound.value();
    if as_json {
        outln!("{}", pretty(&report_json(&loaded, &r, mode)));
        return Ok(0);
    }
    let p = &loaded.program;
    outln!(
        "{}: {}, {}; {}",
        loaded.label,
        plural(p.ranks, "rank", "ranks"),
        plural(p.microbatches, "micro-batch", "micro-batches"),
        loaded.conditions(mode)
    );
    let u = &loaded.units;
    let mut t = Table::with_header(vec![
        "rank".into(),
        "actions".into(),
        u.time("compute"),
        "idle".into(),
        "warm-up".into(),
        "steady".into(),
        "cool-down".into(),
        "busy".into(),
        u.memory("activations"),
        "params".into(),
        "peak memory".into(),
    ]);
    let idle = r.timeline.idle(p, r.makespan);
    for (rank, list) in p.programs.iter().enumerate() {
        let c = r.compute.get(rank).copied().unwrap_or(0.0);
        let phases = idle.get(rank).copied().unwrap_or_default();
        t.row(vec![
            rank.to_string(),
            list.len().to_string(),
            num(c),
            num(r.makespan - c),
            num(phases.warm_up),
            num(phases.steady),
            num(phases.cool_down),
            pct(if r.makespan > 0.0 {
                c / r.makespan
            } else {
                0.0
            }),
            num(r.peak_memory.get(rank).copied().unwrap_or(0.0)),
            num(loaded.params.get(rank).copied().unwrap_or(0.0)),
            num(r.peak_memory.get(rank).copied().unwrap_or(0.0)
                + loaded.params.get(rank).copied().unwrap_or(0.0)),
        ]);
    }
    out!("{}", t.render());
    // Under rendezvous with a link, the ramp bound includes the time transfers
    // between stages hold the ranks; say how much.
    let held = match loaded.bound.transfers {
        t if t > 0.0 => format!(" with transfers {}", num(t)),
        _ => String::new(),
    };
    outln!(
        "makespan {}   bubble {}   lower bound {} (work/ranks {}, chain {}, rank {}, ramp {}{held})   makespan/bound {:.3}",
        num(r.makespan),
        pct(r.bubble),
        num(bound),
        num(loaded.bound.work),
        num(loaded.bound.chain),
        num(loaded.bound.rank),
        num(loaded.bound.ramp),
        if bound > 0.0 { r.makespan / bound } else { 1.0 },
    );
    let limit = loaded
        .limit
        .map(|l| format!("; memory.limit {} applies to it", num(l)))
        .unwrap_or_default();
    outln!(
        "idle: split into warm-up (before the rank's first stage forward), steady and cool-down (after its last stage forward)"
    );
    outln!(
        "activations: held at the rank's peak; params: resident on the rank; peak memory: their sum{limit}"
    );
    let waits = waits(p, &r.timeline, r.makespan);
    if waits.iter().any(|w| !w.by_peer.is_empty()) {
        outln!("");
        let mut t = Table::new(&["rank", "waiting", "for", "transfers", "done early"]);
        for (rank, w) in waits.iter().enumerate() {
            t.row(vec![
                rank.to_string(),
                num(w.waiting()),
                waited_for(w),
                num(w.transfer),
                num(w.done_early),
            ]);
        }
        out!("{}", t.render());
        outln!(
            "waiting: blocked in a transfer or collective until its last partner arrived, by partner (largest first); transfers: once all were there; done early: after the rank's last action"
        );
    }
    Ok(0)
}

/// The partners a rank waited for, largest first: `6: 132.3, 4: 69.8`, the first
/// three and how many more.
fn waited_for(w: &Waits) -> String {
    const SHOWN: usize = 3;
    let all = w.largest_first();
    let mut text: Vec<String> = all
        .iter()
        .take(SHOWN)
        .map(|(peer, t)| format!("{peer}: {}", num(*t)))
        .collect();
    if all.len() > SHOWN {
        text.push(format!("+{} more", all.len() - SHOWN));
    }
    if text.is_empty() {
        "-".into()
    } else {
        text.join(", ")
    }
}

/// One compared schedule: its program and figures, or why it has none.
type Outcome = Result<(Loaded, SimReport), Failure>;

pub(crate) fn compare(
    model: &Path,
    ranks: usize,
    mbs: usize,
    exprs: &[String],
    mode: Mode,
    as_json: bool,
) -> Result<u8, Failure> {
    let all: Vec<&str> = exprs.iter().map(String::as_str).collect();
    let profile = load_inputs(model, ranks, mbs, &all)?;
    let units = crate::table::Units::of(&profile);
    // Every expression in order: its figures, or why it failed.
    let mut results: Vec<(&str, Outcome)> = Vec::new();
    for e in exprs {
        let r = derive_one(&profile, ranks, mbs, e, mode).and_then(|l| {
            run(&l.program, &l.options(mode))
                .map(|r| (l, r))
                .map_err(|x| sim_failure(e, x))
        });
        results.push((e, r));
    }
    let baseline = results
        .iter()
        .find_map(|(e, r)| r.as_ref().ok().map(|(_, rep)| (*e, rep.makespan)));
    let failed = results.iter().filter(|(_, r)| r.is_err()).count();
    let comm = results
        .iter()
        .find_map(|(_, r)| r.as_ref().ok().map(|(l, _)| l.comm))
        .flatten();
    if as_json {
        let mut schedules = Vec::new();
        let mut errors = Vec::new();
        for (e, r) in &results {
            match r {
                Ok((l, rep)) => {
                    let mut v = report_json(l, rep, mode);
                    v["speedup"] = json!(baseline.map(|(_, b)| b / rep.makespan));
                    schedules.push(v);
                }
                Err(f) => {
                    for mut x in f.json_errors() {
                        x["schedule"] = json!(e);
                        errors.push(x);
                    }
                }
            }
        }
        outln!(
            "{}",
            pretty(&json!({
                "model": model.display().to_string(),
                "ranks": ranks,
                "microbatches": mbs,
                "mode": mode.name(),
                "baseline": baseline.map(|(e, _)| e),
                "schedules": schedules,
                "errors": errors,
            }))
        );
    } else {
        let base_note = match baseline {
            Some((e, _)) if e == exprs[0] => String::new(),
            Some((e, _)) => {
                format!("\nspeedup over `{e}` (the first schedule that derived)")
            }
            None => String::new(),
        };
        outln!(
            "{}: {}, {}; {}{base_note}",
            model.display(),
            plural(ranks, "rank", "ranks"),
            plural(mbs, "micro-batch", "micro-batches"),
            conditions(mode, comm)
        );
        let mut header = vec![
            "schedule".to_string(),
            units.time("makespan"),
            "speedup".into(),
            "bubble".into(),
            units.memory("peak memory"),
            units.time("bound"),
            "vs bound".into(),
        ];
        if failed > 0 {
            header.push("note".into());
        }
        let mut t = Table::with_header(header);
        t.left(7);
        for (e, r) in &results {
            match r {
                Ok((l, rep)) => {
                    let bound = l.bound.value();
                    t.row(vec![
                        l.label.clone(),
                        num(rep.makespan),
                        baseline.map_or("-".into(), |(_, b)| format!("{:.2}x", b / rep.makespan)),
                        pct(rep.bubble),
                        num(with_params(&rep.peak_memory, &l.params)
                            .into_iter()
                            .fold(0.0, f64::max)),
                        num(bound),
                        format!(
                            "{:.3}",
                            if bound > 0.0 {
                                rep.makespan / bound
                            } else {
                                1.0
                            }
                        ),
                    ]);
                }
                Err(f) => {
                    let mut row = vec![e.to_string(), "failed".into()];
                    row.extend(vec!["-".to_string(); 5]);
                    row.push(failure_note(f));
                    t.row(row);
                }
            }
        }
        out!("{}", t.render());
        outln!("{PEAK_MEMORY_MEANS}; bound: lower bound on the makespan");
        if failed > 0 {
            let mut blocks = Vec::new();
            for (e, r) in &results {
                if let Err(f) = r {
                    let n = f.problems.len();
                    let mut block = format!(
                        "error in `{e}`{}:",
                        if n > 1 {
                            format!(" ({n} errors)")
                        } else {
                            String::new()
                        }
                    );
                    for (i, p) in f.problems.iter().take(MAX_SHOWN).enumerate() {
                        if i > 0 {
                            block.push('\n');
                        }
                        for line in p.text.lines() {
                            block.push_str("\n  ");
                            block.push_str(line);
                        }
                    }
                    if n > MAX_SHOWN {
                        block.push_str(&format!("\n\n  ... and {} more", n - MAX_SHOWN));
                    }
                    blocks.push(block);
                }
            }
            blocks.push(format!(
                "{} of {} failed",
                plural(failed, "schedule", "schedules"),
                exprs.len()
            ));
            errln!("\n{}", blocks.join("\n\n"));
        }
    }
    let code = results
        .iter()
        .filter_map(|(_, r)| r.as_ref().err().map(|f| f.code))
        .max()
        .unwrap_or(0);
    Ok(code)
}

/// A few words on why a schedule failed, for the comparison table.
fn failure_note(f: &Failure) -> String {
    let kind = f
        .problems
        .first()
        .and_then(|p| p.json.first())
        .and_then(|j| j.get("kind"))
        .and_then(Value::as_str)
        .unwrap_or("error");
    let what = match kind {
        "memory" => "over memory.limit".to_string(),
        "simulation" => "does not run".to_string(),
        other => other.replace('_', " "),
    };
    let more = f.json_errors().len().saturating_sub(1);
    if more > 0 {
        format!("{what} (+{more} more, see below)")
    } else {
        format!("{what} (see below)")
    }
}

pub(crate) fn trace(
    s: &SourceArgs,
    mode: Mode,
    output: &Path,
    embed_program: bool,
) -> Result<u8, Failure> {
    let mut loaded = load_keeping_report(s, mode)?;
    // A derived program's report is its derivation's (not simulated again).
    let r = match loaded.report.take() {
        Some(r) => r,
        None => run(&loaded.program, &loaded.options(mode))
            .map_err(|e| sim_failure(&loaded.label, e))?,
    };
    warn_if_invalid(&loaded, mode);
    let opts = TraceOptions {
        name: Some(format!(
            "mpipe: {} ({})",
            loaded.label,
            loaded.conditions(mode)
        )),
        embed_program,
        ..TraceOptions::default()
    };
    // Streamed event by event: memory bounded by the program, not by the trace.
    let written = std::fs::File::create(output).and_then(|f| {
        let mut w = std::io::BufWriter::new(f);
        write_chrome_trace(&loaded.program, &r.timeline, &opts, &mut w)?;
        std::io::Write::flush(&mut w)
    });
    if let Err(e) = written {
        let message = format!("cannot write {}: {e}", output.display());
        return Err(Failure {
            code: 2,
            problems: vec![Problem {
                json: vec![
                    json!({"kind": "io", "file": output.display().to_string(), "message": message}),
                ],
                text: message,
            }],
        });
    }
    errln!(
        "wrote {}: {} tracks, makespan {}; {} (open it in ui.perfetto.dev or chrome://tracing)",
        output.display(),
        loaded.program.ranks,
        num(r.makespan),
        loaded.conditions(mode)
    );
    Ok(0)
}

pub(crate) fn svg(
    s: &SourceArgs,
    mode: Mode,
    output: &Path,
    width: f64,
    memory: bool,
) -> Result<u8, Failure> {
    // Wider than any screen or print, the file only grows (about 2 bytes a pixel).
    const MAX_WIDTH: f64 = 100_000.0;
    if !(width > 0.0 && width <= MAX_WIDTH) {
        return Err(Failure::input(
            "usage",
            format!("--width must be a number of pixels from 1 to {MAX_WIDTH}, got {width}"),
        ));
    }
    let loaded = load(s, mode)?;
    let r =
        run(&loaded.program, &loaded.options(mode)).map_err(|e| sim_failure(&loaded.label, e))?;
    warn_if_invalid(&loaded, mode);
    let p = &loaded.program;
    let opts = SvgOptions {
        width,
        memory,
        title: Some(format!(
            "{}: {} x {}",
            loaded.label,
            plural(p.ranks, "rank", "ranks"),
            plural(p.microbatches, "micro-batch", "micro-batches")
        )),
        subtitle: Some(format!(
            "makespan {}, bubble {}, lower bound {}, peak memory {}; {}",
            num(r.makespan),
            pct(r.bubble),
            num(loaded.bound.value()),
            peak_text(&r.peak_memory),
            loaded.conditions(mode)
        )),
        ..SvgOptions::default()
    };
    write(Some(output), &gantt_svg(p, &r.timeline, &opts))?;
    errln!(
        "wrote {}: makespan {}, bubble {}; {}",
        output.display(),
        num(r.makespan),
        pct(r.bubble),
        loaded.conditions(mode)
    );
    Ok(0)
}

/// `mpipe refine FILE`: derive the program's transfers again from its compute order
/// (see `mpipe_core::relower`), write the result, and say on standard error what it
/// gained. The link and the memory limit come from `--model`, if given, with
/// `--latency` / `--bandwidth` (`link`) overriding the link. With `order` > 0 the
/// compute order is searched too, with that many simulations at most.
pub(crate) fn refine(
    file: &str,
    model: Option<&Path>,
    link: (Option<f64>, Option<f64>),
    mode: Mode,
    order: usize,
    output: Option<&Path>,
) -> Result<u8, Failure> {
    let (latency, bandwidth) = link;
    let label = file_label(file);
    let mut all = Collect::default();
    let program = all.take(read_program(file));
    let profile = model.and_then(|m| all.take(load_profile(m)));
    let base = profile.as_ref().and_then(|p| p.comm_model());
    all.take(check_link_args(latency, bandwidth));
    let comm = link_override(base, latency, bandwidth);
    all.finish()?;
    let Some(program) = program else {
        return Err(Failure::input("internal", "no program was loaded"));
    };
    let limit = profile
        .as_ref()
        .and_then(|p| p.memory.as_ref().map(|m| m.limit));
    let opts = SimOptions { mode, comm };
    // A program of compute tasks alone (a rank's order written by hand, or from a
    // paper's figure) is a normal input: every transfer is placed, none kept.
    let compute_only = program.ranks > 1
        && program
            .programs
            .iter()
            .flatten()
            .all(|a| matches!(a.view(), ActionRef::Compute(_)));
    let r = mpipe_core::relower::relower_ordered(&program, &opts, limit, order)
        .map_err(|e| Failure::plain(1, "refine", format!("cannot refine {label}: {e}")))?;
    write(output, &r.program.to_json())?;
    let under = conditions(mode, comm);
    let after = num(r.report.makespan);
    let what = match (r.before, r.kept_input, &r.input_problem) {
        (Some(b), true, _) => format!(
            "already as fast as mpipe's placement (makespan {}); written unchanged",
            num(b)
        ),
        (Some(b), false, _) => format!(
            "makespan {} -> {after} ({} faster)",
            num(b),
            pct(1.0 - r.report.makespan / b)
        ),
        (None, _, _) if compute_only => format!(
            "compute only (no transfers in the input); with its transfers placed, makespan {after}"
        ),
        (None, _, problem) => format!(
            "the input cannot run as it is ({}; `mpipe check` says where); with its transfers derived again, makespan {after}",
            problem.as_deref().unwrap_or("invalid")
        ),
    };
    let place = match output {
        Some(p) => format!(", written to {}", p.display()),
        None => String::new(),
    };
    errln!("refined {label}: {what}; {under}{place}");
    if !r.kept_input {
        if order > 0 {
            errln!(
                "kept: each rank's compute tasks (their order searched, with up to {order} simulations); placed again: every transfer"
            );
        } else {
            errln!(
                "kept: each rank's compute, forwards and backwards in the same order (weight gradients may move); placed again: every transfer"
            );
        }
    }
    Ok(0)
}
