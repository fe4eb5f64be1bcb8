//! The heap's live bytes and their peak, as [`super::TrackingAllocator`] counts them: the allocator adds and
//! removes, the snapshot recorder takes its own buffers out (`exclude`), and statistics read them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);
static TRACKING: AtomicBool = AtomicBool::new(false);

/// Counts `bytes` allocated.
pub(super) fn added(bytes: usize) {
    let now = ALLOCATED.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

/// Records that the tracking allocator is in use (it has made an allocation).
pub(super) fn mark_tracking() {
    TRACKING.store(true, Ordering::Relaxed);
}

/// Counts `bytes` freed.
pub(super) fn removed(bytes: usize) {
    ALLOCATED.fetch_sub(bytes as u64, Ordering::Relaxed);
}

/// Takes `bytes` out of the count (and puts them back with `back`): the snapshot recorder's own buffers are not
/// the program's memory, as PyTorch's recorded history is not counted in the CUDA memory it describes.
pub(crate) fn exclude(bytes: usize, back: bool) {
    if back {
        added(bytes);
    } else {
        removed(bytes);
    }
}

/// True when [`super::TrackingAllocator`] is the global allocator (it has counted an allocation).
pub fn tracking() -> bool {
    TRACKING.load(Ordering::Relaxed)
}

/// Heap bytes allocated now and their peak, when tracked.
pub fn allocated() -> Option<(u64, u64)> {
    tracking().then(|| {
        (
            ALLOCATED.load(Ordering::Relaxed),
            PEAK.load(Ordering::Relaxed),
        )
    })
}

/// Resets the tracked peak to the bytes allocated now.
pub(crate) fn reset_heap_peak() {
    PEAK.store(ALLOCATED.load(Ordering::Relaxed), Ordering::Relaxed);
}
