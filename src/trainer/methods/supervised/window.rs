//! Supervised fine-tuning's accumulation window: each micro-batch's causal-LM loss on its labelled tokens, summed,
//! and the objective normalized by the label tokens of the whole window (transformers' `num_items_in_batch`), so
//! the gradients are those of the window's token-level mean loss however it is split into micro-batches and ranks.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use crate::data::TokenizedExample;
use crate::error::Result;
use crate::models::LlamaModel;
use crate::profile::trace;
use crate::trainer::reporting::memory::StepMemory;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::window::batches::{WindowBatches, WindowOutput};
use crate::trainer::window::micro_batch::{
    add_to, backward_into, forward_micro_batch, micro_batch_seed, token_mask, MicroBatchForward,
};

/// Label tokens a batch contributes to the loss (after the shift).
fn counted_tokens(examples: &[&TokenizedExample]) -> usize {
    examples.iter().map(|e| e.learned_tokens()).sum()
}

/// Forward and backward of this rank's micro-batches of `window`, gradients summed, the loss normalized by the
/// label tokens of the whole window (all ranks'), so the ranks' gradients sum to one process's over the same
/// window. Micro-batch `k` draws its dropout and noise from `first_micro + k` whichever rank runs it.
///
/// A mixture of experts whose config sets `output_router_logits` adds `router_aux_loss_coef` times each
/// micro-batch's load-balancing loss (padding left out) to the objective, as transformers' model adds it to each
/// micro-batch's loss; the ranks' shares are averaged, as DDP averages transformers' gradients.
pub(super) fn run_window(
    model: &LlamaModel,
    rows: &[TokenizedExample],
    args: &TrainingArguments,
    window: &WindowBatches<'_>,
    vars: &[Var],
    memory: &mut StepMemory,
) -> Result<WindowOutput> {
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
        // Detached: the window keeps the sum until the step ends, and with its graph it would keep every
        // micro-batch's activations alive until then.
        let mut sum_f64 = sum.detach().to_dtype(DType::F64)?;
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
    let passes = shard.padding_passes(examples.len(), model.sharding().is_some());
    for k in examples.len()..examples.len() + passes {
        // The window's first micro-batch again, for the gathers of a sharded base; its gradients are dropped.
        let seed = micro_batch_seed(args.seed, first_micro);
        let f = forward_micro_batch(model, &examples[0], args, vars, seed, false, memory)?;
        let (sum, _) = model.loss_from_hidden(&f.hidden, &f.batch.labels)?;
        let mut dropped = GradStore::default();
        backward_into(&mut dropped, &(sum * 0.0)?, &f.ck, vars, memory, k)?;
    }
    model.lora_runtime.set_training(false);
    Ok(WindowOutput {
        loss_sum: loss_sum.map_or_else(|| Tensor::zeros((), DType::F64, model.device()), Ok)?,
        counted,
        input_tokens: examples.iter().flatten().map(|e| e.input_ids.len()).sum(),
        grads,
        aux_loss: aux_sum.map(|s| s / aux_count as f64).transpose()?,
        metrics: None,
        host_metrics: Default::default(),
    })
}
