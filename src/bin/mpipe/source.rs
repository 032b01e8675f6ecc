//! Where a command's program comes from: a derivation (profile + expression) or a
//! program file. Errors are rendered for the terminal here, once.

use crate::{Failure, ScheduleArgs, SourceArgs};
use anyhow::Context;
use mpipe_core::derive::{derive_str, DeriveError, Request};
use mpipe_core::expr::{render_error, ExprError};
use mpipe_core::profile::{Profile, ProfileFormat};
use mpipe_core::program::Program;
use mpipe_core::simulate::{CommModel, Mode, SimOptions};
use std::io::Read;
use std::path::Path;

/// Read a profile file, TOML or JSON by extension (TOML when unknown).
pub fn load_profile(path: &Path) -> Result<Profile, Failure> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read profile {}", path.display()))?;
    let format = path
        .extension()
        .and_then(|e| e.to_str())
        .and_then(ProfileFormat::from_extension)
        .unwrap_or(ProfileFormat::Toml);
    Profile::parse(&text, format).map_err(|e| Failure {
        code: 2,
        message: format!("error: bad profile {}:\n{e}", path.display()),
    })
}

/// Render derivation errors against the expression text, all of them.
pub fn render(expr: &str, errors: &[DeriveError]) -> Failure {
    let mut message = String::new();
    for e in errors {
        let shown = ExprError {
            message: e.message.clone(),
            span: e.span,
        };
        message.push_str(&render_error(expr, &shown));
        message.push('\n');
    }
    if errors.len() > 1 {
        message.push_str(&format!("{} errors\n", errors.len()));
    }
    Failure {
        code: 2,
        message: message.trim_end().to_string(),
    }
}

/// A derived or loaded program, with what the commands need to simulate it.
pub struct Loaded {
    pub program: Program,
    pub label: String,
    pub comm: Option<CommModel>,
    /// Derived programs carry their lower bound; loaded files compute it from units.
    pub bound: mpipe_core::bound::Bound,
}

impl Loaded {
    pub fn options(&self, mode: Mode) -> SimOptions {
        SimOptions {
            mode,
            comm: self.comm,
        }
    }
}

/// Derive `expr` for a profile, rendering errors.
pub fn derive_one(
    profile: &Profile,
    ranks: usize,
    microbatches: usize,
    expr: &str,
) -> Result<Loaded, Failure> {
    let req = Request {
        profile,
        ranks,
        microbatches,
    };
    let d = derive_str(&req, expr).map_err(|es| render(expr, &es))?;
    Ok(Loaded {
        program: d.program,
        label: expr.to_string(),
        comm: req.sim_options(Mode::Rendezvous).comm,
        bound: d.bound,
    })
}

pub fn derive_schedule(s: &ScheduleArgs) -> Result<Loaded, Failure> {
    let profile = load_profile(&s.model)?;
    derive_one(&profile, s.ranks, s.microbatches, &s.expr)
}

/// Read a program document from a file or `-` (standard input).
pub fn read_program(file: &str) -> Result<Program, Failure> {
    let text = if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("cannot read standard input")?;
        s
    } else {
        std::fs::read_to_string(file).with_context(|| format!("cannot read program {file}"))?
    };
    Program::from_json(&text).map_err(|e| Failure {
        code: 2,
        message: format!(
            "error: {file} is not an mpipe-program/1 document: {e}\n(see shared/spec/program-format.md; `mpipe derive` writes one)"
        ),
    })
}

pub fn load(s: &SourceArgs) -> Result<Loaded, Failure> {
    let mut loaded = if let Some(file) = &s.program {
        let program = read_program(file)?;
        let bound =
            mpipe_core::bound::lower_bound(&program.units, program.ranks, program.microbatches);
        Loaded {
            program,
            label: file.clone(),
            comm: None,
            bound,
        }
    } else {
        // clap guarantees these are present without --program.
        let (Some(model), Some(ranks), Some(mbs), Some(expr)) =
            (&s.model, s.ranks, s.microbatches, &s.expr)
        else {
            return Err(anyhow::anyhow!(
                "give --program FILE, or --model, --ranks, --microbatches and an expression"
            )
            .into());
        };
        let profile = load_profile(model)?;
        derive_one(&profile, ranks, mbs, expr)?
    };
    if s.latency.is_some() || s.bandwidth.is_some() {
        let base = loaded.comm.unwrap_or(CommModel {
            latency: 0.0,
            bandwidth: f64::INFINITY,
        });
        let bandwidth = s.bandwidth.unwrap_or(base.bandwidth);
        if bandwidth <= 0.0 || bandwidth.is_nan() {
            return Err(anyhow::anyhow!("--bandwidth must be positive, got {bandwidth}").into());
        }
        loaded.comm = Some(CommModel {
            latency: s.latency.unwrap_or(base.latency),
            bandwidth,
        });
    }
    Ok(loaded)
}
