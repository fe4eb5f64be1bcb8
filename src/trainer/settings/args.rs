//! `TrainingArguments` with transformers' field names and defaults (v5, where they differ from 4.x the choice is
//! noted), read from the `[training]` table of a TOML config. An unknown key is an error that names the closest
//! valid one.

use serde::{Deserialize, Serialize};

use super::fsdp::{FsdpConfig, FsdpPlan};
use super::sections::read_section;
use crate::distributed::WorldEnv;
use crate::error::{Error, Result};
use crate::names::named_enum;
use crate::optim::schedule::{check_kwargs, warmup_steps};
use crate::optim::{OptimizerName, SchedulerType};

/// When to evaluate / save / log (`IntervalStrategy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IntervalStrategy {
    /// Never.
    No,
    /// Every `*_steps` optimizer steps.
    Steps,
    /// At the end of each epoch.
    Epoch,
}

impl IntervalStrategy {
    /// The name a config writes (`"no"`, `"steps"`, `"epoch"`).
    pub fn name(self) -> &'static str {
        match self {
            IntervalStrategy::No => "no",
            IntervalStrategy::Steps => "steps",
            IntervalStrategy::Epoch => "epoch",
        }
    }
}

named_enum! {
    /// The order micro-batches take (`train_sampling_strategy`).
    pub enum SamplingStrategy ("train_sampling_strategy") {
        /// A seeded shuffle per epoch.
        Random = "random",
        /// The data's order.
        Sequential = "sequential",
        /// Shuffled, then length-sorted within chunks of 50 batches (transformers' `LengthGroupedSampler`).
        GroupByLength = "group_by_length",
    }
}

/// transformers' `TrainingArguments`, the fields a QLoRA run sets.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrainingArguments {
    /// Where checkpoints, logs and the final adapter go (transformers' doc default `trainer_output`).
    pub output_dir: String,
    /// Replace the contents of an existing `output_dir` (otherwise an earlier run's output is never overwritten).
    pub overwrite_output_dir: bool,
    /// Micro-batch size.
    pub per_device_train_batch_size: usize,
    /// Evaluation batch size.
    pub per_device_eval_batch_size: usize,
    /// Micro-batches per optimizer step.
    pub gradient_accumulation_steps: usize,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Epochs (fractional allowed); ignored when `max_steps > 0`.
    pub num_train_epochs: f64,
    /// Total optimizer steps; overrides epochs when > 0.
    pub max_steps: i64,
    /// Warmup as a step count (≥ 1) or a ratio of the total (< 1), as in transformers 5.
    pub warmup_steps: f64,
    /// Warmup ratio (transformers 4.x); used when `warmup_steps` is 0.
    pub warmup_ratio: f64,
    /// The schedule.
    pub lr_scheduler_type: SchedulerType,
    /// Schedule keyword arguments (e.g. `min_lr`, `num_cycles`, `power`).
    pub lr_scheduler_kwargs: Option<serde_json::Value>,
    /// Decoupled weight decay (not applied to biases and norms).
    pub weight_decay: f64,
    /// Global gradient-norm clipping (0 disables).
    pub max_grad_norm: f64,
    /// Adam β1.
    pub adam_beta1: f64,
    /// Adam β2.
    pub adam_beta2: f64,
    /// Adam ε.
    pub adam_epsilon: f64,
    /// The optimizer (`adamw_torch`, `adamw_8bit`, `paged_adamw_8bit`, `paged_adamw_32bit`, `sgd`; transformers 5's
    /// default `adamw_torch_fused` means `adamw_torch` here).
    pub optim: OptimizerName,
    /// Log every N steps (a value < 1 is a ratio of the total).
    pub logging_steps: f64,
    /// Also log the first step.
    pub logging_first_step: bool,
    /// When to evaluate.
    pub eval_strategy: IntervalStrategy,
    /// Evaluate every N steps (defaults to `logging_steps`).
    pub eval_steps: Option<f64>,
    /// Evaluate once before the first step too (logged at step 0), as transformers' `eval_on_start`.
    pub eval_on_start: bool,
    /// When to save checkpoints.
    pub save_strategy: IntervalStrategy,
    /// Save every N steps.
    pub save_steps: f64,
    /// Keep at most this many checkpoints (transformers' meaning: unset, 0 or less keeps every one; the newest is
    /// always kept, and with `metric_for_best_model` or `load_best_model_at_end` the best one too — so a limit of 1
    /// keeps two when the best is not the newest, and the best alone at the end).
    pub save_total_limit: Option<i64>,
    /// bf16 autocast.
    pub bf16: bool,
    /// fp16 autocast.
    pub fp16: bool,
    /// Recompute each layer in the backward (transformers 5: `None` = off; TRL's `SFTConfig` defaults it on).
    /// transformers 5.24 names it `activation_checkpointing`, which wins when set
    /// ([`TrainingArguments::checkpointing`]).
    pub gradient_checkpointing: bool,
    /// Accepted for compatibility; checkpointing here is always non-reentrant (`use_reentrant = false`).
    pub gradient_checkpointing_kwargs: Option<serde_json::Value>,
    /// transformers 5.24's name for `gradient_checkpointing`; unset, `gradient_checkpointing` decides. Both set to
    /// different values is an error naming both. (Unset, it is left out of `training_args.json`, as before it
    /// existed.)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    /// transformers 5.24's name for `gradient_checkpointing_kwargs` (accepted for compatibility likewise; both set
    /// to different values is an error).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing_kwargs: Option<serde_json::Value>,
    /// candle-qlora: record every allocation of the run (the CPU's tracking allocator, or the GPU's memory pool)
    /// and write `output_dir/memory_snapshot.pickle` at the end — and when a GPU step runs out of memory — in the
    /// layout of PyTorch's `torch.cuda.memory._snapshot()` for pytorch.org/memory_viz (frames name the op, the
    /// layer, the phase and the step).
    pub memory_snapshot: bool,
    /// candle-qlora: the optimizer steps (1-based) to trace into `output_dir/trace.json` (Chrome's trace-event
    /// format, as `torch.profiler`'s `export_chrome_trace`; open it in ui.perfetto.dev): spans per layer for the
    /// forward, recomputation and backward, the loss, the optimizer, data loading and checkpoints, and memory.
    pub trace_steps: Vec<usize>,
    /// The most allocations and frees the snapshot keeps (the last ones; `_record_memory_history(max_entries=…)`;
    /// a free is written as two events, `free_requested` and `free_completed`).
    pub memory_snapshot_max_entries: usize,
    /// candle-qlora: memory-aware checkpointing. With `gradient_checkpointing`, the last layers keep their
    /// activations (no recomputation) as long as those fit in this many MiB per micro-batch; only the other layers
    /// are recomputed in the backward. `None` recomputes every layer (transformers' behaviour).
    pub activation_memory_budget_mib: Option<f64>,
    /// candle-qlora: tiled MLP (ALST's TiledMLP). Each dense layer's MLP runs its forward and backward over slices
    /// of the micro-batch's token rows — `⌈tokens / hidden_size⌉` even slices of at most `hidden_size` rows — so
    /// its gate, up and activation intermediates (3 × tokens × `intermediate_size`) exist for one slice at a time,
    /// with gradient checkpointing on or off. The MLP's forward runs once more (in the backward) when checkpointing
    /// is off. Losses and input gradients are the untiled run's; the adapter's gradient sums are accumulated slice by
    /// slice (another summation order). Needs `lora_dropout = 0` on the MLP projections. Mixture-of-experts layers
    /// run each expert tiled over its own tokens.
    pub tiled_mlp: bool,
    /// candle-qlora: activation offload (torchtune's `enable_activation_offloading`). With gradient checkpointing,
    /// the input each recomputed layer saves for the backward waits in pinned host memory instead of on the GPU:
    /// copied out on a copy stream while the layer computes, brought back one layer ahead of its recomputation, so
    /// the GPU holds two layer inputs instead of one per layer. The pinned buffers (about `(layers − 1) × tokens ×
    /// hidden_size` elements of the compute dtype) are kept for the next step and reported in
    /// `memory_timeline.json` (`host_pinned_bytes`). Losses and gradients are the run's without it, bit for bit.
    /// On the CPU the host memory is the device's, and the setting changes nothing.
    pub activation_offloading: bool,
    /// Seed of initialization, dropout and shuffling.
    pub seed: u64,
    /// Seed of the data order (defaults to `seed`).
    pub data_seed: Option<u64>,
    /// Resume from this checkpoint folder, or from the latest in `output_dir` with `"true"` or `"latest"` (the
    /// command's `--resume` sets it).
    pub resume_from_checkpoint: Option<String>,
    /// candle-qlora: resume even when the checkpoint was trained on another base model (its manifest records a
    /// fingerprint of the base; by default a mismatch is refused).
    pub ignore_base_model_mismatch: bool,
    /// Integrations to report to, a name or a list (transformers' names): `none`, `tensorboard`, or `all` (every
    /// one this build has: TensorBoard). Logs always go to `output_dir/log.jsonl` too.
    pub report_to: ReportTo,
    /// NEFTune noise on the input embeddings during training.
    pub neftune_noise_alpha: Option<f64>,
    /// Batch examples of similar length (transformers 4.x name).
    pub group_by_length: bool,
    /// `random`, `sequential` or `group_by_length` (transformers 5 name).
    pub train_sampling_strategy: SamplingStrategy,
    /// Drop the last incomplete batch.
    pub dataloader_drop_last: bool,
    /// No progress bar (log lines instead), as in transformers.
    pub disable_tqdm: bool,
    /// Evaluation also answers each evaluation example greedily from its prompt and reports the share answered
    /// exactly (`eval_exact_match`), as `Seq2SeqTrainingArguments.predict_with_generate` with an exact-match metric
    /// (examples without a prompt, such as plain text, are not counted).
    pub predict_with_generate: bool,
    /// The evaluation metric that picks the best checkpoint (`best_model_checkpoint` in `trainer_state.json`, which
    /// `save_total_limit` keeps and `load_best_model_at_end` loads) and that early stopping watches: `eval_loss`
    /// (alias `loss`), or a metric the method's evaluation logs (DPO's `eval_rewards/accuracies`, …), with or
    /// without `eval_`; another name is refused before anything loads. Unset, no best checkpoint is tracked,
    /// unless `load_best_model_at_end` makes it `loss` (as transformers).
    pub metric_for_best_model: Option<String>,
    /// Whether a higher metric is better; unset, transformers' default: `false` for a metric whose name ends in
    /// `loss`, `true` otherwise. `true` for a loss is refused (it would keep the worst checkpoint).
    pub greater_is_better: Option<bool>,
    /// At the end of training, load the best checkpoint's adapter (the lowest `eval_loss` among the evaluations
    /// that have a checkpoint) back into the model, as transformers' `load_best_model_at_end`: the adapter written
    /// to `output_dir` (and any evaluation after `train`) is then the best model's, not the last step's. It needs
    /// evaluations and checkpoints on the same schedule: `eval_strategy` equal to `save_strategy` (not `"no"`),
    /// and with `"steps"` a `save_steps` that is a round multiple of `eval_steps`. A run whose best evaluation was
    /// never saved keeps the last step's model, saying so.
    pub load_best_model_at_end: bool,
    /// Train on the CPU even when a CUDA GPU is there (the default trains on GPU 0 when this build has the `cuda`
    /// feature and a GPU answers).
    pub use_cpu: bool,
    /// candle-qlora: stop with an error after this many consecutive steps with a non-finite loss (each such step
    /// is skipped and logged; 0 never stops).
    pub max_consecutive_nonfinite_losses: usize,
    /// transformers' switch of Liger's fused kernels; here the crate's own CUDA kernels (RMSNorm, RoPE, SwiGLU and
    /// GeGLU, attention, the fused linear cross-entropy, the LoRA projection, 4-bit dequantization and decoding).
    /// `true` — the default here, unlike transformers', since they are this crate's GPU path — runs them; `false`
    /// runs Candle's composed ops in their place: slower and hungrier, a way around a kernel that misbehaves on
    /// some GPU. Dropout masks, NEFTune noise and the optimizer updates keep their kernels. No effect on the CPU.
    pub use_liger_kernel: bool,
    /// The collective backend of a distributed run (several processes, torchrun's `WORLD_SIZE`): `"nccl"`, the one
    /// supported (also when unset).
    pub ddp_backend: Option<String>,
    /// Seconds a distributed run waits for the rendezvous or a collective before every rank stops with an error
    /// naming what hung (transformers' default 1800).
    pub ddp_timeout: u64,
    /// The gradient all-reduce's bucket size in MiB (PyTorch DDP's 25 when unset).
    pub ddp_bucket_cap_mb: Option<f64>,
    /// Accepted for compatibility: a LoRA model has no buffers to broadcast (the frozen base is loaded alike by
    /// every rank).
    pub ddp_broadcast_buffers: Option<bool>,
    /// FSDP over the ranks of a distributed run (transformers' option words): `"full_shard"` (optionally with
    /// `"auto_wrap"`) has every rank keep `1/world_size` of each decoder layer's frozen weights, gathered from the
    /// others before the layer runs, instead of the whole base. The adapter stays whole on every rank, its gradients
    /// all-reduced as in data-parallel training. Unset: data-parallel (or one process).
    pub fsdp: Option<String>,
    /// transformers' `fsdp_config` (see [`FsdpConfig`]: the keys that apply, the others refused by name).
    pub fsdp_config: FsdpConfig,
}

impl Default for TrainingArguments {
    fn default() -> Self {
        TrainingArguments {
            output_dir: "trainer_output".into(),
            overwrite_output_dir: false,
            per_device_train_batch_size: 8,
            per_device_eval_batch_size: 8,
            gradient_accumulation_steps: 1,
            learning_rate: 5e-5,
            num_train_epochs: 3.0,
            max_steps: -1,
            warmup_steps: 0.0,
            warmup_ratio: 0.0,
            lr_scheduler_type: SchedulerType::Linear,
            lr_scheduler_kwargs: None,
            weight_decay: 0.0,
            max_grad_norm: 1.0,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            optim: OptimizerName::AdamWTorch,
            logging_steps: 500.0,
            logging_first_step: false,
            eval_strategy: IntervalStrategy::No,
            eval_steps: None,
            eval_on_start: false,
            save_strategy: IntervalStrategy::Steps,
            save_steps: 500.0,
            save_total_limit: None,
            bf16: false,
            fp16: false,
            gradient_checkpointing: false,
            gradient_checkpointing_kwargs: None,
            activation_checkpointing: None,
            activation_checkpointing_kwargs: None,
            activation_memory_budget_mib: None,
            tiled_mlp: false,
            activation_offloading: false,
            memory_snapshot: false,
            trace_steps: Vec::new(),
            memory_snapshot_max_entries: 100_000,
            seed: 42,
            data_seed: None,
            resume_from_checkpoint: None,
            ignore_base_model_mismatch: false,
            report_to: ReportTo(vec!["none".into()]),
            neftune_noise_alpha: None,
            group_by_length: false,
            train_sampling_strategy: SamplingStrategy::Random,
            dataloader_drop_last: false,
            disable_tqdm: false,
            predict_with_generate: false,
            metric_for_best_model: None,
            greater_is_better: None,
            load_best_model_at_end: false,
            use_cpu: false,
            max_consecutive_nonfinite_losses: 5,
            use_liger_kernel: true,
            ddp_backend: None,
            ddp_timeout: 1800,
            ddp_bucket_cap_mb: None,
            ddp_broadcast_buffers: None,
            fsdp: None,
            fsdp_config: FsdpConfig::default(),
        }
    }
}

/// Why `load_best_model_at_end` without evaluations is refused.
const NO_EVALUATIONS: &str = "load_best_model_at_end = true needs evaluations to pick the best checkpoint, and \
     eval_strategy is \"no\": set eval_strategy and save_strategy both to \"steps\" (with eval_steps) or both \
     to \"epoch\", or set load_best_model_at_end = false";

/// The most epochs a run without `max_steps` may ask for: 2^53, beyond which a step count is no longer an exact
/// float (and a run of even one step per epoch would never end).
const MAX_EPOCHS: f64 = 9_007_199_254_740_992.0;

/// The range a number of [`TrainingArguments`] must be in.
#[derive(Clone, Copy)]
enum Range {
    NonNegative,
    Positive,
    /// In [0, 1].
    Fraction,
    /// In [0, 1), as PyTorch's Adam takes its betas.
    Beta,
    /// More than 0; below 1 a ratio of the total steps.
    Steps,
}

impl Range {
    fn admits(self, x: f64) -> bool {
        match self {
            Range::NonNegative => x >= 0.0,
            Range::Positive | Range::Steps => x > 0.0,
            Range::Fraction => (0.0..=1.0).contains(&x),
            Range::Beta => (0.0..1.0).contains(&x),
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Range::NonNegative => "0 or more",
            Range::Positive => "more than 0",
            Range::Fraction => "in [0, 1]",
            Range::Beta => "in [0, 1)",
            Range::Steps => "more than 0 (below 1: a ratio of the steps)",
        }
    }
}

impl TrainingArguments {
    /// The device to train on: CUDA GPU 0 when this build has the `cuda` feature, a GPU answers and `use_cpu` is
    /// off; otherwise the CPU (with a note on stderr when a GPU was wanted but none answered). A GPU that answers
    /// but cannot run this build's kernels (too old a driver or compute capability) is an error saying what to do.
    pub fn device(&self) -> Result<candle_core::Device> {
        // A rank of a distributed run trains on the GPU of its LOCAL_RANK.
        let ordinal = match self.use_cpu || !cfg!(feature = "cuda") {
            true => 0,
            false => WorldEnv::from_env()?.map_or(0, |w| w.local_rank),
        };
        crate::precision::select_device(self.use_cpu, ordinal, "training")
    }

    /// Reads the `[training]` table; `path` names the file in errors.
    pub fn from_toml_value(value: &toml::Value, path: &str) -> Result<Self> {
        let args: TrainingArguments = read_section(value, path, "training", &[])?;
        // Only the table tells `gradient_checkpointing = false` written from the default.
        if let Some(m) = args.renamed_key_conflict(value.get("gradient_checkpointing").is_some()) {
            return Err(Error::InvalidInput(format!("{path}: [training]: {m}")));
        }
        args.validate(path)?;
        Ok(args)
    }

    /// Whether each layer is recomputed in the backward: `activation_checkpointing` (transformers 5.24's name)
    /// when set, else `gradient_checkpointing`.
    pub fn checkpointing(&self) -> bool {
        self.activation_checkpointing
            .unwrap_or(self.gradient_checkpointing)
    }

    /// Why a key and its transformers 5.24 name (`activation_checkpointing`, `activation_checkpointing_kwargs`)
    /// hold different values, if they do. `gradient_checkpointing_written` says whether `gradient_checkpointing` was
    /// set (in code only `true` differs from the default).
    fn renamed_key_conflict(&self, gradient_checkpointing_written: bool) -> Option<String> {
        let disagree = |old: &str, was: String, new: &str, is: String| {
            format!(
                "`{old}` = {was} and `{new}` = {is} disagree: `{new}` is transformers 5.24's name for `{old}`; set \
                 one of them (or both to the same value)"
            )
        };
        if let Some(new) = self.activation_checkpointing {
            if gradient_checkpointing_written && new != self.gradient_checkpointing {
                return Some(disagree(
                    "gradient_checkpointing",
                    self.gradient_checkpointing.to_string(),
                    "activation_checkpointing",
                    new.to_string(),
                ));
            }
        }
        match (
            &self.gradient_checkpointing_kwargs,
            &self.activation_checkpointing_kwargs,
        ) {
            (Some(old), Some(new)) if old != new => Some(disagree(
                "gradient_checkpointing_kwargs",
                old.to_string(),
                "activation_checkpointing_kwargs",
                new.to_string(),
            )),
            _ => None,
        }
    }

    /// Checks names and ranges.
    pub fn validate(&self, path: &str) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("{path}: [training]: {m}")));
        if self.output_dir.trim().is_empty() {
            return bad(
                "`output_dir` is empty: name the folder for the checkpoints, logs and adapter (transformers' \
                 default is \"trainer_output\")"
                    .into(),
            );
        }
        for (key, value) in [
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size,
            ),
            (
                "per_device_eval_batch_size",
                self.per_device_eval_batch_size,
            ),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
            ),
        ] {
            if value == 0 {
                return bad(format!("`{key}` = 0: must be at least 1"));
            }
        }
        // Without max_steps the epochs bound the run: a finite count whose steps can be counted (each epoch has at
        // least one), as transformers needs max_steps > 0 or a finite num_train_epochs > 0.
        if self.max_steps <= 0 && self.num_train_epochs > MAX_EPOCHS {
            return bad(format!(
                "`num_train_epochs` = {} with max_steps = {}: the run would never end; set max_steps > 0 (the \
                 optimizer steps to train) or a finite num_train_epochs of at most {MAX_EPOCHS:e}",
                if self.num_train_epochs.is_finite() {
                    format!("{:e}", self.num_train_epochs)
                } else {
                    self.num_train_epochs.to_string()
                },
                self.max_steps
            ));
        }
        // With max_steps the epochs are ignored, as transformers ignores them: any count, unbounded too.
        if self.max_steps > 0 && (self.num_train_epochs.is_nan() || self.num_train_epochs < 0.0) {
            return bad(format!(
                "`num_train_epochs` = {}: must be 0 or more",
                self.num_train_epochs
            ));
        }
        // Every number a finite value in its range (PyTorch's for the optimizer's), named with the range.
        let mut numbers = vec![("learning_rate", self.learning_rate, Range::NonNegative)];
        if self.max_steps <= 0 {
            numbers.push(("num_train_epochs", self.num_train_epochs, Range::Positive));
        }
        numbers.extend([
            ("warmup_steps", self.warmup_steps, Range::NonNegative),
            ("warmup_ratio", self.warmup_ratio, Range::Fraction),
            ("weight_decay", self.weight_decay, Range::NonNegative),
            ("max_grad_norm", self.max_grad_norm, Range::NonNegative),
            ("adam_beta1", self.adam_beta1, Range::Beta),
            ("adam_beta2", self.adam_beta2, Range::Beta),
            ("adam_epsilon", self.adam_epsilon, Range::NonNegative),
            ("logging_steps", self.logging_steps, Range::Steps),
            ("save_steps", self.save_steps, Range::Steps),
        ]);
        if let Some(e) = self.eval_steps {
            numbers.push(("eval_steps", e, Range::Steps));
        }
        for (key, value, range) in numbers {
            if !value.is_finite() || !range.admits(value) {
                return bad(format!("`{key}` = {value}: must be {}", range.describe()));
            }
        }
        if self
            .activation_memory_budget_mib
            .is_some_and(|b| !b.is_finite() || b < 0.0)
        {
            return bad("activation_memory_budget_mib must be a number of MiB, 0 or more".into());
        }
        if self.activation_offloading && !self.checkpointing() {
            return bad(
                "`activation_offloading` = true offloads the inputs recomputed layers save, and no layer is \
                 recomputed: set gradient_checkpointing = true too (or activation_offloading = false)"
                    .into(),
            );
        }
        // The schedule's keyword arguments, as transformers' schedule function would take them.
        if let Err(e) = check_kwargs(
            self.lr_scheduler_type,
            self.learning_rate,
            self.lr_scheduler_kwargs.as_ref(),
        ) {
            return bad(e.to_string());
        }
        if let Some(conflict) = self.renamed_key_conflict(self.gradient_checkpointing) {
            return bad(conflict);
        }
        if self.bf16 && self.fp16 {
            return bad("bf16 and fp16 are both true: choose one".into());
        }
        if let Some(other) = self
            .report_to
            .0
            .iter()
            .find(|n| !ReportTo::SUPPORTED.contains(&n.as_str()))
        {
            return bad(format!(
                "report_to = \"{other}\" is not supported: use {} (logs are also written to output_dir/log.jsonl)",
                ReportTo::SUPPORTED.join(", ")
            ));
        }
        // The metric's name is checked against what the method's evaluation logs (`preflight`).
        let metric = self.best_model_metric().unwrap_or("eval_loss");
        if self.greater_is_better == Some(true) && metric.ends_with("loss") {
            return bad(format!(
                "greater_is_better = true: the metric for the best model is \"{metric}\", a loss, where lower is \
                 better — transformers would keep the checkpoint with the highest loss; remove greater_is_better \
                 or set it to false (or set metric_for_best_model to a metric where higher is better)"
            ));
        }
        if let Some(problem) = self.load_best_problem() {
            return bad(problem);
        }
        if let Some(problem) = (self.max_steps > 0)
            .then(|| self.trace_steps_problem(self.max_steps as usize))
            .flatten()
        {
            return bad(problem);
        }
        if self
            .neftune_noise_alpha
            .is_some_and(|a| a.is_nan() || a < 0.0)
        {
            return bad("neftune_noise_alpha must be a non-negative number".into());
        }
        if let Some(backend) = self.ddp_backend.as_deref().filter(|b| *b != "nccl") {
            return bad(format!(
                "ddp_backend = \"{backend}\" is not supported: the GPUs talk over NCCL (\"nccl\")"
            ));
        }
        if self.ddp_timeout == 0 {
            return bad("ddp_timeout must be at least 1 second".into());
        }
        if self
            .ddp_bucket_cap_mb
            .is_some_and(|m| !m.is_finite() || m <= 0.0)
        {
            return bad("ddp_bucket_cap_mb must be a positive number of MiB".into());
        }
        if let Err(m) = self.fsdp_plan() {
            return bad(m);
        }
        Ok(())
    }

    /// How the frozen base is shared out over the ranks (`fsdp`, `fsdp_config`): `None` unless `fsdp` is set;
    /// why not, for settings FSDP refuses.
    pub fn fsdp_plan(&self) -> std::result::Result<Option<FsdpPlan>, String> {
        self.fsdp_config
            .plan(self.fsdp.as_deref(), self.gradient_checkpointing)
    }

    /// The metric that picks the best checkpoint: `metric_for_best_model`, or `"loss"` when `load_best_model_at_end`
    /// leaves it unset (transformers fills it in so); `None` when no best checkpoint is tracked.
    pub fn best_model_metric(&self) -> Option<&str> {
        match &self.metric_for_best_model {
            Some(m) => Some(m),
            None => self.load_best_model_at_end.then_some("loss"),
        }
    }

    /// Why `load_best_model_at_end` cannot work with these strategies and intervals (transformers' checks in
    /// `TrainingArguments.__post_init__`, and evaluations at all), if it is on and cannot.
    fn load_best_problem(&self) -> Option<String> {
        if !self.load_best_model_at_end {
            return None;
        }
        let (eval, save) = (self.eval_strategy, self.save_strategy);
        if eval == IntervalStrategy::No {
            return Some(NO_EVALUATIONS.into());
        }
        if eval != save {
            return Some(format!(
                "load_best_model_at_end = true requires the save and eval strategy to match, but found \
                 eval_strategy = \"{}\" and save_strategy = \"{}\": set save_strategy = \"{}\", so that every \
                 checkpoint is saved at an evaluation",
                eval.name(),
                save.name(),
                eval.name()
            ));
        }
        if eval != IntervalStrategy::Steps {
            return None;
        }
        // transformers' rule, to its float arithmetic: step counts must divide, ratios (< 1) divide after scaling
        // by 10^6, and a ratio with a step count cannot be guaranteed to.
        let save_steps = self.save_steps;
        let (eval_steps, eval_key) = match self.eval_steps {
            Some(e) => (e, "eval_steps"),
            None => (self.logging_steps, "eval_steps (unset: logging_steps)"),
        };
        if save_steps % eval_steps == 0.0 {
            return None;
        }
        if eval_steps < 1.0 || save_steps < 1.0 {
            if !(eval_steps < 1.0 && save_steps < 1.0) {
                return Some(format!(
                    "load_best_model_at_end = true requires save_steps to be a multiple of eval_steps, which \
                     cannot be guaranteed when mixing a ratio of the run's steps (below 1) and a step count: \
                     save_steps = {save_steps}, {eval_key} = {eval_steps}; give both as step counts or both as \
                     ratios"
                ));
            }
            const LARGE_MULTIPLIER: f64 = 1_000_000.0;
            if (save_steps * LARGE_MULTIPLIER) % (eval_steps * LARGE_MULTIPLIER) == 0.0 {
                return None;
            }
            return Some(format!(
                "load_best_model_at_end = true requires save_steps to be a multiple of eval_steps, but \
                 save_steps = {save_steps} is not a multiple of {eval_key} = {eval_steps}: make save_steps a \
                 multiple of it, so that every checkpoint is saved at an evaluation"
            ));
        }
        let multiple = (save_steps / eval_steps).ceil() * eval_steps;
        Some(format!(
            "load_best_model_at_end = true requires save_steps to be a round multiple of eval_steps, but \
             save_steps = {save_steps} is not a round multiple of {eval_key} = {eval_steps}: set save_steps = \
             {multiple} (or eval_steps to a divisor of {save_steps}), so that every checkpoint is saved at an \
             evaluation"
        ))
    }

    /// An error unless the save and evaluation intervals this run resolved to (`save`, `eval` steps of `total`)
    /// keep every checkpoint at an evaluation, as `load_best_model_at_end` needs: ratios that passed
    /// [`TrainingArguments::validate`] (transformers' check) may still round to steps that do not divide.
    pub(crate) fn check_best_model_intervals(
        &self,
        save: usize,
        eval: usize,
        total: usize,
    ) -> Result<()> {
        let steps = self.eval_strategy == IntervalStrategy::Steps;
        if !self.load_best_model_at_end || !steps || save % eval == 0 {
            return Ok(());
        }
        Err(Error::InvalidInput(format!(
            "[training] load_best_model_at_end = true: save_steps = {} and eval_steps = {} come to every {save} and \
             every {eval} of this run's {total} steps, and {save} is not a multiple of {eval}, so some checkpoints \
             would have no evaluation: give save_steps and eval_steps as step counts, save_steps a multiple of \
             eval_steps",
            self.save_steps,
            self.eval_steps.unwrap_or(self.logging_steps)
        )))
    }

    /// Why `trace_steps` names a step a run of `total` optimizer steps never takes (they count from 1), if it
    /// does: its trace would silently not be written.
    fn trace_steps_problem(&self, total: usize) -> Option<String> {
        let step = self.trace_steps.iter().find(|&&s| s == 0 || s > total)?;
        Some(format!(
            "trace_steps holds {step}, a step this run never takes: it has optimizer steps 1 to {total}; trace \
             steps in that range, e.g. trace_steps = [{}]",
            total.min(2)
        ))
    }

    /// An error unless every step of `trace_steps` is one of the `total` steps this run resolved to (checked when
    /// the config is read where `max_steps` gives the count).
    pub(crate) fn check_trace_steps(&self, total: usize) -> Result<()> {
        match self.trace_steps_problem(total) {
            Some(m) => Err(Error::InvalidInput(format!("[training] {m}"))),
            None => Ok(()),
        }
    }

    /// The order micro-batches take: `group_by_length` (transformers 4.x) or `train_sampling_strategy`.
    pub fn sampling(&self) -> SamplingStrategy {
        if self.group_by_length {
            SamplingStrategy::GroupByLength
        } else {
            self.train_sampling_strategy
        }
    }

    /// Warmup steps for `total` optimizer steps (`warmup_steps`, else `warmup_ratio`).
    pub fn warmup_for(&self, total: usize) -> usize {
        if self.warmup_steps > 0.0 {
            warmup_steps(self.warmup_steps, total)
        } else {
            (total as f64 * self.warmup_ratio).ceil() as usize
        }
    }

    /// Total optimizer steps for `batches_per_epoch` micro-batches per epoch (transformers' formula: the partial
    /// last accumulation window counts as a step).
    pub fn total_steps(&self, batches_per_epoch: usize) -> usize {
        if self.max_steps > 0 {
            return self.max_steps as usize;
        }
        (self.num_train_epochs * self.steps_per_epoch(batches_per_epoch) as f64).ceil() as usize
    }

    /// Optimizer steps per epoch of `batches_per_epoch` micro-batches (a partial last window counts), at least one.
    fn steps_per_epoch(&self, batches_per_epoch: usize) -> usize {
        batches_per_epoch
            .div_ceil(self.gradient_accumulation_steps)
            .max(1)
    }

    /// The epochs a run of `batches_per_epoch` micro-batches per epoch goes through, as transformers counts them
    /// for `trainer_state.json`: those `max_steps` reaches when it is set (the epochs asked for are ignored then),
    /// otherwise `num_train_epochs` rounded up.
    pub fn epochs(&self, batches_per_epoch: usize) -> usize {
        if self.max_steps > 0 {
            return (self.max_steps as usize).div_ceil(self.steps_per_epoch(batches_per_epoch));
        }
        self.num_train_epochs.ceil() as usize
    }

    /// A step interval that may be given as a ratio (< 1) of `total`.
    pub fn interval(value: f64, total: usize) -> usize {
        if value < 1.0 {
            ((total as f64 * value).ceil() as usize).max(1)
        } else {
            value as usize
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<TrainingArguments> {
        let table: toml::Table = text.parse().unwrap();
        TrainingArguments::from_toml_value(&toml::Value::Table(table), "run.toml")
    }

    #[test]
    fn defaults_are_transformers() {
        let a = parse("").unwrap();
        assert_eq!(a, TrainingArguments::default());
        assert_eq!(
            (
                a.learning_rate,
                a.per_device_train_batch_size,
                a.num_train_epochs
            ),
            (5e-5, 8, 3.0)
        );
        assert_eq!(
            (a.lr_scheduler_type.as_str(), a.max_grad_norm, a.seed),
            ("linear", 1.0, 42)
        );
    }

    #[test]
    fn reads_a_qlora_recipe() {
        let a = parse(
            "output_dir = \"runs/x\"\nlearning_rate = 2e-4\noptim = \"paged_adamw_8bit\"\nwarmup_steps = 0.03\n\
             lr_scheduler_type = \"cosine\"\nbf16 = true\ngradient_checkpointing = true\neval_strategy = \"steps\"\n",
        )
        .unwrap();
        assert_eq!(a.optim, OptimizerName::PagedAdamW8bit);
        assert_eq!(a.warmup_for(100), 3);
        assert_eq!(a.eval_strategy, IntervalStrategy::Steps);
    }

    #[test]
    fn unknown_keys_suggest_the_closest_name_and_types_are_checked() {
        let err = parse("learning_rat = 1e-4").unwrap_err().to_string();
        assert!(
            err.contains("run.toml")
                && err.contains("`learning_rat`")
                && err.contains("did you mean `learning_rate`"),
            "{err}"
        );
        let err = parse("per_device_train_batch_size = \"four\"")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run.toml") && err.contains("invalid type"),
            "{err}"
        );
        let err = parse("optim = \"adafactor\"").unwrap_err().to_string();
        assert!(err.contains("adafactor"), "{err}");
    }

    #[test]
    fn combinations_transformers_refuses_are_refused_by_key() {
        for (toml, says) in [
            ("per_device_train_batch_size = 0", "`per_device_train_batch_size` = 0: must be at least 1"),
            ("per_device_eval_batch_size = 0", "`per_device_eval_batch_size` = 0: must be at least 1"),
            ("gradient_accumulation_steps = 0", "`gradient_accumulation_steps` = 0: must be at least 1"),
            ("output_dir = \"\"", "`output_dir` is empty"),
            ("output_dir = \"  \"", "`output_dir` is empty"),
            ("num_train_epochs = inf\nmax_steps = 0", "`num_train_epochs` = inf with max_steps = 0"),
            ("num_train_epochs = 1e300", "`num_train_epochs` = 1e300 with max_steps = -1"),
            (
                "lr_scheduler_type = \"cosine\"\nlr_scheduler_kwargs = { num_cycles = \"2\" }",
                "lr_scheduler_kwargs.num_cycles = \"2\": must be a finite number (lr_scheduler_type = \"cosine\")",
            ),
            (
                "lr_scheduler_kwargs = { power = 2.0 }",
                "`power` does not apply to this schedule, which takes none (lr_scheduler_type = \"linear\")",
            ),
        ] {
            let err = parse(toml).unwrap_err().to_string();
            assert!(err.contains("run.toml: [training]") && err.contains(says), "{toml}: {err}");
        }
        // With max_steps the epochs do not bound the run (transformers ignores them): even unbounded ones, as the
        // error for them without max_steps advises.
        parse("num_train_epochs = 1e300\nmax_steps = 5").unwrap();
        let a = parse("num_train_epochs = inf\nmax_steps = 5").unwrap();
        assert_eq!(a.epochs(2), 3);
        let err = parse("num_train_epochs = nan\nmax_steps = 5")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`num_train_epochs` = NaN: must be 0 or more"),
            "{err}"
        );
    }

    /// transformers' `__post_init__` rules for `load_best_model_at_end`, case by case (its texts as a guide), plus
    /// evaluations at all; `metric_for_best_model` defaults to the loss, and a greater-is-better loss is refused.
    #[test]
    fn load_best_model_at_end_follows_transformers_rules() {
        let best = |rest: &str| parse(&format!("load_best_model_at_end = true\n{rest}"));
        for (toml, says) in [
            ("", "needs evaluations to pick the best checkpoint, and eval_strategy is \"no\""),
            (
                "eval_strategy = \"steps\"\nsave_strategy = \"epoch\"",
                "requires the save and eval strategy to match, but found eval_strategy = \"steps\" and \
                 save_strategy = \"epoch\": set save_strategy = \"steps\"",
            ),
            (
                "eval_strategy = \"epoch\"\nsave_strategy = \"no\"",
                "eval_strategy = \"epoch\" and save_strategy = \"no\"",
            ),
            (
                "eval_strategy = \"steps\"\neval_steps = 4\nsave_steps = 6",
                "save_steps = 6 is not a round multiple of eval_steps = 4: set save_steps = 8",
            ),
            (
                "eval_strategy = \"steps\"\nlogging_steps = 4\nsave_steps = 10",
                "not a round multiple of eval_steps (unset: logging_steps) = 4",
            ),
            (
                "eval_strategy = \"steps\"\neval_steps = 0.1\nsave_steps = 10",
                "cannot be guaranteed when mixing a ratio",
            ),
            (
                "eval_strategy = \"steps\"\neval_steps = 0.2\nsave_steps = 0.3",
                "save_steps = 0.3 is not a multiple of eval_steps = 0.2",
            ),
            (
                "eval_strategy = \"epoch\"\nsave_strategy = \"epoch\"\ngreater_is_better = true",
                "greater_is_better = true",
            ),
        ] {
            let err = best(toml).unwrap_err().to_string();
            assert!(err.contains("run.toml: [training]") && err.contains(says), "{toml}: {err}");
        }
        for accepted in [
            "eval_strategy = \"steps\"\neval_steps = 2\nsave_steps = 6",
            "eval_strategy = \"steps\"\nlogging_steps = 5\nsave_steps = 500",
            "eval_strategy = \"steps\"\neval_steps = 0.1\nsave_steps = 0.3",
            "eval_strategy = \"steps\"\neval_steps = 0.25\nsave_steps = 0.5",
            // transformers' first test is the float remainder, which a ratio beside a step count may pass.
            "eval_strategy = \"steps\"\neval_steps = 0.25\nsave_steps = 2",
            "eval_strategy = \"epoch\"\nsave_strategy = \"epoch\"\ngreater_is_better = false",
        ] {
            let args = best(accepted).unwrap_or_else(|e| panic!("{accepted}: {e}"));
            assert_eq!(args.best_model_metric(), Some("loss"), "{accepted}");
        }
        let epochs = "eval_strategy = \"epoch\"\nsave_strategy = \"epoch\"";
        let chosen = best(&format!("{epochs}\nmetric_for_best_model = \"eval_loss\""));
        assert_eq!(chosen.unwrap().best_model_metric(), Some("eval_loss"));
        // Off, nothing is required of the strategies and no best checkpoint is tracked without a metric.
        let off = parse("eval_strategy = \"steps\"\nsave_steps = 3\neval_steps = 2").unwrap();
        assert_eq!(off.best_model_metric(), None);
        assert!(parse("greater_is_better = true").is_err());
        // A metric where higher is better may say so (its name is checked against the evaluation's, later).
        parse("metric_for_best_model = \"eval_rewards/accuracies\"\ngreater_is_better = true")
            .unwrap();
        // Ratios transformers accepts may still round to intervals that do not divide; the run refuses them.
        let ratios =
            best("eval_strategy = \"steps\"\neval_steps = 0.25\nsave_steps = 0.5").unwrap();
        ratios.check_best_model_intervals(4, 2, 8).unwrap();
        let err = ratios
            .check_best_model_intervals(5, 3, 10)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("save_steps = 0.5 and eval_steps = 0.25 come to every 5 and every 3 of this run's 10"),
            "{err}"
        );
    }

    #[test]
    fn activation_checkpointing_is_gradient_checkpointing_under_its_new_name() {
        // Either name turns it on; the new one decides when set, in a config or in code.
        assert!(parse("gradient_checkpointing = true")
            .unwrap()
            .checkpointing());
        assert!(parse("activation_checkpointing = true")
            .unwrap()
            .checkpointing());
        assert!(!parse("activation_checkpointing = false")
            .unwrap()
            .checkpointing());
        assert!(!parse("").unwrap().checkpointing());
        let both = parse("gradient_checkpointing = true\nactivation_checkpointing = true").unwrap();
        assert!(both.checkpointing());
        let in_code = TrainingArguments {
            activation_checkpointing: Some(true),
            ..Default::default()
        };
        in_code.validate("TrainingArguments").unwrap();
        assert!(in_code.checkpointing());
        let kwargs = "gradient_checkpointing_kwargs = { use_reentrant = false }\n\
                      activation_checkpointing_kwargs = { use_reentrant = false }";
        parse(kwargs).unwrap();
    }

    #[test]
    fn the_old_and_new_checkpointing_names_set_apart_are_refused_naming_both() {
        for (toml, says) in [
            (
                "gradient_checkpointing = true\nactivation_checkpointing = false",
                "`gradient_checkpointing` = true and `activation_checkpointing` = false disagree",
            ),
            (
                "gradient_checkpointing = false\nactivation_checkpointing = true",
                "`gradient_checkpointing` = false and `activation_checkpointing` = true disagree",
            ),
            (
                "gradient_checkpointing_kwargs = { use_reentrant = false }\n\
                 activation_checkpointing_kwargs = { use_reentrant = true }",
                "`gradient_checkpointing_kwargs` = {\"use_reentrant\":false} and \
                 `activation_checkpointing_kwargs` = {\"use_reentrant\":true} disagree",
            ),
        ] {
            let err = parse(toml).unwrap_err().to_string();
            assert!(
                err.contains("run.toml: [training]")
                    && err.contains(says)
                    && err.contains("transformers 5.24's name"),
                "{toml}: {err}"
            );
        }
        // In code the default `false` is no choice, but `true` beside `Some(false)` is.
        let err = TrainingArguments {
            gradient_checkpointing: true,
            activation_checkpointing: Some(false),
            ..Default::default()
        }
        .validate("TrainingArguments")
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("`gradient_checkpointing` = true and `activation_checkpointing` = false"),
            "{err}"
        );
    }

    #[test]
    fn total_steps_follow_transformers() {
        let a = TrainingArguments {
            gradient_accumulation_steps: 4,
            num_train_epochs: 1.5,
            ..Default::default()
        };
        assert_eq!(a.total_steps(10), 5); // ceil(10/4) = 3 per epoch, ceil(1.5 * 3) = 5
        let a = TrainingArguments {
            max_steps: 7,
            ..Default::default()
        };
        assert_eq!(a.total_steps(1000), 7);
    }
}

/// `report_to`: the integrations a run reports to, written as one name or a list, as transformers reads it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ReportTo(#[serde(deserialize_with = "crate::names::one_or_many")] pub Vec<String>);

impl ReportTo {
    /// The names this build knows.
    pub const SUPPORTED: [&'static str; 3] = ["none", "tensorboard", "all"];

    /// Whether TensorBoard event files are written (`tensorboard`, or `all`).
    pub fn tensorboard(&self) -> bool {
        self.0.iter().any(|n| n == "tensorboard" || n == "all")
    }
}
