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

use candle_core::cuda_backend::cudarc::driver::{
    sys::CUevent_flags, CudaContext, CudaEvent, CudaStream, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Shape, Tensor};

use crate::cuda::{alloc, hold, tensor};

/// A pinned host buffer: its allocation, and its address read once when it was made (cudarc's accessors wait for
/// the host each time; the copies here are ordered by the copy stream instead). It holds up to `len` elements of
/// `dtype`; a copy may use its start only.
pub(crate) struct Pinned {
    /// The `PinnedHostSlice` of the buffer's dtype, held so the memory lives as long as this.
    _memory: Box<dyn std::any::Any + Send + Sync>,
    address: usize,
    len: usize,
    dtype: DType,
}

/// Runs `$body` with `$T` the Rust type of `$dtype`.
macro_rules! with_pinned_type {
    ($dtype:expr, $T:ident, $body:block) => {
        match $dtype {
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => candle_core::bail!(
                "activation offload: no host copy for {other:?} activations (float64, float32, bfloat16 or float16)"
            ),
        }
    };
}

/// `len` elements of pinned host memory on `context`, and their address.
fn pin<T: DeviceRepr + ValidAsZeroBits>(
    context: &Arc<CudaContext>,
    len: usize,
) -> Result<(PinnedHostSlice<T>, usize)> {
    // SAFETY: the buffer is written by a copy before anything reads it.
    let mut memory = unsafe { context.alloc_pinned::<T>(len) }.map_err(candle_core::Error::wrap)?;
    let address = memory.as_mut_ptr().map_err(candle_core::Error::wrap)? as usize;
    Ok((memory, address))
}

impl Pinned {
    /// A new buffer of `len` elements of `dtype` on `device`'s context.
    fn new(device: &CudaDevice, dtype: DType, len: usize) -> Result<Self> {
        let context = device.cuda_stream().context().clone();
        let (memory, address) = with_pinned_type!(dtype, T, {
            let (memory, address) = pin::<T>(&context, len)?;
            (
                Box::new(memory) as Box<dyn std::any::Any + Send + Sync>,
                address,
            )
        });
        Ok(Pinned {
            _memory: memory,
            address,
            len,
            dtype,
        })
    }

    fn bytes(&self) -> u64 {
        (self.len * self.dtype.size_in_bytes()) as u64
    }

    /// The first `len` elements, for a copy on the copy stream.
    ///
    /// # Safety
    /// `T` is the buffer's dtype, `len` at most its length, and only copies on the copy stream (which runs in
    /// order) touch the memory.
    #[allow(clippy::mut_from_ref)]
    unsafe fn elements<T>(&self, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.address as *mut T, len)
    }
}

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
        let stream = device
            .cuda_stream()
            .context()
            .new_stream()
            .map_err(candle_core::Error::wrap)?;
        self.copy_stream = Some(stream.clone());
        Ok(stream)
    }

    /// The smallest free buffer that holds `len` elements of `dtype`, if one is pooled (rows of other lengths reuse
    /// the buffers of longer ones).
    fn take(&mut self, dtype: DType, len: usize) -> Option<Pinned> {
        let at = (0..self.free.len())
            .filter(|&i| self.free[i].dtype == dtype && self.free[i].len >= len)
            .min_by_key(|&i| self.free[i].len)?;
        Some(self.free.swap_remove(at))
    }

    /// Gives `pinned` back for reuse.
    pub(crate) fn give_back(&mut self, pinned: Pinned) {
        self.free.push(pinned);
    }
}

/// An event without timing (cheaper to record) on `stream`.
fn mark(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(candle_core::Error::wrap)
}

fn wait(stream: &CudaStream, event: &CudaEvent) -> Result<()> {
    stream.wait(event).map_err(candle_core::Error::wrap)
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
            let p = Pinned::new(device, x.dtype(), len)?;
            *pinned_bytes += p.bytes();
            p
        }
    };
    wait(&copy_stream, &mark(&device.cuda_stream())?)?;
    with_pinned_type!(x.dtype(), T, {
        let held = hold(&x)?;
        // SAFETY: the buffer holds `len` elements of x's dtype, and only the copy stream touches it.
        let host = unsafe { pinned.elements::<T>(len) };
        copy_stream
            .memcpy_dtoh(&held.view::<T>()?, host)
            .map_err(candle_core::Error::wrap)?;
    });
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
    let len = host.shape.elem_count();
    let tensor = with_pinned_type!(pinned.dtype, T, {
        let mut dst = alloc::<T>(&device, len)?;
        wait(&host.copy_stream, &mark(&device.cuda_stream())?)?;
        // SAFETY: the buffer holds `len` elements of the input's dtype, written by the copy to the host earlier on
        // the same stream.
        let source = unsafe { pinned.elements::<T>(len) };
        host.copy_stream
            .memcpy_htod(&*source, &mut dst)
            .map_err(candle_core::Error::wrap)?;
        tensor(dst, &device, host.shape.clone())
    });
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
