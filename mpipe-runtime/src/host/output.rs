//! Output that survives its reader going away.
//!
//! `println!` panics when standard output is a pipe whose reader has gone (`| head`,
//! a launcher killed with `kill -9`): the rank then dies with "failed printing to
//! stdout: Broken pipe" and its peers fail naming it. [`outln!`](crate::outln) and
//! [`errln!`](crate::errln) write the same text, and on a closed pipe (`EPIPE`) end
//! the process quietly with status 0 (nobody is left to read its output, and its
//! connections' closing tells its peers); any other write error is ignored. A rank
//! binary can shadow the standard macros with them:
//!
//! ```
//! use mpipe_runtime::{errln as eprintln, outln as println};
//! println!("step {}", 1);
//! eprintln!("warning: {}", "nothing");
//! ```

use std::io::Write;

/// Writes `text` (and a newline) to standard output, or standard error when
/// `to_stderr`; ends the process with status 0 when the stream is a closed pipe.
pub fn write_line(text: &str, to_stderr: bool) {
    let written = if to_stderr {
        let mut e = std::io::stderr().lock();
        e.write_all(text.as_bytes())
            .and_then(|()| e.write_all(b"\n"))
    } else {
        let mut o = std::io::stdout().lock();
        o.write_all(text.as_bytes())
            .and_then(|()| o.write_all(b"\n"))
            .and_then(|()| o.flush())
    };
    if let Err(e) = written {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
    }
}

/// `println!` that ends the process quietly (status 0) when standard output is a
/// closed pipe, instead of panicking (see [`crate::host::output`]).
#[macro_export]
macro_rules! outln {
    () => { $crate::host::output::write_line("", false) };
    ($($t:tt)*) => { $crate::host::output::write_line(&format!($($t)*), false) };
}

/// `eprintln!` that ends the process quietly (status 0) when standard error is a
/// closed pipe, instead of panicking (see [`crate::host::output`]).
#[macro_export]
macro_rules! errln {
    () => { $crate::host::output::write_line("", true) };
    ($($t:tt)*) => { $crate::host::output::write_line(&format!($($t)*), true) };
}
