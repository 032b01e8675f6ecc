//! Progress of long work (`auto`'s search, an evaluation), for whoever shows it.
//!
//! The core does no I/O: it only says what it is doing. A caller that wants a
//! progress bar installs a [`Progress`] observer around its work with
//! [`with_progress`]; the passes that take long open a [`Stage`] (a named count of
//! steps) and step it. With no observer installed (the default, and always inside
//! `schedule!`), stages cost a thread-local read and report nothing.
//!
//! Invariants:
//! - reporting never changes a result: stages only count;
//! - stages nest (an evaluation's stage holds `auto`'s); each [`Stage`] ends exactly
//!   once, when it is dropped, so an early return or a failure closes it too;
//! - a [`Stage`] is `Send + Sync`: the search's worker threads step the stage their
//!   caller opened.

use std::cell::RefCell;
use std::sync::Arc;

/// An observer of long work, such as a terminal progress bar.
pub trait Progress: Send + Sync {
    /// Work named `what`, of `total` steps, begins; `id` names it in the calls that
    /// follow (ids are unique within one [`with_progress`]).
    fn begin(&self, id: u64, what: &str, total: u64);
    /// `n` more steps of stage `id` are done.
    fn advance(&self, id: u64, n: u64);
    /// Stage `id` is over (finished, or left early: the search stops as soon as
    /// no candidate left can win).
    fn end(&self, id: u64);
    /// A note for whoever runs the work, such as `auto` stopping early within its
    /// work budget ([`note`]). Ignored unless the observer shows it.
    fn note(&self, _text: &str) {}
}

/// Tells this thread's observer (if any) `text`, a note on the work that the
/// result alone does not show (such as `auto` stopping early within its budget).
pub fn note(text: &str) {
    if let Some(inst) = CURRENT.with(|c| c.borrow().clone()) {
        inst.observer.note(text);
    }
}

struct Installed {
    observer: Arc<dyn Progress>,
    next: std::sync::atomic::AtomicU64,
}

thread_local! {
    static CURRENT: RefCell<Option<Arc<Installed>>> = const { RefCell::new(None) };
}

/// Runs `f` with `observer` told of the stages of the work `f` does on this thread
/// (and on the threads that work starts). The previous observer, if any, is back
/// afterwards.
pub fn with_progress<T>(observer: Arc<dyn Progress>, f: impl FnOnce() -> T) -> T {
    let installed = Arc::new(Installed {
        observer,
        next: std::sync::atomic::AtomicU64::new(0),
    });
    let _back = Current::set(Some(installed));
    f()
}

/// This thread's observer set for a while; the one before is back when dropped, on
/// unwind too, so a panic leaves no observer behind.
struct Current(Option<Arc<Installed>>);

impl Current {
    fn set(to: Option<Arc<Installed>>) -> Current {
        Current(CURRENT.with(|c| c.replace(to)))
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        let before = self.0.take();
        CURRENT.with(|c| *c.borrow_mut() = before);
    }
}

/// One stage of work being reported; ends when dropped.
pub struct Stage {
    to: Option<(Arc<Installed>, u64)>,
}

impl Stage {
    /// Opens a stage of `total` steps named `what`, reported to this thread's
    /// observer (a silent stage if there is none).
    pub fn begin(what: &str, total: usize) -> Stage {
        let to = CURRENT.with(|c| c.borrow().clone()).map(|inst| {
            let id = inst.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            inst.observer.begin(id, what, total as u64);
            (inst, id)
        });
        Stage { to }
    }

    /// One more step is done.
    pub fn step(&self) {
        if let Some((inst, id)) = &self.to {
            inst.observer.advance(*id, 1);
        }
    }

    /// Runs `f` with this thread reporting to the same observer as the thread that
    /// opened the stage (for worker threads, whose own stages then nest under it).
    pub fn within<T>(&self, f: impl FnOnce() -> T) -> T {
        let _back = self
            .to
            .as_ref()
            .map(|(inst, _)| Current::set(Some(inst.clone())));
        f()
    }
}

impl Drop for Stage {
    fn drop(&mut self) {
        if let Some((inst, id)) = &self.to {
            inst.observer.end(*id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Log(Mutex<Vec<String>>);
    impl Progress for Log {
        fn begin(&self, id: u64, what: &str, total: u64) {
            self.0
                .lock()
                .unwrap()
                .push(format!("begin {id} {what} {total}"));
        }
        fn advance(&self, id: u64, n: u64) {
            self.0.lock().unwrap().push(format!("advance {id} {n}"));
        }
        fn end(&self, id: u64) {
            self.0.lock().unwrap().push(format!("end {id}"));
        }
    }

    #[test]
    fn stages_nest_end_once_and_are_silent_without_an_observer() {
        // No observer: nothing to report to, nothing fails.
        Stage::begin("silent", 3).step();
        let log = Arc::new(Log::default());
        with_progress(log.clone(), || {
            let outer = Stage::begin("outer", 2);
            outer.step();
            {
                let inner = Stage::begin("inner", 1);
                std::thread::scope(|s| {
                    s.spawn(|| inner.within(|| inner.step()));
                });
            }
            outer.step();
        });
        // Uninstalled afterwards.
        Stage::begin("silent again", 1).step();
        let got = log.0.lock().unwrap().clone();
        assert_eq!(
            got,
            [
                "begin 0 outer 2",
                "advance 0 1",
                "begin 1 inner 1",
                "advance 1 1",
                "end 1",
                "advance 0 1",
                "end 0"
            ]
        );
    }
}
