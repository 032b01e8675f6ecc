//! Ranks as threads of one process: a [`ThreadComm`] per rank, created together by
//! [`world`], exchanging messages through shared memory.
//!
//! Semantics are the host engine's (see [`crate::host`]): rendezvous transfers,
//! batches, collectives, timeouts and aborts behave exactly as over TCP.
//!
//! ```
//! use mpipe_runtime::comm::{Comm, Tag};
//! use mpipe_runtime::host::threads;
//! use std::time::Duration;
//!
//! let out = threads::run_ranks(2, Duration::from_secs(5), |mut c| {
//!     let peer = 1 - c.rank();
//!     let mine = vec![c.rank() as f32; 3];
//!     let got = c.batch(&[(peer, Tag::act(0, 0), &mine)], &[(peer, Tag::act(0, 0), 3)])?;
//!     Ok::<_, mpipe_runtime::comm::Error>(got[0][0])
//! });
//! assert_eq!(out, vec![Ok(1.0), Ok(0.0)]);
//! ```

use std::fmt::Display;
use std::sync::Arc;
use std::time::Duration;

use super::{host_comm, run_comms, Endpoint, Inbox, Link, Msg};

struct ThreadLink {
    inboxes: Arc<Vec<Arc<Inbox>>>,
    from: usize,
}

impl Link for ThreadLink {
    fn deliver(&self, to: usize, msg: &Msg<&[f32]>) -> std::io::Result<()> {
        self.inboxes[to].handle(self.from, msg.to_owned_msg());
        Ok(())
    }
    fn close(&self, _abrupt: bool) {}
}

/// One rank of a world of threads. `Send`: move each into its thread.
pub struct ThreadComm {
    ep: Endpoint,
}

host_comm!(ThreadComm);

/// Creates the `n` ranks of a world (index = rank). Every blocking call of theirs
/// waits at most `timeout` (see [`crate::host::default_timeout`]).
pub fn world(n: usize, timeout: Duration) -> Vec<ThreadComm> {
    let inboxes: Arc<Vec<Arc<Inbox>>> =
        Arc::new((0..n).map(|r| Arc::new(Inbox::new(r, n, None))).collect());
    (0..n)
        .map(|rank| {
            let link = Arc::new(ThreadLink {
                inboxes: inboxes.clone(),
                from: rank,
            });
            ThreadComm {
                ep: Endpoint::new(rank, n, timeout, inboxes[rank].clone(), link),
            }
        })
        .collect()
}

/// Runs `f` on each rank of a new world of `n` threads and returns every rank's
/// outcome, in rank order (see [`crate::host::run_comms`]: a rank that fails or
/// panics is aborted, so the others stop promptly; each rank's communicator is
/// closed when its `f` returns).
pub fn run_ranks<F, T, E>(n: usize, timeout: Duration, f: F) -> Vec<Result<T, String>>
where
    F: Fn(ThreadComm) -> Result<T, E> + Sync,
    T: Send,
    E: Display,
{
    run_comms(world(n, timeout), f)
}
