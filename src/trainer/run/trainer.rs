//! The [`Trainer`]: a model, the adapter it trains ([`ADAPTER`]), the arguments, the training method (supervised
//! or DPO, behind `Method`), the run's state and the callbacks — built in code ([`Trainer::new`],
//! [`Trainer::new_dpo`]) or from a run config (`pipeline`), trained by `train`.

use std::path::PathBuf;

use crate::adapter::Adapters;
use crate::data::{Dataset, PreferenceDataset, PromptDataset};
use crate::error::Result;
use crate::files::lock::OutputLock;
use crate::lora::LoraConfig;
use crate::memory::snapshot::Recording;
use crate::models::LlamaModel;
use crate::models::TextTokenizer;
use crate::precision::Precision;
use crate::trainer::methods::dpo::Dpo;
use crate::trainer::methods::grpo::{Grpo, Reward};
use crate::trainer::methods::method::Method;
use crate::trainer::methods::supervised::Supervised;
use crate::trainer::reporting::callbacks::TrainerCallback;
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::reporting::tensorboard::TensorBoardCallback;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::settings::dpo::DpoConfig;
use crate::trainer::settings::grpo::GrpoConfig;
use crate::trainer::settings::preflight::check_trainer_data;
use crate::trainer::storage::manifest::Manifest;
use crate::trainer::storage::state::TrainerState;
use crate::trainer::window::shard::Shard;

/// The adapter the trainer trains.
pub const ADAPTER: &str = "default";

/// A trainer for one LoRA adapter on a model.
pub struct Trainer {
    /// The model (with the adapter being trained).
    pub model: LlamaModel,
    pub(super) args: TrainingArguments,
    /// What it optimizes, with its data.
    pub(super) method: Box<dyn Method>,
    pub(super) base_model_name: Option<String>,
    pub(super) state: TrainerState,
    pub(super) callbacks: Vec<Box<dyn TrainerCallback>>,
    pub(super) run_config: Option<String>,
    /// What [`Trainer::from_run_config`] checked before loading the model: the output folder it claimed, and the
    /// resume checkpoint whose files it verified (with its manifest).
    pub(super) prepared: Option<Prepared>,
}

/// What [`Trainer::from_run_config`] checks before loading the model.
pub(super) struct Prepared {
    /// The claimed output folder (rank 0's; `None` on the other ranks of a distributed run).
    pub(super) lock: Option<OutputLock>,
    /// The resume checkpoint and its verified manifest (`None` for one written before manifests).
    pub(super) checkpoint: Option<(PathBuf, Option<Manifest>)>,
    /// `memory_snapshot`'s recording, started before the weights loaded (so they are in the snapshot).
    pub(super) recording: Option<Recording>,
    /// The job's communicator, joined before loading when the ranks read a sharded model's weights in parts.
    #[cfg(feature = "nccl")]
    pub(super) communicator: Option<std::sync::Arc<crate::distributed::Communicator>>,
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
        let method = Supervised::new(train.into(), eval.into())?;
        Self::with_method(model, args, lora, Box::new(method))
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
        let method = Dpo::new(dpo, &args, train, eval)?;
        Self::with_method(model, args, lora, Box::new(method))
    }

    /// A GRPO trainer (TRL's `GRPOTrainer`) on `train` prompts — or rollouts: a [`PromptDataset`] read with its
    /// completions —, evaluated on `eval` prompts, scored by `rewards` (closures, or [`Reward::from_spec`]), the
    /// completions decoded with `tokenizer` (the model's).
    #[allow(clippy::too_many_arguments)]
    pub fn new_grpo(
        model: LlamaModel,
        args: TrainingArguments,
        lora: &LoraConfig,
        grpo: GrpoConfig,
        train: PromptDataset,
        eval: PromptDataset,
        rewards: Vec<Reward>,
        tokenizer: TextTokenizer,
    ) -> Result<Self> {
        let method = Grpo::new(grpo, &args, train, eval, rewards, tokenizer)?;
        Self::with_method(model, args, lora, Box::new(method))
    }

    /// The trainer of `method`, with adapter [`ADAPTER`] added (or kept: a continued adapter) and active, on the
    /// device `args` select.
    pub(super) fn with_method(
        model: LlamaModel,
        args: TrainingArguments,
        lora: &LoraConfig,
        mut method: Box<dyn Method>,
    ) -> Result<Self> {
        args.validate("TrainingArguments")?;
        // A run config's data was checked before its weights loaded; this is for trainers built in code.
        check_trainer_data(
            &args,
            &method.data_facts(),
            model.config().max_position_embeddings,
        )?;
        let continued = model.adapter_names().iter().any(|n| n == ADAPTER);
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
        if !continued {
            model.add_adapter(ADAPTER, lora, args.seed)?;
        }
        model.set_adapter(ADAPTER)?;
        method.attach(&mut model, ADAPTER, continued)?;
        // As transformers' Trainer adds its reporting callbacks from `report_to`.
        let mut callbacks: Vec<Box<dyn TrainerCallback>> = vec![];
        if args.report_to.tensorboard() {
            callbacks.push(Box::new(TensorBoardCallback::new(None)));
        }
        Ok(Trainer {
            model,
            args,
            method,
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
        self.method.eval_dataset().unwrap_or(&NO_ROWS)
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
        let args = &self.args;
        let alone = &mut |_: &mut [f64]| Ok(());
        self.method
            .evaluate(&mut self.model, ADAPTER, args, Shard::ALONE, alone)
    }

    /// Runs `f` on every callback, in the order added.
    pub(super) fn each_callback(
        &mut self,
        f: impl Fn(&mut dyn TrainerCallback, &TrainingArguments, &TrainerState) -> Result<()>,
    ) -> Result<()> {
        for cb in &mut self.callbacks {
            f(cb.as_mut(), &self.args, &self.state)?;
        }
        Ok(())
    }
}
