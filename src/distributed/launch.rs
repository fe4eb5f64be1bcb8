//! Starting the ranks of a one-node job, as `torchrun --nproc-per-node N` does: this program again, N times, each
//! with torchrun's environment, then waiting for them.

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How long the other ranks get to stop on their own after one failed (they notice a rank's exit at once through
/// NCCL) before they are killed.
const GRACE: Duration = Duration::from_secs(60);

/// Runs this executable `nproc` times with `args`, as ranks 0…nproc−1 of one node (`RANK`, `LOCAL_RANK`,
/// `WORLD_SIZE`, `LOCAL_WORLD_SIZE`; `MASTER_ADDR` and `MASTER_PORT` from this environment, else 127.0.0.1 and a
/// free port), and waits for them. Ctrl-C reaches every rank (one process group), which stop together after the
/// current step; the launcher itself ignores it. Returns the first failed rank's exit status, else success.
pub fn launch_local(nproc: usize, args: &[OsString]) -> Result<ExitStatus> {
    if nproc == 0 {
        return Err(Error::InvalidInput(
            "--nproc-per-node must be at least 1".into(),
        ));
    }
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
    #[cfg(unix)]
    // SAFETY: ignoring SIGINT in this process only; the ranks install their own handlers.
    unsafe {
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
    let mut ranks: Vec<Option<Child>> = Vec::new();
    for rank in 0..nproc {
        let child = Command::new(&exe)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("WORLD_SIZE", nproc.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", &port)
            .spawn()
            .map_err(|e| {
                Error::io(
                    "cannot start",
                    format!("rank {rank} ({})", exe.display()),
                    e,
                )
            })?;
        ranks.push(Some(child));
    }
    let mut first_failure: Option<(usize, ExitStatus, Instant)> = None;
    while ranks.iter().any(Option::is_some) {
        for (rank, slot) in ranks.iter_mut().enumerate() {
            let Some(child) = slot else { continue };
            let status = child
                .try_wait()
                .map_err(|e| Error::io("cannot wait for", format!("rank {rank}"), e))?;
            if let Some(status) = status {
                if !status.success() && first_failure.is_none() {
                    eprintln!("rank {rank} failed ({status}); waiting for the other ranks to stop");
                    first_failure = Some((rank, status, Instant::now()));
                }
                *slot = None;
            }
        }
        if let Some((rank, _, since)) = first_failure {
            if since.elapsed() > GRACE {
                for (other, child) in ranks
                    .iter_mut()
                    .enumerate()
                    .filter_map(|(r, c)| Some((r, c.as_mut()?)))
                {
                    eprintln!(
                        "rank {other} still runs {} s after rank {rank} failed: killing it",
                        GRACE.as_secs()
                    );
                    let _ = child.kill();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(match first_failure {
        Some((_, status, _)) => status,
        None => ExitStatus::default(),
    })
}
