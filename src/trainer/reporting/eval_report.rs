//! What an evaluation reports: the loss, its perplexity, counts, the exact match of generated answers, a method's
//! metrics.

use std::collections::BTreeMap;

/// The result of an evaluation (supervised: [`crate::trainer::evaluate`]; DPO: the preference loss and TRL's metrics),
/// as callbacks see it.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct EvalReport {
    /// Mean negative log-likelihood per label token (DPO: the mean preference loss).
    pub loss: f64,
    /// `exp(loss)` (NaN for DPO).
    pub perplexity: f64,
    /// Label tokens counted.
    pub tokens: usize,
    /// Examples evaluated.
    pub examples: usize,
    /// Examples cut to the maximum length.
    pub truncated: usize,
    /// Share of examples whose greedy answer is exactly the reference (with `predict_with_generate`, when some
    /// example has a prompt).
    pub exact_match: Option<f64>,
    /// DPO's metrics (`rewards/chosen`, …, `logps/rejected`, TRL's names); empty for supervised evaluation.
    pub metrics: BTreeMap<String, f64>,
}
