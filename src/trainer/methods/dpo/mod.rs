//! Preference tuning with DPO, as TRL 1.16's `DPOTrainer` does it with a PEFT model: the losses and reward metrics
//! ([`preference_loss`]), the reference ([`Reference`]: the base model, a frozen copy of the starting adapter, or
//! none; precomputed values kept in checkpoints), each window's forward and backward over pairs (`window`), and the
//! evaluation (`evaluate`). Its settings are `[dpo]` ([`DpoConfig`]); the loop runs it like supervised training
//! (accumulation, checkpointing, the optimizer, checkpoints and resume, callbacks, evaluation) when the trainer is
//! built with [`crate::trainer::Trainer::new_dpo`] or from a config with `[dpo]`.

mod evaluate;
mod loss;
mod reference;
mod window;

pub use crate::trainer::settings::dpo::{DpoConfig, LossType};
pub use loss::{preference_loss, CompletionTokens, METRICS};
pub use reference::{pair_logps, Reference, REFERENCE_ADAPTER, REFERENCE_FILE};

use std::path::Path;

use candle_core::{Tensor, Var};

use super::method::{refuse_ranks, Method};
use crate::adapter::Adapters;
use crate::data::{PreferenceDataset, PreferencePair};
use crate::error::{Error, Result};
use crate::files::{read_json, write_atomic};
use crate::models::{LlamaModel, TextTokenizer};
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::reporting::memory::StepMemory;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::settings::config::RunConfig;
use crate::trainer::settings::preflight::DataFacts;
use crate::trainer::storage::position::DataFingerprint;
use crate::trainer::window::batches::{WindowBatches, WindowOutput};
use crate::trainer::window::shard::{Shard, SumOverRanks};
use reference::{load_reference, save_reference, stored_logps};

/// A DPO run's settings, pairs and reference.
pub(crate) struct Dpo {
    config: DpoConfig,
    train: PreferenceDataset,
    eval: PreferenceDataset,
    /// Where the reference log-probabilities come from (decided when the model is attached).
    reference: Reference,
    /// The training pairs' reference log-probabilities, when precomputed.
    train_reference: Option<Vec<[f64; 2]>>,
    /// The evaluation pairs' reference log-probabilities, computed once (the reference does not change).
    eval_reference: Option<Vec<[f64; 2]>>,
}

/// The checkpoint file naming the reference a run compared with (`{"reference": "base"}`), which a resumed run
/// must compare with too.
const REFERENCE_KIND_FILE: &str = "dpo_reference.json";

/// How [`REFERENCE_KIND_FILE`] names a reference.
fn reference_name(reference: &Reference) -> &'static str {
    match reference {
        Reference::Base => "base",
        Reference::Frozen => "frozen",
        Reference::Uniform => "uniform",
    }
}

impl Dpo {
    /// An error when checkpoint `dir` was trained against another reference than this run's: resuming would
    /// change the loss's reference mid-run (e.g. `[model] adapter` added, whose frozen copy would replace the base
    /// model). Checkpoints written before the file existed are not checked.
    fn check_same_reference(&self, dir: &Path) -> Result<()> {
        let path = dir.join(REFERENCE_KIND_FILE);
        if !path.exists() {
            return Ok(());
        }
        let saved: serde_json::Value = read_json(&path)?;
        let then = saved["reference"].as_str().unwrap_or("unknown");
        let now = reference_name(&self.reference);
        if then == now {
            return Ok(());
        }
        let describe = |name: &str| match name {
            "base" => "the base model (a new adapter, switched off)",
            "frozen" => "a frozen copy of the continued adapter ([model] adapter)",
            "uniform" => "none ([dpo] reference_free = true)",
            _ => "unknown",
        };
        let fix = match (then, now) {
            ("base", "frozen") => {
                "remove [model] adapter to resume this run, or continue the adapter in a new run (without \
                 --resume, in another output_dir)"
            }
            ("frozen", "base") => "set [model] adapter as the run had it to resume it",
            _ => "set [dpo] reference_free as the run had it to resume it",
        };
        Err(Error::invalid_file(
            &path,
            format!(
                "the checkpoint's DPO reference is {}, and this run's would be {}: resuming would change the \
                 reference mid-run; {fix}",
                describe(then),
                describe(now)
            ),
        ))
    }

    /// DPO with `config` on `train` pairs, evaluated on `eval` pairs: an error for settings of `config` or `args`
    /// that DPO refuses (named as the fields of [`DpoConfig`] and [`TrainingArguments`]), or no training pairs.
    pub(crate) fn new(
        config: DpoConfig,
        args: &TrainingArguments,
        train: PreferenceDataset,
        eval: PreferenceDataset,
    ) -> Result<Self> {
        config.validate("DpoConfig")?;
        config.check_training(args, "TrainingArguments")?;
        if train.is_empty() {
            return Err(Error::InvalidInput(
                "the training set has no preference pairs".into(),
            ));
        }
        Ok(Dpo {
            config,
            train,
            eval,
            reference: Reference::Base,
            train_reference: None,
            eval_reference: None,
        })
    }

    /// The method of `config`, whose `[dpo]` is `dpo`: its preference pairs read and tokenized as TRL does, with the
    /// notes to print about them (skipped, truncated, counts).
    pub(crate) fn from_run_config(
        config: &RunConfig,
        dpo: &DpoConfig,
        tokenizer: &TextTokenizer,
    ) -> Result<(Self, Vec<String>)> {
        let data = &config.data;
        let name =
            |f: Option<&std::path::PathBuf>| f.map(|f| f.display().to_string()).unwrap_or_default();
        let (train, eval) =
            PreferenceDataset::train_and_eval(tokenizer, data, dpo.truncation_mode)?;
        let max = Some(data.max_length);
        let mut notes = train.file_notes(&name(data.train_file.as_ref()), max);
        if data.eval_file.is_some() {
            notes.extend(eval.file_notes(&name(data.eval_file.as_ref()), max));
        }
        notes.push(format!(
            "{} training pairs, {} evaluation pairs",
            train.len(),
            eval.len()
        ));
        Ok((
            Self::new(dpo.clone(), &config.training, train, eval)?,
            notes,
        ))
    }

    /// The reference log-probabilities of this rank's micro-batches of `window`: precomputed, or computed now with
    /// the model switched to the reference (adapter `trained` active again after).
    fn window_reference(
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
}

impl Method for Dpo {
    fn train_lengths(&self) -> Vec<usize> {
        self.train.pairs.iter().map(|p| p.longest()).collect()
    }

    /// The digests of a pair's chosen then rejected sequence.
    fn train_fingerprint(&self) -> DataFingerprint {
        DataFingerprint::of(
            self.train
                .pairs
                .iter()
                .flat_map(|p| [&p.chosen, &p.rejected]),
        )
    }

    fn data_facts(&self) -> DataFacts {
        let lengths = |d: &PreferenceDataset| d.pairs.iter().map(|p| p.longest()).collect();
        DataFacts {
            eval_examples: self.eval.len(),
            lengths: vec![
                ("training pairs", lengths(&self.train)),
                ("evaluation pairs", lengths(&self.eval)),
            ],
            eval_metrics: &METRICS,
        }
    }

    fn has_eval(&self) -> bool {
        !self.eval.is_empty()
    }

    fn runs_pairs(&self) -> bool {
        true
    }

    fn check_world_size(&self, world_size: usize) -> Result<()> {
        refuse_ranks(world_size, DpoConfig::world_size_problem(world_size))
    }

    /// The reference: none with `reference_free`, else a frozen copy of a `continued` adapter (made now, under
    /// [`REFERENCE_ADAPTER`]), else the base model.
    fn attach(&mut self, model: &mut LlamaModel, trained: &str, continued: bool) -> Result<()> {
        self.reference = match (self.config.reference_free, continued) {
            (true, _) => Reference::Uniform,
            (false, true) => Reference::Frozen,
            (false, false) => Reference::Base,
        };
        if self.reference == Reference::Frozen {
            model.copy_adapter(trained, REFERENCE_ADAPTER)?;
        }
        Ok(())
    }

    /// Computes the reference log-probabilities of every training pair (`precompute_ref_log_probs`) and of every
    /// evaluation pair, unless known, in batches of `precompute_ref_batch_size` or else of `args`' batch sizes.
    fn prepare(
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

    fn run_window(
        &mut self,
        model: &mut LlamaModel,
        trained: &str,
        args: &TrainingArguments,
        window: &WindowBatches<'_>,
        vars: &[Var],
        memory: &mut StepMemory,
    ) -> Result<WindowOutput> {
        let reference = self.window_reference(model, trained, window)?;
        window::run_window(
            model,
            &self.train.pairs,
            &reference,
            &self.config,
            args,
            window,
            vars,
            memory,
        )
    }

    fn metric_names(&self) -> &'static [&'static str] {
        &METRICS
    }

    fn loss_settings(&self) -> Option<String> {
        let types: Vec<&str> = self.config.loss_type.iter().map(|t| t.as_str()).collect();
        Some(format!(
            "[dpo] beta (now {:e}: IPO and SPPO divide by it) and loss_type (now {types:?})",
            self.config.beta
        ))
    }

    fn progress_metrics(&self) -> &'static [&'static str] {
        &["rewards/accuracies", "rewards/margins"]
    }

    /// The preference loss and TRL's reward metrics of the evaluation pairs; their reference log-probabilities are
    /// computed at the first evaluation and kept. DPO runs in one process, so there is nothing to sum over ranks.
    fn evaluate(
        &mut self,
        model: &mut LlamaModel,
        trained: &str,
        args: &TrainingArguments,
        shard: Shard,
        _sum_over_ranks: SumOverRanks<'_>,
    ) -> Result<EvalReport> {
        self.prepare(model, trained, args)?;
        let batch = args.per_device_eval_batch_size;
        let reference = self.eval_reference.as_deref();
        let sums =
            evaluate::evaluation_sums(model, &self.config, &self.eval, reference, batch, shard)?;
        Ok(evaluate::report(&self.eval, &sums))
    }

    /// Which reference the run compares with, and the precomputed reference log-probabilities, when there are.
    fn save(&self, model: &LlamaModel, dir: &Path) -> Result<()> {
        let kind = serde_json::json!({ "reference": reference_name(&self.reference) });
        write_atomic(&dir.join(REFERENCE_KIND_FILE), kind.to_string())?;
        if let Some(train) = &self.train_reference {
            let eval = self.eval_reference.as_deref().unwrap_or_default();
            save_reference(dir, train, eval, model)?;
        }
        Ok(())
    }

    fn restore(&mut self, dir: &Path) -> Result<()> {
        self.check_same_reference(dir)?;
        if self.config.precompute_ref_log_probs {
            let (train, eval) = (self.train.len(), self.eval.len());
            if let Some((train, eval)) = load_reference(dir, train, eval)? {
                self.train_reference = Some(train);
                self.eval_reference = Some(eval);
            }
        }
        Ok(())
    }
}
