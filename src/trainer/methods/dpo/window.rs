//! One DPO optimizer step's forward and backward: each micro-batch's pairs go through the model as one batch
//! (every chosen sequence, then every rejected one), their sequence log-probabilities and the reference's give the
//! preference loss, and the window's loss is the mean of its micro-batches' (as transformers divides each
//! micro-batch's loss by the accumulation steps).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::loss::{preference_loss, CompletionTokens};
use crate::data::{chosen_then_rejected, PreferencePair};
use crate::error::Result;
use crate::models::LlamaModel;
use crate::trainer::reporting::memory::StepMemory;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::settings::dpo::DpoConfig;
use crate::trainer::window::batches::{WindowBatches, WindowOutput};
use crate::trainer::window::micro_batch::{
    add_to, backward_into, forward_micro_batch, micro_batch_seed, token_mask, MicroBatchForward,
};

/// Forward and backward of this rank's micro-batches of `window` over preference `pairs`, against the
/// reference log-probabilities `reference` (one `[2n]` tensor per micro-batch this rank runs, in order).
/// `loss_sum` is the sum of the micro-batches' losses and `counted` their number, so `loss_sum / counted` is
/// the window's loss. A mixture of experts with `output_router_logits` adds its auxiliary loss, as TRL does.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_window(
    model: &LlamaModel,
    pairs: &[PreferencePair],
    reference: &[Tensor],
    config: &DpoConfig,
    args: &TrainingArguments,
    window: &WindowBatches<'_>,
    vars: &[Var],
    memory: &mut StepMemory,
) -> Result<WindowOutput> {
    let (first_micro, shard) = (window.first_micro, window.shard);
    let micro_batches = window.batches.len();
    let moe = model
        .config()
        .moe
        .as_ref()
        .filter(|m| m.output_router_logits && m.router_aux_loss_coef != 0.0);
    let mut grads = GradStore::default();
    let (mut loss_sum, mut metrics_sum, mut aux_sum) = (None, None, None);
    let (mut aux_count, mut input_tokens) = (0usize, 0usize);
    model.lora_runtime.set_training(!config.disable_dropout);
    let mine = shard.share(window.batches.iter().enumerate());
    for ((k, batch), reference) in mine.zip(reference) {
        let batch_pairs: Vec<&PreferencePair> = batch.iter().map(|i| &pairs[*i]).collect();
        let rows = chosen_then_rejected(&batch_pairs);
        input_tokens += rows.iter().map(|r| r.input_ids.len()).sum::<usize>();
        let seed = micro_batch_seed(args.seed, first_micro + k);
        let MicroBatchForward {
            batch: collated,
            hidden,
            router,
            ck,
        } = forward_micro_batch(model, &rows, args, vars, seed, moe.is_some(), memory)?;
        let labels = collated.labels.to_device(model.device())?;
        let policy = model.sequence_logps(&hidden, &labels)?;
        let (mut loss, metrics) =
            preference_loss(config, &policy, reference, &CompletionTokens::of(&rows))?;
        if let (Some(moe), Some(router)) = (moe, &router) {
            let mask = token_mask(&rows, model.device())?;
            if let Some(aux) = router.aux_loss(moe.num_experts_per_tok, mask.as_ref(), 1.0)? {
                let term = (aux.to_dtype(loss.dtype())? * moe.router_aux_loss_coef)?;
                loss = (loss + term)?;
                add_to(&mut aux_sum, aux.detach().to_dtype(DType::F64)?)?;
                aux_count += 1;
            }
        }
        add_to(&mut loss_sum, loss.detach().to_dtype(DType::F64)?)?;
        add_to(&mut metrics_sum, metrics)?;
        let objective = (loss / micro_batches as f64)?;
        backward_into(&mut grads, &objective, &ck, vars, memory, k)?;
    }
    model.lora_runtime.set_training(false);
    let zero = || Tensor::zeros((), DType::F64, model.device());
    Ok(WindowOutput {
        loss_sum: loss_sum.map_or_else(zero, Ok)?,
        counted: micro_batches,
        input_tokens,
        grads,
        aux_loss: aux_sum.map(|s| s / aux_count as f64).transpose()?,
        metrics: metrics_sum,
        host_metrics: Default::default(),
    })
}
