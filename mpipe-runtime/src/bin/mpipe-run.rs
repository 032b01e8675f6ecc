//! `mpipe-run -n N [--port P] [--grace SECS] -- PROGRAM ARGS...`: starts `N` ranks of
//! `PROGRAM` on this machine with `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1` and `MASTER_PORT` set, prefixes their
//! output lines with `[rank R]`, and exits with the code of the rank that failed
//! first (0 if none did). See `mpipe_runtime::host::launch`.

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use mpipe_runtime::host::launch::{launch, Launch};
// A closed standard output or error ends the launcher quietly, never with a panic.
use mpipe_runtime::{errln as eprintln, outln as println};

const USAGE: &str =
    "usage: mpipe-run -n RANKS [--port PORT] [--grace SECONDS] [--] PROGRAM [ARGS...]

Starts RANKS processes of PROGRAM on this machine, each with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and MASTER_PORT set, and prefixes
their output lines with [rank R]. If a rank exits unsuccessfully, the others get
--grace seconds (default 10) to exit, then are killed; mpipe-run exits with the code
of the rank that failed first.

options:
  -n, --ranks RANKS   number of ranks (processes)
  --port PORT         MASTER_PORT (default: a free port)
  --grace SECONDS     time the other ranks get after a failure (default 10)
  -h, --help          this help";

fn parse(mut args: impl Iterator<Item = OsString>) -> Result<Option<Launch>, String> {
    let mut ranks = None;
    let mut port = None;
    let mut grace = Duration::from_secs(10);
    let mut program = None;
    let value = |flag: &str, v: Option<OsString>| -> Result<String, String> {
        v.and_then(|v| v.into_string().ok())
            .ok_or_else(|| format!("{flag} needs a value"))
    };
    while let Some(arg) = args.next() {
        let s = arg.to_string_lossy().into_owned();
        match s.as_str() {
            "-h" | "--help" => return Ok(None),
            "--" => {
                program = args.next();
                break;
            }
            "-n" | "--ranks" | "--nproc" | "--nproc-per-node" | "--nproc_per_node" => {
                let v = value(&s, args.next())?;
                ranks = Some(
                    v.parse::<usize>()
                        .map_err(|_| format!("{s} {v}: not a number"))?,
                );
            }
            "--port" => {
                let v = value(&s, args.next())?;
                port = Some(
                    v.parse::<u16>()
                        .map_err(|_| format!("--port {v}: not a port"))?,
                );
            }
            "--grace" => {
                let v = value(&s, args.next())?;
                let secs = v
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| format!("--grace {v}: not a number of seconds"))?;
                grace = Duration::from_secs_f64(secs);
            }
            _ if s.starts_with("-n") && s[2..].parse::<usize>().is_ok() => {
                ranks = s[2..].parse().ok();
            }
            _ if s.starts_with('-') => return Err(format!("unknown option {s}")),
            _ => {
                program = Some(arg);
                break;
            }
        }
    }
    let ranks = ranks.ok_or("the number of ranks (-n) is missing")?;
    if ranks == 0 {
        return Err("-n must be at least 1".into());
    }
    let program = program.ok_or("the program to run is missing")?;
    Ok(Some(Launch {
        ranks,
        port,
        grace,
        program,
        args: args.collect(),
    }))
}

fn main() -> ExitCode {
    let cfg = match parse(std::env::args_os().skip(1)) {
        Ok(Some(cfg)) => cfg,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("mpipe-run: {e}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    // SIGINT, SIGTERM, SIGHUP: passed on to the ranks, then a clean exit (the
    // temporary directory removed).
    mpipe_runtime::host::launch::forward_signals();
    match launch(&cfg) {
        Ok(report) => ExitCode::from(u8::try_from(report.code).unwrap_or(1)),
        Err(e) => {
            eprintln!("mpipe-run: {e}");
            ExitCode::from(127)
        }
    }
}
