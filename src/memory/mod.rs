//! Where training memory goes: measurement ([`stats`]), a per-phase timeline with a breakdown by category at the
//! peak ([`timeline`]), prediction before a run ([`estimate`]), and the out-of-memory report ([`oom`]).

pub mod estimate;
pub mod oom;
pub mod reuse;
pub mod stats;
pub mod timeline;

pub use estimate::{comparison, estimate, kept_layers, DeviceKind, Estimate, EstimateArgs, Regime};
pub use oom::{is_out_of_memory, oom_report};
pub use reuse::keep_freed_memory;
pub use stats::{
    allocated, human_bytes, process_memory, reset_device_peak, reset_peak, stats, tracking,
    MemoryStats, ProcessMemory, TrackingAllocator,
};
pub use timeline::{Breakdown, MemoryTimeline, Phase, PhaseSample};
