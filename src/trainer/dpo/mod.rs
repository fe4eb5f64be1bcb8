//! Preference tuning with DPO, as TRL 1.16's `DPOTrainer` does it with a PEFT model: the `[dpo]` settings
//! ([`DpoConfig`]), the losses and reward metrics ([`preference_loss`]), the reference ([`Reference`]: the base
//! model, a frozen copy of the starting adapter, or none), and the step's forward and backward over pairs. The
//! [`crate::trainer::Trainer`] runs it like supervised training (accumulation, checkpointing, the optimizer,
//! checkpoints and resume, callbacks, evaluation) when built with [`crate::trainer::Trainer::new_dpo`].

mod config;
mod loss;
mod reference;
mod window;

pub use config::{DpoConfig, LossType};
pub use loss::{preference_loss, CompletionTokens, METRICS};
pub(super) use reference::{load_reference, save_reference};
pub use reference::{pair_logps, Reference, REFERENCE_ADAPTER, REFERENCE_FILE};

use candle_core::Tensor;

use super::args::TrainingArguments;
use super::sampler::Shard;
use super::window::WindowBatches;
use crate::data::{PreferenceDataset, PreferencePair};
use crate::error::{Error, Result};
use crate::models::LlamaModel;
use reference::stored_logps;

/// A DPO run's settings, pairs and reference.
pub(super) struct PreferenceTask {
    pub config: DpoConfig,
    pub train: PreferenceDataset,
    pub eval: PreferenceDataset,
    pub reference: Reference,
    /// The training pairs' reference log-probabilities, when precomputed.
    pub train_reference: Option<Vec<[f64; 2]>>,
    /// The evaluation pairs' reference log-probabilities, computed once (the reference does not change).
    pub eval_reference: Option<Vec<[f64; 2]>>,
}

/// The evaluation of a preference set: the mean loss (each batch weighted by its pairs, as transformers averages
/// it) and the metrics (the mean of the batches' values, as TRL averages them).
pub(super) struct PreferenceEval {
    pub loss: f64,
    pub metrics: Vec<f64>,
}

impl PreferenceTask {
    /// The reference log-probabilities of this rank's micro-batches of `window`: precomputed, or computed now with
    /// the model switched to the reference (adapter `trained` active again after).
    pub(super) fn window_reference(
        &self,
        model: &mut LlamaModel,
        trained: &str,
        window: &WindowBatches<'_>,
    ) -> Result<Vec<Tensor>> {
        let mine: Vec<&Vec<usize>> = window.shard.share(window.batches.iter()).collect();
        if let Some(values) = &self.train_reference {
            return mine
                .iter()
                .map(|b| stored_logps(values, b, model))
                .collect();
        }
        let batches: Vec<Vec<&PreferencePair>> = mine
            .iter()
            .map(|b| b.iter().map(|i| &self.train.pairs[*i]).collect())
            .collect();
        self.reference.logps(model, trained, &batches)
    }

    /// Computes the reference log-probabilities of every training pair (`precompute_ref_log_probs`) and of every
    /// evaluation pair, unless known, in batches of `precompute_ref_batch_size` or else of `args`' batch sizes.
    pub(super) fn precompute(
        &mut self,
        model: &mut LlamaModel,
        trained: &str,
        args: &TrainingArguments,
    ) -> Result<()> {
        let batch = self.config.precompute_ref_batch_size;
        let (train_batch, eval_batch) = (
            args.per_device_train_batch_size,
            args.per_device_eval_batch_size,
        );
        if self.config.precompute_ref_log_probs && self.train_reference.is_none() {
            let values = self.reference.precompute(
                model,
                trained,
                &self.train.pairs,
                batch.unwrap_or(train_batch),
            )?;
            self.train_reference = Some(values);
        }
        if self.eval_reference.is_none() {
            let values = self.reference.precompute(
                model,
                trained,
                &self.eval.pairs,
                batch.unwrap_or(eval_batch),
            )?;
            self.eval_reference = Some(values);
        }
        Ok(())
    }

    /// This rank's share of the evaluation: `[Σ batch loss × pairs, pairs, Σ batch metrics…, batches]` over its
    /// batches of `batch_size` pairs (batch `k` is rank `k % world_size`'s). Needs the evaluation reference
    /// ([`PreferenceTask::precompute`]).
    pub(super) fn evaluation_sums(
        &self,
        model: &LlamaModel,
        batch_size: usize,
        shard: Shard,
    ) -> Result<Vec<f64>> {
        let values = self.eval_reference.as_deref().ok_or_else(|| {
            Error::InvalidInput(
                "the evaluation pairs' reference log-probabilities are not computed yet".into(),
            )
        })?;
        let indices: Vec<usize> = (0..self.eval.len()).collect();
        let mut sums = vec![0.0; METRICS.len() + 3];
        for batch in shard.share(indices.chunks(batch_size.max(1))) {
            let pairs: Vec<&PreferencePair> = batch.iter().map(|i| &self.eval.pairs[*i]).collect();
            let reference = stored_logps(values, batch, model)?;
            let (loss, metrics) = window::evaluate_pairs(model, &self.config, &pairs, &reference)?;
            sums[0] += loss * batch.len() as f64;
            sums[1] += batch.len() as f64;
            for (s, m) in sums[2..].iter_mut().zip(metrics) {
                *s += m;
            }
            sums[METRICS.len() + 2] += 1.0;
        }
        Ok(sums)
    }
}

impl PreferenceEval {
    /// The evaluation from the summed [`PreferenceTask::evaluation_sums`] of every rank.
    pub(super) fn from_sums(sums: &[f64]) -> Self {
        let batches = sums[METRICS.len() + 2].max(1.0);
        PreferenceEval {
            loss: sums[0] / sums[1].max(1.0),
            metrics: sums[2..METRICS.len() + 2]
                .iter()
                .map(|m| m / batches)
                .collect(),
        }
    }
}
