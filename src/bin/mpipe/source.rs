//! Where a command's program comes from: a derivation (profile + expression) or a
//! program file. Every problem is collected (bad sizes, a bad profile and a bad
//! expression are all reported together) and rendered here, once.

use crate::decode::decode_program;
use crate::failure::{expr_failure, snippet, snippet_of_line, Collect, Failure, Problem};
use crate::{ScheduleArgs, SourceArgs};
use mpipe_core::bound::lower_bound;
use mpipe_core::derive::{
    bound_for, derive_str, resident_params, DeriveError, Derived, ErrorKind, Request,
};
use mpipe_core::profile::{Profile, ProfileError, ProfileFormat};
use mpipe_core::program::Program;
use mpipe_core::simulate::{CommModel, Mode, SimOptions, SimReport};
use serde_json::json;
use std::io::Read;
use std::path::Path;

/// Read a profile file, TOML or JSON by extension (TOML when unknown).
pub(crate) fn load_profile(path: &Path) -> Result<Profile, Failure> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| {
        let message = if path.is_dir() {
            format!("cannot read profile {shown}: it is a directory, not a file")
        } else {
            format!("cannot read profile {shown}: {e}")
        };
        Failure {
            code: 2,
            problems: vec![Problem {
                json: vec![json!({"kind": "io", "file": shown, "message": message})],
                text: message,
            }],
        }
    })?;
    let format = path
        .extension()
        .and_then(|e| e.to_str())
        .and_then(ProfileFormat::from_extension)
        .unwrap_or(ProfileFormat::Toml);
    Profile::parse(&text, format).map_err(|e| profile_failure(&shown, &text, &e))
}

/// Every problem of a profile, each as `FILE:LINE: key.path: message` with the line.
fn profile_failure(file: &str, text: &str, e: &ProfileError) -> Failure {
    let mut problems = Vec::new();
    let lines: Vec<&str> = if e.issues().is_empty() {
        Vec::new()
    } else {
        text.lines().collect()
    };
    for issue in e.issues() {
        let place = match issue.line {
            Some(l) => format!("{file}:{l}"),
            None => file.to_string(),
        };
        let mut t = format!("bad profile {place}: {}: {}", issue.path, issue.message);
        let source_line = issue
            .line
            .and_then(|l| Some((l, *lines.get(l.checked_sub(1)?)?)));
        if let Some(s) = source_line.and_then(|(l, src)| snippet_of_line(src, l, None)) {
            t.push('\n');
            t.push_str(&s);
        }
        problems.push(Problem {
            text: t,
            json: vec![json!({
                "kind": "profile",
                "file": file,
                "key": issue.path,
                "line": issue.line,
                "message": issue.message,
            })],
        });
    }
    if problems.is_empty() {
        // A syntax error (or any problem without key paths).
        let mut t = format!("bad profile {file}: {e}");
        let mut obj = json!({"kind": "profile", "file": file, "message": e.to_string()});
        if let ProfileError::Syntax { line, column, .. } = e {
            obj["line"] = json!(line);
            obj["column"] = json!(column);
            if let Some(s) = line.and_then(|l| snippet(text, l, *column)) {
                t.push('\n');
                t.push_str(&s);
            }
        }
        problems.push(Problem {
            text: t,
            json: vec![obj],
        });
    }
    Failure { code: 2, problems }
}

/// `--ranks` and `--microbatches` must be at least 1, and the step no larger than a
/// derivation takes (`mpipe_core::derive`'s limits); every problem is reported.
pub(crate) fn check_sizes(ranks: usize, microbatches: usize) -> Result<(), Failure> {
    use mpipe_core::program::{over_limit, OverLimit, MAX_MICROBATCHES, MAX_RANK_MICROBATCHES};
    let mut all = Collect::default();
    for (flag, value, what) in [
        ("--ranks", ranks, "the number of pipeline ranks"),
        (
            "--microbatches",
            microbatches,
            "the number of micro-batches per step",
        ),
    ] {
        if value == 0 {
            all.add(Failure::input(
                "usage",
                format!("{flag} must be at least 1 ({what}), got 0"),
            ));
        }
    }
    let over = over_limit(ranks, microbatches);
    if over == Some(OverLimit::Microbatches) {
        all.add(Failure::input(
            "usage",
            format!(
                "--microbatches {microbatches} is over the {MAX_MICROBATCHES} a step can have \
                 (a program holds every action of one step): accumulate gradients over \
                 several steps instead"
            ),
        ));
    } else if over == Some(OverLimit::Pairs) {
        all.add(Failure::input(
            "usage",
            format!(
                "--ranks x --microbatches = {ranks} x {microbatches} is over the \
                 {MAX_RANK_MICROBATCHES} a step can have (a program holds every action of one \
                 step): use fewer micro-batches per step"
            ),
        ));
    }
    all.finish()
}

/// Syntax errors of `expr`, if any (used to report them alongside other problems
/// when the derivation cannot run).
pub(crate) fn parse_errors(expr: &str) -> Result<(), Failure> {
    match mpipe_core::expr::parse_str(expr) {
        Ok(_) => Ok(()),
        Err(es) => {
            let errors: Vec<DeriveError> = es
                .into_iter()
                .map(|e| DeriveError {
                    message: e.message,
                    span: e.span,
                    kind: ErrorKind::BadArgument,
                })
                .collect();
            Err(expr_failure(expr, &errors))
        }
    }
}

/// A derived or loaded program, with what the commands need to simulate it.
pub(crate) struct Loaded {
    pub program: Program,
    pub label: String,
    pub comm: Option<CommModel>,
    /// Derived programs carry their lower bound; loaded files compute it from units.
    pub bound: mpipe_core::bound::Bound,
    /// Parameter memory resident on each rank.
    pub params: Vec<f64>,
    /// The profile's `memory.limit`, when the program was derived from one.
    pub limit: Option<f64>,
    /// Whether the program comes from a file (it has not been verified).
    pub from_file: bool,
    /// The unit names the profile declares (none for a program file).
    pub units: crate::table::Units,
    /// The derivation's own simulation of the program, when asked for
    /// ([`load_keeping_report`]) and timed as the command times it (the mode it
    /// was derived for, the profile's link): the report [`mpipe_core::simulate::simulate`]
    /// gives, not computed again.
    pub report: Option<SimReport>,
}

impl Loaded {
    pub(crate) fn options(&self, mode: Mode) -> SimOptions {
        SimOptions {
            mode,
            comm: self.comm,
        }
    }

    /// `rendezvous semantics, free communication` and the like.
    pub(crate) fn conditions(&self, mode: Mode) -> String {
        conditions(mode, self.comm)
    }
}

/// The execution semantics and communication model, in words.
pub(crate) fn conditions(mode: Mode, comm: Option<CommModel>) -> String {
    let mode = match mode {
        Mode::Rendezvous => "rendezvous",
        Mode::Eager => "eager",
    };
    let comm = match comm {
        None => "free communication".to_string(),
        Some(c) if c.bandwidth.is_infinite() => {
            format!("link latency {}", crate::table::num(c.latency))
        }
        Some(c) => format!(
            "link latency {}, bandwidth {}",
            crate::table::num(c.latency),
            crate::table::num(c.bandwidth)
        ),
    };
    format!("{mode} semantics, {comm}")
}

/// Derive `expr` for a profile, rendering errors against the expression.
pub(crate) fn derive_one(
    profile: &Profile,
    ranks: usize,
    microbatches: usize,
    expr: &str,
    mode: Mode,
) -> Result<Loaded, Failure> {
    let req = Request {
        mode,
        ..Request::new(profile, ranks, microbatches)
    };
    let d = derive_str(&req, expr).map_err(|es| expr_failure(expr, &es))?;
    let mut loaded = loaded_of(profile, expr, &req, d);
    // The derivation's report is dropped: the commands time the program themselves.
    loaded.report = None;
    Ok(loaded)
}

/// What [`derive_one`] gives for the derivation `d` of `expr` under `req`, its
/// report kept.
fn loaded_of(profile: &Profile, expr: &str, req: &Request, d: Derived) -> Loaded {
    let encoders: Vec<&str> = profile.encoders.iter().map(|e| e.name.as_str()).collect();
    if let Some(w) = mpipe_core::advice::degenerate(&d.expr, &d.program, &encoders) {
        errln!("warning: {w}");
    }
    // `auto` (the only expression derived as another) names its choice.
    let written = mpipe_core::expr::parse_str(expr).map(|e| e.to_string());
    let label = match written {
        Ok(w) if w != d.expr => format!("{w} = {}", d.expr),
        _ => expr.to_string(),
    };
    Loaded {
        program: d.program,
        label,
        comm: req.sim_options(Mode::Rendezvous).comm,
        bound: d.bound,
        params: d.params,
        limit: profile.memory.as_ref().map(|m| m.limit),
        from_file: false,
        units: crate::table::Units::of(profile),
        report: Some(d.report),
    }
}

/// Load the profile and check the sizes; when either fails, also report the
/// expressions' syntax errors, so that one run shows every mistake.
pub(crate) fn load_inputs(
    model: &Path,
    ranks: usize,
    microbatches: usize,
    exprs: &[&str],
) -> Result<Profile, Failure> {
    let mut failure = match (check_sizes(ranks, microbatches), load_profile(model)) {
        (Ok(()), Ok(profile)) => return Ok(profile),
        (Err(mut a), Err(b)) => {
            a.absorb(b);
            a
        }
        (Err(f), Ok(_)) | (Ok(()), Err(f)) => f,
    };
    for e in exprs {
        if let Err(x) = parse_errors(e) {
            failure.absorb(x);
        }
    }
    Err(failure)
}

pub(crate) fn derive_schedule(s: &ScheduleArgs) -> Result<Loaded, Failure> {
    let profile = load_inputs(&s.model, s.ranks, s.microbatches, &[&s.expr])?;
    derive_one(&profile, s.ranks, s.microbatches, &s.expr, Mode::Rendezvous)
}

/// How a program file is named in messages (`-` is standard input).
pub(crate) fn file_label(file: &str) -> String {
    if file == "-" {
        "<stdin>".to_string()
    } else {
        file.to_string()
    }
}

/// Read a program document from a file or `-` (standard input).
pub(crate) fn read_program(file: &str) -> Result<Program, Failure> {
    let label = file_label(file);
    let text = if file == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).map_err(|e| {
            Failure::input(
                "io",
                format!("cannot read the program from standard input: {e}"),
            )
        })?;
        s
    } else {
        std::fs::read_to_string(file).map_err(|e| {
            let message = if Path::new(file).is_dir() {
                format!("cannot read program {file}: it is a directory, not a file")
            } else {
                format!("cannot read program {file}: {e}")
            };
            Failure {
                code: 2,
                problems: vec![Problem {
                    json: vec![json!({"kind": "io", "file": file, "message": message})],
                    text: message,
                }],
            }
        })?
    };
    if text.trim().is_empty() {
        return Err(Failure::input(
            "program",
            format!(
                "{label} is empty; expected an mpipe-program/1 document (JSON), as `mpipe derive` writes"
            ),
        ));
    }
    decode_program(&text).map_err(|problems| {
        // One block: the file, then each problem on its own line.
        let count = match problems.len() {
            1 => String::new(),
            n => format!(" ({n} problems)"),
        };
        let mut text = format!("{label} is not an mpipe-program/1 document{count}:");
        for p in &problems {
            for line in p.lines() {
                text.push_str("\n  ");
                text.push_str(line);
            }
        }
        text.push_str(
            "\n(the format is docs/spec/program-format.md; `mpipe derive` writes such documents)",
        );
        let json = problems
            .iter()
            .map(|p| {
                json!({
                    "kind": "program",
                    "file": label,
                    "message": p.lines().next().unwrap_or_default(),
                })
            })
            .collect();
        Failure {
            code: 2,
            problems: vec![Problem { text, json }],
        }
    })
}

/// Read the program file, or derive the expression for `mode` (the semantics it is
/// then timed under).
pub(crate) fn load(s: &SourceArgs, mode: Mode) -> Result<Loaded, Failure> {
    load_keeping(s, mode, false)
}

/// [`load`], keeping a derivation's report ([`Loaded::report`]) where it is the one
/// the command would compute (no `--latency` or `--bandwidth` changing the link).
pub(crate) fn load_keeping_report(s: &SourceArgs, mode: Mode) -> Result<Loaded, Failure> {
    load_keeping(s, mode, true)
}

fn load_keeping(s: &SourceArgs, mode: Mode, keep_report: bool) -> Result<Loaded, Failure> {
    let mut all = Collect::default();
    // Bad link arguments are reported without deriving, which can take a while.
    let link_ok = all.take(check_link_args(s.latency, s.bandwidth)).is_some();
    let loaded = if let Some(file) = &s.program {
        // What the figures below index by rank and micro-batch must hold first.
        let program = all.take(read_program(file).and_then(|p| {
            mpipe_core::simulate::check_shape(&p)
                .map(|()| p)
                .map_err(|e| {
                    Failure::plain(
                        1,
                        "program",
                        format!("{} cannot be simulated: {e}", file_label(file)),
                    )
                })
        }));
        program.map(|program| {
            // Set below, once the link is known.
            let bound = lower_bound(&program.units, program.ranks, program.microbatches, None);
            let loaded = Loaded {
                params: resident_params(&program),
                program,
                label: file_label(file),
                comm: None,
                bound,
                limit: None,
                from_file: true,
                units: Default::default(),
                report: None,
            };
            (loaded, None)
        })
    } else {
        // clap guarantees these are present without --program.
        let (Some(model), Some(ranks), Some(mbs), Some(expr)) =
            (&s.model, s.ranks, s.microbatches, &s.expr)
        else {
            return Err(Failure::input(
                "usage",
                "give --program FILE, or --model FILE --ranks P --microbatches M and an expression",
            ));
        };
        all.take(load_inputs(model, ranks, mbs, &[expr]))
            .filter(|_| link_ok)
            .and_then(|profile| {
                let req = Request {
                    mode,
                    ..Request::new(&profile, ranks, mbs)
                };
                let derived = derive_str(&req, expr).map_err(|es| expr_failure(expr, &es));
                let mut loaded = loaded_of(&profile, expr, &req, all.take(derived)?);
                if !keep_report {
                    loaded.report = None;
                }
                Some((loaded, Some(profile)))
            })
    };
    let base = loaded.as_ref().and_then(|(l, _)| l.comm);
    let comm = link_override(base, s.latency, s.bandwidth);
    match (all.finish(), loaded) {
        (Err(f), _) => Err(f),
        (Ok(()), Some((mut l, profile))) => {
            // The bound counts the time transfers hold the ranks, which depends on
            // the link the program is timed with.
            if l.from_file || comm != base {
                // Timed under another link than the derivation's.
                l.report = None;
                l.comm = comm;
                let opts = l.options(mode);
                l.bound = match &profile {
                    Some(profile) => bound_for(profile, &l.program, &opts),
                    None => lower_bound(
                        &l.program.units,
                        l.program.ranks,
                        l.program.microbatches,
                        opts.held_link(),
                    ),
                };
            }
            Ok(l)
        }
        (Ok(()), None) => Err(Failure::input("internal", "no program was loaded")),
    }
}

/// The link model a command times under: `base` (the profile's `[link]`, if any) with
/// `--latency` / `--bandwidth` overriding its fields (checked by [`check_link_args`]).
pub(crate) fn link_override(
    base: Option<CommModel>,
    latency: Option<f64>,
    bandwidth: Option<f64>,
) -> Option<CommModel> {
    if latency.is_none() && bandwidth.is_none() {
        return base;
    }
    let base = base.unwrap_or(CommModel {
        latency: 0.0,
        bandwidth: f64::INFINITY,
    });
    Some(CommModel {
        latency: latency.unwrap_or(base.latency),
        bandwidth: bandwidth.unwrap_or(base.bandwidth),
    })
}

/// `--latency` and `--bandwidth` as given (a profile's own link passed its checks).
pub(crate) fn check_link_args(latency: Option<f64>, bandwidth: Option<f64>) -> Result<(), Failure> {
    use mpipe_core::profile::{MAX_FIGURE, MIN_FIGURE};
    let mut all = Collect::default();
    if let Some(b) = bandwidth.filter(|b| b.is_nan() || *b < MIN_FIGURE) {
        all.add(Failure::input(
            "usage",
            format!("--bandwidth must be a number >= {MIN_FIGURE:e} (or inf), got {b}"),
        ));
    }
    if let Some(l) = latency.filter(|l| !(0.0..=MAX_FIGURE).contains(l)) {
        all.add(Failure::input(
            "usage",
            format!("--latency must be a number from 0 to {MAX_FIGURE:e}, got {l}"),
        ));
    }
    all.finish()
}
