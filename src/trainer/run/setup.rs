//! Preparing a run ([`Run`]): the output folder, this process's rank, the data plan, the schedule and the optimizer,
//! the memory timeline with the estimate drawn on it, the state (restored from the checkpoint resumed), the
//! method's setup, the log file, and the callbacks' `on_train_begin`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::Var;

#[cfg(feature = "nccl")]
use super::ddp::Ddp;
use super::fits::RunShape;
use super::interrupt;
use super::sampler::DataPlan;
use super::trainer::{Trainer, ADAPTER};
use crate::adapter::{base_quantization, Adapters};
use crate::distributed::{check_ranks, RanksFrom, WorldEnv};
use crate::error::{Error, Result};
use crate::files::lock::OutputLock;
use crate::memory::snapshot::Recording;
use crate::memory::{MemoryTimeline, RunEstimate};
use crate::ops::ActivationOffload;
use crate::optim::{Optimizer, OptimizerConfig, Schedule};
use crate::trainer::reporting::callbacks::TrainerControl;
use crate::trainer::reporting::memory::{start_memory_snapshot, StepMemory, MEMORY_SNAPSHOT_FILE};
use crate::trainer::reporting::progress::Progress;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::storage::log::{write_log, LOG_FILE};
use crate::trainer::storage::manifest::{
    check_base_model, check_base_quantization, verify_checkpoint_files, BaseModelId,
};
use crate::trainer::storage::output_dir::prepare_output_dir;
use crate::trainer::storage::state::TrainerState;
use crate::trainer::window::shard::Shard;

/// Step intervals of logging, evaluation and saving, resolved against the run's total.
pub(super) struct Intervals {
    pub(super) log: usize,
    pub(super) eval: usize,
    pub(super) save: usize,
}

/// What `Trainer::setup` prepares for a run and every step uses.
pub(super) struct Run {
    /// The arguments, as the run started (callbacks see `Trainer::args`, the same values).
    pub(super) args: TrainingArguments,
    pub(super) out: PathBuf,
    /// The log file (rank 0's; `None` on the other ranks).
    pub(super) log_path: Option<PathBuf>,
    pub(super) plan: DataPlan,
    pub(super) total: usize,
    pub(super) warmup: usize,
    pub(super) schedule: Schedule,
    pub(super) vars: Vec<Var>,
    pub(super) optimizer: Optimizer,
    pub(super) memory: StepMemory,
    pub(super) every: Intervals,
    pub(super) progress: Progress,
    pub(super) started: Instant,
    pub(super) tokens_at_start: usize,
    pub(super) control: TrainerControl,
    /// The base model, recorded in checkpoints.
    pub(super) base_model: BaseModelId,
    /// This process's share of the data (rank 0 of 1 alone).
    pub(super) shard: Shard,
    /// Whether the ranks of a distributed run agreed to stop after this step (`None` alone).
    pub(super) agreed_stop: Option<bool>,
    /// The other ranks of a distributed run.
    #[cfg(feature = "nccl")]
    pub(super) ddp: Option<Ddp>,
    /// The output folder's lock, released when the run ends (rank 0 alone holds it and writes there).
    pub(super) _lock: Option<OutputLock>,
    /// Allocations recorded for `memory_snapshot` (stopped when the run ends, however it ends).
    pub(super) snapshot: Option<Recording>,
    /// The checkpoint whose adapter `load_best_model_at_end` loaded at the end, once it has.
    pub(super) loaded_best: Option<PathBuf>,
}

impl Run {
    /// Whether this process writes the run's files: alone, or rank 0 of a distributed run.
    pub(super) fn writes(&self) -> bool {
        self.shard.is_main()
    }

    /// `values` summed in place over the ranks of a distributed run (left as they are alone); `what` names them
    /// in errors.
    #[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
    pub(super) fn sum_over_ranks(&self, values: &mut [f64], what: &str) -> Result<()> {
        #[cfg(feature = "nccl")]
        if let Some(ddp) = &self.ddp {
            return ddp.sum(values, what);
        }
        Ok(())
    }
}

impl Trainer {
    /// What `qlora estimate` predicts for this run's longest micro-batch (drawn on the memory chart; see
    /// [`RunShape::estimate_args`]). `None` when the estimate refuses the sizes.
    fn run_estimate(&self, args: &TrainingArguments, world_size: usize) -> Option<RunEstimate> {
        let lora = self.model.adapter_configs.get(ADAPTER)?;
        let quantize = self
            .model
            .linears()
            .iter()
            .any(|(_, l)| !matches!(l.base.weight, crate::ops::FrozenWeight::Dense(_)));
        let run = RunShape {
            args,
            lora,
            longest: self.method.train_lengths().into_iter().max()?,
            quantize,
            device: self.model.device(),
            compute_dtype: self.model.compute_dtype(),
            world_size,
            preference: self.method.runs_pairs(),
            grpo_generations: self.method.completions_per_prompt(),
        };
        RunEstimate::new(self.model.config(), run.estimate_args()).ok()
    }

    /// With `fsdp`, the model's layers sharded over the job's ranks (a model `from_run_config` loaded was sharded
    /// as it moved to its device; one made in code is sharded here); a model sharded for other ranks is refused.
    fn shard_base(&mut self, args: &TrainingArguments, shard: Shard) -> Result<()> {
        let plan = args.fsdp_plan().map_err(Error::InvalidInput)?;
        match (plan, self.model.sharding()) {
            (_, Some(s)) if (s.rank(), s.world_size()) != (shard.rank, shard.world_size) => {
                Err(Error::InvalidInput(format!(
                    "the model is sharded as rank {} of {}, but this process is rank {} of {}: shard it for this job \
                     (LlamaModel::to_device_sharded) or set fsdp and let the trainer shard it",
                    s.rank(),
                    s.world_size(),
                    shard.rank,
                    shard.world_size
                )))
            }
            (Some(_), None) if !self.model.saved_modules.is_empty() => Err(Error::InvalidInput(
                "fsdp with an adapter that trains modules_to_save (the embedding table or head): not supported; \
                 remove modules_to_save or fsdp"
                    .into(),
            )),
            (Some(plan), None) => {
                let sharding = plan.sharding(shard.rank, shard.world_size)?;
                let device = self.model.device().clone();
                self.model = self.model.clone().to_device_sharded(&device, &sharding)?;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    /// Prepares a run: the output folder, the schedule and the optimizer, the memory timeline, the state (restored
    /// from `resume`), the log file, and the callbacks' `on_train_begin`.
    pub(super) fn setup(&mut self, resume: Option<&Path>) -> Result<Run> {
        crate::memory::keep_freed_memory();
        interrupt::reset();
        let args = self.args.clone();
        let out = PathBuf::from(&args.output_dir);
        let prepared = self.prepared.take();
        let world = WorldEnv::from_env()?;
        let shard = world.as_ref().map_or(Shard::ALONE, |w| Shard {
            rank: w.rank,
            world_size: w.world_size,
        });
        // A trainer built in code meets here the check `from_run_config` makes before loading.
        if let Some(w) = &world {
            check_ranks(w.world_size, w.local_world_size, RanksFrom::Environment)?;
        }
        #[cfg(feature = "nccl")]
        let communicator = prepared.as_ref().and_then(|p| p.communicator.clone());
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
            Some(w) if w.world_size > 1 => {
                Some(Ddp::join(self.model.device(), w, &args, communicator)?)
            }
            _ => None,
        };
        self.method.check_world_size(shard.world_size)?;
        self.shard_base(&args, shard)?;
        #[cfg(feature = "nccl")]
        if let (Some(ddp), Some(sharding)) = (&ddp, self.model.sharding()) {
            sharding.attach(ddp.exchange());
        }
        let plan = DataPlan::new(
            self.method.train_lengths(),
            self.method.train_fingerprint(),
            self.method.prompt_groups(),
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
        // The base's bytes as the estimate counts them: the weights and the RoPE tables.
        let mut timeline = MemoryTimeline::new(
            self.model.device(),
            (self.model.weight_bytes() + self.model.rope_table_bytes()) as u64,
            lora_bytes,
        );
        timeline.estimate = self.run_estimate(&args, shard.world_size);
        let memory = StepMemory {
            timeline,
            step: 0,
            optimizer_bytes: optimizer.resident_bytes() as u64,
            snapshot_on_oom: (args.memory_snapshot && shard.is_main())
                .then(|| out.join(MEMORY_SNAPSHOT_FILE)),
            offload: args.activation_offloading.then(ActivationOffload::new),
        };
        let every = Intervals {
            log: TrainingArguments::interval(args.logging_steps, total),
            save: TrainingArguments::interval(args.save_steps, total),
            eval: TrainingArguments::interval(args.eval_steps.unwrap_or(args.logging_steps), total),
        };
        args.check_best_model_intervals(every.save, every.eval, total)?;
        args.check_trace_steps(total)?;
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
        self.method.prepare(&mut self.model, ADAPTER, &args)?;
        // The log file holds exactly the restored history (a killed run may have logged past its checkpoint).
        let log_path = shard.is_main().then(|| out.join(LOG_FILE));
        if let Some(log_path) = &log_path {
            write_log(log_path, &self.state.log_history)?;
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
}
