//! `[dpo]`: the fields of TRL 1.16's `DPOConfig` that are DPO's own (the rest of its arguments are
//! `TrainingArguments`, in `[training]`; `max_length` is `[data]`'s).

use serde::{Deserialize, Serialize};

use super::args::TrainingArguments;
use crate::data::TruncationMode;
use crate::error::{Error, Result};
use crate::names::named_enum;

named_enum! {
    /// A preference loss (TRL's `loss_type` values; see `dpo::loss` for each formula).
    pub enum LossType ("loss_type") {
        /// `−log σ(β·Δ)`: DPO.
        Sigmoid = "sigmoid",
        /// `relu(1 − β·Δ)`: SLiC.
        Hinge = "hinge",
        /// `(Δ̄ − 1/(2β))²` with per-token log-ratios: IPO.
        Ipo = "ipo",
        /// DPO robust to a share `label_smoothing` of flipped labels.
        Robust = "robust",
        /// `−log σ(β·r_c) − log σ(−β·r_r)`: BCO on pairs.
        BcoPair = "bco_pair",
        /// `(r_c − 1/(2β))² + (r_r + 1/(2β))²`: SPPO with hard labels.
        SppoHard = "sppo_hard",
        /// NCA on pairs.
        NcaPair = "nca_pair",
        /// APO-zero: raise the chosen likelihood, lower the rejected one.
        ApoZero = "apo_zero",
        /// APO-down: lower both, the rejected more.
        ApoDown = "apo_down",
        /// The negative log-likelihood of the chosen completions' tokens (RPO's term with `rpo_alpha`).
        Sft = "sft",
    }
}

/// DPO's settings, with TRL 1.16's names and defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DpoConfig {
    /// How far the policy may move from the reference (higher: less); IPO's τ.
    pub beta: f64,
    /// The share of flipped preference labels assumed by `robust`.
    pub label_smoothing: f64,
    /// The loss, or several summed with `loss_weights`.
    #[serde(deserialize_with = "crate::names::one_or_many")]
    pub loss_type: Vec<LossType>,
    /// A weight per `loss_type` (1 each when unset).
    pub loss_weights: Option<Vec<f64>>,
    /// RPO: adds `rpo_alpha` × the chosen completions' token NLL (what TRL 1.16 writes as `loss_type = ["sigmoid",
    /// "sft"]`, `loss_weights = [1, rpo_alpha]`).
    pub rpo_alpha: Option<f64>,
    /// Compare with a uniform reference (log-probabilities 0) instead of the reference model (older TRL's option).
    pub reference_free: bool,
    /// Compute the reference log-probabilities of every pair once before training (and of the evaluation pairs)
    /// instead of in every batch; they are kept in each checkpoint, so a resumed run does not recompute them.
    pub precompute_ref_log_probs: bool,
    /// Batch size of that pass (`per_device_train_batch_size` / `per_device_eval_batch_size` when unset).
    pub precompute_ref_batch_size: Option<usize>,
    /// Which end of a sequence longer than `[data] max_length` is kept.
    pub truncation_mode: TruncationMode,
    /// Turn LoRA dropout off (TRL's default: the policy and the reference see the same network).
    pub disable_dropout: bool,
}

impl Default for DpoConfig {
    fn default() -> Self {
        DpoConfig {
            beta: 0.1,
            label_smoothing: 0.0,
            loss_type: vec![LossType::Sigmoid],
            loss_weights: None,
            rpo_alpha: None,
            reference_free: false,
            precompute_ref_log_probs: false,
            precompute_ref_batch_size: None,
            truncation_mode: TruncationMode::KeepStart,
            disable_dropout: true,
        }
    }
}

impl DpoConfig {
    /// Checks the values; `path` names the config in errors.
    pub fn validate(&self, path: &str) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("{path}: [dpo]: {m}")));
        if !(self.beta.is_finite() && self.beta > 0.0) {
            return bad(format!("beta = {}: must be a positive number", self.beta));
        }
        if !(0.0..0.5).contains(&self.label_smoothing) {
            return bad(format!(
                "label_smoothing = {}: must be in [0, 0.5) (the share of flipped labels)",
                self.label_smoothing
            ));
        }
        if self.loss_type.is_empty() {
            return bad(
                "loss_type is an empty list: name at least one loss, e.g. \"sigmoid\"".into(),
            );
        }
        if let Some(w) = &self.loss_weights {
            if w.len() != self.loss_type.len() {
                return bad(format!(
                    "loss_weights has {} values for {} loss types: give one weight per loss_type",
                    w.len(),
                    self.loss_type.len()
                ));
            }
            if let Some(x) = w.iter().find(|x| !x.is_finite()) {
                return bad(format!(
                    "loss_weights holds {x}: every weight must be finite"
                ));
            }
            // A negative weight would maximize its loss, as a negative rpo_alpha would (refused below too).
            if let Some((i, x)) = w.iter().enumerate().find(|(_, x)| **x < 0.0) {
                return bad(format!(
                    "loss_weights[{i}] = {x} (for loss_type \"{}\"): must be a number ≥ 0 — a negative weight \
                     would maximize that loss; make it positive, or remove the loss type",
                    self.loss_type[i].as_str()
                ));
            }
        }
        if let Some(a) = self.rpo_alpha.filter(|a| !(a.is_finite() && *a >= 0.0)) {
            return bad(format!("rpo_alpha = {a}: must be a number ≥ 0"));
        }
        if self.precompute_ref_batch_size == Some(0) {
            return bad("precompute_ref_batch_size = 0: must be at least 1".into());
        }
        Ok(())
    }

    /// Why DPO cannot train on `world_size` processes, if it cannot: the one rule a run's ranks and `qlora estimate
    /// --dpo --world-size` both apply (each caller names its own key).
    pub fn world_size_problem(world_size: usize) -> Option<&'static str> {
        (world_size > 1).then_some("DPO runs in one process for now")
    }

    /// Refuses `[training]` settings that have no meaning for DPO; `path` names the config in errors.
    pub fn check_training(&self, args: &TrainingArguments, path: &str) -> Result<()> {
        if args.predict_with_generate {
            return Err(Error::InvalidInput(format!(
                "{path}: [training] predict_with_generate = true: it answers supervised examples, and DPO evaluates \
                 preference pairs (rewards/accuracies says which answer the model prefers); turn it off"
            )));
        }
        Ok(())
    }

    /// Every loss term with its weight: `loss_type` with `loss_weights`, then RPO's `sft` term.
    pub fn weighted_losses(&self) -> Vec<(LossType, f64)> {
        let weights = self
            .loss_weights
            .clone()
            .unwrap_or(vec![1.0; self.loss_type.len()]);
        let mut terms: Vec<(LossType, f64)> = self.loss_type.iter().copied().zip(weights).collect();
        if let Some(alpha) = self.rpo_alpha {
            terms.push((LossType::Sft, alpha));
        }
        terms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_trl_names_and_refuses_bad_values_by_key() {
        let c: DpoConfig = toml::from_str("loss_type = \"ipo\"\nbeta = 0.5").unwrap();
        assert_eq!((c.loss_type.clone(), c.beta), (vec![LossType::Ipo], 0.5));
        let c: DpoConfig =
            toml::from_str("loss_type = [\"sigmoid\", \"sft\"]\nloss_weights = [1.0, 0.5]")
                .unwrap();
        assert_eq!(
            c.weighted_losses(),
            vec![(LossType::Sigmoid, 1.0), (LossType::Sft, 0.5)]
        );
        let rpo = DpoConfig {
            rpo_alpha: Some(0.5),
            ..Default::default()
        };
        assert_eq!(rpo.weighted_losses(), c.weighted_losses());
        let err = toml::from_str::<DpoConfig>("loss_type = \"exo\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("sigmoid"), "{err}");
        for (text, key) in [
            ("beta = 0.0", "beta"),
            ("label_smoothing = 0.5", "label_smoothing"),
            ("loss_type = []", "loss_type"),
            ("loss_weights = [1.0, 2.0]", "loss_weights"),
            ("rpo_alpha = -1.0", "rpo_alpha"),
            ("loss_weights = [-1.0]", "loss_weights[0] = -1"),
            ("precompute_ref_batch_size = 0", "precompute_ref_batch_size"),
        ] {
            let c: DpoConfig = toml::from_str(text).unwrap();
            let err = c.validate("run.toml").unwrap_err().to_string();
            assert!(err.contains(key) && err.contains("[dpo]"), "{text}: {err}");
        }
    }
}
