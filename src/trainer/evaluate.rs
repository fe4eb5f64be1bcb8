//! Evaluation: the token-level mean loss over a whole data set (total NLL / total label tokens, not a mean of
//! per-example means), and its perplexity.

use candle_core::{DType, Device};

use crate::data::{collate, TokenizedExample};
use crate::error::Result;
use crate::models::{Checkpointing, LlamaModel};

/// The result of [`evaluate`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EvalReport {
    /// Mean negative log-likelihood per label token.
    pub loss: f64,
    /// `exp(loss)`.
    pub perplexity: f64,
    /// Label tokens counted.
    pub tokens: usize,
    /// Examples evaluated.
    pub examples: usize,
    /// Examples cut to the maximum length.
    pub truncated: usize,
}

/// Evaluates `examples` in batches of `batch_size` (no gradients are built: the model's weights are frozen).
pub fn evaluate(
    model: &LlamaModel,
    examples: &[TokenizedExample],
    batch_size: usize,
) -> Result<EvalReport> {
    let mut total = 0f64;
    let mut tokens = 0usize;
    // Sort by length so batches pad little; the result does not depend on the order.
    let mut order: Vec<&TokenizedExample> = examples.iter().collect();
    order.sort_by_key(|e| e.input_ids.len());
    for batch in order.chunks(batch_size.max(1)) {
        // Built on the host: the model uploads the ids and reads the labels where they are (no readback).
        let b = collate(batch, &Device::Cpu)?;
        let (sum, n) =
            model.loss_sum(&b.ids, &b.labels, &b.positions, &Checkpointing::default())?;
        total += sum.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        tokens += n;
    }
    let loss = if tokens == 0 {
        f64::NAN
    } else {
        total / tokens as f64
    };
    Ok(EvalReport {
        loss,
        perplexity: loss.exp(),
        tokens,
        examples: examples.len(),
        truncated: examples.iter().filter(|e| e.truncated).count(),
    })
}
