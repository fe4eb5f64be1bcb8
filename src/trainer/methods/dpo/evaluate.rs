//! DPO's evaluation, as TRL's `DPOTrainer.prediction_step` and transformers' evaluation loop average it: each batch
//! of evaluation pairs gives the preference loss and TRL's metrics against the precomputed reference; the loss is
//! the mean weighted by each batch's pairs, the metrics the mean of the batches' values.

use candle_core::{DType, Tensor};

use super::loss::{preference_loss, CompletionTokens, METRICS};
use super::reference::{pair_logps, stored_logps};
use crate::data::{chosen_then_rejected, PreferenceDataset, PreferencePair};
use crate::error::{Error, Result};
use crate::models::LlamaModel;
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::settings::dpo::DpoConfig;
use crate::trainer::window::shard::Shard;

/// The DPO loss and metrics of `pairs` under the model as it is, against `reference` (`[2n]`), without gradients.
fn evaluate_pairs(
    model: &LlamaModel,
    config: &DpoConfig,
    pairs: &[&PreferencePair],
    reference: &Tensor,
) -> Result<(f64, Vec<f64>)> {
    let policy = pair_logps(model, pairs)?;
    let tokens = CompletionTokens::of(&chosen_then_rejected(pairs));
    let (loss, metrics) = preference_loss(config, &policy, reference, &tokens)?;
    let loss = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
    Ok((loss, metrics.to_vec1()?))
}

/// This rank's share of the evaluation of `eval`: `[Σ batch loss × pairs, pairs, Σ batch metrics…, batches]` over
/// its batches of `batch_size` pairs (batch `k` is rank `k % world_size`'s), against the pairs' precomputed
/// reference log-probabilities `reference` (`None` before they are computed: an error).
pub(super) fn evaluation_sums(
    model: &LlamaModel,
    config: &DpoConfig,
    eval: &PreferenceDataset,
    reference: Option<&[[f64; 2]]>,
    batch_size: usize,
    shard: Shard,
) -> Result<Vec<f64>> {
    let values = reference.ok_or_else(|| {
        Error::InvalidInput(
            "the evaluation pairs' reference log-probabilities are not computed yet".into(),
        )
    })?;
    let indices: Vec<usize> = (0..eval.len()).collect();
    let mut sums = vec![0.0; METRICS.len() + 3];
    for batch in shard.share(indices.chunks(batch_size.max(1))) {
        let pairs: Vec<&PreferencePair> = batch.iter().map(|i| &eval.pairs[*i]).collect();
        let reference = stored_logps(values, batch, model)?;
        let (loss, metrics) = evaluate_pairs(model, config, &pairs, &reference)?;
        sums[0] += loss * batch.len() as f64;
        sums[1] += batch.len() as f64;
        for (s, m) in sums[2..].iter_mut().zip(metrics) {
            *s += m;
        }
        sums[METRICS.len() + 2] += 1.0;
    }
    Ok(sums)
}

/// The report of the evaluation of `pairs` from the summed [`evaluation_sums`] of every rank: the mean loss (each
/// batch weighted by its pairs, as transformers averages it; perplexity is not defined: NaN) and the metrics (the
/// mean of the batches' values, as TRL averages them) under TRL's names; `tokens` counts the completion tokens.
pub(super) fn report(pairs: &PreferenceDataset, sums: &[f64]) -> EvalReport {
    let batches = sums[METRICS.len() + 2].max(1.0);
    EvalReport {
        loss: sums[0] / sums[1].max(1.0),
        perplexity: f64::NAN,
        tokens: pairs
            .pairs
            .iter()
            .map(|p| p.chosen.learned_tokens() + p.rejected.learned_tokens())
            .sum(),
        examples: pairs.len(),
        truncated: pairs.truncated,
        exact_match: None,
        metrics: METRICS
            .iter()
            .zip(&sums[2..METRICS.len() + 2])
            .map(|(k, m)| (k.to_string(), m / batches))
            .collect(),
    }
}
