//! `mpipe evaluate`: for each profile, every peer schedule, the best mpipe schedule
//! (`auto`), the lower bound and the speedups; optionally the Gantt charts of the
//! baseline and the winner.

use crate::failure::Failure;
use crate::source::{conditions, load_profile};
use crate::table::{num, pct, Table, Units, PEAK_MEMORY_MEANS};
use mpipe_core::evaluation::{evaluate as run_evaluation, intended_size, Evaluation, Row};
use mpipe_core::render::svg::{gantt_svg, SvgOptions};
use mpipe_core::simulate::Mode;
use std::path::{Path, PathBuf};

/// What to evaluate and how to print it.
pub(crate) struct Options<'a> {
    pub profiles: &'a [PathBuf],
    pub size: Option<(usize, usize)>,
    pub svg_dir: Option<&'a Path>,
    pub markdown: bool,
    /// The semantics programs are derived for and timed under.
    pub mode: Mode,
}

/// One evaluated profile.
struct Done {
    name: String,
    eval: Evaluation,
}

pub(crate) fn evaluate(o: &Options) -> Result<u8, Failure> {
    let mut done = Vec::new();
    for path in o.profiles {
        let profile = load_profile(path)?;
        let text = std::fs::read_to_string(path).unwrap_or_default();
        let (ranks, mbs) = match o.size.or_else(|| intended_size(&text)) {
            Some(s) => s,
            None => {
                return Err(Failure::input(
                    "usage",
                    format!(
                    "{} does not say its size (a line `# evaluate: ranks = R, microbatches = M`); \
                         give --ranks and --microbatches",
                    path.display()
                ),
                ))
            }
        };
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("profile")
            .to_string();
        errln!(
            "evaluating {} on {ranks} ranks x {mbs} micro-batches ...",
            path.display()
        );
        let eval = run_evaluation(&profile, ranks, mbs, o.mode);
        let comm = profile.comm_model();
        let units = Units::of(&profile);
        print_profile(&name, &eval, &conditions(o.mode, comm), &units, o.markdown);
        if let Some(dir) = o.svg_dir {
            charts(dir, &name, &eval)?;
        }
        done.push(Done { name, eval });
    }
    print_summary(&done, o.markdown, o.mode);
    // The evaluation is for `auto`'s row: without it, say why and fail.
    let mut failed = 0u8;
    for d in &done {
        if let Err(es) = &d.eval.best.outcome {
            let first = es.first().map_or("no schedule derives".to_string(), |e| {
                mpipe_core::advice::for_written("auto", &e.message)
            });
            errln!(
                "error: {}: `auto` gave no schedule on {} ranks x {} micro-batches: {first}",
                d.name,
                d.eval.ranks,
                d.eval.microbatches
            );
            failed = 1;
        }
    }
    Ok(failed)
}

fn ratio(a: Option<f64>, b: Option<f64>) -> String {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => format!("{:.3}", a / b),
        _ => "-".into(),
    }
}

fn speedup(base: Option<f64>, t: Option<f64>) -> String {
    match (base, t) {
        (Some(b), Some(t)) if t > 0.0 => format!("{:.2}x", b / t),
        _ => "-".into(),
    }
}

fn why(row: &Row) -> String {
    match &row.outcome {
        Ok(_) => String::new(),
        Err(es) => {
            let first = es.first().map(|e| e.message.as_str()).unwrap_or("failed");
            // The first clause is enough in a table.
            let short = first.split(';').next().unwrap_or(first);
            short.to_string()
        }
    }
}

fn print_profile(name: &str, e: &Evaluation, conditions: &str, units: &Units, markdown: bool) {
    let bound = e.bound.map(|b| b.value());
    let base = e.baseline();
    if markdown {
        outln!(
            "\n#### {name}: {} ranks x {} micro-batches ({conditions})\n",
            e.ranks,
            e.microbatches
        );
        outln!(
            "| schedule | {} | vs 1f1b | / bound | {} | note |",
            units.time("makespan"),
            units.memory("peak memory")
        );
        outln!("| --- | ---: | ---: | ---: | ---: | --- |");
    } else {
        outln!(
            "\n{name}: {} ranks x {} micro-batches; {conditions}; lower bound {}",
            e.ranks,
            e.microbatches,
            bound.map_or("-".into(), num)
        );
    }
    let mut t = Table::with_header(vec![
        "schedule".into(),
        units.time("makespan"),
        "vs 1f1b".into(),
        "/ bound".into(),
        units.memory("peak memory"),
        "note".into(),
    ]);
    t.left(5);
    let best_label = match &e.best.outcome {
        Ok(d) => format!("auto = {}", d.expr),
        Err(_) => "auto".into(),
    };
    for (label, row) in e
        .peers
        .iter()
        .map(|r| (r.expr.clone(), r))
        .chain(std::iter::once((best_label, &e.best)))
    {
        let cells = match &row.outcome {
            Ok(d) => vec![
                label,
                num(d.report.makespan),
                speedup(base, Some(d.report.makespan)),
                ratio(Some(d.report.makespan), bound),
                num(d.peak_with_params()),
                String::new(),
            ],
            Err(_) => vec![
                label,
                "-".into(),
                "-".into(),
                "-".into(),
                "-".into(),
                why(row),
            ],
        };
        if markdown {
            let mut c = cells;
            c[0] = format!("`{}`", c[0]);
            outln!("| {} |", c.join(" | "));
        } else {
            t.row(cells);
        }
    }
    if !markdown {
        out!("{}", t.render());
        outln!("{PEAK_MEMORY_MEANS}");
    }
}

fn print_summary(done: &[Done], markdown: bool, mode: Mode) {
    let header = [
        "profile",
        "size",
        "1f1b",
        "best peer",
        "mpipe (auto)",
        "lower bound",
        "auto / bound",
        "vs 1f1b",
        "vs best peer",
    ];
    let mut rows = Vec::new();
    for d in done {
        let e = &d.eval;
        let bound = e.bound.map(|b| b.value());
        let peer = e.best_peer();
        let best = e.best.makespan();
        let best_expr = e
            .best
            .outcome
            .as_ref()
            .map(|x| x.expr.clone())
            .unwrap_or_else(|_| "-".into());
        rows.push(vec![
            d.name.clone(),
            format!("{} x {}", e.ranks, e.microbatches),
            e.baseline().map_or("-".into(), num),
            peer.map_or("-".into(), |p| {
                format!("{} ({})", num(p.makespan().unwrap_or(0.0)), p.expr)
            }),
            best.map_or("-".into(), |b| format!("{} ({best_expr})", num(b))),
            bound.map_or("-".into(), num),
            ratio(best, bound),
            speedup(e.baseline(), best),
            speedup(peer.and_then(Row::makespan), best),
        ]);
    }
    if markdown {
        outln!("\n| {} |", header.join(" | "));
        outln!("| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |");
        for r in rows {
            outln!("| {} |", r.join(" | "));
        }
    } else {
        let mode = mode.name();
        outln!("\nsummary (simulated step time; {mode} semantics, each profile's link)");
        let mut t = Table::new(&header);
        t.left(3);
        t.left(4);
        for r in rows {
            t.row(r);
        }
        out!("{}", t.render());
    }
}

/// `DIR/NAME-1f1b.svg` and `DIR/NAME-best.svg`.
fn charts(dir: &Path, name: &str, e: &Evaluation) -> Result<(), Failure> {
    std::fs::create_dir_all(dir)
        .map_err(|x| Failure::plain(2, "io", format!("cannot create {}: {x}", dir.display())))?;
    let best_title = e
        .best
        .outcome
        .as_ref()
        .map(|d| format!("auto = {}", d.expr))
        .unwrap_or_default();
    let pairs = [
        (e.peers.first(), "1f1b".to_string(), "1f1b"),
        (Some(&e.best), best_title, "best"),
    ];
    for (row, title, file) in pairs {
        let Some(Ok(d)) = row.map(|r| &r.outcome) else {
            continue;
        };
        let opts = SvgOptions {
            width: 1400.0,
            title: Some(format!(
                "{name}: {title}, {} ranks x {} micro-batches",
                e.ranks, e.microbatches
            )),
            subtitle: Some(format!(
                "makespan {}, bubble {}, lower bound {}",
                num(d.report.makespan),
                pct(d.report.bubble),
                e.bound.map_or("-".into(), |b| num(b.value()))
            )),
            ..SvgOptions::default()
        };
        let path = dir.join(format!("{name}-{file}.svg"));
        let svg = gantt_svg(&d.program, &d.report.timeline, &opts);
        std::fs::write(&path, svg).map_err(|x| {
            Failure::plain(2, "io", format!("cannot write {}: {x}", path.display()))
        })?;
        errln!("wrote {}", path.display());
    }
    Ok(())
}
