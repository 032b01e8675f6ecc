//! One function per subcommand.

use crate::source::{derive_one, derive_schedule, load, load_profile, read_program};
use crate::table::{num, pct, Table};
use crate::{Failure, ScheduleArgs, SourceArgs};
use anyhow::Context;
use mpipe_core::render::svg::{gantt_svg, SvgOptions};
use mpipe_core::render::trace::{chrome_trace, TraceOptions};
use mpipe_core::simulate::{simulate as run, Mode, SimOptions, SimReport};
use mpipe_core::verify::verify_mode;
use serde_json::json;
use std::path::Path;

fn write(path: Option<&Path>, text: &str) -> Result<(), Failure> {
    match path {
        Some(p) => {
            std::fs::write(p, text).with_context(|| format!("cannot write {}", p.display()))?
        }
        None => println!("{text}"),
    }
    Ok(())
}

fn sim_failure(label: &str, e: impl std::fmt::Display) -> Failure {
    Failure {
        code: 1,
        message: format!("error: {label} does not run to completion:\n{e}"),
    }
}

pub fn derive(s: &ScheduleArgs, output: Option<&Path>) -> Result<u8, Failure> {
    let loaded = derive_schedule(s)?;
    write(output, &loaded.program.to_json())?;
    Ok(0)
}

pub fn check(file: &str, mode: Mode, as_json: bool) -> Result<u8, Failure> {
    let program = read_program(file)?;
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
        println!("{}", serde_json::to_string_pretty(&out).unwrap_or_default());
    } else if valid {
        let r = report.as_ref();
        println!(
            "{file}: valid ({} ranks, {} micro-batches); makespan {}, bubble {}",
            program.ranks,
            program.microbatches,
            r.map_or("-".into(), |r| num(r.makespan)),
            r.map_or("-".into(), |r| pct(r.bubble)),
        );
    } else {
        eprintln!("{file}: invalid, {} violation(s):", violations.len());
        for v in &violations {
            eprintln!("  {v}");
        }
    }
    Ok(if valid { 0 } else { 1 })
}

fn report_json(label: &str, r: &SimReport, bound: f64) -> serde_json::Value {
    json!({
        "schedule": label,
        "makespan": r.makespan,
        "bubble": r.bubble,
        "peak_memory": r.peak_memory,
        "compute": r.compute,
        "lower_bound": bound,
    })
}

pub fn simulate(s: &SourceArgs, mode: Mode, as_json: bool) -> Result<u8, Failure> {
    let loaded = load(s)?;
    let r =
        run(&loaded.program, &loaded.options(mode)).map_err(|e| sim_failure(&loaded.label, e))?;
    let bound = loaded.bound.value();
    if as_json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report_json(&loaded.label, &r, bound))
                .unwrap_or_default()
        );
        return Ok(0);
    }
    let p = &loaded.program;
    println!(
        "{}: {} ranks, {} micro-batches, {:?} semantics",
        loaded.label, p.ranks, p.microbatches, mode
    );
    let mut t = Table::new(&["rank", "actions", "compute", "idle", "busy", "peak memory"]);
    for (rank, list) in p.programs.iter().enumerate() {
        let c = r.compute.get(rank).copied().unwrap_or(0.0);
        t.row(vec![
            rank.to_string(),
            list.len().to_string(),
            num(c),
            num(r.makespan - c),
            pct(if r.makespan > 0.0 {
                c / r.makespan
            } else {
                0.0
            }),
            num(r.peak_memory.get(rank).copied().unwrap_or(0.0)),
        ]);
    }
    print!("{}", t.render());
    println!(
        "makespan {}   bubble {}   lower bound {} (work/ranks {}, chain {})   makespan/bound {:.3}",
        num(r.makespan),
        pct(r.bubble),
        num(bound),
        num(loaded.bound.work),
        num(loaded.bound.chain),
        if bound > 0.0 { r.makespan / bound } else { 1.0 },
    );
    Ok(0)
}

pub fn compare(
    model: &Path,
    ranks: usize,
    mbs: usize,
    exprs: &[String],
    mode: Mode,
    as_json: bool,
) -> Result<u8, Failure> {
    let profile = load_profile(model)?;
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for e in exprs {
        match derive_one(&profile, ranks, mbs, e) {
            Ok(l) => match run(&l.program, &l.options(mode)) {
                Ok(r) => rows.push((l, r)),
                Err(x) => failures.push(sim_failure(e, x).message),
            },
            Err(f) => failures.push(f.message),
        }
    }
    let base = rows.first().map(|(_, r)| r.makespan);
    if as_json {
        let out: Vec<_> = rows
            .iter()
            .map(|(l, r)| {
                let mut v = report_json(&l.label, r, l.bound.value());
                v["speedup"] = json!(base.map(|b| b / r.makespan));
                v
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"ranks": ranks, "microbatches": mbs, "schedules": out, "errors": failures})
            )
            .unwrap_or_default()
        );
    } else {
        println!(
            "{}: {ranks} ranks, {mbs} micro-batches, {mode:?} semantics",
            model.display()
        );
        let mut t = Table::new(&[
            "schedule",
            "makespan",
            "speedup",
            "bubble",
            "max peak mem",
            "bound",
            "vs bound",
        ]);
        for (l, r) in &rows {
            let bound = l.bound.value();
            t.row(vec![
                l.label.clone(),
                num(r.makespan),
                base.map_or("-".into(), |b| format!("{:.2}x", b / r.makespan)),
                pct(r.bubble),
                num(r.peak_memory.iter().copied().fold(0.0, f64::max)),
                num(bound),
                format!("{:.3}", if bound > 0.0 { r.makespan / bound } else { 1.0 }),
            ]);
        }
        print!("{}", t.render());
        for f in &failures {
            eprintln!("{f}");
        }
    }
    Ok(if failures.is_empty() { 0 } else { 2 })
}

pub fn trace(s: &SourceArgs, mode: Mode, output: &Path) -> Result<u8, Failure> {
    let loaded = load(s)?;
    let r =
        run(&loaded.program, &loaded.options(mode)).map_err(|e| sim_failure(&loaded.label, e))?;
    let opts = TraceOptions {
        name: Some(format!("mpipe: {}", loaded.label)),
        ..TraceOptions::default()
    };
    write(
        Some(output),
        &chrome_trace(&loaded.program, &r.timeline, &opts),
    )?;
    eprintln!(
        "wrote {} (open it in ui.perfetto.dev or chrome://tracing)",
        output.display()
    );
    Ok(0)
}

pub fn svg(s: &SourceArgs, mode: Mode, output: &Path, width: f64) -> Result<u8, Failure> {
    let loaded = load(s)?;
    let r =
        run(&loaded.program, &loaded.options(mode)).map_err(|e| sim_failure(&loaded.label, e))?;
    let p = &loaded.program;
    let opts = SvgOptions {
        width,
        title: Some(format!(
            "{}: {} ranks x {} micro-batches",
            loaded.label, p.ranks, p.microbatches
        )),
        subtitle: Some(format!(
            "makespan {}, bubble {}, lower bound {}, peak memory {}",
            num(r.makespan),
            pct(r.bubble),
            num(loaded.bound.value()),
            num(r.peak_memory.iter().copied().fold(0.0, f64::max))
        )),
        ..SvgOptions::default()
    };
    write(Some(output), &gantt_svg(p, &r.timeline, &opts))?;
    eprintln!("wrote {}", output.display());
    Ok(0)
}
