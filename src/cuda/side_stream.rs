//! Work on a second stream beside a device's compute stream (copies to and from the host, collectives): the pinned
//! host buffers such copies go through, and the events that order the two streams without stopping the host.

use std::sync::Arc;

use candle_core::cuda_backend::cudarc::driver::{
    sys::CUevent_flags, CudaContext, CudaEvent, CudaStream, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result, Shape, Tensor};

use super::{alloc, hold, tensor};

/// Runs `$body` with `$T` the Rust type of `$dtype` (u8 or a float dtype); `$what` names the data in the error for
/// another dtype.
macro_rules! with_pinned_type {
    ($dtype:expr, $what:expr, $T:ident, $body:block) => {
        match $dtype {
            DType::U8 => {
                type $T = u8;
                $body
            }
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
                "{}: no pinned host copy for {other:?} (u8, float64, float32, bfloat16 or float16)",
                $what
            ),
        }
    };
}

/// A pinned host buffer: its allocation, and its address read once when it was made (cudarc's accessors wait for
/// the host each time; the copies here are ordered by their stream instead). It holds up to `len` elements of
/// `dtype`; a copy may use its start only.
pub(crate) struct Pinned {
    /// The `PinnedHostSlice` of the buffer's dtype, held so the memory lives as long as this.
    _memory: Box<dyn std::any::Any + Send + Sync>,
    address: usize,
    len: usize,
    dtype: DType,
}

/// `len` elements of pinned host memory on `context`, and their address.
fn pin<T: DeviceRepr + ValidAsZeroBits>(
    context: &Arc<CudaContext>,
    len: usize,
) -> Result<(PinnedHostSlice<T>, usize)> {
    // SAFETY: the buffer is written (by a copy, or from the host) before anything reads it.
    let mut memory = unsafe { context.alloc_pinned::<T>(len) }.map_err(candle_core::Error::wrap)?;
    let address = memory.as_mut_ptr().map_err(candle_core::Error::wrap)? as usize;
    Ok((memory, address))
}

impl Pinned {
    /// A new buffer of `len` elements of `dtype` on `device`'s context; `what` names its use in errors.
    pub(crate) fn new(device: &CudaDevice, dtype: DType, len: usize, what: &str) -> Result<Self> {
        let context = device.cuda_stream().context().clone();
        let (memory, address) = with_pinned_type!(dtype, what, T, {
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

    /// A buffer holding the elements of `host` (a 1-D tensor in host memory), pinned on `device`'s context.
    pub(crate) fn from_host(device: &CudaDevice, host: &Tensor, what: &str) -> Result<Self> {
        let pinned = Pinned::new(device, host.dtype(), host.elem_count(), what)?;
        with_pinned_type!(host.dtype(), what, T, {
            let values = host.flatten_all()?.to_vec1::<T>()?;
            // SAFETY: the buffer was just made for these elements; no stream uses it yet.
            unsafe { pinned.elements::<T>(values.len()) }.copy_from_slice(&values);
        });
        Ok(pinned)
    }

    /// Its elements.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Its dtype.
    pub(crate) fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its size in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        (self.len * self.dtype.size_in_bytes()) as u64
    }

    /// The first `len` elements, for a copy on one stream.
    ///
    /// # Safety
    /// `T` is the buffer's dtype, `len` at most its length, and only copies on one stream (which runs in order)
    /// touch the memory while any may be in flight.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn elements<T>(&self, len: usize) -> &mut [T] {
        std::slice::from_raw_parts_mut(self.address as *mut T, len)
    }

    /// Starts copying the first `shape.elem_count()` elements to a new tensor on `device`, on `stream`: the
    /// buffer is allocated on the compute stream, so `stream` waits for the compute stream's work so far (the pool
    /// may hand out memory earlier kernels still read) before the copy. The copy is finished when an event recorded
    /// on `stream` afterwards is.
    ///
    /// # Safety
    /// Nothing writes the buffer until the copy is done (only copies on `stream` touch it).
    pub(crate) unsafe fn copy_to_device(
        &self,
        device: &CudaDevice,
        stream: &Arc<CudaStream>,
        shape: Shape,
    ) -> Result<Tensor> {
        let len = shape.elem_count();
        with_pinned_type!(self.dtype, "a pinned copy", T, {
            let mut dst = alloc::<T>(device, len)?;
            after_compute(device, stream)?;
            let source = self.elements::<T>(len);
            stream
                .memcpy_htod(&*source, &mut dst)
                .map_err(candle_core::Error::wrap)?;
            Ok(tensor(dst, device, shape))
        })
    }

    /// Starts copying `x` (contiguous, on `device`) into this buffer on `stream`, after the compute stream's work
    /// so far (which wrote `x`). The copy is finished when an event recorded on `stream` afterwards is.
    ///
    /// # Safety
    /// The buffer holds `x`'s dtype and elements, and only copies on `stream` touch it.
    pub(crate) unsafe fn copy_from_device(
        &self,
        device: &CudaDevice,
        stream: &Arc<CudaStream>,
        x: &Tensor,
    ) -> Result<()> {
        let len = x.elem_count();
        after_compute(device, stream)?;
        with_pinned_type!(x.dtype(), "a pinned copy", T, {
            let held = hold(x)?;
            let host = self.elements::<T>(len);
            stream
                .memcpy_dtoh(&held.view::<T>()?, host)
                .map_err(candle_core::Error::wrap)?;
        });
        Ok(())
    }
}

/// Makes `stream`'s later work wait for the work queued so far on `device`'s compute stream (nothing to do when
/// `stream` is the compute stream).
pub(crate) fn after_compute(device: &CudaDevice, stream: &CudaStream) -> Result<()> {
    let compute = device.cuda_stream();
    match stream.cu_stream() == compute.cu_stream() {
        true => Ok(()),
        false => wait(stream, &mark(&compute)?),
    }
}

/// A new stream beside `device`'s compute stream.
pub(crate) fn new_stream(device: &CudaDevice) -> Result<Arc<CudaStream>> {
    device
        .cuda_stream()
        .context()
        .new_stream()
        .map_err(candle_core::Error::wrap)
}

/// The stream `cell` holds, made beside `device`'s compute stream the first time.
pub(crate) fn made_once(
    cell: &std::sync::OnceLock<Arc<CudaStream>>,
    device: &CudaDevice,
) -> Result<Arc<CudaStream>> {
    if let Some(stream) = cell.get() {
        return Ok(stream.clone());
    }
    let made = new_stream(device)?;
    Ok(cell.get_or_init(|| made).clone())
}

/// An event without timing (cheaper to record) on `stream`: it completes when the work queued there so far has.
pub(crate) fn mark(stream: &CudaStream) -> Result<CudaEvent> {
    stream
        .record_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
        .map_err(candle_core::Error::wrap)
}

/// Makes `stream`'s later work wait for `event` (the host does not wait).
pub(crate) fn wait(stream: &CudaStream, event: &CudaEvent) -> Result<()> {
    stream.wait(event).map_err(candle_core::Error::wrap)
}
