//! The ranks' pid lines as `mpipe-run` forwards them (`[rank R] rank R pid P`, from
//! `comm-selftest`, which prints `rank R pid P` once its world is formed), for the
//! tests that signal one rank of a launched job: `tests/liveness.rs`,
//! `tests/blame.rs`, `tests/launcher.rs` (included with `#[path]`).

use std::io::{BufRead, BufReader, Read};
use std::sync::mpsc;

/// The rank and pid a line names, if it is a pid line.
pub(crate) fn parse(line: &str) -> Option<(usize, i32)> {
    let (head, pid) = line.rsplit_once(" pid ")?;
    let rank = head.rsplit(' ').next()?.parse().ok()?;
    Some((rank, pid.trim().parse().ok()?))
}

/// Reads `out` (a launcher's standard output) on a thread of its own until it
/// closes, sending each rank's `(rank, pid)` as its line arrives.
pub(crate) fn read_pids(out: impl Read + Send + 'static) -> mpsc::Receiver<(usize, i32)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(found) = parse(&line) {
                let _ = tx.send(found);
            }
        }
    });
    rx
}

#[test]
fn pid_lines_are_read_and_other_lines_skipped() {
    assert_eq!(parse("[rank 3] rank 3 pid 4242"), Some((3, 4242)));
    assert_eq!(parse("rank 0 pid 7 "), Some((0, 7)));
    assert_eq!(parse("[rank 1] rank 1: ok"), None);
    assert_eq!(parse("[rank 1] rank x pid 7"), None);
}
