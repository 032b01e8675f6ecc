//! Progress bars for long work (`auto`'s search, `evaluate`), on standard error and
//! when it is a terminal ([`Bars`]); otherwise one line every few seconds ([`Lines`]).

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use mpipe_core::progress::Progress;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// One bar per open stage of `mpipe_core::progress`, nested stages below their
/// parents; a stage's bar is cleared when it ends.
pub(crate) struct Bars {
    multi: MultiProgress,
    open: Mutex<BTreeMap<u64, ProgressBar>>,
}

impl Bars {
    pub(crate) fn new() -> Bars {
        Bars {
            multi: MultiProgress::new(),
            open: Mutex::new(BTreeMap::new()),
        }
    }
}

impl Progress for Bars {
    fn begin(&self, id: u64, what: &str, total: u64) {
        let bar = self.multi.add(ProgressBar::new(total));
        // The template is fixed and valid; a failure would only lose the styling.
        if let Ok(style) =
            ProgressStyle::with_template("{msg:36} [{bar:30}] {pos}/{len} ({elapsed})")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(what.to_string());
        if let Ok(mut open) = self.open.lock() {
            open.insert(id, bar);
        }
    }

    fn advance(&self, id: u64, n: u64) {
        if let Ok(open) = self.open.lock() {
            if let Some(bar) = open.get(&id) {
                bar.inc(n);
            }
        }
    }

    fn end(&self, id: u64) {
        let bar = self.open.lock().ok().and_then(|mut open| open.remove(&id));
        if let Some(bar) = bar {
            bar.finish_and_clear();
            self.multi.remove(&bar);
        }
    }

    fn note(&self, text: &str) {
        // Above the bars; straight to standard error when they are hidden.
        if self.multi.println(format!("mpipe: note: {text}")).is_err() {
            errln!("mpipe: note: {text}");
        }
    }
}

/// How often [`Lines`] reports, in seconds, unless `MPIPE_PROGRESS_INTERVAL` says.
pub(crate) const DEFAULT_INTERVAL_SECS: f64 = 10.0;

/// The interval `MPIPE_PROGRESS_INTERVAL` gives, by [`interval_from`]; a value that
/// is set but not a positive number of seconds is named in a warning on standard
/// error, and the default is used.
pub(crate) fn interval_from_env() -> std::time::Duration {
    let value = match std::env::var("MPIPE_PROGRESS_INTERVAL") {
        Err(std::env::VarError::NotPresent) => None,
        Err(std::env::VarError::NotUnicode(raw)) => Some(raw.to_string_lossy().into_owned()),
        Ok(v) => Some(v),
    };
    interval_from(value.as_deref()).unwrap_or_else(|bad| {
        errln!(
            "mpipe: warning: MPIPE_PROGRESS_INTERVAL={bad:?} is not a positive number of \
             seconds; progress lines come every {DEFAULT_INTERVAL_SECS} s"
        );
        std::time::Duration::from_secs_f64(DEFAULT_INTERVAL_SECS)
    })
}

/// The interval a value of `MPIPE_PROGRESS_INTERVAL` gives: seconds, a number > 0
/// (one too large for a duration, `inf` included, means never); no value gives
/// [`DEFAULT_INTERVAL_SECS`]; anything else is an error carrying the value.
fn interval_from(value: Option<&str>) -> Result<std::time::Duration, String> {
    let Some(v) = value else {
        return Ok(std::time::Duration::from_secs_f64(DEFAULT_INTERVAL_SECS));
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s > 0.0 => {
            Ok(std::time::Duration::try_from_secs_f64(s).unwrap_or(std::time::Duration::MAX))
        }
        _ => Err(v.to_owned()),
    }
}

/// One open stage as [`Lines`] knows it: what, done, total, when it began.
struct Open {
    what: String,
    done: u64,
    total: u64,
    began: std::time::Instant,
}

/// Progress for a standard error that is not a terminal (a pipe, CI's log): every
/// interval while work is open, one line `mpipe: <stage>: <done>/<total> (<secs>s)`
/// for the outermost open stage, so a long `auto` is never silent. A background
/// thread prints; it stops with the process.
pub(crate) struct Lines {
    open: std::sync::Arc<Mutex<BTreeMap<u64, Open>>>,
}

impl Lines {
    pub(crate) fn new(interval: std::time::Duration) -> Lines {
        let open: std::sync::Arc<Mutex<BTreeMap<u64, Open>>> = Default::default();
        let seen = std::sync::Arc::clone(&open);
        let spawned = std::thread::Builder::new()
            .name("mpipe-progress".into())
            .spawn(move || loop {
                std::thread::sleep(interval);
                let line = seen.lock().ok().and_then(|open| {
                    open.values().next().map(|o| {
                        format!(
                            "mpipe: {}: {}/{} ({:.1}s)",
                            o.what,
                            o.done.min(o.total),
                            o.total,
                            o.began.elapsed().as_secs_f64()
                        )
                    })
                });
                if let Some(line) = line {
                    errln!("{line}");
                }
            });
        // Without the thread there is only no progress line.
        drop(spawned);
        Lines { open }
    }
}

impl Progress for Lines {
    fn begin(&self, id: u64, what: &str, total: u64) {
        if let Ok(mut open) = self.open.lock() {
            open.insert(
                id,
                Open {
                    what: what.to_string(),
                    done: 0,
                    total,
                    began: std::time::Instant::now(),
                },
            );
        }
    }

    fn advance(&self, id: u64, n: u64) {
        if let Ok(mut open) = self.open.lock() {
            if let Some(o) = open.get_mut(&id) {
                o.done = o.done.saturating_add(n);
            }
        }
    }

    fn end(&self, id: u64) {
        if let Ok(mut open) = self.open.lock() {
            open.remove(&id);
        }
    }

    fn note(&self, text: &str) {
        errln!("mpipe: note: {text}");
    }
}

#[cfg(test)]
mod tests {
    use super::{interval_from, DEFAULT_INTERVAL_SECS};
    use std::time::Duration;

    #[test]
    fn an_interval_is_positive_seconds_a_huge_one_means_never_and_a_bad_one_is_named() {
        let default = Duration::from_secs_f64(DEFAULT_INTERVAL_SECS);
        assert_eq!(interval_from(None), Ok(default));
        assert_eq!(interval_from(Some("0.01")), Ok(Duration::from_millis(10)));
        // The guide's test asks for 1e6 s so that a loaded machine shows no line; it
        // once fell back to the default here, and a slow run printed one.
        assert_eq!(
            interval_from(Some("1000000")),
            Ok(Duration::from_secs(1_000_000))
        );
        assert_eq!(interval_from(Some("inf")), Ok(Duration::MAX));
        assert_eq!(interval_from(Some("1e300")), Ok(Duration::MAX));
        // Set but not a positive number: an error naming the value (the binary warns
        // and uses the default).
        for bad in ["", "0", "-1", "NaN", "soon"] {
            assert_eq!(interval_from(Some(bad)), Err(bad.to_owned()), "{bad:?}");
        }
    }
}
