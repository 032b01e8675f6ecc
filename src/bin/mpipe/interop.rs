//! `mpipe import` and `mpipe export`: schedules of other tools in and out
//! (PyTorch's `torch.distributed.pipelining` schedule CSV, `mpipe_core::torch_csv`).

use crate::failure::{Failure, Problem};
use crate::source::{derive_one, file_label, load_inputs, load_profile, read_program};
use mpipe_core::simulate::Mode;
use mpipe_core::torch_csv::{export, import_with, Batching, Form, ImportOptions};
use mpipe_core::verify::verify;
use serde_json::json;
use std::io::Read;
use std::path::{Path, PathBuf};

/// The formats `import` and `export` speak.
#[derive(Clone, Copy, clap::ValueEnum)]
pub(crate) enum Format {
    /// PyTorch's pipeline schedule CSV (one row per rank, one action per cell).
    TorchCsv,
}

fn write(path: Option<&Path>, text: &str, newline: bool) -> Result<(), Failure> {
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
        None if newline => outln!("{text}"),
        None => out!("{text}"),
    }
    Ok(())
}

fn read_text(file: &str) -> Result<String, Failure> {
    if file == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| Failure::input("io", format!("cannot read standard input: {e}")))?;
        return Ok(s);
    }
    std::fs::read_to_string(file).map_err(|e| {
        let message = if Path::new(file).is_dir() {
            format!("cannot read {file}: it is a directory, not a file")
        } else {
            format!("cannot read {file}: {e}")
        };
        Failure::input("io", message)
    })
}

/// `mpipe import --format torch-csv FILE [--model P] [--batch-adjacent] [-o OUT]`:
/// write the program; exit 1 when it breaks a validity rule (a deadlock, most often),
/// with every violation on standard error.
pub(crate) fn import(
    _format: Format,
    file: &str,
    model: Option<&Path>,
    batch_adjacent: bool,
    output: Option<&Path>,
) -> Result<u8, Failure> {
    let label = file_label(file);
    let text = read_text(file)?;
    let profile = model.map(load_profile).transpose()?;
    let opts = ImportOptions {
        profile: profile.as_ref(),
        batching: if batch_adjacent {
            Batching::Adjacent
        } else {
            Batching::Unbatched
        },
    };
    let program = import_with(&text, &opts).map_err(|e| {
        let mut message = format!("{label}: not a torch schedule CSV: {e}");
        if let (Some(l), Some(c)) = (e.line, e.column) {
            if let Some(line) = text.lines().nth(l - 1) {
                let line = line.trim_end_matches('\r');
                message.push_str(&format!(
                    "\n  {l} | {line}\n  {} | {}^",
                    " ".repeat(l.to_string().len()),
                    " ".repeat(c.saturating_sub(1))
                ));
            }
        }
        Failure {
            code: 2,
            problems: vec![Problem {
                json: vec![json!({"kind": "torch-csv", "file": label, "line": e.line,
                                  "column": e.column, "message": e.message})],
                text: message,
            }],
        }
    })?;
    write(output, &program.to_json(), true)?;
    let stages = program.units.len();
    errln!(
        "imported {label}: {} ranks, {stages} stages, {} micro-batches{}",
        program.ranks,
        program.microbatches,
        output
            .map(|p| format!(", written to {}", p.display()))
            .unwrap_or_default()
    );
    let violations = verify(&program);
    if violations.is_empty() {
        return Ok(0);
    }
    errln!(
        "warning: the imported schedule breaks the validity rules ({} violations; termination \
         under rendezvous semantics, each SEND/RECV its own call as torch posts them):",
        violations.len()
    );
    for v in &violations {
        errln!("  {v}");
    }
    Ok(1)
}

/// Where `export` takes its program from.
pub(crate) struct ExportSource<'a> {
    /// A program file (or `-`), or, with `model`, a schedule expression.
    pub input: &'a str,
    pub model: Option<&'a PathBuf>,
    pub ranks: Option<usize>,
    pub microbatches: Option<usize>,
}

/// `mpipe export --format torch-csv [--compute-only] PROGRAM|- [-o FILE]`, or with
/// `--model P --ranks N --microbatches M EXPR`.
pub(crate) fn export_cmd(
    _format: Format,
    src: &ExportSource,
    compute_only: bool,
    output: Option<&Path>,
) -> Result<u8, Failure> {
    let (program, label) = match src.model {
        Some(model) => {
            let (Some(ranks), Some(mbs)) = (src.ranks, src.microbatches) else {
                return Err(Failure::input(
                    "usage",
                    "with --model, give --ranks and --microbatches too (the input is then a \
                     schedule expression)",
                ));
            };
            let profile = load_inputs(model, ranks, mbs, &[src.input])?;
            let loaded = derive_one(&profile, ranks, mbs, src.input, Mode::Rendezvous)?;
            (loaded.program, format!("`{}`", src.input))
        }
        None => {
            if src.ranks.is_some() || src.microbatches.is_some() {
                return Err(Failure::input(
                    "usage",
                    "--ranks and --microbatches derive from a profile: give --model too, or \
                     drop them to export a program file",
                ));
            }
            (read_program(src.input)?, file_label(src.input))
        }
    };
    let form = if compute_only {
        Form::ComputeOnly
    } else {
        Form::WithComm
    };
    let csv = export(&program, form).map_err(|e| {
        Failure::plain(
            1,
            "torch-csv",
            format!("{label} cannot be written as a torch schedule CSV: {e}"),
        )
    })?;
    write(output, &csv, false)?;
    if let Some(p) = output {
        errln!("wrote {}", p.display());
    }
    if form == Form::WithComm {
        // Torch posts every SEND/RECV as its own call; say if that order hangs.
        if let Ok(back) = mpipe_core::torch_csv::import(&csv, None) {
            let vs = verify(&back);
            if let Some(v) = vs.first() {
                errln!(
                    "warning: run by torch's runtime, where each SEND/RECV is its own call, \
                     this order can hang under rendezvous (NCCL/HCCL) semantics: {v}\n\
                     (mpipe posts those transfers together in batches, which torch's CSV \
                     cannot spell; export with --compute-only to let torch derive the \
                     communication)"
                );
            }
        }
    }
    Ok(0)
}
