//! The few process and signal calls the launcher needs, as safe functions (the one
//! place of `host/` with `unsafe` code: thin calls into libc).

use std::process::Command;
use std::sync::atomic::{AtomicI32, Ordering};

/// The signal received by a handler of [`note_signals`], 0 if none.
static NOTED: AtomicI32 = AtomicI32::new(0);

#[cfg(unix)]
extern "C" fn note(sig: libc::c_int) {
    // Async-signal-safe: one atomic store.
    NOTED.store(sig, Ordering::SeqCst);
}

/// Replaces the action of `SIGINT`, `SIGTERM` and `SIGHUP` (process-wide) by noting
/// the signal for [`take_noted`].
pub(crate) fn note_signals() {
    #[cfg(unix)]
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        let handler = note as extern "C" fn(libc::c_int);
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }
}

/// The signal noted since the last call, if any.
pub(crate) fn take_noted() -> Option<i32> {
    match NOTED.swap(0, Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Sends `sig` to process `pid` (errors ignored: it may have exited).
pub(crate) fn send(pid: u32, sig: i32) {
    #[cfg(unix)]
    if let Ok(pid) = libc::pid_t::try_from(pid) {
        if pid > 0 {
            // SAFETY: kill has no memory-safety preconditions.
            unsafe {
                libc::kill(pid, sig);
            }
        }
    }
}

/// Whether no process `pid` exists (`false` when unsure).
pub(crate) fn is_gone(pid: u32) -> bool {
    #[cfg(unix)]
    {
        let Ok(pid) = libc::pid_t::try_from(pid) else {
            return false;
        };
        // SAFETY: signal 0 only checks that the process exists.
        let r = unsafe { libc::kill(pid, 0) };
        r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    }
    #[cfg(not(unix))]
    {
        let _ = pid;
        false
    }
}

/// This process's real user id (0 off Unix).
pub(crate) fn user_id() -> u32 {
    #[cfg(unix)]
    {
        // SAFETY: getuid has no preconditions and cannot fail.
        unsafe { libc::getuid() }
    }
    #[cfg(not(unix))]
    0
}

/// Linux: the process `command` starts gets `SIGTERM` when this process (the thread
/// that spawns it) dies, however it dies (`SIGKILL` included). Elsewhere: nothing.
pub(crate) fn terminate_with_parent(command: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id();
        // SAFETY: between fork and exec the closure calls only async-signal-safe
        // functions (prctl, getppid, raise) and allocates nothing.
        unsafe {
            command.pre_exec(move || {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                // The parent died before the line above took effect.
                if u32::try_from(libc::getppid()).ok() != Some(parent) {
                    libc::raise(libc::SIGTERM);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}
