//! The heap under Candle's CPU tensors: counting its bytes ([`TrackingAllocator`], into `super::heap`) and keeping
//! freed memory for reuse instead of returning it to the operating system ([`keep_freed_memory`]).
//!
//! A training step allocates and frees the same activation-sized buffers (megabytes each) thousands of times.
//! glibc's allocator serves such sizes with fresh `mmap`s and unmaps them on free, so every buffer costs a page fault
//! per 4 KiB page and a zeroing of that page by the kernel — a sizeable share of a CPU step. Raising the mmap and
//! trim thresholds keeps freed buffers in the heap, where the next step's allocations find them. The resident set
//! then stays near the step's peak, which the process reaches anyway.

use std::alloc::{GlobalAlloc, Layout, System};

use super::heap::{added, mark_tracking, removed};
use super::snapshot::{on_alloc, on_free};

/// The system allocator, counting live bytes and their peak (and recording allocations for a memory snapshot while
/// [`super::snapshot::start_recording`] is on). Install it in a binary to get exact CPU numbers:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: candle_qlora::memory::TrackingAllocator = candle_qlora::memory::TrackingAllocator;
/// ```
pub struct TrackingAllocator;

// SAFETY: every call forwards to `System` with the caller's layout; the counters do not touch the memory.
unsafe impl GlobalAlloc for TrackingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            added(layout.size());
            mark_tracking();
            on_alloc(p as usize, layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            added(layout.size());
            mark_tracking();
            on_alloc(p as usize, layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // Recorded before the address can be handed out again.
        on_free(ptr as usize, layout.size());
        System.dealloc(ptr, layout);
        removed(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            removed(layout.size());
            added(new_size);
            on_free(ptr as usize, layout.size());
            on_alloc(p as usize, new_size);
        }
        p
    }
}

/// The largest block glibc accepts as the mmap threshold (`DEFAULT_MMAP_THRESHOLD_MAX` on 64-bit): 32 MiB.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 32 << 20;

/// Asks the C allocator to keep freed memory for reuse (see the module doc). Process-wide and idempotent; a no-op
/// where the allocator is not glibc's. The trainer calls it when training starts.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `mallopt` only changes allocator tuning parameters; any value is accepted or rejected by glibc.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}
