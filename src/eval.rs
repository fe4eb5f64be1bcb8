//! Evaluation: the token-level mean loss over a whole data set (total NLL / total label tokens, not a mean of
//! per-example means), and its perplexity.

use candle_core::{DType, Device, Tensor};

use crate::data::{row_positions, TokenizedExample};
use crate::error::Result;
use crate::models::{Checkpointing, LlamaModel, Positions};
use crate::ops::IGNORE_INDEX;

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

/// A batch ready for the model.
pub struct Batch {
    /// Token ids `[b, t]` (u32).
    pub ids: Tensor,
    /// Labels `[b, t]` (i64, −100 = no loss).
    pub labels: Tensor,
    /// `Range(0)`, or `Packed` when a row holds several examples.
    pub positions: Positions,
}

/// Right-pads a batch; padding is labelled −100 and, being after every real token, never influences them under
/// causal attention. Packed rows get positions that restart at each example.
pub fn collate(batch: &[&TokenizedExample], device: &Device) -> Result<Batch> {
    let t = batch.iter().map(|e| e.input_ids.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(batch.len() * t);
    let mut labels = Vec::with_capacity(batch.len() * t);
    for e in batch {
        ids.extend(
            e.input_ids
                .iter()
                .copied()
                .chain(std::iter::repeat_n(0, t - e.input_ids.len())),
        );
        labels.extend(
            e.labels
                .iter()
                .copied()
                .chain(std::iter::repeat_n(IGNORE_INDEX, t - e.labels.len())),
        );
    }
    let positions = if batch.iter().any(|e| e.segments.len() > 1) {
        let p: Vec<u32> = batch.iter().flat_map(|e| row_positions(e, t)).collect();
        Positions::Packed(Tensor::from_vec(p, (batch.len(), t), device)?)
    } else {
        Positions::Range(0)
    };
    Ok(Batch {
        ids: Tensor::from_vec(ids, (batch.len(), t), device)?,
        labels: Tensor::from_vec(labels, (batch.len(), t), device)?,
        positions,
    })
}

/// Evaluates `examples` in batches of `batch_size` (no gradients are built: the model's weights are frozen).
pub fn evaluate(
    model: &LlamaModel,
    examples: &[TokenizedExample],
    batch_size: usize,
) -> Result<EvalReport> {
    let device = model.device().clone();
    let mut total = 0f64;
    let mut tokens = 0usize;
    // Sort by length so batches pad little; the result does not depend on the order.
    let mut order: Vec<&TokenizedExample> = examples.iter().collect();
    order.sort_by_key(|e| e.input_ids.len());
    for batch in order.chunks(batch_size.max(1)) {
        let b = collate(batch, &device)?;
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
