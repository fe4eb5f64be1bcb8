//! A CUDA device's allocations, seen for memory snapshots ([`super::snapshot::Source::CudaPool`]).
//!
//! Candle allocates every CUDA tensor's buffer through cudarc, which calls the driver's `cuMemAllocAsync` (the
//! device's stream-ordered pool; `cuMemAlloc_v2` on a device without one) and frees it with `cuMemFreeAsync`
//! (`cuMemFree_v2`) — calls linked against libcuda by name. PyTorch sees its allocations in its own caching
//! allocator; we have no allocator of our own on the GPU, so this module defines those four functions in the
//! program itself, as profilers interpose them: the static linker binds cudarc's calls to these definitions (a
//! program's own symbol comes before a shared library's), and each forwards to the driver's function — the next
//! definition after the program's, found once with `dlsym(RTLD_NEXT, …)` — and tells the recorder. Allocations the
//! CUDA libraries make for themselves (cuBLAS' workspace, NCCL's buffers) reach the driver another way and are not
//! in the snapshot, as they are not in PyTorch's.
//!
//! [`check`] makes sure the hooks are in the program before a recording relies on them.

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use candle_core::cuda_backend::cudarc::driver::sys::{self, CUdeviceptr, CUresult, CUstream};
use candle_core::{DType, Device, Tensor};

use super::snapshot::{on_device_alloc, on_device_free, on_device_oom};
use crate::error::{Error, Result};

/// Allocations that went through the hooks since the program started.
static SEEN: AtomicU64 = AtomicU64::new(0);

/// Checks that an allocation on `device` passes through the hooks (they are linked into this program).
pub(crate) fn check(device: &Device) -> Result<()> {
    // Naming the hooks keeps them in the program whatever the linker would otherwise leave out.
    std::hint::black_box([
        cuMemAllocAsync as *const (),
        cuMemFreeAsync as *const (),
        cuMemAlloc_v2 as *const (),
        cuMemFree_v2 as *const (),
    ]);
    let before = SEEN.load(Ordering::Relaxed);
    drop(Tensor::zeros(256, DType::U8, device)?);
    if SEEN.load(Ordering::Relaxed) == before {
        return Err(Error::InvalidInput(
            "memory_snapshot cannot see this program's CUDA allocations (its calls to cuMemAllocAsync do not go \
             through candle_qlora's hooks: linked another way?); set memory_snapshot = false"
                .into(),
        ));
    }
    Ok(())
}

/// The driver's definition of `name` (the next one after this program's), looked up once into `slot`.
fn driver_function(slot: &OnceLock<usize>, name: &CStr) -> *mut c_void {
    // SAFETY: `dlsym` with a NUL-terminated name; RTLD_NEXT searches the objects loaded after this one.
    *slot.get_or_init(|| unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize)
        as *mut c_void
}

/// Counts and records an allocation of `bytes` at `*dptr` that ended in `result` (a refusal for lack of memory
/// with the bytes the device had free).
///
/// # Safety
/// `dptr` is the pointer the driver wrote to (valid when `result` is success).
unsafe fn allocated(result: CUresult, dptr: *mut CUdeviceptr, bytes: usize) -> CUresult {
    if result == CUresult::CUDA_SUCCESS && bytes > 0 && *dptr != 0 {
        SEEN.fetch_add(1, Ordering::Relaxed);
        on_device_alloc(*dptr as usize, bytes);
    } else if result == CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        let (mut free, mut total) = (0usize, 0usize);
        // A failed query leaves `free` at 0.
        let _ = sys::cuMemGetInfo_v2(&mut free, &mut total);
        on_device_oom(bytes, free);
    }
    result
}

/// The driver's `cuMemAllocAsync`, recorded.
///
/// # Safety
/// As the driver's function: `dptr` writable, `stream` a live stream of the current context.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    dptr: *mut CUdeviceptr,
    bytesize: usize,
    stream: CUstream,
) -> CUresult {
    static NEXT: OnceLock<usize> = OnceLock::new();
    let next = driver_function(&NEXT, c"cuMemAllocAsync");
    if next.is_null() {
        return CUresult::CUDA_ERROR_NOT_FOUND;
    }
    type Alloc = unsafe extern "C" fn(*mut CUdeviceptr, usize, CUstream) -> CUresult;
    let next: Alloc = std::mem::transmute(next);
    allocated(next(dptr, bytesize, stream), dptr, bytesize)
}

/// The driver's `cuMemAlloc_v2`, recorded.
///
/// # Safety
/// As the driver's function: `dptr` writable, a context current.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    static NEXT: OnceLock<usize> = OnceLock::new();
    let next = driver_function(&NEXT, c"cuMemAlloc_v2");
    if next.is_null() {
        return CUresult::CUDA_ERROR_NOT_FOUND;
    }
    type Alloc = unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult;
    let next: Alloc = std::mem::transmute(next);
    allocated(next(dptr, bytesize), dptr, bytesize)
}

/// The driver's `cuMemFreeAsync`, recorded (before the driver may hand the address out again).
///
/// # Safety
/// As the driver's function: `dptr` allocated by the driver, `stream` a live stream.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    static NEXT: OnceLock<usize> = OnceLock::new();
    let next = driver_function(&NEXT, c"cuMemFreeAsync");
    if next.is_null() {
        return CUresult::CUDA_ERROR_NOT_FOUND;
    }
    type Free = unsafe extern "C" fn(CUdeviceptr, CUstream) -> CUresult;
    let next: Free = std::mem::transmute(next);
    on_device_free(dptr as usize);
    next(dptr, stream)
}

/// The driver's `cuMemFree_v2`, recorded (before the driver may hand the address out again).
///
/// # Safety
/// As the driver's function: `dptr` allocated by the driver.
#[no_mangle]
pub unsafe extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult {
    static NEXT: OnceLock<usize> = OnceLock::new();
    let next = driver_function(&NEXT, c"cuMemFree_v2");
    if next.is_null() {
        return CUresult::CUDA_ERROR_NOT_FOUND;
    }
    type Free = unsafe extern "C" fn(CUdeviceptr) -> CUresult;
    let next: Free = std::mem::transmute(next);
    on_device_free(dptr as usize);
    next(dptr)
}
