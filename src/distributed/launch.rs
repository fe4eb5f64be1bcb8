//! Starting the ranks of a one-node job, as `torchrun --nproc-per-node N` does: this program again, N times, each
//! with torchrun's environment, then waiting for them and passing them the signals the launcher gets.

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::ranks::{check_ranks, RanksFrom};
use crate::error::{Error, Result};

/// How long the other ranks get to stop on their own after one failed (they notice a rank's exit at once through
/// NCCL) before they are killed: the launcher outlives a rank's failure by this at most.
pub const LAUNCH_GRACE: Duration = Duration::from_secs(60);

/// How often the launcher looks at its ranks and its signals.
const POLL: Duration = Duration::from_millis(50);

/// Runs this executable `nproc` times with `args`, as ranks 0…nproc−1 of one node (`RANK`, `LOCAL_RANK`,
/// `WORLD_SIZE`, `LOCAL_WORLD_SIZE`; `MASTER_ADDR` and `MASTER_PORT` from this environment, else 127.0.0.1 and a
/// free port), and waits for them. A job this build or machine cannot run ([`check_ranks`]) is refused before any
/// rank starts. The ranks run in a process group of their own, and the launcher passes each SIGINT and SIGTERM it
/// gets to every rank once (Ctrl-C, or `kill -INT` of the launcher alone: the ranks agree to stop after the same
/// step, with a checkpoint; a second Ctrl-C stops them at once); a rank whose launcher dies is sent SIGTERM by the
/// kernel (Linux), so none is left behind. Once a rank fails, the others get [`LAUNCH_GRACE`] to stop, then are killed.
/// Returns the first failed rank's exit status, else success.
pub fn launch_local(nproc: usize, args: &[OsString]) -> Result<ExitStatus> {
    check_ranks(nproc, nproc, RanksFrom::Launcher)?;
    let exe = std::env::current_exe()
        .map_err(|e| Error::io("cannot find", "the running executable", e))?;
    let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let port = match std::env::var("MASTER_PORT") {
        Ok(port) => port,
        Err(_) => std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| Error::io("cannot pick", "a free port for MASTER_PORT", e))?
            .port()
            .to_string(),
    };
    forward_signals()?;
    let mut ranks: Vec<Child> = Vec::new();
    for rank in 0..nproc {
        let mut command = Command::new(&exe);
        rank_process(&mut command);
        let started = command
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", &port)
            .spawn();
        match started {
            Ok(child) => ranks.push(child),
            Err(e) => {
                // The ranks already started would wait for this one: stop them before saying why.
                for child in &mut ranks {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(Error::io(
                    "cannot start",
                    format!("rank {rank} ({})", exe.display()),
                    e,
                ));
            }
        }
    }
    wait_for_ranks(ranks, LAUNCH_GRACE)
}

/// Waits for every rank, passing on the launcher's signals; once one fails, the others get `grace` to stop on
/// their own and are then killed, so this returns at most `grace` (and a poll) after the first failure. Returns the
/// first failed rank's exit status, else success.
fn wait_for_ranks(ranks: Vec<Child>, grace: Duration) -> Result<ExitStatus> {
    let mut ranks: Vec<Option<Child>> = ranks.into_iter().map(Some).collect();
    let mut first_failure: Option<(usize, ExitStatus, Instant)> = None;
    let mut killed = false;
    let mut forwarded = [0; 2];
    while ranks.iter().any(Option::is_some) {
        pass_on_signals(&ranks, &mut forwarded);
        for (rank, slot) in ranks.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            let status = child
                .try_wait()
                .map_err(|e| Error::io("cannot wait for", format!("rank {rank}"), e))?;
            if let Some(status) = status {
                if !status.success() && first_failure.is_none() {
                    eprintln!(
                        "rank {rank} failed ({status}); the other ranks get {} s to stop before they are killed",
                        grace.as_secs_f64()
                    );
                    first_failure = Some((rank, status, Instant::now()));
                }
                *slot = None;
            }
        }
        if let Some((rank, _, since)) = first_failure {
            if !killed && since.elapsed() >= grace {
                for (other, child) in ranks
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(r, c)| Some((r, c.as_mut()?)))
                {
                    eprintln!(
                        "rank {other} still runs {} s after rank {rank} failed: killing it",
                        grace.as_secs_f64()
                    );
                    let _ = child.kill();
                }
                killed = true;
            }
        }
        if ranks.iter().any(Option::is_some) {
            std::thread::sleep(POLL);
        }
    }
    Ok(match first_failure {
        Some((_, status, _)) => status,
        None => ExitStatus::default(),
    })
}

/// Signals the launcher got and has to pass on to the ranks: SIGINT and SIGTERM, counted.
static RECEIVED: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

#[cfg(unix)]
const FORWARDED: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

#[cfg(unix)]
extern "C" fn on_signal(signal: libc::c_int) {
    if let Some(i) = FORWARDED.iter().position(|&s| s == signal) {
        RECEIVED[i].fetch_add(1, Ordering::SeqCst);
    }
}

/// Makes SIGINT and SIGTERM of the launcher counted (and passed on by [`pass_on_signals`]) instead of fatal.
fn forward_signals() -> Result<()> {
    #[cfg(unix)]
    for signal in FORWARDED {
        // SAFETY: the handler only increments an atomic.
        let previous =
            unsafe { libc::signal(signal, on_signal as *const () as libc::sighandler_t) };
        if previous == libc::SIG_ERR {
            return Err(Error::io(
                "cannot install",
                "the launcher's signal handler",
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}

/// Sends every running rank the signals received since the last call (`forwarded` counts those already sent).
fn pass_on_signals(ranks: &[Option<Child>], forwarded: &mut [usize; 2]) {
    #[cfg(unix)]
    for (i, signal) in FORWARDED.into_iter().enumerate() {
        let received = RECEIVED[i].load(Ordering::SeqCst);
        for _ in forwarded[i]..received {
            for child in ranks.iter().flatten() {
                // SAFETY: kill(2) on a child this process started and has not yet reaped.
                unsafe { libc::kill(child.id() as libc::pid_t, signal) };
            }
        }
        forwarded[i] = received;
    }
    #[cfg(not(unix))]
    let _ = (ranks, forwarded);
}

/// Puts a rank in a process group of its own, so a terminal's Ctrl-C reaches it once, through the launcher, and
/// (Linux) has the kernel send it SIGTERM when the launcher dies.
fn rank_process(command: &mut Command) {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        command.process_group(0);
        #[cfg(target_os = "linux")]
        // SAFETY: prctl(2) is async-signal-safe, as code between fork and exec must be.
        unsafe {
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    #[cfg(not(unix))]
    let _ = command;
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    fn sh(script: &str) -> Child {
        Command::new("sh").args(["-c", script]).spawn().unwrap()
    }

    #[test]
    fn a_failed_rank_ends_the_launch_within_the_grace_period() {
        let grace = Duration::from_millis(500);
        let start = Instant::now();
        let ranks = vec![sh("sleep 0.1; exit 3"), sh("sleep 30"), sh("sleep 30")];
        let status = wait_for_ranks(ranks, grace).unwrap();
        let took = start.elapsed();
        assert_eq!(status.code(), Some(3));
        // 0.1 s until the failure, the grace, a poll and the reaping of the killed ranks.
        assert!(
            took < Duration::from_millis(100) + grace + Duration::from_secs(1),
            "{took:?}"
        );
        assert!(took >= grace, "{took:?}");
        let ok = wait_for_ranks(vec![sh("exit 0"), sh("exit 0")], grace).unwrap();
        assert!(ok.success());
    }

    #[test]
    fn nothing_starts_when_the_ranks_cannot_run() {
        let err = launch_local(0, &[]).unwrap_err().to_string();
        assert!(err.contains("--nproc-per-node 0"), "{err}");
    }
}
