//! The memory side of a run: the per-phase timeline of its steps ([`StepMemory`], drawn as `memory.svg` with the
//! estimate), the out-of-memory report a failed allocation becomes (with the snapshot dumped next to it), and the
//! allocation recording of `memory_snapshot`.

use std::path::PathBuf;

use candle_core::backprop::GradStore;
use candle_core::{Device, Var};

use super::oom::oom_report;
use crate::error::{Error, Result};
use crate::memory::snapshot::{write_snapshot, Recording, Source};
use crate::memory::{is_out_of_memory, MemoryTimeline, Phase};
use crate::ops::ActivationOffload;
use crate::trainer::settings::args::TrainingArguments;

/// The memory snapshot `memory_snapshot` writes, for pytorch.org/memory_viz.
pub const MEMORY_SNAPSHOT_FILE: &str = "memory_snapshot.pickle";

/// Bytes of the accumulated gradients of `vars`.
pub(crate) fn gradient_bytes(vars: &[Var], grads: &GradStore) -> u64 {
    vars.iter()
        .filter_map(|v| grads.get(v))
        .map(|g| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
        .sum()
}

/// The memory timeline of a run and what it needs to attribute bytes: the step being run and the optimizer's
/// state size.
pub(crate) struct StepMemory {
    /// The per-phase timeline.
    pub timeline: MemoryTimeline,
    /// The step being run.
    pub step: usize,
    /// Bytes of optimizer state on the training device.
    pub optimizer_bytes: u64,
    /// Where the memory snapshot is written when a step runs out of memory (`memory_snapshot`, the writing rank).
    pub snapshot_on_oom: Option<PathBuf>,
    /// The pinned host memory the recomputed layers' inputs wait in (`activation_offloading`), kept from step to
    /// step.
    pub offload: Option<ActivationOffload>,
}

impl StepMemory {
    /// Ends the current phase of micro-batch `micro_batch` with `gradients` bytes of gradients held.
    pub(crate) fn end_phase(&mut self, micro_batch: usize, gradients: u64) {
        if let Some(offload) = &self.offload {
            self.timeline.host_pinned_bytes = offload.host_bytes();
        }
        self.timeline
            .end_phase(self.step, micro_batch, self.optimizer_bytes, gradients);
    }

    /// `error` turned into the out-of-memory report when it is an allocation failure, with the memory snapshot
    /// written next to it when one is being recorded (PyTorch's "dump on OOM").
    pub(crate) fn explain(&self, error: Error, args: &TrainingArguments) -> Error {
        if !is_out_of_memory(&error.to_string()) {
            return error;
        }
        let live = self
            .timeline
            .breakdown_at_phase_peak(self.optimizer_bytes, 0);
        let phase = self.timeline.current_phase().unwrap_or(Phase::Forward);
        // The device's words are the error's first line (a backtrace may follow).
        let said = error.to_string();
        let snapshot = match self
            .snapshot_on_oom
            .as_deref()
            .map(|p| (p, write_snapshot(p)))
        {
            Some((path, Ok(true))) => format!(
                "\nmemory snapshot up to the failure: {} (open it in pytorch.org/memory_viz)",
                path.display()
            ),
            Some((_, Err(e))) => format!("\nthe memory snapshot could not be written: {e}"),
            _ => String::new(),
        };
        Error::OutOfMemory(format!(
            "{}\n(the device said: {}){snapshot}",
            oom_report(&live, self.step, phase, args),
            said.lines().next().unwrap_or_default()
        ))
    }
}

/// What `memory_snapshot` records on `device`: the CPU heap (counted by the tracking allocator) or a CUDA device's
/// pool; an error says why it cannot.
fn snapshot_source(device: &Device) -> Result<Source> {
    const NEEDS_TRACKING: &str =
        "memory_snapshot needs candle_qlora::memory::TrackingAllocator as the program's \
         #[global_allocator] (the qlora command has it)";
    match device {
        Device::Cpu if crate::memory::tracking() => Ok(Source::Heap),
        Device::Cpu => Err(Error::InvalidInput(NEEDS_TRACKING.into())),
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            crate::memory::cuda_hooks::check(device)?;
            Ok(Source::CudaPool {
                ordinal: cuda.cuda_stream().context().ordinal(),
            })
        }
        other => Err(Error::InvalidInput(format!(
            "memory_snapshot records the CPU heap or a CUDA device's pool, not {:?}'s memory: set \
             memory_snapshot = false",
            other.location()
        ))),
    }
}

/// Starts recording allocations for `memory_snapshot` on `device` (see [`snapshot_source`]), or joins the
/// recording already on.
pub(crate) fn start_memory_snapshot(
    device: &Device,
    args: &TrainingArguments,
) -> Result<Recording> {
    if args.memory_snapshot_max_entries == 0 {
        return Err(Error::InvalidInput(
            "memory_snapshot_max_entries must be at least 1".into(),
        ));
    }
    let source = snapshot_source(device)?;
    Ok(Recording::start(source, args.memory_snapshot_max_entries))
}
