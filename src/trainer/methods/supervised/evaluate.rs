//! Evaluation: the token-level mean loss over a whole data set (total NLL / total label tokens, not a mean of
//! per-example means), its perplexity, and (with `predict_with_generate`) the exact match of greedy answers.

use std::collections::BTreeMap;

use candle_core::{DType, Device};

use crate::data::{collate, TokenizedExample};
use crate::error::Result;
use crate::models::{generate, Checkpointing, GenerationConfig, LlamaModel};
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::window::shard::Shard;

/// Evaluates `examples` in batches of `batch_size` (no gradients are built: the model's weights are frozen).
pub fn evaluate(
    model: &LlamaModel,
    examples: &[TokenizedExample],
    batch_size: usize,
) -> Result<EvalReport> {
    let (nll, tokens) = loss_sums(model, examples, batch_size, Shard::ALONE, false)?;
    Ok(report(examples, nll, tokens, None))
}

/// This rank's part of an evaluation: the summed negative log-likelihood and the label tokens of its batches
/// (batch `k` of the length-sorted order is rank `k % world_size`'s, so the ranks' sums add up to one process's),
/// the MLPs run over slices of the rows with `tiled_mlp` (as the training forward's, so an evaluation's working
/// set is bounded alike).
pub(super) fn loss_sums(
    model: &LlamaModel,
    examples: &[TokenizedExample],
    batch_size: usize,
    shard: Shard,
    tiled_mlp: bool,
) -> Result<(f64, usize)> {
    let layers = Checkpointing {
        tiled_mlp,
        ..Default::default()
    };
    let mut total = 0f64;
    let mut tokens = 0usize;
    // Sort by length so batches pad little; the result does not depend on the order.
    let mut order: Vec<&TokenizedExample> = examples.iter().collect();
    order.sort_by_key(|e| e.input_ids.len());
    let batches: Vec<&[&TokenizedExample]> = order.chunks(batch_size.max(1)).collect();
    for batch in shard.share(batches.iter()) {
        // Built on the host: the model uploads the ids and reads the labels where they are (no readback).
        let b = collate(batch, &Device::Cpu)?;
        let (sum, n) = model.loss_sum(&b.ids, &b.labels, &b.positions, &layers)?;
        total += sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        tokens += n;
    }
    for _ in 0..shard.padding_passes(batches.len(), model.sharding().is_some()) {
        let b = collate(batches[0], &Device::Cpu)?;
        model.loss_sum(&b.ids, &b.labels, &b.positions, &layers)?;
    }
    Ok((total, tokens))
}

/// The report of `examples` from the summed negative log-likelihood, the label tokens and, with
/// `predict_with_generate`, the exact answers among those counted.
pub(super) fn report(
    examples: &[TokenizedExample],
    nll: f64,
    tokens: usize,
    exact: Option<(usize, usize)>,
) -> EvalReport {
    let loss = if tokens == 0 {
        f64::NAN
    } else {
        nll / tokens as f64
    };
    EvalReport {
        loss,
        perplexity: loss.exp(),
        tokens,
        examples: examples.len(),
        truncated: examples.iter().filter(|e| e.truncated).count(),
        exact_match: exact
            .filter(|(_, counted)| *counted > 0)
            .map(|(hits, counted)| hits as f64 / counted as f64),
        metrics: BTreeMap::new(),
    }
}

/// How many of `examples` `model` answers exactly: each example's prompt (its tokens before the first label) is
/// continued greedily, and the answer (up to an end-of-sequence token of the model) must be the reference token
/// for token (its labelled tokens, up to an end-of-sequence token). transformers' `predict_with_generate` with an
/// exact-match metric. Examples without a prompt (plain text, labelled from its first token) or without labels are
/// not counted.
pub fn exact_match(model: &LlamaModel, examples: &[TokenizedExample]) -> Result<(usize, usize)> {
    exact_match_share(model, examples, Shard::ALONE)
}

/// This rank's part of [`exact_match`]: examples `rank`, `rank + world_size`, ….
pub(super) fn exact_match_share(
    model: &LlamaModel,
    examples: &[TokenizedExample],
    shard: Shard,
) -> Result<(usize, usize)> {
    let eos = &model.config().eos_token_ids;
    let (mut hits, mut counted) = (0, 0);
    for example in shard.share(examples) {
        let Some(start) = example
            .labels
            .iter()
            .position(|&l| l != -100)
            .filter(|&s| s > 0)
        else {
            continue;
        };
        let reference: Vec<u32> = example.input_ids[start..]
            .iter()
            .zip(&example.labels[start..])
            .take_while(|(id, label)| **label != -100 && !eos.contains(id))
            .map(|(id, _)| *id)
            .collect();
        let config = GenerationConfig::greedy(reference.len() + 1);
        let answer = generate(model, &example.input_ids[..start], &config, |_| Ok(()))?;
        let answer: Vec<u32> = answer
            .into_iter()
            .take_while(|id| !eos.contains(id))
            .collect();
        hits += (answer == reference) as usize;
        counted += 1;
    }
    Ok((hits, counted))
}
