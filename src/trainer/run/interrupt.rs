//! Stopping a run cleanly on request: the first Ctrl-C (or [`request_stop`]) lets the trainer finish the current
//! optimizer step, save a checkpoint and return [`Error::Interrupted`](crate::Error::Interrupted); a second Ctrl-C
//! exits at once (checkpoints are written atomically, so one cut short is never picked up).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Stop requests (Ctrl-C presses) since the current run started.
static REQUESTS: AtomicUsize = AtomicUsize::new(0);

/// Asks a running [`Trainer::train`](crate::trainer::Trainer::train) to stop after its current step, with a
/// checkpoint.
pub fn request_stop() {
    REQUESTS.fetch_add(1, Ordering::SeqCst);
}

/// Whether a stop was requested since [`reset`].
pub(crate) fn stop_requested() -> bool {
    REQUESTS.load(Ordering::SeqCst) > 0
}

/// Forgets earlier requests (a run starts).
pub(crate) fn reset() {
    REQUESTS.store(0, Ordering::SeqCst);
}

/// Makes Ctrl-C (SIGINT) request a clean stop: the first press lets the step finish and a checkpoint be saved, the
/// second exits with status 130 at once. Install it once loading is done (before, Ctrl-C stops the process as
/// usual). On platforms without POSIX signals it does nothing.
pub fn stop_on_ctrl_c() -> std::io::Result<()> {
    #[cfg(unix)]
    {
        // SAFETY: the handler only touches an atomic and calls the async-signal-safe write(2) and _exit(2).
        let previous =
            unsafe { libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t) };
        if previous == libc::SIG_ERR {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(unix)]
extern "C" fn on_sigint(_: libc::c_int) {
    const FIRST: &[u8] =
        b"\nstopping after this step, with a checkpoint (Ctrl-C again to stop at once)\n";
    if REQUESTS.fetch_add(1, Ordering::SeqCst) == 0 {
        // SAFETY: write(2) on stderr with a static buffer is async-signal-safe.
        unsafe { libc::write(2, FIRST.as_ptr().cast(), FIRST.len()) };
    } else {
        // SAFETY: _exit(2) is async-signal-safe and skips destructors that could deadlock in a handler.
        unsafe { libc::_exit(130) };
    }
}
