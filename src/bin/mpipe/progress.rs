//! Progress bars for long work (`auto`'s search, `evaluate`), on standard error and
//! only when it is a terminal: piped or captured output never sees them.

use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use mpipe_core::progress::Progress;
use std::collections::BTreeMap;
use std::sync::Mutex;

/// One bar per open stage of `mpipe_core::progress`, nested stages below their
/// parents; a stage's bar is cleared when it ends.
pub struct Bars {
    multi: MultiProgress,
    open: Mutex<BTreeMap<u64, ProgressBar>>,
}

impl Bars {
    pub fn new() -> Bars {
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
}
