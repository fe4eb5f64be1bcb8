//! The pieces every method's accumulation window is made of: a micro-batch's seed (dropout masks and NEFTune noise
//! are functions of it, so a resumed or checkpointed run draws them again alike), its training forward (the batch
//! built on the host, layers checkpointed as asked, NEFTune noise, the router record) and its backward (gradients
//! added to the window's, the memory of each phase recorded), and the running sums a window keeps on the device.

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use super::neftune::neftune_noise;
use crate::data::{collate, Batch, TokenizedExample};
use crate::error::Result;
use crate::memory::{kept_layers, Phase};
use crate::models::{Checkpointing, LlamaModel, RouterLogits};
use crate::ops::ActivationOffload;
use crate::profile::trace;
use crate::trainer::reporting::memory::{gradient_bytes, StepMemory};
use crate::trainer::settings::args::TrainingArguments;

/// The seed of micro-batch `index` (dropout masks, NEFTune noise).
pub(crate) fn micro_batch_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// How a training forward of `tokens` input tokens runs its layers: checkpointed as `args` ask, keeping as many
/// of the last layers as `activation_memory_budget_mib` allows, MLPs tiled with `tiled_mlp`, the recomputed layers'
/// inputs in `offload`'s host memory, with `vars` the trainable parameters.
fn checkpointing(
    model: &LlamaModel,
    args: &TrainingArguments,
    tokens: u64,
    vars: &[Var],
    offload: Option<&ActivationOffload>,
) -> Checkpointing {
    Checkpointing {
        enabled: args.checkpointing(),
        kept_layers: kept_layers(
            model.config(),
            tokens,
            model.compute_dtype().size_in_bytes() as u64,
            args.activation_memory_budget_mib,
        ),
        params: vars.to_vec(),
        tiled_mlp: args.tiled_mlp,
        offload: offload.cloned(),
        ..Default::default()
    }
}

/// A micro-batch's training forward: its batch, the final hidden states, the router record (with `routed`) and how
/// its layers ran (the backward merges `ck.sink`).
pub(crate) struct MicroBatchForward {
    pub batch: Batch,
    pub hidden: Tensor,
    pub router: Option<RouterLogits>,
    pub ck: Checkpointing,
}

/// The forward of `rows` as one micro-batch drawing its dropout and NEFTune noise from `seed`, in the memory
/// timeline's forward phase. The batch is built on the host: the model uploads the ids and positions and reads
/// labels and packing segments where they are, so nothing is read back from the GPU.
pub(crate) fn forward_micro_batch(
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
    let ck = checkpointing(
        model,
        args,
        batch.ids.elem_count() as u64,
        vars,
        memory.offload.as_ref(),
    );
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
pub(crate) fn backward_into(
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
pub(crate) fn add_to(total: &mut Option<Tensor>, term: Tensor) -> Result<()> {
    *total = Some(match total.take() {
        Some(t) => (t + term)?,
        None => term,
    });
    Ok(())
}

/// 1 for each real token of a right-padded batch `[rows · longest]`, 0 for padding; `None` without padding.
pub(crate) fn token_mask(
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
