//! What can be known of a data-parallel job before any rank starts: whether this build trains in several
//! processes (the `nccl` feature), the GPUs there are, and the ranks asked for against both. The launcher checks it
//! before it starts a rank, and each rank before its model loads, so a job that cannot run fails in milliseconds,
//! once, instead of after every rank has loaded the model.

use crate::error::{Error, Result};

/// Where the number of ranks came from, so a message names what the user set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RanksFrom {
    /// `qlora train --nproc-per-node N` ([`crate::distributed::launch_local`]).
    Launcher,
    /// torchrun's environment (`WORLD_SIZE`, `LOCAL_WORLD_SIZE`), set by another launcher.
    Environment,
}

/// The CUDA GPUs this process sees (`CUDA_VISIBLE_DEVICES` applies): none in a build without the `cuda` feature,
/// or where the driver does not answer.
pub fn visible_gpus() -> usize {
    #[cfg(feature = "cuda")]
    {
        candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()
            .map_or(0, |n| usize::try_from(n).unwrap_or(0))
    }
    #[cfg(not(feature = "cuda"))]
    0
}

/// Checks that this build and machine can run a job of `world_size` processes, `local` of them on this machine,
/// one GPU each: at least one process; several only in a build with the `nccl` feature; no more on this machine
/// than it has GPUs (which also bounds a mistyped count). The error names the flag or variable `from` says, and a
/// count that runs.
pub fn check_ranks(world_size: usize, local: usize, from: RanksFrom) -> Result<()> {
    let asked = match from {
        RanksFrom::Launcher => format!("--nproc-per-node {local}"),
        RanksFrom::Environment => format!("WORLD_SIZE={world_size} (LOCAL_WORLD_SIZE={local})"),
    };
    let alone = match from {
        RanksFrom::Launcher => "drop --nproc-per-node to train in one process",
        RanksFrom::Environment => {
            "start the command alone, without a launcher, to train in one process"
        }
    };
    if world_size == 0 || local == 0 {
        return Err(Error::InvalidInput(format!(
            "{asked}: a job has at least 1 process; {alone}"
        )));
    }
    if world_size == 1 {
        return Ok(()); // one process: any build, any device
    }
    if !cfg!(feature = "nccl") {
        return Err(Error::InvalidInput(format!(
            "{asked}: this build trains in one process; several need a build with the `nccl` feature (cargo build \
             --release --features nccl) and a GPU for each; {alone}"
        )));
    }
    let gpus = visible_gpus();
    if local > gpus {
        let visible = std::env::var("CUDA_VISIBLE_DEVICES")
            .map(|v| format!(" (CUDA_VISIBLE_DEVICES={v:?})"))
            .unwrap_or_default();
        let fewer = match (from, gpus) {
            (_, 0 | 1) => alone.to_string(),
            (RanksFrom::Launcher, n) => format!("use --nproc-per-node {n}"),
            (RanksFrom::Environment, n) => format!("start at most {n} ranks on this machine"),
        };
        return Err(Error::InvalidInput(format!(
            "{asked}: each rank trains on a GPU of its own, and this machine has {gpus}{visible}; {fewer}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_this_build_cannot_run_are_refused_naming_the_setting() {
        check_ranks(1, 1, RanksFrom::Launcher).unwrap();
        let err = check_ranks(0, 0, RanksFrom::Launcher)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("--nproc-per-node 0: a job has at least 1 process"),
            "{err}"
        );
        let err = check_ranks(4096, 4096, RanksFrom::Launcher)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("--nproc-per-node 4096: "), "{err}");
        assert!(err.contains("drop --nproc-per-node"), "{err}");
        let err = check_ranks(16, 8, RanksFrom::Environment)
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("WORLD_SIZE=16 (LOCAL_WORLD_SIZE=8): "),
            "{err}"
        );
        if !cfg!(feature = "nccl") {
            assert!(err.contains("the `nccl` feature"), "{err}");
        }
    }
}
