//! One GRPO micro-batch's forward and backward: its completions after their prompts through the model (layers
//! checkpointed as the run asks, LoRA dropout drawn from the micro-batch's seed), each completion token's
//! log-probability and entropy, the loss and its gradient with respect to those log-probabilities on the host
//! (`loss`), and the backward of `Σ gradient · log-probability` into the window's gradients.

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};

use super::generation::{per_row, rows_of, Completion};
use super::loss::{micro_batch_loss, LossRow, MicroLoss, Normalization};
use crate::data::{Prompt, TokenizedExample};
use crate::error::Result;
use crate::models::LlamaModel;
use crate::trainer::reporting::memory::StepMemory;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::settings::grpo::GrpoConfig;
use crate::trainer::window::micro_batch::{
    backward_into, forward_micro_batch, token_mask, MicroBatchForward,
};

/// The loss rows of `completions` with their current log-probabilities and entropies.
pub(super) fn loss_rows<'a>(
    completions: &[&'a Completion],
    logps: &'a [Vec<f64>],
    entropies: &'a [Vec<f64>],
    config: &GrpoConfig,
) -> Vec<LossRow<'a>> {
    completions
        .iter()
        .zip(logps.iter().zip(entropies))
        .map(|(c, (l, e))| LossRow {
            logps: l,
            entropies: e,
            old_logps: c.old_logps.as_deref(),
            ref_logps: c.ref_logps.as_deref(),
            advantage: c.advantage,
            counted: !(config.mask_truncated_completions && c.truncated),
        })
        .collect()
}

/// Micro-batch `k` of a window (drawing its dropout from `seed`): forward, loss, and its gradients of `vars` added to
/// `grads`. Returns the loss and TRL's metrics, and a mixture of experts' load-balancing loss when its config sets
/// `output_router_logits`: TRL adds `router_aux_loss_coef` × it over the accumulation steps to the loss.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_micro_batch(
    model: &LlamaModel,
    prompts: &[Prompt],
    completions: &[Completion],
    config: &GrpoConfig,
    normalization: Normalization,
    args: &TrainingArguments,
    vars: &[Var],
    seed: u64,
    grads: &mut GradStore,
    memory: &mut StepMemory,
    k: usize,
) -> Result<(MicroLoss, Option<f64>)> {
    let completions: Vec<&Completion> = completions.iter().collect();
    let (examples, rows) = rows_of(prompts, &completions);
    let refs: Vec<&TokenizedExample> = examples.iter().collect();
    model.lora_runtime.set_training(true);
    let moe = model
        .config()
        .moe
        .as_ref()
        .filter(|m| m.output_router_logits);
    let MicroBatchForward {
        hidden, router, ck, ..
    } = forward_micro_batch(model, &refs, args, vars, seed, moe.is_some(), memory)?;
    let (logps, entropies) = model.completion_logps(&hidden, &rows, config.temperature)?;
    let values: Vec<f64> = logps.detach().to_dtype(DType::F64)?.to_vec1()?;
    let (values, entropies) = (
        per_row(&values, &completions),
        per_row(&entropies, &completions),
    );
    let mut loss = micro_batch_loss(
        &loss_rows(&completions, &values, &entropies, config),
        config,
        normalization,
    );
    let gradient: Vec<f64> = loss.gradients.iter().flatten().copied().collect();
    let gradient =
        Tensor::from_vec(gradient, logps.dims1()?, model.device())?.to_dtype(logps.dtype())?;
    // d(Σ g·logp)/dθ = Σ g·dlogp/dθ: the loss's gradient, with g = ∂loss/∂logp computed on the host.
    let mut objective = (logps * gradient)?.sum_all()?;
    let mut aux_loss = None;
    if let (Some(moe), Some(router)) = (moe, &router) {
        let scale = moe.router_aux_loss_coef / args.gradient_accumulation_steps as f64;
        let mask = token_mask(&refs, model.device())?;
        if let Some(aux) = router.aux_loss(moe.num_experts_per_tok, mask.as_ref(), scale)? {
            let term = (aux.to_dtype(objective.dtype())? * scale)?;
            objective = (objective + term)?;
            let value = aux.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            loss.loss += scale * value;
            aux_loss = Some(value);
        }
    }
    // Dropout stays on through the backward, whose recomputed layers draw the forward's masks again.
    backward_into(grads, &objective, &ck, vars, memory, k)?;
    model.lora_runtime.set_training(false);
    Ok((loss, aux_loss))
}
