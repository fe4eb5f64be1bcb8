//! Measured memory: heap bytes the process allocated (exact, when [`super::TrackingAllocator`] is the global
//! allocator — Candle's CPU tensors live on the heap, so this is the library's accounting of tensor storage), what
//! the operating system says the process holds (resident set, its peak, the machine's total and available memory;
//! Linux reads `/proc`, elsewhere those values are `None`), and a CUDA device's memory pool.

use candle_core::Device;

use super::heap::{allocated, reset_heap_peak};

/// Memory of a device, in bytes (`None` where it cannot be measured).
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct MemoryStats {
    /// The device (`cpu`, `cuda:0`).
    pub device: String,
    /// Bytes allocated now (CPU: heap bytes counted by [`super::TrackingAllocator`]).
    pub allocated: Option<u64>,
    /// Peak of `allocated` since the start or the last [`reset_peak`].
    pub peak_allocated: Option<u64>,
    /// Bytes the process holds from the system (CPU: resident set).
    pub reserved: Option<u64>,
    /// Peak of `reserved` (CPU: `VmHWM`, reset with [`reset_peak`] where Linux allows).
    pub peak_reserved: Option<u64>,
    /// Device capacity (CPU: physical memory).
    pub total: Option<u64>,
    /// Still available (CPU: `MemAvailable`).
    pub available: Option<u64>,
}

/// Memory statistics of `device`. On CPU: tracked heap bytes and the process' resident set. On CUDA (builds with
/// the `cuda` feature): the device's stream-ordered memory pool, which Candle allocates from — bytes in use and
/// their high-water mark (`allocated`, `peak_allocated`), bytes the pool holds from the driver and their
/// high-water mark (`reserved`, `peak_reserved`) — and the driver's `cuMemGetInfo` (`total`, `available`).
/// Other devices: all `None` but the name.
pub fn stats(device: &Device) -> MemoryStats {
    match device {
        Device::Cpu => {
            let p = process_memory();
            let tracked = allocated();
            MemoryStats {
                device: "cpu".into(),
                allocated: tracked.map(|t| t.0),
                peak_allocated: tracked.map(|t| t.1),
                reserved: p.rss,
                peak_reserved: p.peak_rss,
                total: p.total,
                available: p.available,
            }
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => cuda_pool::stats(cuda).unwrap_or_else(|_| MemoryStats {
            device: format!("{:?}", device.location()),
            ..Default::default()
        }),
        other => MemoryStats {
            device: format!("{:?}", other.location()),
            ..Default::default()
        },
    }
}

/// Resets the peaks of `device`'s memory: on CPU as [`reset_peak`], on CUDA the pool's high-water marks (to the
/// bytes in use now). Returns false where a peak could not be reset.
pub fn reset_device_peak(device: &Device, include_resident_set: bool) -> bool {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => cuda_pool::reset_peak(cuda).is_ok(),
        _ => reset_peak(include_resident_set),
    }
}

/// The CUDA device's memory pool (the one `cuMemAllocAsync`, and so Candle, allocates from).
#[cfg(feature = "cuda")]
mod cuda_pool {
    use candle_core::cuda_backend::cudarc::driver::{sys, DriverError};
    use candle_core::CudaDevice;

    use super::MemoryStats;

    /// The device's current pool, with its context bound to this thread and its stream drained (frees are
    /// stream-ordered: the counters are exact once the stream is idle).
    fn pool(cuda: &CudaDevice) -> Result<sys::CUmemoryPool, DriverError> {
        let stream = cuda.cuda_stream();
        stream.synchronize()?;
        let ctx = stream.context();
        ctx.bind_to_thread()?;
        let mut pool = std::mem::MaybeUninit::uninit();
        // SAFETY: the context is current and `pool` is a valid out-pointer.
        unsafe { sys::cuDeviceGetMemPool(pool.as_mut_ptr(), ctx.cu_device()).result()? };
        // SAFETY: written by the successful call above.
        Ok(unsafe { pool.assume_init() })
    }

    fn attribute(
        pool: sys::CUmemoryPool,
        attr: sys::CUmemPool_attribute,
    ) -> Result<u64, DriverError> {
        let mut value = 0u64;
        // SAFETY: the four byte-count attributes are 64-bit values.
        unsafe {
            sys::cuMemPoolGetAttribute(pool, attr, (&mut value as *mut u64).cast()).result()?;
        }
        Ok(value)
    }

    pub(super) fn stats(cuda: &CudaDevice) -> Result<MemoryStats, DriverError> {
        use sys::CUmemPool_attribute::*;
        let pool = pool(cuda)?;
        let (free, total) = cuda.cuda_stream().context().mem_get_info()?;
        Ok(MemoryStats {
            device: format!("cuda:{}", cuda.cuda_stream().context().ordinal()),
            allocated: Some(attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?),
            peak_allocated: Some(attribute(pool, CU_MEMPOOL_ATTR_USED_MEM_HIGH)?),
            reserved: Some(attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?),
            peak_reserved: Some(attribute(pool, CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?),
            total: Some(total as u64),
            available: Some(free as u64),
        })
    }

    pub(super) fn reset_peak(cuda: &CudaDevice) -> Result<(), DriverError> {
        use sys::CUmemPool_attribute::*;
        let pool = pool(cuda)?;
        for attr in [
            CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
        ] {
            // The driver only accepts 0: the high-water mark restarts from the current value.
            let mut zero = 0u64;
            // SAFETY: a 64-bit value for a 64-bit attribute.
            unsafe {
                sys::cuMemPoolSetAttribute(pool, attr, (&mut zero as *mut u64).cast()).result()?;
            }
        }
        Ok(())
    }
}

/// A process-level memory reading, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct ProcessMemory {
    /// Resident set size now (`VmRSS`).
    pub rss: Option<u64>,
    /// Peak resident set size since the process started, or since [`reset_peak`] (`VmHWM`).
    pub peak_rss: Option<u64>,
    /// Physical memory of the machine (`MemTotal`).
    pub total: Option<u64>,
    /// Memory the kernel could still give without swapping (`MemAvailable`).
    pub available: Option<u64>,
}

/// The value of `key` (in KiB in the file) from a `/proc` file, in bytes.
fn proc_kib(file: &str, key: &str) -> Option<u64> {
    let text = std::fs::read_to_string(file).ok()?;
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Reads the process' memory now.
pub fn process_memory() -> ProcessMemory {
    ProcessMemory {
        rss: proc_kib("/proc/self/status", "VmRSS:"),
        peak_rss: proc_kib("/proc/self/status", "VmHWM:"),
        total: proc_kib("/proc/meminfo", "MemTotal:"),
        available: proc_kib("/proc/meminfo", "MemAvailable:"),
    }
}

/// Resets the tracked peak to the bytes allocated now. With `include_resident_set`, also the resident-set peak
/// (Linux: writes 5 to `/proc/self/clear_refs`; returns false where that is not allowed).
pub fn reset_peak(include_resident_set: bool) -> bool {
    reset_heap_peak();
    !include_resident_set || std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// True if `message` (an error's text) is an out-of-memory failure of a device allocator.
pub fn is_out_of_memory(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("out of memory")
        || m.contains("out_of_memory")
        || m.contains("memory allocation failed")
}

/// `bytes` as a short human string (`1.23 GiB`, `512.0 MiB`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognizes_allocator_failures() {
        assert!(is_out_of_memory(
            "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")"
        ));
        assert!(is_out_of_memory(
            "CUDA out of memory. Tried to allocate 2.00 GiB"
        ));
        assert!(!is_out_of_memory("shape mismatch in matmul"));
    }

    #[test]
    fn reads_this_process_and_formats_sizes() {
        let m = process_memory();
        if cfg!(target_os = "linux") {
            let (rss, peak, total) = (m.rss.unwrap(), m.peak_rss.unwrap(), m.total.unwrap());
            assert!(rss > 1 << 20 && peak >= rss && total > rss, "{m:?}");
        }
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 * 1024 * 1024 / 2), "1.50 MiB");
        assert_eq!(human_bytes(5 << 30), "5.00 GiB");
    }
}
