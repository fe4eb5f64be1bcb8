//! What a run knows about itself: the log entries, `trainer_state.json` (transformers' `TrainerState` keys), and
//! the result `Trainer::train` returns.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The file of the [`TrainerState`] in a checkpoint.
pub const TRAINER_STATE: &str = "trainer_state.json";

/// One line of the training log (`log_history` in `trainer_state.json`, and `log.jsonl`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LogEntry {
    /// Optimizer step.
    pub step: usize,
    /// Fractional epoch.
    pub epoch: f64,
    /// Token-level mean training loss of the step's window (train entries).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub loss: Option<f64>,
    /// A mixture of experts' auxiliary load-balancing loss (mean over the step's micro-batches, before
    /// `router_aux_loss_coef`; `loss` includes it times the coefficient), when the model's config asks for it.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub aux_loss: Option<f64>,
    /// Pre-clip gradient norm.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub grad_norm: Option<f64>,
    /// Learning rate used by the step.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub learning_rate: Option<f64>,
    /// Input tokens (padding included) the step processed.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub tokens: Option<usize>,
    /// Wall-clock seconds of the step (forward, backward and update).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub step_seconds: Option<f64>,
    /// Resident memory of the process after the step, in bytes.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub memory_bytes: Option<u64>,
    /// The step's loss was not finite and its update was skipped.
    #[serde(skip_serializing_if = "std::ops::Not::not", default)]
    pub skipped: bool,
    /// Evaluation loss (eval entries).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_loss: Option<f64>,
    /// Evaluation perplexity (eval entries).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_perplexity: Option<f64>,
    /// Share of evaluation examples answered exactly (eval entries with `predict_with_generate`).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_exact_match: Option<f64>,
    /// DPO's metrics under TRL's names (`rewards/chosen`, …, `logps/rejected`; `eval_rewards/chosen`, … on
    /// evaluation), written as keys of the entry itself.
    #[serde(flatten, default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metrics: BTreeMap<String, f64>,
    /// Texts shown with the step in TensorBoard (tag, Markdown: GRPO's sample completions); not in `log.jsonl`.
    #[serde(skip)]
    pub texts: Vec<(String, String)>,
}

/// `trainer_state.json`, with transformers' keys.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainerState {
    /// Optimizer steps done.
    pub global_step: usize,
    /// Steps the run will do.
    pub max_steps: usize,
    /// Fractional epoch reached.
    pub epoch: f64,
    /// Epochs asked for.
    pub num_train_epochs: f64,
    /// Logging interval in steps.
    pub logging_steps: usize,
    /// Evaluation interval in steps.
    pub eval_steps: usize,
    /// Saving interval in steps.
    pub save_steps: usize,
    /// Micro-batch size.
    pub train_batch_size: usize,
    /// Input tokens processed so far.
    pub num_input_tokens_seen: usize,
    /// Every log entry so far.
    pub log_history: Vec<LogEntry>,
    /// Best value of the followed metric (lowest `eval_loss`).
    pub best_metric: Option<f64>,
    /// Step of the best metric.
    pub best_global_step: Option<usize>,
    /// The checkpoint of the best metric's step, once saved (with `metric_for_best_model` or
    /// `load_best_model_at_end`, as transformers 5); `save_total_limit` never removes it, and
    /// `load_best_model_at_end` loads it at the end.
    pub best_model_checkpoint: Option<String>,
    /// Always true (one process).
    pub is_world_process_zero: bool,
    /// Always true (one process).
    pub is_local_process_zero: bool,
    /// Always false.
    pub is_hyper_param_search: bool,
    /// Floating-point operations (not counted: 0).
    pub total_flos: f64,
    /// Consecutive steps with a non-finite loss up to now.
    pub consecutive_nonfinite_losses: usize,
    /// State of callbacks that have one, by name (transformers' `stateful_callbacks`).
    pub stateful_callbacks: serde_json::Map<String, serde_json::Value>,
}

impl TrainerState {
    /// The training losses logged so far, in order.
    pub fn train_losses(&self) -> Vec<f64> {
        self.log_history.iter().filter_map(|e| e.loss).collect()
    }

    /// The evaluation losses logged so far, with their steps.
    pub fn eval_losses(&self) -> Vec<(usize, f64)> {
        self.log_history
            .iter()
            .filter_map(|e| Some((e.step, e.eval_loss?)))
            .collect()
    }
}

/// What `Trainer::train` returns (transformers' `TrainOutput` plus the log).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainOutput {
    /// Steps done.
    pub global_step: usize,
    /// Mean of the logged training losses of this run.
    pub training_loss: f64,
    /// Wall-clock seconds of this call (a resumed run counts only its own part).
    pub train_runtime: f64,
    /// Input tokens per second over this call.
    pub train_tokens_per_second: f64,
    /// Peak resident memory of the process, in bytes, if known.
    pub peak_memory_bytes: Option<u64>,
    /// True if a callback (e.g. early stopping) ended the run before `max_steps`.
    pub stopped_early: bool,
    /// Every log entry.
    pub log_history: Vec<LogEntry>,
}
