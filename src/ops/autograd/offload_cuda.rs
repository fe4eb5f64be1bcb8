//! The CUDA side of [`super::offload`]: a copy stream, pinned host buffers and the events that order the two
//! streams. Every wait is a stream's wait on an event, so the host never stops for a copy:
//! - to the host: the copy stream waits for the compute stream's work so far (the input is written), copies, and
//!   records `copied`; before the device buffer is freed (stream-ordered, on the compute stream) the compute stream
//!   waits for `copied`, so the memory is not reused while the copy reads it;
//! - to the device: the buffer is allocated on the compute stream, the copy stream waits for the compute stream's
//!   work so far (the pool may hand out memory earlier kernels still read), copies, and records `ready`; the compute
//!   stream waits for `ready` just before the block that reads the input is recomputed.
//!
//! Pinned buffers are reused only by later copies on the same copy stream, which runs in order.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{CudaEvent, CudaStream};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Shape, Tensor};

pub(crate) use crate::cuda::side_stream::Pinned;
use crate::cuda::side_stream::{mark, new_stream, wait};

/// The copy stream of a device and the pinned buffers not in use.
#[derive(Default)]
pub(crate) struct Buffers {
    copy_stream: Option<Arc<CudaStream>>,
    free: Vec<Pinned>,
}

impl Buffers {
    /// The copy stream on `device` (made on first use).
    fn stream(&mut self, device: &CudaDevice) -> Result<Arc<CudaStream>> {
        if let Some(s) = &self.copy_stream {
            return Ok(s.clone());
        }
        let stream = new_stream(device)?;
        self.copy_stream = Some(stream.clone());
        Ok(stream)
    }

    /// The smallest free buffer that holds `len` elements of `dtype`, if one is pooled (rows of other lengths reuse
    /// the buffers of longer ones).
    fn take(&mut self, dtype: DType, len: usize) -> Option<Pinned> {
        let at = (0..self.free.len())
            .filter(|&i| self.free[i].dtype() == dtype && self.free[i].len() >= len)
            .min_by_key(|&i| self.free[i].len())?;
        Some(self.free.swap_remove(at))
    }

    /// Gives `pinned` back for reuse.
    pub(crate) fn give_back(&mut self, pinned: Pinned) {
        self.free.push(pinned);
    }
}

/// A block input copied to pinned host memory; while `source` is held, the device buffer it was copied from.
pub(crate) struct HostCopy {
    pinned: Option<Pinned>,
    shape: Shape,
    device: CudaDevice,
    copy_stream: Arc<CudaStream>,
    copied: CudaEvent,
    source: Option<Tensor>,
}

impl HostCopy {
    /// Lets the device buffer go once the copy has read it (the compute stream waits for the copy there).
    pub(crate) fn release_source(&mut self) -> Result<()> {
        if let Some(source) = self.source.take() {
            wait(&self.device.cuda_stream(), &self.copied)?;
            drop(source);
        }
        Ok(())
    }
}

impl Drop for HostCopy {
    fn drop(&mut self) {
        // An error here leaves the buffer to the stream's own order; nothing better can be done in a drop.
        let _ = self.release_source();
    }
}

/// Starts copying `x` (on `device`) to a pinned buffer from `buffers`, or a new one (added to `pinned_bytes`).
pub(crate) fn to_host(
    device: &CudaDevice,
    x: &Tensor,
    buffers: &mut Buffers,
    pinned_bytes: &mut u64,
) -> Result<HostCopy> {
    let x = x.contiguous()?;
    let len = x.elem_count();
    let copy_stream = buffers.stream(device)?;
    let pinned = match buffers.take(x.dtype(), len) {
        Some(p) => p,
        None => {
            let p = Pinned::new(device, x.dtype(), len, "activation offload")?;
            *pinned_bytes += p.bytes();
            p
        }
    };
    // SAFETY: the buffer holds `len` elements of x's dtype, and only the copy stream touches it.
    unsafe { pinned.copy_from_device(device, &copy_stream, &x)? };
    let copied = mark(&copy_stream)?;
    Ok(HostCopy {
        pinned: Some(pinned),
        shape: x.shape().clone(),
        device: device.clone(),
        copy_stream,
        copied,
        source: Some(x),
    })
}

/// A block input on its way back to the device.
pub(crate) struct Loading {
    tensor: Tensor,
    device: CudaDevice,
    ready: CudaEvent,
}

impl Loading {
    /// The tensor, once the compute stream has been told to wait for its copy.
    pub(crate) fn wait(self) -> Result<Tensor> {
        wait(&self.device.cuda_stream(), &self.ready)?;
        Ok(self.tensor)
    }
}

/// Starts copying `host` back to its device; returns the tensor being filled and the pinned buffer (free for the
/// copy stream's later copies).
pub(crate) fn to_device(mut host: HostCopy) -> Result<(Loading, Pinned)> {
    host.release_source()?;
    let device = host.device.clone();
    let pinned = host
        .pinned
        .take()
        .ok_or_else(|| candle_core::Error::Msg("activation offload: loaded twice".into()))?;
    // SAFETY: the buffer holds the input's elements, written by the copy to the host earlier on the same stream,
    // which is the only one touching it.
    let tensor = unsafe { pinned.copy_to_device(&device, &host.copy_stream, host.shape.clone())? };
    let ready = mark(&host.copy_stream)?;
    Ok((
        Loading {
            tensor,
            device,
            ready,
        },
        pinned,
    ))
}
