//! The memory timeline of a run: for every micro-batch's forward and backward and every optimizer update, how long
//! it ran, the bytes live at its end and the peak inside it with a breakdown by category, and the run's estimate.
//! Written to `output_dir/memory_timeline.json` and drawn in `memory.svg` (memory over each step, stacked by
//! category, as PyTorch's memory_viz timeline draws it).

use std::path::Path;
use std::time::Instant;

use serde::Serialize;

use candle_core::Device;

use super::estimate::RunEstimate;
use super::heap::allocated;
use super::stats::{human_bytes, process_memory, reset_device_peak, stats};
use crate::error::{Error, Result};
use crate::plot::{memory_svg, MemoryPoint};
use crate::profile::context::{self, Phase as SnapshotPhase};

/// A phase of a training step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// Forward pass of a micro-batch (the graph and saved activations build up).
    Forward,
    /// Backward pass of a micro-batch (recomputation, gradients).
    Backward,
    /// Clipping and the optimizer update.
    Optimizer,
}

/// Bytes by category.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Breakdown {
    /// Frozen base weights (NF4 codes + quantization state, and the unquantized tensors).
    pub base_weights: u64,
    /// Trainable adapter parameters.
    pub lora: u64,
    /// Optimizer state.
    pub optimizer: u64,
    /// Gradients of the trainable parameters.
    pub gradients: u64,
    /// Everything the forward/backward holds beyond the above: saved activations, recomputed blocks, temporaries.
    pub activations: u64,
    /// What was allocated before training began besides the weights: tokenizer, data, runtime.
    pub other: u64,
}

impl Breakdown {
    /// The sum of the categories.
    pub fn total(&self) -> u64 {
        self.base_weights
            + self.lora
            + self.optimizer
            + self.gradients
            + self.activations
            + self.other
    }

    /// `(category, bytes)` pairs in a fixed order.
    pub fn rows(&self) -> [(&'static str, u64); 6] {
        [
            ("base weights", self.base_weights),
            ("LoRA parameters", self.lora),
            ("optimizer state", self.optimizer),
            ("gradients", self.gradients),
            ("activations", self.activations),
            ("other", self.other),
        ]
    }

    /// The chart's categories ([`CHART_CATEGORIES`], bottom to top), cut so they sum to `total`: each takes at most
    /// what the ones below it leave (the constant rows can exceed a low phase's bytes when memory counted as `other`
    /// at the start was freed since).
    fn chart_bytes(&self, total: u64) -> Vec<u64> {
        let mut left = total;
        [
            self.base_weights,
            self.other,
            self.lora + self.gradients + self.optimizer,
            self.activations,
        ]
        .into_iter()
        .map(|b| {
            let drawn = b.min(left);
            left -= drawn;
            drawn
        })
        .collect()
    }

    /// A small table, one category per line, with shares of the total.
    pub fn table(&self) -> String {
        let total = self.total().max(1) as f64;
        let mut lines: Vec<String> = self
            .rows()
            .iter()
            .map(|(name, b)| {
                format!(
                    "  {name:<16} {:>12}  {:>5.1}%",
                    human_bytes(*b),
                    100.0 * *b as f64 / total
                )
            })
            .collect();
        lines.push(format!(
            "  {:<16} {:>12}",
            "total",
            human_bytes(self.total())
        ));
        lines.join("\n")
    }
}

/// The categories of `memory.svg`, bottom to top: the constant ones first, so the changing ones sit on top.
const CHART_CATEGORIES: [&str; 4] = [
    "base weights",
    "other",
    "adapter, gradients, optimizer",
    "activations, autograd",
];

/// One measured phase.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PhaseSample {
    /// Optimizer step (1-based).
    pub step: usize,
    /// Micro-batch within the step (0 for the optimizer).
    pub micro_batch: usize,
    /// The phase.
    pub phase: Phase,
    /// Bytes live at the end of the phase.
    pub allocated: u64,
    /// Highest bytes live during the phase.
    pub peak: u64,
    /// How long the phase ran, in seconds.
    pub seconds: f64,
    /// What `peak` was made of.
    pub breakdown: Breakdown,
}

/// Samples of a run and the breakdown at its highest peak.
#[derive(Clone, Debug, Default, Serialize)]
pub struct MemoryTimeline {
    /// `heap` (tracked allocations), `resident set` (the operating system's view) or `device pool` (a GPU's
    /// memory pool).
    pub source: &'static str,
    /// Every phase, in order.
    pub samples: Vec<PhaseSample>,
    /// The highest peak and what it was made of.
    pub peak: Option<(PhaseSample, Breakdown)>,
    /// The memory estimate (`memory::estimate`) of the run (the trainer makes it for its longest micro-batch),
    /// drawn in `memory.svg` as a line to compare the measured phases with; `None`: no line.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimate: Option<RunEstimate>,
    /// Pinned host memory the run's offloaded activations wait in (`activation_offloading`; not part of `source`'s
    /// bytes).
    #[serde(skip_serializing_if = "is_zero")]
    pub host_pinned_bytes: u64,
    base_weights: u64,
    lora: u64,
    other: u64,
    #[serde(skip)]
    phase: Option<Phase>,
    /// When the current phase started.
    #[serde(skip)]
    phase_start: Option<Instant>,
    /// The device measured (`None`: the CPU).
    #[serde(skip)]
    device: Option<Device>,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Bytes live now and the peak since the last reset, from the best source available for `device`.
fn reading(device: Option<&Device>) -> Option<(u64, u64, &'static str)> {
    if let Some(device) = device.filter(|d| !d.is_cpu()) {
        let s = stats(device);
        return Some((s.allocated?, s.peak_allocated?, "device pool"));
    }
    if let Some((now, peak)) = allocated() {
        return Some((now, peak, "heap"));
    }
    let m = process_memory();
    Some((m.rss?, m.peak_rss?, "resident set"))
}

impl MemoryTimeline {
    /// A timeline of `device`'s memory whose constant categories are the model's weights and the adapter; what is
    /// allocated now beyond them is counted as `other`.
    pub fn new(device: &Device, base_weights: u64, lora: u64) -> Self {
        let device = (!device.is_cpu()).then(|| device.clone());
        let (now, _, source) = reading(device.as_ref()).unwrap_or((0, 0, "unavailable"));
        MemoryTimeline {
            source,
            base_weights,
            lora,
            other: now.saturating_sub(base_weights + lora),
            device,
            ..Default::default()
        }
    }

    /// Call when `phase` starts: resets the peak so the next sample sees only this phase.
    pub fn start_phase(&mut self, phase: Phase) {
        self.phase = Some(phase);
        context::set_phase(match phase {
            Phase::Forward => SnapshotPhase::Forward,
            Phase::Backward => SnapshotPhase::Backward,
            Phase::Optimizer => SnapshotPhase::Optimizer,
        });
        reset_device_peak(
            self.device.as_ref().unwrap_or(&Device::Cpu),
            self.source == "resident set",
        );
        self.phase_start = Some(Instant::now());
    }

    /// The phase running now (the last one started).
    pub fn current_phase(&self) -> Option<Phase> {
        self.phase
    }

    /// What was live at the highest point of the current phase, by category (`optimizer` and `gradients` are
    /// those categories' bytes now). After a failed allocation this is what the phase held when it failed: the
    /// failing op's tensors are already freed by then, but the peak remembers them.
    pub fn breakdown_at_phase_peak(&self, optimizer: u64, gradients: u64) -> Breakdown {
        let peak = reading(self.device.as_ref()).map_or(0, |r| r.1.max(r.0));
        self.breakdown(peak, optimizer, gradients)
    }

    fn breakdown(&self, bytes: u64, optimizer: u64, gradients: u64) -> Breakdown {
        let known = self.base_weights + self.lora + optimizer + gradients + self.other;
        Breakdown {
            base_weights: self.base_weights,
            lora: self.lora,
            optimizer,
            gradients,
            activations: bytes.saturating_sub(known),
            other: self.other,
        }
    }

    /// Records the phase that just ended; `optimizer` and `gradients` are the bytes of those categories now.
    pub fn end_phase(&mut self, step: usize, micro_batch: usize, optimizer: u64, gradients: u64) {
        context::set_phase(SnapshotPhase::Idle);
        let (Some((now, peak, _)), Some(phase)) = (reading(self.device.as_ref()), self.phase)
        else {
            return;
        };
        let peak = peak.max(now);
        let sample = PhaseSample {
            step,
            micro_batch,
            phase,
            allocated: now,
            peak,
            seconds: self
                .phase_start
                .map_or(0.0, |start| start.elapsed().as_secs_f64()),
            breakdown: self.breakdown(peak, optimizer, gradients),
        };
        if self.peak.as_ref().is_none_or(|(p, _)| sample.peak > p.peak) {
            self.peak = Some((sample.clone(), sample.breakdown.clone()));
        }
        self.samples.push(sample);
    }

    /// The summary lines: peak, where it happened, its breakdown, why a row may look odd, and the run's estimate
    /// with the `qlora estimate` flags that repeat it.
    pub fn summary(&self) -> Option<String> {
        let (s, b) = self.peak.as_ref()?;
        let mut text = format!(
            "peak memory {} ({}) at step {} {:?} (micro-batch {}):\n{}",
            human_bytes(s.peak),
            self.source,
            s.step,
            s.phase,
            s.micro_batch,
            b.table()
        );
        if b.gradients == 0 {
            text += "\n  (no gradients at this peak: it came before the step's first backward pass made any)";
        }
        if self.host_pinned_bytes > 0 {
            text += &format!(
                "\n  (and {} of pinned host memory holding the offloaded layer inputs)",
                human_bytes(self.host_pinned_bytes)
            );
        }
        if self.source == "resident set" {
            text += "\n  (measured as the resident set: without memory::TrackingAllocator as the global allocator \
                     the heap is not counted, and `activations` holds everything the other rows do not)";
        }
        if let Some(e) = &self.estimate {
            let total = human_bytes(e.prediction.total_bytes);
            text += &match e.args.flags() {
                Some(flags) => format!(
                    "\nestimate for this run {total}: `qlora estimate --model <the base model> {flags}` (--seq: \
                     the longest training example)"
                ),
                None => format!(
                    "\nestimate for this run {total} (its target_modules is a regex, which `qlora estimate` has \
                     no flag for)"
                ),
            };
        }
        Some(text)
    }

    /// Writes `memory_timeline.json` and `memory.svg` into `dir`.
    pub fn write(&self, dir: &Path) -> Result<()> {
        let json = dir.join("memory_timeline.json");
        let text = serde_json::to_string_pretty(self).unwrap_or_default();
        std::fs::write(&json, text).map_err(|e| Error::io("cannot write", &json, e))?;
        let points: Vec<MemoryPoint> = self
            .samples
            .iter()
            .map(|s| MemoryPoint {
                step: s.step,
                phase: match s.phase {
                    Phase::Forward => "forward",
                    Phase::Backward => "backward",
                    Phase::Optimizer => "optimizer",
                },
                seconds: s.seconds,
                bytes: s.breakdown.chart_bytes(s.peak),
            })
            .collect();
        let path = dir.join("memory.svg");
        let estimate = self.estimate.as_ref().map(|e| e.prediction.total_bytes);
        let svg = memory_svg(self.source, &CHART_CATEGORIES, &points, estimate)
            .map_err(|e| Error::io("cannot draw", &path, e))?;
        std::fs::write(&path, svg).map_err(|e| Error::io("cannot write", &path, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakdown_table_sums_and_shares() {
        let b = Breakdown {
            base_weights: 600,
            lora: 100,
            optimizer: 100,
            gradients: 100,
            activations: 100,
            other: 0,
        };
        assert_eq!(b.total(), 1000);
        let t = b.table();
        assert!(
            t.contains("base weights") && t.contains("60.0%") && t.contains("1000 B"),
            "{t}"
        );
    }

    #[test]
    fn the_peak_sample_carries_the_breakdown() {
        let mut timeline = MemoryTimeline::new(&Device::Cpu, 0, 0);
        timeline.start_phase(Phase::Forward);
        // Large enough that the other tests, allocating on their threads meanwhile, cannot out-peak it.
        let big = std::hint::black_box(vec![1u8; 256 << 20]);
        timeline.end_phase(1, 0, 0, 0);
        drop(big);
        timeline.start_phase(Phase::Backward);
        timeline.end_phase(1, 0, 0, 0);
        assert_eq!(timeline.samples.len(), 2);
        // Lib tests run under the tracking allocator: the 256 MiB vector is the forward's peak.
        assert_eq!(timeline.source, "heap");
        let (s, b) = timeline.peak.clone().unwrap();
        assert_eq!(s.phase, Phase::Forward, "{timeline:?}");
        assert!(
            s.peak >= 256 << 20 && b.activations >= 256 << 20,
            "{s:?} {b:?}"
        );
        assert_eq!(b.total(), s.peak);
        let dir = tempfile::tempdir().unwrap();
        timeline.write(dir.path()).unwrap();
        assert!(dir.path().join("memory.svg").exists());
    }
}
