//! `mpipe calibrate`: a run's measured costs, from its trace, against the program's.

use crate::failure::{Collect, Failure};
use crate::source::{file_label, load_profile, read_program};
use crate::table::{num, Table};
use clap::ValueEnum;
use mpipe_core::calibrate::{measure, Calibration, Family, Stat};
use mpipe_core::profile::{Profile, ProfileFormat};
use mpipe_core::program::Program;
use mpipe_core::render::trace::{embedded_program_from_reader, timeline_from_trace_reader};
use mpipe_core::simulate::{simulate, Mode, SimOptions};
use serde_json::json;
use std::path::Path;

/// The time unit the measured costs are given in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TimeUnit {
    /// Seconds.
    S,
    /// Milliseconds.
    Ms,
    /// Microseconds.
    Us,
}

impl TimeUnit {
    /// Microseconds per unit (the trace-event format's `ts` is in microseconds).
    fn us(self) -> f64 {
        match self {
            TimeUnit::S => 1e6,
            TimeUnit::Ms => 1e3,
            TimeUnit::Us => 1.0,
        }
    }

    fn name(self) -> &'static str {
        match self {
            TimeUnit::S => "s",
            TimeUnit::Ms => "ms",
            TimeUnit::Us => "us",
        }
    }
}

/// What `mpipe calibrate` was asked.
pub(crate) struct Options<'a> {
    pub trace: &'a str,
    pub program: Option<&'a str>,
    pub model: Option<&'a Path>,
    pub mode: Mode,
    pub unit: TimeUnit,
    pub units: bool,
    pub output: Option<&'a Path>,
    pub write_profile: Option<&'a Path>,
    pub json: bool,
}

/// Open the trace (read later as a stream: it may be far larger than what is kept).
fn open_trace(file: &str) -> Result<std::fs::File, Failure> {
    let fail = |e: String| Failure::input("io", format!("cannot read trace {file}: {e}"));
    let f = std::fs::File::open(file).map_err(|e| fail(e.to_string()))?;
    match f.metadata() {
        Ok(m) if m.is_dir() => Err(fail("it is a directory, not a file".into())),
        _ => Ok(f),
    }
}

fn write_file(path: &Path, text: &str, what: &str) -> Result<(), Failure> {
    std::fs::write(path, text).map_err(|e| {
        Failure::input(
            "io",
            format!("cannot write the {what} to {}: {e}", path.display()),
        )
    })
}

pub(crate) fn calibrate(o: &Options) -> Result<u8, Failure> {
    let mut all = Collect::default();
    let file = all.take(open_trace(o.trace));
    let profile = o.model.and_then(|m| all.take(load_profile(m)));
    let explicit = o.program.and_then(|p| all.take(read_program(p)));
    if o.write_profile.is_some() && o.model.is_none() {
        all.add(Failure::input(
            "usage",
            "--write-profile scales a profile: give the one the program was derived from with --model",
        ));
    }
    all.finish()?;
    let label = file_label(o.trace);
    let refused = |e| Failure::input("trace", format!("{label}: {e}"));
    // `all.finish()` passed, so the trace opened. The embedded program comes after
    // the events: read it in one pass over the file, the timings in a second, so
    // that neither holds the trace.
    let Some(mut file) = file else {
        return Err(Failure::input(
            "io",
            format!("cannot read trace {}", o.trace),
        ));
    };
    let program = match explicit {
        Some(p) => p,
        None => {
            let p = embedded_program_from_reader(&mut file).map_err(refused)?;
            std::io::Seek::rewind(&mut file)
                .map_err(|e| Failure::input("io", format!("cannot read trace {}: {e}", o.trace)))?;
            p
        }
    };
    let timeline = timeline_from_trace_reader(&program, file, o.unit.us()).map_err(refused)?;
    let prior = profile.as_ref().and_then(Profile::comm_model);
    let cal = measure(&program, &timeline, o.mode, prior)
        .map_err(|e| Failure::input("calibrate", format!("{label}: {e}")))?;
    // Measured: the run's timings are not needed again (the calibrated program's
    // simulation below would otherwise hold them too).
    drop(timeline);

    let calibrated = cal.apply(&program);
    let comm = cal.link.map(|l| l.model());
    let sim = simulate(&calibrated, &SimOptions { mode: o.mode, comm }).ok();
    let predicted = sim.as_ref().map(|r| r.makespan);
    // When each rank finished in the simulation, and its compute there.
    let sim_ends: Option<Vec<(f64, f64)>> = sim.as_ref().map(|r| {
        r.timeline
            .ranks
            .iter()
            .zip(&r.compute)
            .map(|(slots, &c)| (slots.iter().map(|s| s.end).fold(0.0, f64::max), c))
            .collect()
    });
    if let Some(path) = o.output {
        write_file(path, &calibrated.to_json(), "calibrated program")?;
    }
    let scaled = match (&profile, o.write_profile) {
        (Some(p), Some(path)) => {
            // Every encoder the run measured must be one of the profile's, or the
            // profile is not the one the program came from.
            let strangers: Vec<String> = cal
                .scales(&program)
                .into_keys()
                .filter_map(|f| match f {
                    Family::Encoder(name) if p.encoder(&name).is_none() => Some(name),
                    _ => None,
                })
                .collect();
            if !strangers.is_empty() {
                return Err(Failure::input(
                    "calibrate",
                    format!(
                        "the run has encoder units ({}) that the --model profile does not have; \
                         give the profile the program was derived from",
                        strangers.join(", ")
                    ),
                ));
            }
            let s = cal.scale_profile(&program, p);
            s.validate().map_err(|e| {
                Failure::plain(
                    1,
                    "calibrate",
                    format!("the scaled profile is not valid ({e}); is --model the profile the program was derived from?"),
                )
            })?;
            write_file(path, &profile_text(&s, path)?, "scaled profile")?;
            Some(s)
        }
        _ => None,
    };

    if o.json {
        let v = json!({
            "trace": label,
            "mode": o.mode.name(),
            "time_unit": o.unit.name(),
            "calibration": cal,
            "scales": cal.scales(&program).into_iter()
                .map(|(f, s)| json!({"family": f.to_string(), "F": s.f, "B": s.b, "W": s.w}))
                .collect::<Vec<_>>(),
            "predicted_step": predicted,
            "predicted_rank_ends": sim_ends.as_ref().map(|v| v.iter().map(|x| x.0).collect::<Vec<_>>()),
        });
        outln!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        print_text(o, &label, &program, &cal, predicted, sim_ends.as_deref());
    }
    if let (Some(path), Some(_)) = (o.write_profile, scaled) {
        errln!(
            "wrote the profile with measured costs to {}",
            path.display()
        );
    }
    if let Some(path) = o.output {
        errln!(
            "wrote the program with measured costs to {}",
            path.display()
        );
    }
    Ok(0)
}

fn profile_text(p: &Profile, path: &Path) -> Result<String, Failure> {
    let format = path
        .extension()
        .and_then(|e| e.to_str())
        .and_then(ProfileFormat::from_extension)
        .unwrap_or(ProfileFormat::Toml);
    match format {
        ProfileFormat::Json => Ok(serde_json::to_string_pretty(p).unwrap_or_default() + "\n"),
        ProfileFormat::Toml => toml::to_string(p).map_err(|e| {
            Failure::plain(
                1,
                "calibrate",
                format!("cannot write the profile as TOML: {e}"),
            )
        }),
    }
}

fn ratio(x: Option<f64>) -> String {
    x.map_or("-".into(), |r| format!("{r:.3}"))
}

fn stat(s: Option<Stat>) -> String {
    s.map_or("-".into(), |s| num(s.mean))
}

fn print_text(
    o: &Options,
    label: &str,
    p: &Program,
    cal: &Calibration,
    predicted: Option<f64>,
    sim_ends: Option<&[(f64, f64)]>,
) {
    let u = o.unit.name();
    outln!(
        "{label}: {} ranks, {} micro-batches, run under {} semantics; times in {u}",
        p.ranks,
        p.microbatches,
        o.mode.name()
    );
    outln!("");
    let mut t = Table::new(&["family", "units", "F", "B", "W"]);
    let scales = cal.scales(p);
    for (fam, s) in &scales {
        let n = p
            .units
            .iter()
            .filter(|x| cal.units.contains_key(&x.name))
            .filter(|x| mpipe_core::calibrate::family(&x.name).as_ref() == Some(fam))
            .count();
        t.row(vec![
            fam.to_string(),
            n.to_string(),
            ratio(s.f),
            ratio(s.b),
            ratio(s.w),
        ]);
    }
    outln!("measured / program cost, per family of units:");
    out!("{}", t.render());
    if o.units {
        outln!("");
        let mut t = Table::new(&["unit", "F", "B", "W", "BW", "samples", "spread"]);
        for (name, m) in &cal.units {
            let all = [m.f, m.b, m.w, m.bw];
            let samples: usize = all.iter().flatten().map(|s| s.samples).sum();
            let spread = all
                .iter()
                .flatten()
                .filter(|s| s.mean > 0.0)
                .map(|s| (s.max - s.min) / s.mean)
                .fold(0.0, f64::max);
            t.row(vec![
                name.clone(),
                stat(m.f),
                stat(m.b),
                stat(m.w),
                stat(m.bw),
                samples.to_string(),
                format!("{:.0}%", spread * 100.0),
            ]);
        }
        outln!("measured means per unit (spread: largest (max - min) / mean of its ops):");
        out!("{}", t.render());
    }
    outln!("");
    match cal.link {
        Some(l) => outln!(
            "link: latency {}, bandwidth {} ({} samples, {} size{}, rms residual {})",
            num(l.latency),
            num(l.bandwidth),
            l.samples,
            l.sizes,
            if l.sizes == 1 { "" } else { "s" },
            num(l.rms)
        ),
        None => outln!("link: no transfer or collective took measurable time"),
    }
    if let Some(ends) = sim_ends {
        outln!("");
        let mut t = Table::new(&[
            "rank",
            "compute",
            "finished",
            "predicted",
            "waited",
            "predicted wait",
        ]);
        for (r, (m, &(end, sim_compute))) in cal.ranks.iter().zip(ends).enumerate() {
            t.row(vec![
                r.to_string(),
                num(m.compute),
                num(m.end),
                num(end),
                num((m.end - m.compute).max(0.0)),
                num((end - sim_compute).max(0.0)),
            ]);
        }
        outln!("per rank, measured and predicted with the measured costs ({u}):");
        out!("{}", t.render());
    }
    let err = predicted.map(|x| {
        if cal.step > 0.0 {
            format!(" ({:+.1}%)", (x / cal.step - 1.0) * 100.0)
        } else {
            String::new()
        }
    });
    outln!(
        "step: measured {} {u}; simulated with the measured costs and link: {}",
        num(cal.step),
        match (predicted, err) {
            (Some(x), Some(e)) => format!("{} {u}{e}", num(x)),
            _ => "does not run".to_string(),
        }
    );
}
