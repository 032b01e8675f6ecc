//! One ordered parallel map, used by the search and the compute-order search.
//!
//! The answer never depends on the threads: results come back in index order,
//! and a panic in the work is the caller's panic on one thread and on many (after
//! every worker has stopped, the first panic in index order is resumed), so a bug
//! never silently changes an answer.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `f(i)` for every index of `order` (a permutation of `0..order.len()`), on up to
/// `threads` threads (this one when 1), each taking the next `run` entries of
/// `order` in turn; results by index. `within` wraps each worker's whole loop (a
/// worker's per-thread set-up: a memo, a progress observer). If `f` panics, the
/// first panic in `order` is resumed on the calling thread once the other workers
/// have stopped, as on one thread.
pub(crate) fn ordered_map<R, F, W>(
    order: &[usize],
    threads: usize,
    run: usize,
    within: W,
    f: F,
) -> Vec<R>
where
    R: Send,
    F: Fn(usize) -> R + Sync,
    W: Fn(&mut dyn FnMut()) + Sync,
{
    let len = order.len();
    let mut slots: Vec<Option<R>> = (0..len).map(|_| None).collect();
    if threads <= 1 || len <= 1 {
        within(&mut || {
            for &i in order {
                slots[i] = Some(f(i));
            }
        });
    } else {
        let run = run.max(1);
        let next = AtomicUsize::new(0);
        // Set once any worker's work has panicked: the others stop taking work.
        let stop = std::sync::atomic::AtomicBool::new(false);
        let outcomes: Vec<Vec<(usize, std::thread::Result<R>)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads.min(len))
                .map(|_| {
                    let (f, next, within, stop) = (&f, &next, &within, &stop);
                    s.spawn(move || {
                        let mut done = Vec::new();
                        within(&mut || loop {
                            let at = next.fetch_add(run, Ordering::Relaxed);
                            if at >= len || stop.load(Ordering::Relaxed) {
                                break;
                            }
                            for (k, &i) in order[at..(at + run).min(len)].iter().enumerate() {
                                let r = catch_unwind(AssertUnwindSafe(|| f(i)));
                                let failed = r.is_err();
                                done.push((at + k, r));
                                if failed {
                                    stop.store(true, Ordering::Relaxed);
                                    return;
                                }
                            }
                        });
                        done
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|p| resume_unwind(p)))
                .collect()
        });
        // By position in `order`: the first panic there is the one resumed, the one
        // a single thread would have met first among those that ran.
        let mut by_pos: Vec<(usize, std::thread::Result<R>)> =
            outcomes.into_iter().flatten().collect();
        by_pos.sort_by_key(|(pos, _)| *pos);
        for (pos, r) in by_pos {
            match r {
                Ok(r) => slots[order[pos]] = Some(r),
                Err(p) => resume_unwind(p),
            }
        }
    }
    slots
        .into_iter()
        .map(|r| r.expect("ordered_map: `order` is a permutation of its indices"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(threads: usize, order: &[usize]) -> Result<Vec<usize>, String> {
        catch_unwind(AssertUnwindSafe(|| {
            ordered_map(
                order,
                threads,
                1,
                |body| body(),
                |i| {
                    if i == 3 {
                        panic!("work item {i} failed");
                    }
                    i * 10
                },
            )
        }))
        .map_err(|p| {
            p.downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "non-text panic".into())
        })
    }

    /// A panicking work item is the caller's panic, with the same message, on one
    /// worker and on several; without one, the same results in index order.
    #[test]
    fn a_panic_is_the_same_on_one_worker_and_many() {
        let order: Vec<usize> = (0..8).rev().collect();
        let one = outcome(1, &order);
        assert_eq!(one, Err("work item 3 failed".to_string()));
        for threads in [2, 3, 8] {
            assert_eq!(outcome(threads, &order), one, "{threads} workers");
        }
        for threads in [1, 2, 4] {
            let got = ordered_map(&[2, 0, 1], threads, 2, |body| body(), |i| i + 1);
            assert_eq!(got, [1, 2, 3], "{threads} workers");
        }
    }
}
