//! One DPO optimizer step's forward and backward: each micro-batch's pairs go through the model as one batch
//! (every chosen sequence, then every rejected one), their sequence log-probabilities and the reference's give the
//! preference loss, and the window's loss is the mean of its micro-batches' (as transformers divides each
//! micro-batch's loss by the accumulation steps).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::config::DpoConfig;
use super::loss::{preference_loss, CompletionTokens};
use crate::data::{chosen_then_rejected, PreferencePair, TokenizedExample};
use crate::error::Result;
use crate::models::LlamaModel;
use crate::ops::IGNORE_INDEX;
use crate::trainer::args::TrainingArguments;
use crate::trainer::window::{
    add_to, backward_into, forward_micro_batch, micro_batch_seed, token_mask, MicroBatchForward,
    StepMemory, Window, WindowBatches,
};

/// The completion tokens of `rows` (chosen rows then rejected rows).
fn completion_tokens(rows: &[&TokenizedExample]) -> CompletionTokens {
    CompletionTokens {
        completion: rows
            .iter()
            .map(|r| r.labels.iter().filter(|l| **l != IGNORE_INDEX).count())
            .collect(),
        predicted: rows.iter().map(|r| r.learned_tokens()).collect(),
    }
}

/// The DPO loss and metrics of `pairs` under the model as it is, against `reference` (`[2n]`), without gradients
/// (evaluation).
pub(in crate::trainer) fn evaluate_pairs(
    model: &LlamaModel,
    config: &DpoConfig,
    pairs: &[&PreferencePair],
    reference: &Tensor,
) -> Result<(f64, Vec<f64>)> {
    let policy = super::reference::pair_logps(model, pairs)?;
    let tokens = completion_tokens(&chosen_then_rejected(pairs));
    let (loss, metrics) = preference_loss(config, &policy, reference, &tokens)?;
    let loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((loss, metrics.to_vec1()?))
}

impl Window {
    /// Forward and backward of this rank's micro-batches of `window` over preference `pairs`, against the
    /// reference log-probabilities `reference` (one `[2n]` tensor per micro-batch this rank runs, in order).
    /// `loss_sum` is the sum of the micro-batches' losses and `counted` their number, so `loss_sum / counted` is
    /// the window's loss. A mixture of experts with `output_router_logits` adds its auxiliary loss, as TRL does.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::trainer) fn run_preference(
        model: &LlamaModel,
        pairs: &[PreferencePair],
        reference: &[Tensor],
        config: &DpoConfig,
        args: &TrainingArguments,
        window: &WindowBatches<'_>,
        vars: &[Var],
        memory: &mut StepMemory,
    ) -> Result<Self> {
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
                preference_loss(config, &policy, reference, &completion_tokens(&rows))?;
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
        Ok(Window {
            loss_sum: loss_sum.map_or_else(zero, Ok)?,
            counted: micro_batches,
            input_tokens,
            grads,
            aux_loss: aux_sum.map(|s| s / aux_count as f64).transpose()?,
            preference: metrics_sum,
        })
    }
}
