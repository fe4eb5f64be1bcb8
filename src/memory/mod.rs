//! Where training memory goes: the heap under CPU tensors ([`allocator`], which counts its bytes in [`heap`]),
//! measurement ([`mod@stats`]), a per-phase timeline with a breakdown by category at the peak ([`timeline`]),
//! snapshots of every allocation in PyTorch's format ([`snapshot`], written with [`pickle`]; a CUDA pool's
//! allocations seen through `cuda_hooks`), and prediction before a run ([`mod@estimate`]).

pub mod allocator;
#[cfg(feature = "cuda")]
pub(crate) mod cuda_hooks;
pub mod estimate;
pub mod heap;
pub mod pickle;
pub mod snapshot;
pub mod stats;
pub mod timeline;

pub use allocator::{keep_freed_memory, TrackingAllocator};
pub use estimate::{
    comparison, estimate, kept_layers, max_seq_len, DataParallel, DeviceKind, Estimate,
    EstimateArgs, Regime, RunEstimate, DDP_BUCKET_CAP_MB, USABLE_GPU_MEMORY,
};
pub use heap::{allocated, tracking};
pub use stats::{
    human_bytes, is_out_of_memory, process_memory, reset_device_peak, reset_peak, stats,
    MemoryStats, ProcessMemory,
};
pub use timeline::{Breakdown, MemoryTimeline, Phase, PhaseSample};
