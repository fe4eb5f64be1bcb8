//! Activation offload (torchtune's idea): the inputs a chain of checkpointed blocks saves for the backward wait in
//! pinned host memory instead of on the GPU, so the device holds O(1) of them rather than one per block.
//!
//! On a CUDA device each saved input is copied to the host on a copy stream of its own while its block computes,
//! and brought back one block ahead of the backward's recomputation; the streams are ordered by events, never by a
//! host synchronization (see `offload_cuda`). On the CPU the host memory is the device's: an input stays where it is.
//!
//! The pinned buffers are kept for the next step (pinning memory is slow) and counted:
//! [`ActivationOffload::host_bytes`].

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::{Result, Tensor};

/// Where a chain of checkpointed blocks keeps the inputs it saves for the backward: pinned host memory, reused from
/// step to step. Clones share the buffers.
#[derive(Clone, Default)]
pub struct ActivationOffload {
    inner: Arc<Mutex<Pool>>,
}

/// The copy stream and the pinned buffers not in use, and the bytes pinned in all.
#[derive(Default)]
struct Pool {
    #[cfg(feature = "cuda")]
    cuda: super::offload_cuda::Buffers,
    pinned_bytes: u64,
}

impl ActivationOffload {
    /// A store with nothing pinned yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes of pinned host memory this store holds (its high-water mark: buffers are kept for reuse).
    pub fn host_bytes(&self) -> u64 {
        self.inner.lock().map(|p| p.pinned_bytes).unwrap_or(0)
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn pool(&self) -> Result<MutexGuard<'_, Pool>> {
        self.inner
            .lock()
            .map_err(|_| candle_core::Error::Msg("activation offload: poisoned buffer pool".into()))
    }

    /// Saves `x` for the backward: a copy to the host on the copy stream (a CUDA tensor), or `x` itself (a CPU
    /// tensor).
    pub(crate) fn save(&self, x: &Tensor) -> Result<Saved> {
        match x.device() {
            #[cfg(feature = "cuda")]
            candle_core::Device::Cuda(device) => {
                let mut pool = self.pool()?;
                let pool = &mut *pool;
                let copy = super::offload_cuda::to_host(
                    device,
                    x,
                    &mut pool.cuda,
                    &mut pool.pinned_bytes,
                )?;
                Ok(Saved::Host {
                    copy,
                    pool: self.clone(),
                })
            }
            _ => Ok(Saved::Kept(x.clone())),
        }
    }
}

/// A saved block input: kept as it is, or copied to pinned host memory.
pub(crate) enum Saved {
    /// The tensor itself (the CPU, or no offload).
    Kept(Tensor),
    /// A copy in pinned host memory, and the store its buffer returns to.
    #[cfg(feature = "cuda")]
    Host {
        copy: super::offload_cuda::HostCopy,
        pool: ActivationOffload,
    },
}

impl Saved {
    /// Lets go of the device buffer the input was copied from (once its block has run: the block reads it). A kept
    /// input stays.
    pub(crate) fn release_source(&mut self) -> Result<()> {
        match self {
            Saved::Kept(_) => Ok(()),
            #[cfg(feature = "cuda")]
            Saved::Host { copy, .. } => copy.release_source(),
        }
    }

    /// Starts bringing the input back to the device; a pinned buffer returns to its store.
    pub(crate) fn load(self) -> Result<Loading> {
        match self {
            Saved::Kept(x) => Ok(Loading::Ready(x)),
            #[cfg(feature = "cuda")]
            Saved::Host { copy, pool } => {
                let (loading, pinned) = super::offload_cuda::to_device(copy)?;
                pool.pool()?.cuda.give_back(pinned);
                Ok(Loading::Cuda(loading))
            }
        }
    }
}

/// A saved input on its way back to the device.
pub(crate) enum Loading {
    /// Already there.
    Ready(Tensor),
    /// Being copied on the copy stream.
    #[cfg(feature = "cuda")]
    Cuda(super::offload_cuda::Loading),
}

impl Loading {
    /// The input, with the compute stream told to wait for its copy.
    pub(crate) fn wait(self) -> Result<Tensor> {
        match self {
            Loading::Ready(x) => Ok(x),
            #[cfg(feature = "cuda")]
            Loading::Cuda(loading) => loading.wait(),
        }
    }
}
