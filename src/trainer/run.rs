//! The training loop: gradient accumulation with token-level loss normalization over the whole window, the
//! schedule, clipping, the optimizer, evaluation, logging and checkpoints on schedule, callbacks, and resume.
//!
//! Data order depends only on (`data_seed`, epoch), and dropout masks and NEFTune noise only on (`seed`,
//! micro-batch index), so a resumed run replays the same batches, masks and noise as an uninterrupted one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::Var;

use super::args::{IntervalStrategy, TrainingArguments};
use super::callbacks::{TrainerCallback, TrainerControl};
use super::checkpoint::{
    read_json, remove_partial_checkpoints, rotate_checkpoints, write_checkpoint, CheckpointFiles,
    DataPosition, SchedulerState, RNG_STATE, SCHEDULER, TRAINER_STATE,
};
use super::neftune::neftune_noise;
use super::progress::{summary, Progress, StepFigures};
use super::state::{LogEntry, TrainOutput, TrainerState};
use crate::adapter::{load_adapter, save_adapter};
use crate::data::TokenizedExample;
use crate::error::{Error, Result};
use crate::eval::{collate, evaluate, EvalReport};
use crate::lora::LoraConfig;
use crate::memory::{
    is_out_of_memory, kept_layers, oom_report, process_memory, DeviceKind, MemoryTimeline, Phase,
};
use crate::models::{Checkpointing, LlamaModel};
use crate::ops::IGNORE_INDEX;
use crate::optim::{clip_grad_norm, Optimizer, OptimizerConfig, Schedule};
use crate::plot::loss_svg;

/// The adapter the trainer trains.
pub const ADAPTER: &str = "default";

/// Files of a finished run in `output_dir` besides the adapter.
const LOG_FILE: &str = "log.jsonl";
const PLOT_FILE: &str = "loss.svg";
const RESULTS_FILE: &str = "train_results.json";

/// A trainer for one LoRA adapter on a model.
pub struct Trainer {
    /// The model (with the adapter being trained).
    pub model: LlamaModel,
    args: TrainingArguments,
    train: Vec<TokenizedExample>,
    eval: Vec<TokenizedExample>,
    base_model_name: String,
    state: TrainerState,
    callbacks: Vec<Box<dyn TrainerCallback>>,
    run_config: Option<String>,
}

/// Micro-batches of example indices for `epoch` (seeded shuffle, or length-grouped).
fn epoch_batches(
    n: usize,
    batch: usize,
    seed: u64,
    epoch: usize,
    lengths: &[usize],
    strategy: &str,
    drop_last: bool,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..n).collect();
    if strategy != "sequential" {
        // Fisher–Yates with a counter-based generator: the order is a pure function of (seed, epoch).
        let mut state = seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for i in (1..n).rev() {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let j = ((state >> 33) as usize) % (i + 1);
            order.swap(i, j);
        }
    }
    if strategy == "group_by_length" {
        // Length-sorted within chunks of 50 batches, as transformers' LengthGroupedSampler does.
        for chunk in order.chunks_mut(batch * 50) {
            chunk.sort_by_key(|i| std::cmp::Reverse(lengths[*i]));
        }
    }
    let mut batches: Vec<Vec<usize>> = order.chunks(batch).map(|c| c.to_vec()).collect();
    if drop_last && batches.last().is_some_and(|b| b.len() < batch) {
        batches.pop();
    }
    batches
}

/// Label tokens a batch contributes to the loss (after the shift).
fn counted_tokens(examples: &[&TokenizedExample]) -> usize {
    examples
        .iter()
        .map(|e| {
            e.labels
                .iter()
                .skip(1)
                .filter(|l| **l != IGNORE_INDEX)
                .count()
        })
        .sum()
}

/// The seed of micro-batch `index` (dropout masks, NEFTune noise).
fn micro_batch_seed(seed: u64, index: usize) -> u64 {
    seed ^ (index as u64).wrapping_mul(0x2545_F491_4F6C_DD1D)
}

/// Bytes of the accumulated gradients of `vars`.
fn gradient_bytes(vars: &[Var], grads: &GradStore) -> u64 {
    vars.iter()
        .filter_map(|v| grads.get(v))
        .map(|g| (g.elem_count() * g.dtype().size_in_bytes()) as u64)
        .sum()
}

/// The memory timeline of a run and what it needs to attribute bytes: the step being run and the optimizer's
/// state size.
struct StepMemory {
    timeline: MemoryTimeline,
    step: usize,
    optimizer_bytes: u64,
}

impl StepMemory {
    fn end_phase(&mut self, micro_batch: usize, gradients: u64) {
        self.timeline
            .end_phase(self.step, micro_batch, self.optimizer_bytes, gradients);
    }

    /// `error` turned into the out-of-memory report when it is an allocation failure.
    fn explain(&self, error: Error, args: &TrainingArguments) -> Error {
        if !is_out_of_memory(&error.to_string()) {
            return error;
        }
        let live = self
            .timeline
            .breakdown_at_phase_peak(self.optimizer_bytes, 0);
        let phase = self.timeline.current_phase().unwrap_or(Phase::Forward);
        // The device's words are the error's first line (a backtrace may follow).
        let said = error.to_string();
        Error::OutOfMemory(format!(
            "{}\n(the device said: {})",
            oom_report(&live, self.step, phase, args),
            said.lines().next().unwrap_or_default()
        ))
    }
}

/// How the data is walked: fixed once per run.
struct DataPlan {
    lengths: Vec<usize>,
    strategy: String,
    data_seed: u64,
    batches_per_epoch: usize,
}

impl DataPlan {
    fn new(train: &[TokenizedExample], args: &TrainingArguments) -> Self {
        let lengths: Vec<usize> = train.iter().map(|e| e.input_ids.len()).collect();
        let strategy = if args.group_by_length {
            "group_by_length".to_string()
        } else {
            args.train_sampling_strategy.clone()
        };
        let data_seed = args.data_seed.unwrap_or(args.seed);
        let mut plan = DataPlan {
            lengths,
            strategy,
            data_seed,
            batches_per_epoch: 0,
        };
        plan.batches_per_epoch = plan.batches(0, args).len();
        plan
    }

    fn batches(&self, epoch: usize, args: &TrainingArguments) -> Vec<Vec<usize>> {
        epoch_batches(
            self.lengths.len(),
            args.per_device_train_batch_size,
            self.data_seed,
            epoch,
            &self.lengths,
            &self.strategy,
            args.dataloader_drop_last,
        )
    }

    fn position(&self, args: &TrainingArguments, micro_batches_done: usize) -> DataPosition {
        DataPosition {
            seed: args.seed,
            data_seed: self.data_seed,
            sampling: self.strategy.clone(),
            per_device_train_batch_size: args.per_device_train_batch_size,
            gradient_accumulation_steps: args.gradient_accumulation_steps,
            train_rows: self.lengths.len(),
            micro_batches_done,
            epoch: micro_batches_done / self.batches_per_epoch.max(1),
        }
    }
}

/// The outcome of one accumulation window.
struct WindowResult {
    loss_sum: f64,
    counted: usize,
    input_tokens: usize,
    grads: GradStore,
}

impl Trainer {
    /// A trainer that adds (or keeps) adapter [`ADAPTER`] with `lora` on `model`.
    pub fn new(
        mut model: LlamaModel,
        args: TrainingArguments,
        lora: &LoraConfig,
        train: Vec<TokenizedExample>,
        eval: Vec<TokenizedExample>,
        base_model_name: &str,
    ) -> Result<Self> {
        args.validate("TrainingArguments")?;
        if train.is_empty() {
            return Err(Error::InvalidInput("the training set is empty".into()));
        }
        if !model.adapter_names().iter().any(|n| n == ADAPTER) {
            model.add_adapter(ADAPTER, lora, args.seed)?;
        }
        model.set_adapter(ADAPTER)?;
        Ok(Trainer {
            model,
            args,
            train,
            eval,
            base_model_name: base_model_name.to_string(),
            state: TrainerState::default(),
            callbacks: vec![],
            run_config: None,
        })
    }

    /// The arguments.
    pub fn args(&self) -> &TrainingArguments {
        &self.args
    }

    /// The run's state (steps, log, best metric).
    pub fn state(&self) -> &TrainerState {
        &self.state
    }

    /// Adds a callback; callbacks run in the order added.
    pub fn add_callback(&mut self, callback: Box<dyn TrainerCallback>) {
        self.callbacks.push(callback);
    }

    /// The resolved run config (TOML), copied into every checkpoint as `run_config.toml`.
    pub fn set_run_config(&mut self, toml: String) {
        self.run_config = Some(toml);
    }

    fn vars(&self) -> Result<Vec<(String, Var)>> {
        self.model.adapter_parameters(ADAPTER)
    }

    /// Refuses to reuse the output of an earlier run (an adapter or checkpoints) unless resuming or
    /// `overwrite_output_dir`; with it, removes that run's adapter and checkpoints (the user asked for it). A log
    /// without any checkpoint (a run killed early) holds nothing to keep and is replaced.
    fn prepare_output_dir(&self, out: &Path, resuming: bool) -> Result<()> {
        let earlier: Vec<PathBuf> = std::fs::read_dir(out)
            .into_iter()
            .flatten()
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| {
                let name = p.file_name().unwrap_or_default().to_string_lossy();
                name.starts_with("checkpoint-")
                    || ["adapter_config.json", "adapter_model.safetensors"].contains(&name.as_ref())
            })
            .collect();
        if !resuming && !earlier.is_empty() {
            if !self.args.overwrite_output_dir {
                return Err(Error::WouldOverwrite(format!(
                    "`{}` holds the output of an earlier run ({}); resume it (--resume), set overwrite_output_dir = \
                     true to replace it, or pick another output_dir",
                    out.display(),
                    earlier[0].file_name().unwrap_or_default().to_string_lossy()
                )));
            }
            for p in &earlier {
                let removed = if p.is_dir() {
                    std::fs::remove_dir_all(p)
                } else {
                    std::fs::remove_file(p)
                };
                removed.map_err(|e| Error::io("cannot remove", p, e))?;
            }
        }
        std::fs::create_dir_all(out).map_err(|e| Error::io("cannot create", out, e))?;
        remove_partial_checkpoints(out)
    }

    /// Forward and backward of every micro-batch of a window, gradients summed, the loss normalized by the
    /// window's label tokens.
    fn run_window(
        &self,
        window: &[Vec<usize>],
        first_micro: usize,
        vars: &[Var],
        memory: &mut StepMemory,
    ) -> Result<WindowResult> {
        let args = &self.args;
        let examples: Vec<Vec<&TokenizedExample>> = window
            .iter()
            .map(|b| b.iter().map(|i| &self.train[*i]).collect())
            .collect();
        let counted: usize = examples.iter().map(|e| counted_tokens(e)).sum();
        let mut grads = GradStore::default();
        let mut loss_sum = 0f64;
        self.model.lora_runtime.set_training(true);
        for (k, ex) in examples.iter().enumerate() {
            let seed = micro_batch_seed(args.seed, first_micro + k);
            self.model.lora_runtime.set_step_seed(seed);
            let batch = collate(ex, self.model.device())?;
            let tokens = batch.ids.elem_count() as u64;
            let ck = Checkpointing {
                enabled: args.gradient_checkpointing,
                kept_layers: kept_layers(
                    self.model.config(),
                    if self.model.device().is_cpu() {
                        DeviceKind::Cpu
                    } else {
                        DeviceKind::Cuda
                    },
                    tokens,
                    self.model.compute_dtype().size_in_bytes() as u64,
                    args.activation_memory_budget_mib,
                ),
                params: vars.to_vec(),
                ..Default::default()
            };
            memory.timeline.start_phase(Phase::Forward);
            let mut embeds = self.model.embed(&batch.ids)?;
            if let Some(alpha) = args.neftune_noise_alpha.filter(|a| *a > 0.0) {
                embeds = neftune_noise(&embeds, alpha, seed)?;
            }
            let hidden = self.model.forward_embeds(&embeds, &batch.positions, &ck)?;
            let (sum, _) = self.model.loss_from_hidden(&hidden, &batch.labels)?;
            loss_sum += sum.to_scalar::<f32>()? as f64;
            memory.end_phase(k, gradient_bytes(vars, &grads));
            memory.timeline.start_phase(Phase::Backward);
            let mut g = (sum / counted.max(1) as f64)?.backward()?;
            ck.sink.merge_into(&mut g)?;
            for v in vars {
                if let Some(gv) = g.get(v) {
                    let acc = match grads.get(v) {
                        Some(old) => (old + gv)?,
                        None => gv.clone(),
                    };
                    grads.insert(v, acc);
                }
            }
            drop(g);
            memory.end_phase(k, gradient_bytes(vars, &grads));
        }
        self.model.lora_runtime.set_training(false);
        Ok(WindowResult {
            loss_sum,
            counted,
            input_tokens: examples.iter().flatten().map(|e| e.input_ids.len()).sum(),
            grads,
        })
    }

    fn each_callback(
        &mut self,
        f: impl Fn(&mut dyn TrainerCallback, &TrainingArguments, &TrainerState) -> Result<()>,
    ) -> Result<()> {
        for cb in &mut self.callbacks {
            f(cb.as_mut(), &self.args, &self.state)?;
        }
        Ok(())
    }

    /// Trains to the end (resuming from `resume` if given: a `checkpoint-N` folder), saves the final adapter in
    /// `output_dir` with the log, a loss plot and `train_results.json`, and prints a summary.
    pub fn train(&mut self, resume: Option<&Path>) -> Result<TrainOutput> {
        crate::memory::keep_freed_memory();
        let args = self.args.clone();
        let out = PathBuf::from(&args.output_dir);
        self.prepare_output_dir(&out, resume.is_some())?;
        let plan = DataPlan::new(&self.train, &args);
        let total = args.total_steps(plan.batches_per_epoch);
        let scheduler_type = args.scheduler_type()?;
        let warmup = args.warmup_for(total);
        let schedule = Schedule::new(
            scheduler_type,
            args.learning_rate,
            warmup,
            total,
            args.lr_scheduler_kwargs.as_ref(),
        )?;
        let params = self.vars()?;
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        let config = OptimizerConfig {
            name: args.optim_name()?,
            beta1: args.adam_beta1,
            beta2: args.adam_beta2,
            eps: args.adam_epsilon,
            weight_decay: args.weight_decay,
            ..Default::default()
        };
        let mut optimizer = Optimizer::new(params, config)?;
        let lora_bytes: u64 = vars
            .iter()
            .map(|v| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum();
        let mut memory = StepMemory {
            timeline: MemoryTimeline::new(
                self.model.device(),
                self.model.weight_bytes() as u64,
                lora_bytes,
            ),
            step: 0,
            // The optimizer's state lives in host memory; on a GPU it is not part of the device's memory.
            optimizer_bytes: if self.model.device().is_cpu() {
                optimizer.state_bytes() as u64
            } else {
                0
            },
        };
        let log_every = TrainingArguments::interval(args.logging_steps, total);
        let save_every = TrainingArguments::interval(args.save_steps, total);
        let eval_every =
            TrainingArguments::interval(args.eval_steps.unwrap_or(args.logging_steps), total);
        self.state = TrainerState {
            max_steps: total,
            num_train_epochs: args.num_train_epochs,
            logging_steps: log_every,
            eval_steps: eval_every,
            save_steps: save_every,
            train_batch_size: args.per_device_train_batch_size,
            is_world_process_zero: true,
            is_local_process_zero: true,
            ..Default::default()
        };
        if let Some(ckpt) = resume {
            self.restore(ckpt, &mut optimizer, &plan)?;
        }
        // The log file holds exactly the restored history (a killed run may have logged past its checkpoint).
        let log_path = out.join(LOG_FILE);
        let history: String = self
            .state
            .log_history
            .iter()
            .map(|e| serde_json::to_string(e).unwrap_or_default() + "\n")
            .collect();
        std::fs::write(&log_path, history).map_err(|e| Error::io("cannot write", &log_path, e))?;
        self.each_callback(|cb, a, s| cb.on_train_begin(a, s))?;

        let started = Instant::now();
        let tokens_at_start = self.state.num_input_tokens_seen;
        let progress = Progress::new(total, self.state.global_step, args.disable_tqdm);
        let accumulation = args.gradient_accumulation_steps;
        let windows = plan.batches_per_epoch.div_ceil(accumulation);
        let mut control = TrainerControl::default();
        let mut micro = 0usize;
        let mut step = self.state.global_step;
        'epochs: for epoch in 0.. {
            if step >= total || control.should_training_stop {
                break;
            }
            let batches = plan.batches(epoch, &args);
            for (w, window) in batches.chunks(accumulation).enumerate() {
                let first_micro = micro;
                micro += window.len();
                if epoch * windows + w < step {
                    continue; // done before the checkpoint this run resumed from
                }
                if step >= total {
                    break 'epochs;
                }
                let step_started = Instant::now();
                memory.step = step + 1;
                let result = self
                    .run_window(window, first_micro, &vars, &mut memory)
                    .map_err(|e| memory.explain(e, &args))?;
                step += 1;
                let epoch_f = epoch as f64 + (w + 1) as f64 / windows as f64;
                self.state.global_step = step;
                self.state.epoch = epoch_f;
                self.state.num_input_tokens_seen += result.input_tokens;
                let loss = result.loss_sum / result.counted.max(1) as f64;
                let lr = schedule.lr_for_update(step);
                let mut entry = LogEntry {
                    step,
                    epoch: epoch_f,
                    learning_rate: Some(lr),
                    tokens: Some(result.input_tokens),
                    ..Default::default()
                };
                if loss.is_finite() {
                    self.state.consecutive_nonfinite_losses = 0;
                    let mut grads = result.grads;
                    memory.timeline.start_phase(Phase::Optimizer);
                    let grad_norm = clip_grad_norm(&vars, &mut grads, args.max_grad_norm)?;
                    optimizer
                        .step(&grads, lr)
                        .map_err(|e| memory.explain(e, &args))?;
                    memory.optimizer_bytes = optimizer.state_bytes() as u64;
                    memory.end_phase(0, gradient_bytes(&vars, &grads));
                    entry.loss = Some(loss);
                    entry.grad_norm = Some(grad_norm);
                } else {
                    self.state.consecutive_nonfinite_losses += 1;
                    entry.skipped = true;
                    progress.println(&format!(
                        "step {step}: non-finite loss ({loss}); update skipped ({} in a row)",
                        self.state.consecutive_nonfinite_losses
                    ));
                }
                entry.step_seconds = Some(step_started.elapsed().as_secs_f64());
                entry.memory_bytes = process_memory().rss;
                let tokens_per_second = (self.state.num_input_tokens_seen - tokens_at_start) as f64
                    / started.elapsed().as_secs_f64();
                progress.update(&StepFigures {
                    step,
                    loss,
                    lr,
                    tokens_per_second,
                    memory: entry.memory_bytes,
                });
                let log_now = step % log_every == 0
                    || (step == 1 && args.logging_first_step)
                    || step == total;
                if log_now && !entry.skipped {
                    progress.println(&format!(
                        "step {step}/{total}  loss {loss:.4}  lr {lr:.3e}  grad_norm {:.3}  {tokens_per_second:.0} tokens/s",
                        entry.grad_norm.unwrap_or(f64::NAN)
                    ));
                }
                if log_now || entry.skipped {
                    self.log(&log_path, entry)?;
                }
                let limit = args.max_consecutive_nonfinite_losses;
                if limit > 0 && self.state.consecutive_nonfinite_losses >= limit {
                    return Err(Error::Diverged(format!(
                        "the loss was not finite for {limit} steps in a row (last at step {step}); lower \
                         learning_rate, set max_grad_norm, use bf16 instead of fp16, or check the data \
                         (max_consecutive_nonfinite_losses sets this limit)"
                    )));
                }
                let last_window = w + 1 == windows;
                let evaluate_now = match args.eval_strategy {
                    IntervalStrategy::Steps => step % eval_every == 0,
                    IntervalStrategy::Epoch => last_window,
                    IntervalStrategy::No => false,
                };
                if evaluate_now && !self.eval.is_empty() {
                    self.evaluate_and_log(&log_path, &progress, &mut control)?;
                }
                for cb in &mut self.callbacks {
                    cb.on_step_end(&args, &self.state, &mut control)?;
                }
                let save_now = match args.save_strategy {
                    IntervalStrategy::Steps => step % save_every == 0,
                    IntervalStrategy::Epoch => last_window,
                    IntervalStrategy::No => false,
                };
                if save_now && step < total && !control.should_training_stop {
                    let data = plan.position(&args, micro);
                    let scheduler = SchedulerState {
                        lr_scheduler_type: args.lr_scheduler_type.clone(),
                        learning_rate: args.learning_rate,
                        warmup_steps: warmup,
                        total_steps: total,
                        last_step: step,
                        last_lr: lr,
                    };
                    self.save_checkpoint(&out, &optimizer, &data, &scheduler)?;
                }
                if control.should_training_stop {
                    break 'epochs;
                }
            }
        }
        progress.finish();
        save_adapter(&self.model, ADAPTER, &out, &self.base_model_name)?;
        memory.timeline.write(&out)?;
        let output = self.finish(
            &out,
            started,
            tokens_at_start,
            step < total,
            &memory.timeline,
        )?;
        self.each_callback(|cb, a, s| cb.on_train_end(a, s))?;
        Ok(output)
    }

    /// Evaluates, logs the result, tracks the best metric and runs the callbacks' `on_evaluate`.
    fn evaluate_and_log(
        &mut self,
        log_path: &Path,
        progress: &Progress,
        control: &mut TrainerControl,
    ) -> Result<EvalReport> {
        let report = evaluate(
            &self.model,
            &self.eval,
            self.args.per_device_eval_batch_size,
        )?;
        let step = self.state.global_step;
        progress.println(&format!(
            "step {step}: eval_loss {:.4}  perplexity {:.3}",
            report.loss, report.perplexity
        ));
        if self.state.best_metric.is_none_or(|b| report.loss < b) {
            self.state.best_metric = Some(report.loss);
            self.state.best_global_step = Some(step);
        }
        let entry = LogEntry {
            step,
            epoch: self.state.epoch,
            eval_loss: Some(report.loss),
            eval_perplexity: Some(report.perplexity),
            ..Default::default()
        };
        self.log(log_path, entry)?;
        for cb in &mut self.callbacks {
            cb.on_evaluate(&self.args, &self.state, control, &report)?;
        }
        Ok(report)
    }

    fn log(&mut self, path: &Path, entry: LogEntry) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::io("cannot write", path, e))?;
        writeln!(f, "{}", serde_json::to_string(&entry).unwrap_or_default())
            .map_err(|e| Error::io("cannot write", path, e))?;
        self.state.log_history.push(entry.clone());
        self.each_callback(|cb, a, s| cb.on_log(a, s, &entry))
    }

    /// Writes `checkpoint-{step}` (see [`super::checkpoint`]) and applies `save_total_limit`.
    fn save_checkpoint(
        &mut self,
        out: &Path,
        optimizer: &Optimizer,
        data: &DataPosition,
        scheduler: &SchedulerState,
    ) -> Result<()> {
        let step = self.state.global_step;
        if self.state.best_global_step.is_some_and(|b| b <= step) {
            self.state.best_model_checkpoint =
                Some(out.join(format!("checkpoint-{step}")).display().to_string());
        }
        self.state.stateful_callbacks = self
            .callbacks
            .iter()
            .filter_map(|cb| Some((cb.name().to_string(), cb.state()?)))
            .collect();
        let files = CheckpointFiles {
            state: &self.state,
            data,
            scheduler,
            args: &self.args,
            run_config: self.run_config.as_deref(),
        };
        let dir = write_checkpoint(out, step, &files, |tmp| {
            save_adapter(&self.model, ADAPTER, tmp, &self.base_model_name)?;
            optimizer.save(tmp)
        })?;
        if let Some(limit) = self.args.save_total_limit {
            rotate_checkpoints(out, limit)?;
        }
        for cb in &mut self.callbacks {
            cb.on_save(&self.args, &self.state, &dir)?;
        }
        Ok(())
    }

    /// Loads adapter weights, optimizer state, the trainer state and the callbacks' state from a checkpoint, after
    /// checking it replays the same data.
    fn restore(&mut self, ckpt: &Path, optimizer: &mut Optimizer, plan: &DataPlan) -> Result<()> {
        let saved: TrainerState = read_json(ckpt, TRAINER_STATE)?;
        let position: DataPosition = read_json(ckpt, RNG_STATE)?;
        let scheduler: SchedulerState = read_json(ckpt, SCHEDULER)?;
        position.check_compatible(&plan.position(&self.args, 0), ckpt)?;
        if scheduler.total_steps != self.state.max_steps {
            eprintln!(
                "warning: {} was written for {} steps, this run has {}: the learning-rate schedule changes",
                ckpt.display(),
                scheduler.total_steps,
                self.state.max_steps
            );
        }
        // Load the checkpoint's adapter next to ours, copy its tensors into our variables, drop it.
        load_adapter(&mut self.model, ckpt, "__resume")?;
        let restored: Vec<(String, Var)> = self.model.adapter_parameters("__resume")?;
        let ours = self.vars()?;
        for ((k, v), (k2, s)) in ours.iter().zip(&restored) {
            if k != k2 {
                return Err(Error::invalid_file(
                    ckpt,
                    format!("checkpoint tensor `{k2}` does not match `{k}`"),
                ));
            }
            v.set(&s.as_tensor().copy()?)?;
        }
        self.model.delete_adapter("__resume")?;
        self.model.set_adapter(ADAPTER)?;
        optimizer.load(ckpt)?;
        for cb in &mut self.callbacks {
            if let Some(s) = saved.stateful_callbacks.get(cb.name()) {
                cb.load_state(s)?;
            }
        }
        self.state = TrainerState {
            max_steps: self.state.max_steps,
            ..saved
        };
        Ok(())
    }

    /// The run's result: `train_results.json`, the loss plot and the printed summary.
    fn finish(
        &self,
        out: &Path,
        started: Instant,
        tokens_at_start: usize,
        stopped_early: bool,
        memory: &MemoryTimeline,
    ) -> Result<TrainOutput> {
        let losses = self.state.train_losses();
        let runtime = started.elapsed().as_secs_f64();
        let output = TrainOutput {
            global_step: self.state.global_step,
            training_loss: losses.iter().sum::<f64>() / losses.len().max(1) as f64,
            train_runtime: runtime,
            train_tokens_per_second: (self.state.num_input_tokens_seen - tokens_at_start) as f64
                / runtime.max(1e-9),
            peak_memory_bytes: process_memory().peak_rss,
            stopped_early,
            log_history: self.state.log_history.clone(),
        };
        let train: Vec<(usize, f64)> = self
            .state
            .log_history
            .iter()
            .filter_map(|e| Some((e.step, e.loss?)))
            .collect();
        let eval = self.state.eval_losses();
        let plot = out.join(PLOT_FILE);
        std::fs::write(&plot, loss_svg(&train, &eval))
            .map_err(|e| Error::io("cannot write", &plot, e))?;
        let results = out.join(RESULTS_FILE);
        let json = serde_json::json!({
            "epoch": self.state.epoch,
            "global_step": output.global_step,
            "train_loss": output.training_loss,
            "train_runtime": output.train_runtime,
            "train_tokens_per_second": output.train_tokens_per_second,
            "peak_memory_bytes": output.peak_memory_bytes,
            "best_metric": self.state.best_metric,
        });
        std::fs::write(
            &results,
            serde_json::to_string_pretty(&json).unwrap_or_default(),
        )
        .map_err(|e| Error::io("cannot write", &results, e))?;
        let best = self.state.best_global_step.zip(self.state.best_metric);
        if let Some(peak) = memory.summary() {
            eprintln!("{peak}");
        }
        eprintln!(
            "{}",
            summary(
                &output,
                best,
                &[
                    format!(
                        "adapter: {}",
                        out.join("adapter_model.safetensors").display()
                    ),
                    format!("log: {}", out.join(LOG_FILE).display()),
                    format!("loss plot: {}", plot.display()),
                    format!(
                        "memory timeline: {} and memory.svg",
                        out.join("memory_timeline.json").display()
                    ),
                ]
            )
        );
        Ok(output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_cover_every_example_once_in_a_seeded_order() {
        let lengths: Vec<usize> = (0..23).map(|i| (i * 7) % 31 + 1).collect();
        for strategy in ["random", "sequential", "group_by_length"] {
            let a = epoch_batches(23, 4, 9, 0, &lengths, strategy, false);
            let mut all: Vec<usize> = a.iter().flatten().copied().collect();
            all.sort();
            assert_eq!(all, (0..23).collect::<Vec<_>>(), "{strategy}");
            assert_eq!(a, epoch_batches(23, 4, 9, 0, &lengths, strategy, false));
            if strategy == "random" {
                assert_ne!(a, epoch_batches(23, 4, 9, 1, &lengths, strategy, false));
            }
        }
        assert_eq!(
            epoch_batches(23, 4, 9, 0, &lengths, "random", true).len(),
            5
        );
    }

    #[test]
    fn group_by_length_puts_similar_lengths_together() {
        // 400 examples, lengths 1..=400 shuffled; a batch of 8 within a 400-example chunk is length-sorted, so
        // neighbours differ little, unlike random batches.
        let lengths: Vec<usize> = (0..400).map(|i| (i * 173) % 400 + 1).collect();
        let spread = |batches: &[Vec<usize>]| -> f64 {
            let total: usize = batches
                .iter()
                .map(|b| {
                    let ls: Vec<usize> = b.iter().map(|i| lengths[*i]).collect();
                    ls.iter().max().unwrap() - ls.iter().min().unwrap()
                })
                .sum();
            total as f64 / batches.len() as f64
        };
        let grouped = epoch_batches(400, 8, 3, 0, &lengths, "group_by_length", false);
        let random = epoch_batches(400, 8, 3, 0, &lengths, "random", false);
        assert!(
            spread(&grouped) * 10.0 < spread(&random),
            "{} vs {}",
            spread(&grouped),
            spread(&random)
        );
        // The longest example comes first, as transformers' sampler puts it (out-of-memory shows up at once).
        assert_eq!(lengths[grouped[0][0]], 400);
    }
}
