//! One optimizer step's work: the forward and backward of every micro-batch of an accumulation window, gradients
//! summed and the loss normalized by the window's label tokens (transformers' `num_items_in_batch`), with the memory
//! of each phase recorded.

use std::path::PathBuf;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use super::args::TrainingArguments;
use super::neftune::neftune_noise;
use super::oom::oom_report;
use super::sampler::Shard;
use crate::data::{collate, Batch, TokenizedExample};
use crate::error::{Error, Result};
use crate::memory::snapshot::write_snapshot;
use crate::memory::{is_out_of_memory, kept_layers, DeviceKind, MemoryTimeline, Phase};
use crate::models::{Checkpointing, LlamaModel, RouterLogits};
use crate::profile::trace;

/// Label tokens a batch contributes to the loss (after the shift).
fn counted_tokens(examples: &[&TokenizedExample]) -> usize {
    examples.iter().map(|e| e.learned_tokens()).sum()
}

/// The seed of micro-batch `index` (dropout masks, NEFTune noise).
pub(super) fn micro_batch_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Bytes of the accumulated gradients of `vars`.
pub(super) fn gradient_bytes(vars: &[Var], grads: &GradStore) -> u64 {
    vars.iter()
        .filter_map(|v| grads.get(v))
        .map(|g| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
        .sum()
}

/// The memory timeline of a run and what it needs to attribute bytes: the step being run and the optimizer's
/// state size.
pub(super) struct StepMemory {
    /// The per-phase timeline.
    pub timeline: MemoryTimeline,
    /// The step being run.
    pub step: usize,
    /// Bytes of optimizer state on the training device.
    pub optimizer_bytes: u64,
    /// Where the memory snapshot is written when a step runs out of memory (`memory_snapshot`, the writing rank).
    pub snapshot_on_oom: Option<PathBuf>,
}

impl StepMemory {
    /// Ends the current phase of micro-batch `micro_batch` with `gradients` bytes of gradients held.
    pub(super) fn end_phase(&mut self, micro_batch: usize, gradients: u64) {
        self.timeline
            .end_phase(self.step, micro_batch, self.optimizer_bytes, gradients);
    }

    /// `error` turned into the out-of-memory report when it is an allocation failure, with the memory snapshot
    /// written next to it when one is being recorded (PyTorch's "dump on OOM").
    pub(super) fn explain(&self, error: Error, args: &TrainingArguments) -> Error {
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

/// The outcome of one accumulation window.
pub(super) struct Window {
    /// Sum of this rank's token losses: a float64 scalar on the model's device (read with the gradient norm).
    pub loss_sum: Tensor,
    /// Label tokens counted, of all ranks.
    pub counted: usize,
    /// Input tokens, of all ranks.
    pub input_tokens: usize,
    /// Gradients of the trainable variables, summed over this rank's micro-batches.
    pub grads: GradStore,
    /// A mixture of experts' auxiliary load-balancing loss (with `output_router_logits`), the mean of this rank's
    /// micro-batches': a float64 scalar on the device.
    pub aux_loss: Option<Tensor>,
    /// DPO's metrics (`dpo::METRICS`) summed over this rank's micro-batches: float64 `[6]` on the device.
    pub preference: Option<Tensor>,
}

/// How a training forward of `tokens` input tokens runs its layers: checkpointed as `args` ask, keeping as many
/// of the last layers as `activation_memory_budget_mib` allows, with `vars` the trainable parameters.
pub(super) fn checkpointing(
    model: &LlamaModel,
    args: &TrainingArguments,
    tokens: u64,
    vars: &[Var],
) -> Checkpointing {
    Checkpointing {
        enabled: args.gradient_checkpointing,
        kept_layers: kept_layers(
            model.config(),
            if model.device().is_cpu() {
                DeviceKind::Cpu
            } else {
                DeviceKind::Cuda
            },
            tokens,
            model.compute_dtype().size_in_bytes() as u64,
            args.activation_memory_budget_mib,
        ),
        params: vars.to_vec(),
        ..Default::default()
    }
}

/// A micro-batch's training forward: its batch, the final hidden states, the router record (with `routed`) and how
/// its layers ran (the backward merges `ck.sink`).
pub(super) struct MicroBatchForward {
    pub batch: Batch,
    pub hidden: Tensor,
    pub router: Option<RouterLogits>,
    pub ck: Checkpointing,
}

/// The forward of `rows` as one micro-batch drawing its dropout and NEFTune noise from `seed`, in the memory
/// timeline's forward phase. The batch is built on the host: the model uploads the ids and positions and reads
/// labels and packing segments where they are, so nothing is read back from the GPU.
pub(super) fn forward_micro_batch(
    model: &LlamaModel,
    rows: &[&TokenizedExample],
    args: &TrainingArguments,
    vars: &[Var],
    seed: u64,
    routed: bool,
    memory: &mut StepMemory,
) -> Result<MicroBatchForward> {
    model.lora_runtime.set_step_seed(seed);
    let batch = {
        let _data = trace::span("data", "data");
        collate(rows, &Device::Cpu)?
    };
    let ck = checkpointing(model, args, batch.ids.elem_count() as u64, vars);
    let _forward = trace::span("forward", "forward");
    memory.timeline.start_phase(Phase::Forward);
    let mut embeds = model.embed(&batch.ids)?;
    if let Some(alpha) = args.neftune_noise_alpha.filter(|a| *a > 0.0) {
        embeds = neftune_noise(&embeds, alpha, seed)?;
    }
    let router = routed.then(RouterLogits::new);
    let hidden = model.forward_embeds_routed(&embeds, &batch.positions, &ck, router.as_ref())?;
    Ok(MicroBatchForward {
        batch,
        hidden,
        router,
        ck,
    })
}

/// Micro-batch `k`'s backward of `objective` (its forward ran as `ck` says), in the memory timeline's backward
/// phase, its gradients of `vars` added to `grads`.
pub(super) fn backward_into(
    grads: &mut GradStore,
    objective: &Tensor,
    ck: &Checkpointing,
    vars: &[Var],
    memory: &mut StepMemory,
    k: usize,
) -> Result<()> {
    memory.end_phase(k, gradient_bytes(vars, grads));
    let _backward = trace::span("backward", "backward");
    memory.timeline.start_phase(Phase::Backward);
    let mut g = objective.backward()?;
    ck.sink.merge_into(&mut g)?;
    accumulate(grads, &g, vars)?;
    drop(g);
    memory.end_phase(k, gradient_bytes(vars, grads));
    Ok(())
}

/// Adds the gradients of `vars` in `g` to `grads`.
fn accumulate(grads: &mut GradStore, g: &GradStore, vars: &[Var]) -> Result<()> {
    for v in vars {
        if let Some(gv) = g.get(v) {
            let acc = match grads.get(v) {
                Some(old) => (old + gv)?,
                None => gv.clone(),
            };
            grads.insert(v, acc);
        }
    }
    Ok(())
}

/// The running sum of `term` in `total` (float64 scalars or vectors on the device).
pub(super) fn add_to(total: &mut Option<Tensor>, term: Tensor) -> Result<()> {
    *total = Some(match total.take() {
        Some(t) => (t + term)?,
        None => term,
    });
    Ok(())
}

/// 1 for each real token of a right-padded batch `[rows · longest]`, 0 for padding; `None` without padding.
pub(super) fn token_mask(
    examples: &[&TokenizedExample],
    device: &Device,
) -> Result<Option<Tensor>> {
    let longest = examples
        .iter()
        .map(|e| e.input_ids.len())
        .max()
        .unwrap_or(0);
    if examples.iter().all(|e| e.input_ids.len() == longest) {
        return Ok(None);
    }
    let mask: Vec<f32> = examples
        .iter()
        .flat_map(|e| (0..longest).map(move |t| if t < e.input_ids.len() { 1.0 } else { 0.0 }))
        .collect();
    Ok(Some(Tensor::from_vec(
        mask,
        examples.len() * longest,
        device,
    )?))
}

/// The micro-batches of one window, of every rank (micro-batch `k` is rank `k % world_size`'s), and the run's
/// index of the first.
pub(super) struct WindowBatches<'a> {
    pub batches: &'a [Vec<usize>],
    pub first_micro: usize,
    pub shard: Shard,
}

impl Window {
    /// Forward and backward of this rank's micro-batches of `window`, gradients summed, the loss normalized by the
    /// label tokens of the whole window (all ranks'), so the ranks' gradients sum to one process's over the same
    /// window. Micro-batch `k` draws its dropout and noise from `first_micro + k` whichever rank runs it.
    ///
    /// A mixture of experts whose config sets `output_router_logits` adds `router_aux_loss_coef` times each
    /// micro-batch's load-balancing loss (padding left out) to the objective, as transformers' model adds it to each
    /// micro-batch's loss; the ranks' shares are averaged, as DDP averages transformers' gradients.
    pub(super) fn run(
        model: &LlamaModel,
        rows: &[TokenizedExample],
        args: &TrainingArguments,
        window: &WindowBatches<'_>,
        vars: &[Var],
        memory: &mut StepMemory,
    ) -> Result<Self> {
        let (first_micro, shard) = (window.first_micro, window.shard);
        let examples: Vec<Vec<&TokenizedExample>> = window
            .batches
            .iter()
            .map(|b| b.iter().map(|i| &rows[*i]).collect())
            .collect();
        let counted: usize = examples.iter().map(|e| counted_tokens(e)).sum();
        let mut grads = GradStore::default();
        // The loss sums stay on the device (read once per step, with the gradient norm).
        let mut loss_sum: Option<Tensor> = None;
        let moe = model
            .config()
            .moe
            .as_ref()
            .filter(|m| m.output_router_logits);
        let (mut aux_sum, mut aux_count): (Option<Tensor>, usize) = (None, 0);
        model.lora_runtime.set_training(true);
        for (k, ex) in shard.share(examples.iter().enumerate()) {
            let seed = micro_batch_seed(args.seed, first_micro + k);
            let MicroBatchForward {
                batch,
                hidden,
                router,
                ck,
            } = forward_micro_batch(model, ex, args, vars, seed, moe.is_some(), memory)?;
            let (sum, _) = {
                let _loss = trace::span("loss", "loss");
                model.loss_from_hidden(&hidden, &batch.labels)?
            };
            let mut sum_f64 = sum.to_dtype(DType::F64)?;
            let mut objective = (sum / counted.max(1) as f64)?;
            if let (Some(moe), Some(router)) = (moe, &router) {
                let scale = moe.router_aux_loss_coef / shard.world_size as f64;
                let mask = token_mask(ex, model.device())?;
                if let Some(aux) = router.aux_loss(moe.num_experts_per_tok, mask.as_ref(), scale)? {
                    let term = (aux.to_dtype(objective.dtype())? * scale)?;
                    objective = (objective + term)?;
                    // In the logged loss as in the objective: the window's mean token loss plus the term.
                    let aux_f64 = aux.detach().to_dtype(DType::F64)?;
                    sum_f64 = (sum_f64 + (&aux_f64 * (scale * counted.max(1) as f64))?)?;
                    add_to(&mut aux_sum, aux_f64)?;
                    aux_count += 1;
                }
            }
            add_to(&mut loss_sum, sum_f64)?;
            backward_into(&mut grads, &objective, &ck, vars, memory, k)?;
        }
        model.lora_runtime.set_training(false);
        Ok(Window {
            loss_sum: loss_sum.map_or_else(|| Tensor::zeros((), DType::F64, model.device()), Ok)?,
            counted,
            input_tokens: examples.iter().flatten().map(|e| e.input_ids.len()).sum(),
            grads,
            aux_loss: aux_sum.map(|s| s / aux_count as f64).transpose()?,
            preference: None,
        })
    }
}
