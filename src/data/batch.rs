//! Batches for the model: rows right-padded to one length, labels, and positions (restarting per example in
//! packed rows).

use candle_core::{Device, Tensor};

use super::formats::TokenizedExample;
use super::packing::row_positions;
use crate::error::Result;
use crate::models::Positions;
use crate::ops::IGNORE_INDEX;

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
