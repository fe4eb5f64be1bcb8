//! The `Trainer`: gradient accumulation with token-level loss normalization over the whole window, the schedule,
//! clipping, the optimizer, evaluation, logging and checkpoints on schedule, callbacks, and resume.
//!
//! `train` is three parts: `setup` (output folder, schedule, optimizer, resume), one optimizer `step` per
//! accumulation window (on the `window` module), and what follows a step on schedule (`after_step`: log, evaluate,
//! callbacks, checkpoint); after the last step `load_best_model_at_end` loads the best checkpoint's adapter back
//! before the final one is written. Data order depends only on (`data_seed`, epoch),
//! and dropout masks and NEFTune noise only on (`seed`, micro-batch index), so a resumed run replays the same
//! batches, masks and noise as an uninterrupted one.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};

use super::args::{IntervalStrategy, TrainingArguments};
use super::callbacks::{TrainerCallback, TrainerControl};
use super::checkpoint::{
    check_base_model, check_base_quantization, latest_checkpoint, read_json,
    remove_partial_checkpoints, rotate_checkpoints, rotate_checkpoints_at_end,
    verify_adapter_files, verify_checkpoint_files, write_checkpoint, BaseModelId, CheckpointFiles,
    DataPosition, Manifest, SchedulerState, RNG_STATE, SCHEDULER, TRAINER_STATE,
};
#[cfg(feature = "nccl")]
use super::ddp::Ddp;
use super::dpo::{
    load_reference, save_reference, DpoConfig, PreferenceEval, PreferenceTask, Reference, METRICS,
    REFERENCE_ADAPTER,
};
use super::evaluate::{exact_match_share, loss_sums, EvalReport};
use super::preflight::check_trainer_data;
use super::progress::{summary, Progress, StepFigures};
use super::sampler::{DataPlan, Shard};
use super::state::{LogEntry, TrainOutput, TrainerState};
use super::task::Task;
use super::tensorboard::TensorBoardCallback;
use super::window::{gradient_bytes, StepMemory, Window, WindowBatches};
use crate::adapter::{base_quantization, load_adapter, save_adapter, Adapters, ADAPTER_CONFIG};
use crate::data::{Dataset, PreferenceDataset};
use crate::distributed::WorldEnv;
use crate::error::{Error, Result};
use crate::files::lock::OutputLock;
use crate::files::{first_non_finite, sweep_abandoned};
use crate::lora::LoraConfig;
use crate::memory::snapshot::{write_snapshot, Recording, Source};
use crate::memory::{process_memory, DeviceKind, EstimateArgs, MemoryTimeline, Phase, RunEstimate};
use crate::models::LlamaModel;
use crate::optim::clip::{scale_to_norm, squared_norm};
use crate::optim::{Optimizer, OptimizerConfig, Schedule};
use crate::plot::{loss_svg, LossCurves};
use crate::precision::{Precision, TorchDtype};
use crate::profile::context as snapshot_context;
use crate::profile::trace;

/// The adapter the trainer trains.
pub const ADAPTER: &str = "default";

/// Files of a finished run in `output_dir` besides the adapter.
const LOG_FILE: &str = "log.jsonl";
const PLOT_FILE: &str = "loss.svg";
/// The Chrome trace of the steps `trace_steps` names, for Perfetto.
pub const TRACE_FILE: &str = "trace.json";
/// The memory snapshot `memory_snapshot` writes, for pytorch.org/memory_viz.
pub const MEMORY_SNAPSHOT_FILE: &str = "memory_snapshot.pickle";
const RESULTS_FILE: &str = "train_results.json";

/// A trainer for one LoRA adapter on a model.
pub struct Trainer {
    /// The model (with the adapter being trained).
    pub model: LlamaModel,
    args: TrainingArguments,
    task: Task,
    base_model_name: Option<String>,
    state: TrainerState,
    callbacks: Vec<Box<dyn TrainerCallback>>,
    run_config: Option<String>,
    /// What [`Trainer::from_run_config`] checked before loading the model: the output folder it claimed, and the
    /// resume checkpoint whose files it verified (with its manifest).
    prepared: Option<Prepared>,
}

/// Step intervals of logging, evaluation and saving, resolved against the run's total.
struct Intervals {
    log: usize,
    eval: usize,
    save: usize,
}

/// What [`Trainer::setup`] prepares for a run and every step uses.
struct Run {
    /// The arguments, as the run started (callbacks see `Trainer::args`, the same values).
    args: TrainingArguments,
    out: PathBuf,
    /// The log file (rank 0's; `None` on the other ranks).
    log_path: Option<PathBuf>,
    plan: DataPlan,
    total: usize,
    warmup: usize,
    schedule: Schedule,
    vars: Vec<Var>,
    optimizer: Optimizer,
    memory: StepMemory,
    every: Intervals,
    progress: Progress,
    started: Instant,
    tokens_at_start: usize,
    control: TrainerControl,
    /// The base model, recorded in checkpoints.
    base_model: BaseModelId,
    /// This process's share of the data (rank 0 of 1 alone).
    shard: Shard,
    /// Whether the ranks of a distributed run agreed to stop after this step (`None` alone).
    agreed_stop: Option<bool>,
    /// The other ranks of a distributed run.
    #[cfg(feature = "nccl")]
    ddp: Option<Ddp>,
    /// The output folder's lock, released when the run ends (rank 0 alone holds it and writes there).
    _lock: Option<OutputLock>,
    /// Allocations recorded for `memory_snapshot` (stopped when the run ends, however it ends).
    snapshot: Option<Recording>,
    /// The checkpoint whose adapter `load_best_model_at_end` loaded at the end, once it has.
    loaded_best: Option<PathBuf>,
}

impl Run {
    /// Whether this process writes the run's files: alone, or rank 0 of a distributed run.
    fn writes(&self) -> bool {
        self.shard.is_main()
    }

    /// `values` summed over the ranks of a distributed run (as they are alone); `what` names them in errors.
    #[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
    fn sum_over_ranks<const N: usize>(&self, values: [f64; N], what: &str) -> Result<[f64; N]> {
        #[cfg(feature = "nccl")]
        if let Some(ddp) = &self.ddp {
            return ddp.sum(values, what);
        }
        Ok(values)
    }
}

impl Trainer {
    /// A trainer that adds (or keeps) adapter [`ADAPTER`] with `lora` on `model`, for `train` rows and `eval` rows
    /// (a [`Dataset`], or a `Vec` of tokenized examples; the evaluation set may be empty). As transformers' Trainer,
    /// it moves the model to the device `args` select (a GPU unless `use_cpu`, where this build and the machine
    /// have one) and computes in bf16/fp16 when `args` ask; otherwise the model keeps the compute dtype it was
    /// loaded with. `use_liger_kernel` chooses the CUDA kernels or Candle's composed ops for the whole process.
    pub fn new(
        model: LlamaModel,
        args: TrainingArguments,
        lora: &LoraConfig,
        train: impl Into<Dataset>,
        eval: impl Into<Dataset>,
    ) -> Result<Self> {
        let (train, eval) = (train.into(), eval.into());
        if train.is_empty() {
            return Err(Error::InvalidInput("the training set is empty".into()));
        }
        // The data config that labelled the rows is the caller's: named by its fields.
        train.check_learnable(
            "the training set",
            Some(
                "DataConfig's completion_only_loss and assistant_only_loss = false when tokenizing",
            ),
        )?;
        Self::with_task(model, args, lora, Task::LanguageModeling { train, eval })
    }

    /// A DPO trainer (TRL's `DPOTrainer` with a PEFT model) of adapter [`ADAPTER`] on preference pairs `train`,
    /// evaluated on `eval` (may be empty). When `model` already holds adapter [`ADAPTER`] — an adapter loaded to
    /// continue from (`load_adapter(&mut model, dir, "default")`) — training starts from it and a frozen copy of it
    /// is the reference; otherwise a new adapter is added with `lora` and the reference is the base model (the
    /// adapter switched off). With `dpo.reference_free`, there is no reference model.
    pub fn new_dpo(
        model: LlamaModel,
        args: TrainingArguments,
        lora: &LoraConfig,
        dpo: DpoConfig,
        train: PreferenceDataset,
        eval: PreferenceDataset,
    ) -> Result<Self> {
        dpo.validate("DpoConfig")?;
        dpo.check_training(&args, "TrainingArguments")?;
        if train.is_empty() {
            return Err(Error::InvalidInput(
                "the training set has no preference pairs".into(),
            ));
        }
        let continued = model.adapter_names().iter().any(|n| n == ADAPTER);
        let reference = match (dpo.reference_free, continued) {
            (true, _) => Reference::Uniform,
            (false, true) => Reference::Frozen,
            (false, false) => Reference::Base,
        };
        let task = PreferenceTask {
            config: dpo,
            train,
            eval,
            reference,
            train_reference: None,
            eval_reference: None,
        };
        let mut trainer = Self::with_task(model, args, lora, Task::Preference(Box::new(task)))?;
        if let Task::Preference(p) = &trainer.task {
            if p.reference == Reference::Frozen {
                trainer.model.copy_adapter(ADAPTER, REFERENCE_ADAPTER)?;
            }
        }
        Ok(trainer)
    }

    /// The trainer of `task`, with adapter [`ADAPTER`] added (or kept) and active, on the device `args` select.
    fn with_task(
        model: LlamaModel,
        args: TrainingArguments,
        lora: &LoraConfig,
        task: Task,
    ) -> Result<Self> {
        args.validate("TrainingArguments")?;
        // A run config's data was checked before its weights loaded; this is for trainers built in code.
        check_trainer_data(&args, &task.facts(), model.config().max_position_embeddings)?;
        let mut model = match (model.device().is_cpu(), args.use_cpu) {
            (true, false) => match args.device()? {
                gpu if !gpu.is_cpu() => model.to_device(&gpu)?,
                _ => model,
            },
            (false, true) => model.to_device(&candle_core::Device::Cpu)?,
            _ => model,
        };
        #[cfg(feature = "cuda")]
        crate::cuda::set_fused_kernels(args.use_liger_kernel);
        if args.bf16 || args.fp16 {
            let precision = Precision::from_flags(args.bf16, args.fp16, None, model.device())?;
            model.set_compute_dtype(precision.compute_dtype)?;
        }
        if !model.adapter_names().iter().any(|n| n == ADAPTER) {
            model.add_adapter(ADAPTER, lora, args.seed)?;
        }
        model.set_adapter(ADAPTER)?;
        // As transformers' Trainer adds its reporting callbacks from `report_to`.
        let mut callbacks: Vec<Box<dyn TrainerCallback>> = vec![];
        if args.report_to.tensorboard() {
            callbacks.push(Box::new(TensorBoardCallback::new(None)));
        }
        Ok(Trainer {
            model,
            args,
            task,
            base_model_name: None,
            state: TrainerState::default(),
            callbacks,
            run_config: None,
            prepared: None,
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

    /// The evaluation rows of supervised training (none for DPO, whose evaluation pairs are its own).
    pub fn eval_dataset(&self) -> &Dataset {
        static NO_ROWS: Dataset = Dataset {
            rows: Vec::new(),
            skipped: Vec::new(),
            truncated: 0,
            examples: 0,
            empty: 0,
        };
        match &self.task {
            Task::LanguageModeling { eval, .. } => eval,
            Task::Preference(_) => &NO_ROWS,
        }
    }

    /// Adds a callback; callbacks run in the order added.
    pub fn add_callback(&mut self, callback: Box<dyn TrainerCallback>) {
        self.callbacks.push(callback);
    }

    /// Keeps what was checked before the model was loaded, for the run.
    pub(super) fn set_prepared(&mut self, prepared: Prepared) {
        self.prepared = Some(prepared);
    }

    /// The base model's name or path, recorded in the saved adapters' `adapter_config.json`
    /// (`base_model_name_or_path`).
    pub fn set_base_model_name(&mut self, name: &str) {
        self.base_model_name = Some(name.to_string());
    }

    /// The resolved run config (TOML), copied into every checkpoint as `run_config.toml`.
    pub fn set_run_config(&mut self, toml: String) {
        self.run_config = Some(toml);
    }

    /// Evaluates the model on the evaluation rows (token-level mean loss and perplexity), or for DPO on the
    /// evaluation pairs (the preference loss and TRL's reward metrics; the reference log-probabilities of the pairs
    /// are computed at the first evaluation and kept).
    pub fn evaluate(&mut self) -> Result<EvalReport> {
        self.evaluate_share(Shard::ALONE, Ok)
    }

    /// The evaluation of `shard`'s part of the evaluation rows, made whole by `sum_over_ranks` (of
    /// `[negative log-likelihood, label tokens, exact answers, answers counted]`).
    fn evaluate_share(
        &mut self,
        shard: Shard,
        sum_over_ranks: impl FnOnce([f64; 4]) -> Result<[f64; 4]>,
    ) -> Result<EvalReport> {
        let rows = match &mut self.task {
            Task::LanguageModeling { eval, .. } => &eval.rows,
            Task::Preference(task) => {
                task.precompute(&mut self.model, ADAPTER, &self.args)?;
                let batch = self.args.per_device_eval_batch_size;
                let sums = task.evaluation_sums(&self.model, batch, shard)?;
                let eval = PreferenceEval::from_sums(&sums);
                return Ok(EvalReport::of_preferences(
                    &task.eval,
                    eval.loss,
                    &eval.metrics,
                ));
            }
        };
        let (nll, tokens) = loss_sums(
            &self.model,
            rows,
            self.args.per_device_eval_batch_size,
            shard,
        )?;
        let (hits, counted) = match self.args.predict_with_generate {
            true => exact_match_share(&self.model, rows, shard)?,
            false => (0, 0),
        };
        let [nll, tokens, hits, counted] =
            sum_over_ranks([nll, tokens as f64, hits as f64, counted as f64])?;
        let exact = self
            .args
            .predict_with_generate
            .then_some((hits as usize, counted as usize));
        Ok(EvalReport::from_sums(rows, nll, tokens as usize, exact))
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
    /// `output_dir` — with `load_best_model_at_end`, the best checkpoint's, loaded back into the model first — with
    /// the log, a loss plot and `train_results.json`, and prints a summary.
    pub fn train(&mut self, resume: Option<&Path>) -> Result<TrainOutput> {
        let mut run = self.setup(resume)?;
        if run.args.eval_on_start && self.state.global_step == 0 && self.task.has_eval() {
            self.evaluate_and_log(&mut run)?;
        }
        let accumulation = run.args.gradient_accumulation_steps;
        let windows = run.plan.batches_per_epoch.div_ceil(accumulation);
        // Micro-batches of all ranks: a window holds `accumulation` of each rank's.
        let mut micro = 0usize;
        'epochs: for epoch in 0.. {
            if self.state.global_step >= run.total || run.control.should_training_stop {
                break;
            }
            let batches = run.plan.batches(epoch, &run.args);
            for (w, window) in batches
                .chunks(accumulation * run.shard.world_size)
                .enumerate()
            {
                let first_micro = micro;
                micro += window.len();
                if epoch * windows + w < self.state.global_step {
                    continue; // done before the checkpoint this run resumed from
                }
                if self.state.global_step >= run.total {
                    break 'epochs;
                }
                let epoch_done = epoch as f64 + (w + 1) as f64 / windows as f64;
                let next = self.state.global_step + 1;
                let device = self.model.device().clone();
                let tracing = trace::trace_if(run.args.trace_steps.contains(&next), || {
                    Box::new(move || crate::memory::stats(&device).allocated)
                });
                let step_span = trace::span_with(|| format!("step {next}"), "step");
                let entry = self.step(&mut run, window, first_micro, epoch_done)?;
                let after = trace::span("log, evaluate, save", "log");
                self.after_step(&mut run, entry, micro, w + 1 == windows)?;
                drop(after);
                drop((step_span, tracing));
                if run.control.should_training_stop {
                    break 'epochs;
                }
            }
        }
        run.progress.finish();
        // As transformers: the best model is loaded after the last step, before the final model is saved.
        if run.args.load_best_model_at_end {
            run.loaded_best = self.load_best_model(&run.progress)?;
        }
        if run.writes() {
            save_adapter(
                &self.model,
                ADAPTER,
                &run.out,
                self.base_model_name.as_deref(),
            )?;
            let best = self.state.best_model_checkpoint.as_deref().map(Path::new);
            rotate_checkpoints_at_end(&run.out, run.args.save_total_limit, best)?;
            run.memory.timeline.write(&run.out)?;
            let events = trace::take_events();
            if !events.is_empty() {
                trace::write_chrome_trace(&run.out.join(TRACE_FILE), &events)?;
            }
            if run.snapshot.is_some() {
                write_snapshot(&run.out.join(MEMORY_SNAPSHOT_FILE))?;
            }
        }
        run.snapshot = None;
        let output = self.finish(&run, self.state.global_step < run.total)?;
        self.each_callback(|cb, a, s| cb.on_train_end(a, s))?;
        Ok(output)
    }

    /// What `qlora estimate` predicts for this run's longest micro-batch (drawn on the memory chart): its batch and
    /// longest example, the adapter's rank and target modules, optimizer, checkpointing and its activation budget,
    /// base, device and compute dtype. `None` when the estimate refuses the sizes.
    fn run_estimate(&self, args: &TrainingArguments, world_size: usize) -> Option<RunEstimate> {
        let lora = self.model.adapter_configs.get(ADAPTER)?;
        let quantize = self
            .model
            .linears()
            .iter()
            .any(|(_, l)| !matches!(l.base.weight, crate::ops::FrozenWeight::Dense(_)));
        let estimate_args = EstimateArgs {
            batch: args.per_device_train_batch_size,
            seq: self.task.train_lengths().into_iter().max()?,
            lora_r: lora.r,
            target_modules: lora.target_modules.clone(),
            optim: args.optim,
            gradient_checkpointing: args.gradient_checkpointing,
            activation_memory_budget_mib: args.activation_memory_budget_mib,
            quantize,
            device: if self.model.device().is_cpu() {
                DeviceKind::Cpu
            } else {
                DeviceKind::Cuda
            },
            dtype: Some(TorchDtype::of(self.model.compute_dtype())),
            world_size,
            preference: matches!(self.task, Task::Preference(_)),
        };
        RunEstimate::new(self.model.config(), estimate_args).ok()
    }

    /// Prepares a run: the output folder, the schedule and the optimizer, the memory timeline, the state (restored
    /// from `resume`), the log file, and the callbacks' `on_train_begin`.
    fn setup(&mut self, resume: Option<&Path>) -> Result<Run> {
        crate::memory::keep_freed_memory();
        super::interrupt::reset();
        let args = self.args.clone();
        let out = PathBuf::from(&args.output_dir);
        let prepared = self.prepared.take();
        let world = WorldEnv::from_env()?;
        let shard = world.as_ref().map_or(Shard::ALONE, |w| Shard {
            rank: w.rank,
            world_size: w.world_size,
        });
        let (lock, checked, recording) = match prepared {
            Some(p) => (p.lock, p.checkpoint, p.recording),
            None => (
                prepare_output_dir(&args, &out, resume.is_some())?,
                None,
                None,
            ),
        };
        #[cfg(feature = "nccl")]
        let ddp = match &world {
            Some(w) if w.world_size > 1 => Some(Ddp::join(self.model.device(), w, &args)?),
            _ => None,
        };
        #[cfg(not(feature = "nccl"))]
        if shard.world_size > 1 {
            return Err(Error::InvalidInput(format!(
                "WORLD_SIZE={}: this build runs one process; distributed training needs a build with the `nccl` \
                 feature (cargo build --release --features nccl)",
                shard.world_size
            )));
        }
        if matches!(self.task, Task::Preference(_)) && shard.world_size > 1 {
            return Err(Error::InvalidInput(format!(
                "WORLD_SIZE={}: DPO runs in one process for now; train it without torchrun or --nproc-per-node",
                shard.world_size
            )));
        }
        let plan = DataPlan::new(
            self.task.train_lengths(),
            self.task.train_fingerprint(),
            &args,
            shard.world_size,
        );
        let total = args.total_steps(plan.batches_per_epoch);
        let warmup = args.warmup_for(total);
        let schedule = Schedule::new(
            args.lr_scheduler_type,
            args.learning_rate,
            warmup,
            total,
            args.lr_scheduler_kwargs.as_ref(),
        )?;
        let params = self.model.adapter_parameters(ADAPTER)?;
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        let config = OptimizerConfig {
            name: args.optim,
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
        let mut timeline = MemoryTimeline::new(
            self.model.device(),
            self.model.weight_bytes() as u64,
            lora_bytes,
        );
        timeline.estimate = self.run_estimate(&args, shard.world_size);
        let memory = StepMemory {
            timeline,
            step: 0,
            optimizer_bytes: optimizer.resident_bytes() as u64,
            snapshot_on_oom: (args.memory_snapshot && shard.is_main())
                .then(|| out.join(MEMORY_SNAPSHOT_FILE)),
        };
        let every = Intervals {
            log: TrainingArguments::interval(args.logging_steps, total),
            save: TrainingArguments::interval(args.save_steps, total),
            eval: TrainingArguments::interval(args.eval_steps.unwrap_or(args.logging_steps), total),
        };
        args.check_best_model_intervals(every.save, every.eval, total)?;
        self.state = TrainerState {
            max_steps: total,
            num_train_epochs: args.epochs(plan.batches_per_epoch) as f64,
            logging_steps: every.log,
            eval_steps: every.eval,
            save_steps: every.save,
            train_batch_size: args.per_device_train_batch_size,
            is_world_process_zero: shard.is_main(),
            is_local_process_zero: world.as_ref().is_none_or(|w| w.local_rank == 0),
            ..Default::default()
        };
        let base_model = BaseModelId::of(&self.model, self.base_model_name.as_deref())?;
        if let Some(ckpt) = resume {
            let manifest = match checked {
                Some((path, manifest)) if path == ckpt => manifest,
                _ => verify_checkpoint_files(ckpt)?,
            };
            if let Some(manifest) = &manifest {
                check_base_model(ckpt, manifest, &base_model, args.ignore_base_model_mismatch)?;
            }
            check_base_quantization(
                ckpt,
                base_quantization(&self.model),
                args.ignore_base_model_mismatch,
            )?;
            self.restore(ckpt, &mut optimizer, &plan)?;
        }
        if let Task::Preference(task) = &mut self.task {
            task.precompute(&mut self.model, ADAPTER, &args)?;
        }
        // The log file holds exactly the restored history (a killed run may have logged past its checkpoint).
        let log_path = shard.is_main().then(|| out.join(LOG_FILE));
        if let Some(log_path) = &log_path {
            let history: String = self
                .state
                .log_history
                .iter()
                .map(|e| serde_json::to_string(e).unwrap_or_default() + "\n")
                .collect();
            std::fs::write(log_path, history)
                .map_err(|e| Error::io("cannot write", log_path, e))?;
        }
        let snapshot = match (args.memory_snapshot, recording) {
            (false, _) => None,
            (true, Some(started)) => Some(started),
            (true, None) => Some(start_memory_snapshot(self.model.device(), &args)?),
        };
        self.each_callback(|cb, a, s| cb.on_train_begin(a, s))?;
        Ok(Run {
            snapshot,
            loaded_best: None,
            _lock: lock,
            base_model,
            progress: if shard.is_main() {
                Progress::new(total, self.state.global_step, args.disable_tqdm)
            } else {
                Progress::quiet(total, self.state.global_step)
            },
            args,
            out,
            log_path,
            plan,
            total,
            warmup,
            schedule,
            vars,
            optimizer,
            memory,
            every,
            started: Instant::now(),
            tokens_at_start: self.state.num_input_tokens_seen,
            control: TrainerControl::default(),
            shard,
            agreed_stop: None,
            #[cfg(feature = "nccl")]
            ddp,
        })
    }

    /// One optimizer step on the micro-batches of `window` (the next step; `epoch` counts the epochs done after
    /// it): forward and backward, then clipping and the update — skipped when the loss is not finite.
    fn step(
        &mut self,
        run: &mut Run,
        window: &[Vec<usize>],
        first_micro: usize,
        epoch: f64,
    ) -> Result<LogEntry> {
        let args = &run.args;
        let step = self.state.global_step + 1;
        let step_started = Instant::now();
        run.memory.step = step;
        snapshot_context::set_step(step);
        let batches = WindowBatches {
            batches: window,
            first_micro,
            shard: run.shard,
        };
        let result = match &self.task {
            Task::LanguageModeling { train, .. } => Window::run(
                &self.model,
                &train.rows,
                args,
                &batches,
                &run.vars,
                &mut run.memory,
            ),
            Task::Preference(task) => task
                .window_reference(&mut self.model, ADAPTER, &batches)
                .and_then(|reference| {
                    Window::run_preference(
                        &self.model,
                        &task.train.pairs,
                        &reference,
                        &task.config,
                        args,
                        &batches,
                        &run.vars,
                        &mut run.memory,
                    )
                }),
        }
        .map_err(|e| run.memory.explain(e, args))?;
        self.state.global_step = step;
        self.state.epoch = epoch;
        self.state.num_input_tokens_seen += result.input_tokens;
        let mut grads = result.grads;
        let sync = trace::span("read loss and gradient norm", "sync");
        let (loss_sum, stop_flag) =
            Self::reduce_over_ranks(run, &mut grads, result.loss_sum, step)?;
        // The one read from the device in a step: the loss and the squared gradient norm together (and a
        // distributed run's stop flag).
        let squared_norm = squared_norm(&run.vars, &grads)?;
        let read: Vec<f64> = Tensor::cat(
            &[
                Some(&loss_sum),
                squared_norm.as_ref(),
                result.aux_loss.as_ref(),
                stop_flag.as_ref(),
                result.preference.as_ref(),
            ]
            .into_iter()
            .flatten()
            .map(|t| t.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?,
            0,
        )?
        .to_vec1()?;
        drop(sync);
        let grad_norm = squared_norm.as_ref().map_or(0.0, |_| read[1].sqrt());
        let aux_at = 1 + usize::from(squared_norm.is_some());
        let aux_loss = result.aux_loss.as_ref().map(|_| read[aux_at]);
        let flag_at = aux_at + usize::from(aux_loss.is_some());
        // DPO's metrics: means over the window's micro-batches, under TRL's names.
        let metrics: BTreeMap<String, f64> = match result.preference {
            Some(_) => METRICS
                .iter()
                .zip(&read[flag_at + usize::from(stop_flag.is_some())..])
                .map(|(name, sum)| (name.to_string(), sum / result.counted.max(1) as f64))
                .collect(),
            None => BTreeMap::new(),
        };
        // A distributed run stops where the ranks agreed (a Ctrl-C arriving later on one rank counts next step).
        run.agreed_stop = stop_flag.map(|_| read[flag_at] > 0.0);
        let loss = read[0] / result.counted.max(1) as f64;
        let lr = run.schedule.lr_for_update(step);
        let mut entry = LogEntry {
            step,
            epoch,
            learning_rate: Some(lr),
            tokens: Some(result.input_tokens),
            aux_loss,
            metrics,
            ..Default::default()
        };
        if loss.is_finite() {
            self.state.consecutive_nonfinite_losses = 0;
            let _optimizer = trace::span("optimizer", "optimizer");
            run.memory.timeline.start_phase(Phase::Optimizer);
            scale_to_norm(&run.vars, &mut grads, grad_norm, args.max_grad_norm)?;
            run.optimizer
                .step(&grads, lr)
                .map_err(|e| run.memory.explain(e, args))?;
            run.memory.optimizer_bytes = run.optimizer.resident_bytes() as u64;
            run.memory.end_phase(0, gradient_bytes(&run.vars, &grads));
            entry.loss = Some(loss);
            entry.grad_norm = Some(grad_norm);
        } else {
            self.state.consecutive_nonfinite_losses += 1;
            entry.skipped = true;
            run.progress.println(&format!(
                "step {step}: non-finite loss ({loss}); update skipped ({} in a row)",
                self.state.consecutive_nonfinite_losses
            ));
        }
        entry.step_seconds = Some(step_started.elapsed().as_secs_f64());
        entry.memory_bytes = process_memory().rss;
        let tokens_per_second = (self.state.num_input_tokens_seen - run.tokens_at_start) as f64
            / run.started.elapsed().as_secs_f64();
        run.progress.update(&StepFigures {
            step,
            loss,
            lr,
            tokens_per_second,
            memory: entry.memory_bytes,
        });
        if Self::log_now(run, args, step) && !entry.skipped {
            let aux = aux_loss.map_or(String::new(), |a| format!("  aux_loss {a:.4}"));
            run.progress.println(&format!(
                "step {step}/{}  loss {loss:.4}{aux}{}  lr {lr:.3e}  grad_norm {:.3}  {tokens_per_second:.0} tokens/s",
                run.total,
                preference_figures(&entry.metrics, ""),
                entry.grad_norm.unwrap_or(f64::NAN)
            ));
        }
        Ok(entry)
    }

    /// A distributed run's gradients summed over the ranks (in place) and its loss sum too, with the flag that
    /// is positive when any rank was asked to stop; alone, `loss_sum` and no flag.
    #[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
    fn reduce_over_ranks(
        run: &Run,
        grads: &mut GradStore,
        loss_sum: Tensor,
        step: usize,
    ) -> Result<(Tensor, Option<Tensor>)> {
        #[cfg(feature = "nccl")]
        if let Some(ddp) = &run.ddp {
            ddp.reduce_gradients(&run.vars, grads, step)?;
            let agreed = ddp.agree(&loss_sum, super::interrupt::stop_requested(), step)?;
            return Ok((agreed.get(0)?, Some(agreed.get(1)?)));
        }
        Ok((loss_sum, None))
    }

    /// Whether `step` is logged.
    fn log_now(run: &Run, args: &TrainingArguments, step: usize) -> bool {
        step % run.every.log == 0 || (step == 1 && args.logging_first_step) || step == run.total
    }

    /// What follows a step on schedule: its log entry, the non-finite-loss limit, evaluation, the callbacks'
    /// `on_step_end`, and a checkpoint. `micro` counts the micro-batches consumed; `last_window` ends an epoch.
    fn after_step(
        &mut self,
        run: &mut Run,
        entry: LogEntry,
        micro: usize,
        last_window: bool,
    ) -> Result<()> {
        let (step, lr) = (entry.step, entry.learning_rate.unwrap_or_default());
        if Self::log_now(run, &run.args, step) || entry.skipped {
            self.log(run.log_path.as_deref(), entry)?;
        }
        let args = &run.args;
        let limit = args.max_consecutive_nonfinite_losses;
        if limit > 0 && self.state.consecutive_nonfinite_losses >= limit {
            return Err(Error::Diverged(format!(
                "the loss was not finite for {limit} steps in a row (last at step {step}); {} \
                 (max_consecutive_nonfinite_losses sets this limit)",
                divergence_fixes(args)
            )));
        }
        let evaluate_now = match args.eval_strategy {
            IntervalStrategy::Steps => step % run.every.eval == 0,
            IntervalStrategy::Epoch => last_window,
            IntervalStrategy::No => false,
        };
        if evaluate_now && self.task.has_eval() {
            self.evaluate_and_log(run)?;
        }
        let args = &run.args;
        for cb in &mut self.callbacks {
            cb.on_step_end(args, &self.state, &mut run.control)?;
        }
        // As transformers: on schedule, and with "steps" also at the last step.
        let save_now = match args.save_strategy {
            IntervalStrategy::Steps => step % run.every.save == 0 || step == run.total,
            IntervalStrategy::Epoch => last_window,
            IntervalStrategy::No => false,
        };
        let interrupted = run
            .agreed_stop
            .unwrap_or_else(super::interrupt::stop_requested);
        if (save_now && !run.control.should_training_stop) || interrupted {
            let data = run.plan.position(args, micro);
            let scheduler = SchedulerState {
                lr_scheduler_type: args.lr_scheduler_type,
                learning_rate: args.learning_rate,
                warmup_steps: run.warmup,
                total_steps: run.total,
                last_step: step,
                last_lr: lr,
            };
            #[cfg(feature = "nccl")]
            if let Some(ddp) = &run.ddp {
                ddp.check_same_adapter(&run.vars, step)?;
            }
            let checkpoint = {
                let _save = trace::span("checkpoint", "checkpoint");
                self.save_checkpoint(run, &data, &scheduler)?
            };
            if interrupted {
                run.progress.finish();
                return Err(Error::Interrupted { step, checkpoint });
            }
        }
        Ok(())
    }

    /// Evaluates, logs the result, tracks the best metric and runs the callbacks' `on_evaluate`.
    fn evaluate_and_log(&mut self, run: &mut Run) -> Result<EvalReport> {
        let step = self.state.global_step;
        // Each rank evaluates its share of the batches; the sums travel together (one all-reduce).
        let report = self.evaluate_share(run.shard, |sums| {
            run.sum_over_ranks(sums, &format!("step {step}'s evaluation"))
        })?;
        let exact = report
            .exact_match
            .map(|m| format!("  exact match {:.1}%", 100.0 * m))
            .unwrap_or_default();
        let perplexity = match report.metrics.is_empty() {
            true => format!("  perplexity {:.3}", report.perplexity),
            false => preference_figures(&report.metrics, "eval_"),
        };
        run.progress.println(&format!(
            "step {step}: eval_loss {:.4}{perplexity}{exact}",
            report.loss
        ));
        if self.state.best_metric.is_none_or(|b| report.loss < b) {
            self.state.best_metric = Some(report.loss);
            self.state.best_global_step = Some(step);
        }
        let entry = LogEntry {
            step,
            epoch: self.state.epoch,
            eval_loss: Some(report.loss),
            eval_perplexity: report.metrics.is_empty().then_some(report.perplexity),
            eval_exact_match: report.exact_match,
            metrics: report
                .metrics
                .iter()
                .map(|(k, v)| (format!("eval_{k}"), *v))
                .collect(),
            ..Default::default()
        };
        self.log(run.log_path.as_deref(), entry)?;
        for cb in &mut self.callbacks {
            cb.on_evaluate(&self.args, &self.state, &mut run.control, &report)?;
        }
        Ok(report)
    }

    /// Records `entry` in the history, appends it to the log file (rank 0's: `path` is `None` on the others) and
    /// runs the callbacks' `on_log`.
    fn log(&mut self, path: Option<&Path>, entry: LogEntry) -> Result<()> {
        if let Some(path) = path {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| Error::io("cannot write", path, e))?;
            writeln!(f, "{}", serde_json::to_string(&entry).unwrap_or_default())
                .map_err(|e| Error::io("cannot write", path, e))?;
        }
        self.state.log_history.push(entry.clone());
        self.each_callback(|cb, a, s| cb.on_log(a, s, &entry))
    }

    /// Writes `checkpoint-{step}` (see [`super::checkpoint`]) and applies `save_total_limit`; returns its folder,
    /// or the newest earlier one when this state is not finite and is not saved.
    fn save_checkpoint(
        &mut self,
        run: &Run,
        data: &DataPosition,
        scheduler: &SchedulerState,
    ) -> Result<Option<PathBuf>> {
        let (out, optimizer) = (&run.out, &run.optimizer);
        let step = self.state.global_step;
        // A diverged run's state is not worth keeping, and saving it would rotate a good checkpoint out.
        if let Some(what) = self.non_finite_state(optimizer)? {
            eprintln!(
                "warning: checkpoint-{step} not saved: {what} is not finite (the checkpoints before it are kept)"
            );
            return Ok(latest_checkpoint(out));
        }
        // As transformers 5: with metric_for_best_model (which load_best_model_at_end defaults to the loss), the
        // checkpoint of the best evaluation's step once saved.
        if let Some(best) = self
            .state
            .best_global_step
            .filter(|_| self.args.best_model_metric().is_some())
        {
            let dir = out.join(format!("checkpoint-{best}"));
            if best == step || dir.join(TRAINER_STATE).exists() {
                self.state.best_model_checkpoint = Some(dir.display().to_string());
            }
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
            base_model: &run.base_model,
        };
        // Rank 0 writes the checkpoint; the ranks' states are the same (checked before), and so is their RNG, a
        // function of the seed and the micro-batch index.
        let dir = if run.writes() {
            let dir = write_checkpoint(out, step, &files, |tmp| {
                save_adapter(&self.model, ADAPTER, tmp, self.base_model_name.as_deref())?;
                if let Task::Preference(task) = &self.task {
                    if let Some(train) = &task.train_reference {
                        let eval = task.eval_reference.as_deref().unwrap_or_default();
                        save_reference(tmp, train, eval, &self.model)?;
                    }
                }
                optimizer.save(tmp)
            })?;
            let best = self.state.best_model_checkpoint.as_deref().map(Path::new);
            rotate_checkpoints(out, self.args.save_total_limit, best)?;
            dir
        } else {
            out.join(format!("checkpoint-{step}"))
        };
        for cb in &mut self.callbacks {
            cb.on_save(&self.args, &self.state, &dir)?;
        }
        Ok(Some(dir))
    }

    /// What holds a NaN or an infinity — an adapter weight or a parameter's optimizer state — if anything does.
    fn non_finite_state(&self, optimizer: &Optimizer) -> Result<Option<String>> {
        for (name, var) in self.model.adapter_parameters(ADAPTER)? {
            if first_non_finite(var.as_tensor())?.is_some() {
                return Ok(Some(format!("adapter weight `{name}`")));
            }
        }
        Ok(optimizer
            .first_non_finite()?
            .map(|name| format!("the optimizer state of `{name}`")))
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
        self.copy_adapter_from(ckpt)?;
        if let Task::Preference(task) = &mut self.task {
            if task.config.precompute_ref_log_probs {
                let (train, eval) = (task.train.len(), task.eval.len());
                if let Some((train, eval)) = load_reference(ckpt, train, eval)? {
                    task.train_reference = Some(train);
                    task.eval_reference = Some(eval);
                }
            }
        }
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
        // As transformers: a best checkpoint removed since is forgotten (the run goes on without it).
        if let Some(best) = &self.state.best_model_checkpoint {
            if !Path::new(best).is_dir() {
                eprintln!(
                    "warning: the best checkpoint {best} recorded in the resumed state does not exist anymore; \
                     ignoring it for this run"
                );
                self.state.best_model_checkpoint = None;
            }
        }
        Ok(())
    }

    /// Sets the trained adapter's weights to checkpoint `ckpt`'s (its PEFT adapter files), after checking that it
    /// has this run's LoRA settings.
    fn copy_adapter_from(&mut self, ckpt: &Path) -> Result<()> {
        const LOADED: &str = "__checkpoint";
        let config_path = ckpt.join(ADAPTER_CONFIG);
        let then = LoraConfig::from_file(&config_path)?;
        if let Some(now) = self.model.adapter_configs.get(ADAPTER) {
            check_same_lora(&then, now, &config_path)?;
        }
        // Load the checkpoint's adapter next to ours, copy its tensors into our variables, drop it.
        load_adapter(&mut self.model, ckpt, LOADED)?;
        let restored: Vec<(String, Var)> = self.model.adapter_parameters(LOADED)?;
        let ours = self.model.adapter_parameters(ADAPTER)?;
        for ((k, v), (k2, s)) in ours.iter().zip(&restored) {
            if k != k2 {
                return Err(Error::invalid_file(
                    ckpt,
                    format!("checkpoint tensor `{k2}` does not match `{k}`"),
                ));
            }
            v.set(&s.as_tensor().copy()?)?;
        }
        self.model.delete_adapter(LOADED)?;
        self.model.set_adapter(ADAPTER)
    }

    /// `load_best_model_at_end`, as transformers' `_load_best_model`: the adapter of the best checkpoint
    /// (`best_model_checkpoint`) back into the model, announced with its score; returns that checkpoint. Without
    /// one — no evaluation was saved, or its folder is gone — the last step's model stays, with a note saying why.
    fn load_best_model(&mut self, progress: &Progress) -> Result<Option<PathBuf>> {
        let step = self.state.global_step;
        let Some(best) = self.state.best_model_checkpoint.clone().map(PathBuf::from) else {
            let why = match (self.state.best_global_step, self.state.best_metric) {
                (Some(at), Some(loss)) => {
                    format!("the best evaluation, eval_loss {loss} at step {at}, has no checkpoint")
                }
                _ => "no evaluation ran".to_string(),
            };
            progress.println(&format!(
                "load_best_model_at_end: no best checkpoint to load ({why}); keeping the model of the last step, \
                 {step}"
            ));
            return Ok(None);
        };
        if !best.is_dir() {
            progress.println(&format!(
                "warning: load_best_model_at_end: could not locate the best model at {} (it was removed); keeping \
                 the model of the last step, {step}",
                best.display()
            ));
            return Ok(None);
        }
        // The checkpoint's own score: a best evaluation after it that has no checkpoint is not this one's.
        let saved_at: Option<usize> = best
            .file_name()
            .and_then(|n| n.to_str()?.strip_prefix("checkpoint-")?.parse().ok());
        let score = self
            .state
            .log_history
            .iter()
            .rev()
            .find(|e| Some(e.step) == saved_at && e.eval_loss.is_some())
            .and_then(|e| e.eval_loss)
            .or(self.state.best_metric);
        let shown = score.map_or("unknown".into(), |s| s.to_string());
        progress.println(&format!(
            "Loading best model from {} (score: {shown}).",
            best.display()
        ));
        if let (Some(at), Some(loss)) = (self.state.best_global_step, self.state.best_metric) {
            if saved_at.is_some_and(|s| s != at) {
                progress.println(&format!(
                    "note: the best evaluation, eval_loss {loss} at step {at}, has no checkpoint; {} holds the best \
                     one saved",
                    best.display()
                ));
            }
        }
        verify_adapter_files(&best)?;
        self.copy_adapter_from(&best)?;
        Ok(Some(best))
    }

    /// The run's result: `train_results.json`, the loss plot and the printed summary.
    fn finish(&self, run: &Run, stopped_early: bool) -> Result<TrainOutput> {
        let (out, memory) = (&run.out, &run.memory.timeline);
        let losses = self.state.train_losses();
        let runtime = run.started.elapsed().as_secs_f64();
        let output = TrainOutput {
            global_step: self.state.global_step,
            training_loss: losses.iter().sum::<f64>() / losses.len().max(1) as f64,
            train_runtime: runtime,
            train_tokens_per_second: (self.state.num_input_tokens_seen - run.tokens_at_start)
                as f64
                / runtime.max(1e-9),
            peak_memory_bytes: process_memory().peak_rss,
            stopped_early,
            log_history: self.state.log_history.clone(),
        };
        if !run.writes() {
            return Ok(output);
        }
        let by_step = |value: fn(&LogEntry) -> Option<f64>| -> Vec<(usize, f64)> {
            let history = self.state.log_history.iter();
            history.filter_map(|e| Some((e.step, value(e)?))).collect()
        };
        let train = by_step(|e| e.loss);
        let learning_rate = by_step(|e| e.learning_rate);
        let eval = self.state.eval_losses();
        let plot = out.join(PLOT_FILE);
        let svg = loss_svg(&LossCurves {
            train: &train,
            eval: &eval,
            learning_rate: &learning_rate,
        })
        .map_err(|e| Error::io("cannot draw", &plot, e))?;
        std::fs::write(&plot, svg).map_err(|e| Error::io("cannot write", &plot, e))?;
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
        let from_best = match &run.loaded_best {
            Some(best) => format!(" (the best model's, from {})", best.display()),
            None => String::new(),
        };
        let mut files = vec![
            format!(
                "adapter: {}{from_best}",
                out.join("adapter_model.safetensors").display()
            ),
            format!("log: {}", out.join(LOG_FILE).display()),
            format!("loss plot: {}", plot.display()),
            format!(
                "memory timeline: {} and memory.svg",
                out.join("memory_timeline.json").display()
            ),
        ];
        if run.args.memory_snapshot {
            files.push(format!(
                "memory snapshot: {} (open it in pytorch.org/memory_viz)",
                out.join(MEMORY_SNAPSHOT_FILE).display()
            ));
        }
        eprintln!("{}", summary(&output, best, &files));
        Ok(output)
    }
}

/// What may stop a run's loss from going non-finite, of what `args` does not do already: a lower learning rate,
/// clipping (when `max_grad_norm` = 0 turns it off), bf16 in place of fp16 (whose range overflows), the data.
fn divergence_fixes(args: &TrainingArguments) -> String {
    let mut fixes = vec![format!(
        "lower learning_rate (now {:e})",
        args.learning_rate
    )];
    if args.max_grad_norm == 0.0 {
        fixes.push("set max_grad_norm = 1.0 (clipping is off)".into());
    }
    if args.fp16 {
        fixes.push("use bf16 = true instead of fp16 (float16 overflows)".into());
    }
    fixes.push("check the data".into());
    let last = fixes.pop().unwrap_or_default();
    match fixes.is_empty() {
        true => last,
        false => format!("{}, or {last}", fixes.join(", ")),
    }
}

/// What `memory_snapshot` records on `device`: the CPU heap (counted by the tracking allocator) or a CUDA device's
/// pool; an error says why it cannot.
fn snapshot_source(device: &Device) -> Result<Source> {
    const NEEDS_TRACKING: &str =
        "memory_snapshot needs candle_qlora::memory::TrackingAllocator as the program's \
         #[global_allocator] (the qlora command has it)";
    match device {
        Device::Cpu if crate::memory::tracking() => Ok(Source::Heap),
        Device::Cpu => Err(Error::InvalidInput(NEEDS_TRACKING.into())),
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => {
            crate::memory::cuda_hooks::check(device)?;
            Ok(Source::CudaPool {
                ordinal: cuda.cuda_stream().context().ordinal(),
            })
        }
        other => Err(Error::InvalidInput(format!(
            "memory_snapshot records the CPU heap or a CUDA device's pool, not {:?}'s memory: set \
             memory_snapshot = false",
            other.location()
        ))),
    }
}

/// Starts recording allocations for `memory_snapshot` on `device` (see [`snapshot_source`]), or joins the
/// recording already on.
pub(super) fn start_memory_snapshot(
    device: &Device,
    args: &TrainingArguments,
) -> Result<Recording> {
    if args.memory_snapshot_max_entries == 0 {
        return Err(Error::InvalidInput(
            "memory_snapshot_max_entries must be at least 1".into(),
        ));
    }
    let source = snapshot_source(device)?;
    Ok(Recording::start(source, args.memory_snapshot_max_entries))
}

/// DPO's reward accuracy and margin, for the progress lines: `"  rewards/accuracies 0.750  rewards/margins 0.120"`
/// (printed with `prefix` before each name, e.g. `eval_`), or nothing when `metrics` has none.
fn preference_figures(metrics: &BTreeMap<String, f64>, prefix: &str) -> String {
    ["rewards/accuracies", "rewards/margins"]
        .iter()
        .filter_map(|name| {
            let value = metrics.get(*name)?;
            Some(format!("  {prefix}{name} {value:.3}"))
        })
        .collect()
}

/// An error naming the first LoRA setting in which checkpoint config `then` (read from `path`) and this run's
/// `now` differ: a resumed run must train the same adapter.
fn check_same_lora(then: &LoraConfig, now: &LoraConfig, path: &Path) -> Result<()> {
    match then.first_difference(now) {
        None => Ok(()),
        Some((key, a, b)) => Err(Error::invalid_file(
            path,
            format!(
                "the checkpoint has {key} = {a}, the config asks for {key} = {b}: resume with the checkpoint's \
                 LoRA settings, or start a new run in another output_dir"
            ),
        )),
    }
}

/// What [`Trainer::from_run_config`] checks before loading the model.
pub(super) struct Prepared {
    /// The claimed output folder (rank 0's; `None` on the other ranks of a distributed run).
    pub(super) lock: Option<OutputLock>,
    /// The resume checkpoint and its verified manifest (`None` for one written before manifests).
    pub(super) checkpoint: Option<(PathBuf, Option<Manifest>)>,
    /// `memory_snapshot`'s recording, started before the weights loaded (so they are in the snapshot).
    pub(super) recording: Option<Recording>,
}

/// Takes the output folder's lock (one run per folder), then refuses to reuse the output of an earlier run (an
/// adapter or checkpoints) unless resuming or `overwrite_output_dir`; with it, removes that run's adapter and
/// checkpoints (the user asked for it). A log without any checkpoint (a run killed early) holds nothing to keep
/// and is replaced. The other ranks of a distributed run leave the folder to rank 0 (`None`).
pub(super) fn prepare_output_dir(
    args: &TrainingArguments,
    out: &Path,
    resuming: bool,
) -> Result<Option<OutputLock>> {
    if WorldEnv::from_env()?.is_some_and(|w| w.rank != 0) {
        return Ok(None); // rank 0 claims and writes the folder of a distributed run
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io("cannot create", out, e))?;
    let lock = OutputLock::acquire(out)?;
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
        if !args.overwrite_output_dir {
            // Resuming is a way out only where there is a checkpoint to resume from (a finished run without one
            // left its adapter alone).
            let resume = match latest_checkpoint(out) {
                Some(_) => "resume it (resume_from_checkpoint, or --resume), ",
                None => "",
            };
            return Err(Error::WouldOverwrite(format!(
                "`{}` holds the output of an earlier run ({}); {resume}set overwrite_output_dir = true to replace \
                 it, or pick another output_dir",
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
    remove_partial_checkpoints(out)?;
    // Files a killed run was writing (the folder is ours now: no one else writes into it).
    sweep_abandoned(out, None)?;
    Ok(Some(lock))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergence_advice_names_only_what_the_run_does_not_do_already() {
        // transformers' defaults: clipping at 1.0, float32 — only the learning rate and the data are left.
        let fixes = divergence_fixes(&TrainingArguments::default());
        assert_eq!(fixes, "lower learning_rate (now 5e-5), or check the data");
        let fixes = divergence_fixes(&TrainingArguments {
            max_grad_norm: 0.0,
            fp16: true,
            ..Default::default()
        });
        assert!(
            fixes.contains("set max_grad_norm = 1.0")
                && fixes.contains("use bf16 = true instead of fp16"),
            "{fixes}"
        );
    }
}
