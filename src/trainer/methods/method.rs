//! The interface between the training loop and a training method (supervised fine-tuning, DPO, …): what the loop
//! asks of the method's data, of each accumulation window, of an evaluation and of a checkpoint. The loop owns
//! everything around it — the data order and the ranks, the schedule, clipping and the optimizer, logging, the
//! evaluation schedule, checkpoints and resume — as transformers' `Trainer` does around TRL's trainers'
//! `compute_loss` and `prediction_step`.

use std::path::Path;

use candle_core::Var;

use crate::data::Dataset;
use crate::error::Result;
use crate::models::LlamaModel;
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::reporting::memory::StepMemory;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::settings::preflight::DataFacts;
use crate::trainer::storage::position::DataFingerprint;
use crate::trainer::window::batches::{PromptGroups, WindowBatches, WindowOutput};
use crate::trainer::window::shard::{Shard, SumOverRanks};

/// The error of a method that cannot run on `world_size` processes, for `problem` (its settings' reason), if any.
pub(crate) fn refuse_ranks(world_size: usize, problem: Option<&str>) -> Result<()> {
    match problem {
        Some(why) => Err(crate::error::Error::InvalidInput(format!(
            "WORLD_SIZE={world_size}: {why}; train it without torchrun or --nproc-per-node"
        ))),
        None => Ok(()),
    }
}

/// A training method: its data, and the loss it optimizes over an accumulation window. The trained adapter is
/// named `trained` wherever a method switches the model to another one (and back).
pub(crate) trait Method {
    /// The length in tokens of each training item (the loop deals micro-batches of their indices; lengths group
    /// them with `group_by_length` and size the memory estimate).
    fn train_lengths(&self) -> Vec<usize>;

    /// The digests of the training items, which a resumed run checks.
    fn train_fingerprint(&self) -> DataFingerprint;

    /// What the checks before training need of the training and evaluation data.
    fn data_facts(&self) -> DataFacts;

    /// Whether there is anything to evaluate.
    fn has_eval(&self) -> bool;

    /// Whether each training item is a preference pair whose two sequences run in one forward (the memory estimate
    /// counts twice the rows).
    fn runs_pairs(&self) -> bool {
        false
    }

    /// The completions sampled per prompt, for a method that samples them (GRPO): the memory estimate counts
    /// their KV cache.
    fn completions_per_prompt(&self) -> Option<usize> {
        None
    }

    /// An error when the method cannot run on `world_size` processes.
    fn check_world_size(&self, _world_size: usize) -> Result<()> {
        Ok(())
    }

    /// Takes the model once the trainer holds it, with adapter `trained` active; `continued` says the adapter was
    /// loaded to continue from rather than added new.
    fn attach(&mut self, _model: &mut LlamaModel, _trained: &str, _continued: bool) -> Result<()> {
        Ok(())
    }

    /// Work before a run's first step, after a resume restored the checkpoint.
    fn prepare(
        &mut self,
        _model: &mut LlamaModel,
        _trained: &str,
        _args: &TrainingArguments,
    ) -> Result<()> {
        Ok(())
    }

    /// The forward, loss and backward of this rank's micro-batches of `window`: the gradients of `vars` summed,
    /// the loss sum and what it averages over, and the method's metrics. Micro-batch `k` draws its dropout and noise
    /// from `window.first_micro + k` whichever rank runs it; the memory of each phase goes to `memory`.
    fn run_window(
        &mut self,
        model: &mut LlamaModel,
        trained: &str,
        args: &TrainingArguments,
        window: &WindowBatches<'_>,
        vars: &[Var],
        memory: &mut StepMemory,
    ) -> Result<WindowOutput>;

    /// How the loop deals the items when they are prompts sampled in groups (GRPO); `None` deals them one by one.
    fn prompt_groups(&self) -> Option<PromptGroups> {
        None
    }

    /// Writes what the method shows of the last step into the run's folder `out` when a step is logged (GRPO's
    /// sample completions), and returns texts for TensorBoard (tag, text).
    fn write_samples(&mut self, _out: &Path, _step: usize) -> Result<Vec<(String, String)>> {
        Ok(Vec::new())
    }

    /// The names of the metrics of [`WindowOutput::metrics`], in order (logged under them).
    fn metric_names(&self) -> &'static [&'static str] {
        &[]
    }

    /// The settings of the method's loss, as the user writes them with their values (e.g. `[dpo] beta (now 0.1)`),
    /// for the advice of a run whose loss is not finite from its first step; `None` when it has none.
    fn loss_settings(&self) -> Option<String> {
        None
    }

    /// The metrics a progress line shows after the loss (of those logged).
    fn progress_metrics(&self) -> &'static [&'static str] {
        &[]
    }

    /// Evaluates `shard`'s part of the evaluation data, made whole by `sum_over_ranks`.
    fn evaluate(
        &mut self,
        model: &mut LlamaModel,
        trained: &str,
        args: &TrainingArguments,
        shard: Shard,
        sum_over_ranks: SumOverRanks<'_>,
    ) -> Result<EvalReport>;

    /// Writes the method's own files into checkpoint folder `dir` as it is written (`model` as trained so far).
    fn save(&self, _model: &LlamaModel, _dir: &Path) -> Result<()> {
        Ok(())
    }

    /// Restores what [`Method::save`] wrote in checkpoint `dir`.
    fn restore(&mut self, _dir: &Path) -> Result<()> {
        Ok(())
    }

    /// The evaluation rows, for a method that evaluates tokenized examples.
    fn eval_dataset(&self) -> Option<&Dataset> {
        None
    }
}
