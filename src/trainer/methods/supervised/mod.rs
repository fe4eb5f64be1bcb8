//! Supervised fine-tuning, as TRL's `SFTTrainer`: the causal-LM loss on the labelled tokens of tokenized examples
//! (packed or not), each window's loss normalized by its label tokens (`window`), and the evaluation by the
//! token-level mean loss, its perplexity and, with `predict_with_generate`, the exact match of greedy answers
//! (`evaluate`).

pub(crate) mod evaluate;
mod window;

use candle_core::Var;

use crate::data::{Dataset, TokenizedExample};
use crate::error::{Error, Result};
use crate::models::{LlamaModel, TextTokenizer};
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::reporting::memory::StepMemory;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::settings::config::RunConfig;
use crate::trainer::settings::preflight::DataFacts;
use crate::trainer::storage::position::DataFingerprint;
use crate::trainer::window::batches::{WindowBatches, WindowOutput};
use crate::trainer::window::shard::{Shard, SumOverRanks};

use super::method::Method;

/// Supervised training on tokenized rows.
pub(crate) struct Supervised {
    /// Training rows.
    train: Dataset,
    /// Evaluation rows (may be empty).
    eval: Dataset,
}

impl Supervised {
    /// Training on `train` rows, evaluated on `eval` rows: an error for a training set that is empty or has no
    /// label to learn (the data config that labelled the rows is the caller's, named by its fields).
    pub(crate) fn new(train: Dataset, eval: Dataset) -> Result<Self> {
        if train.is_empty() {
            return Err(Error::InvalidInput("the training set is empty".into()));
        }
        train.check_learnable(
            "the training set",
            Some(
                "DataConfig's completion_only_loss and assistant_only_loss = false when tokenizing",
            ),
        )?;
        Ok(Supervised { train, eval })
    }

    /// The method of `config`: its examples read, tokenized, labelled and packed as `[data]` says, with the notes
    /// to print about them (skipped, truncated, packed, counts).
    pub(crate) fn from_run_config(
        config: &RunConfig,
        tokenizer: &TextTokenizer,
    ) -> Result<(Self, Vec<String>)> {
        let data = &config.data;
        let name =
            |f: Option<&std::path::PathBuf>| f.map(|f| f.display().to_string()).unwrap_or_default();
        let (train, eval) = Dataset::train_and_eval(tokenizer, data)?;
        train.check_learnable(
            "the training set",
            data.learn_all_keys("[data] ").as_deref(),
        )?;
        let train_name = name(data.train_file.as_ref());
        let mut notes = match &data.eval_file {
            Some(_) => {
                let mut notes = train.file_notes(&train_name, train.truncated, data.max_length);
                let eval_name = name(data.eval_file.as_ref());
                notes.extend(eval.file_notes(&eval_name, eval.truncated, data.max_length));
                notes
            }
            None => {
                let truncated = train.truncated + eval.truncated;
                train.file_notes(&train_name, truncated, data.max_length)
            }
        };
        notes.push(format!(
            "{} training examples, {} evaluation examples",
            train.examples,
            eval.len()
        ));
        if data.packing {
            notes.push(train.packing_note(data.max_length));
        }
        Ok((Self::new(train, eval)?, notes))
    }
}

impl Method for Supervised {
    fn train_lengths(&self) -> Vec<usize> {
        self.train.rows.iter().map(|r| r.input_ids.len()).collect()
    }

    fn train_fingerprint(&self) -> DataFingerprint {
        DataFingerprint::of(&self.train.rows)
    }

    fn data_facts(&self) -> DataFacts {
        // Each example the model reads whole: a row, or a packed row's examples (their positions restart).
        let lengths = |d: &Dataset| -> Vec<usize> {
            d.rows
                .iter()
                .flat_map(|r: &TokenizedExample| {
                    if r.segments.is_empty() {
                        vec![r.input_ids.len()]
                    } else {
                        r.segments.clone()
                    }
                })
                .collect()
        };
        DataFacts {
            eval_examples: self.eval.len(),
            lengths: vec![
                ("training set", lengths(&self.train)),
                ("evaluation set", lengths(&self.eval)),
            ],
            // The loss alone: perplexity only restates it (and transformers would rank it greater-is-better by
            // its name).
            eval_metrics: &[],
        }
    }

    fn has_eval(&self) -> bool {
        !self.eval.is_empty()
    }

    fn run_window(
        &mut self,
        model: &mut LlamaModel,
        _trained: &str,
        args: &TrainingArguments,
        window: &WindowBatches<'_>,
        vars: &[Var],
        memory: &mut StepMemory,
    ) -> Result<WindowOutput> {
        window::run_window(model, &self.train.rows, args, window, vars, memory)
    }

    fn evaluate(
        &mut self,
        model: &mut LlamaModel,
        _trained: &str,
        args: &TrainingArguments,
        shard: Shard,
        sum_over_ranks: SumOverRanks<'_>,
    ) -> Result<EvalReport> {
        let rows = &self.eval.rows;
        let batch = args.per_device_eval_batch_size;
        let (nll, tokens) = evaluate::loss_sums(model, rows, batch, shard, args.tiled_mlp)?;
        let (hits, counted) = match args.predict_with_generate {
            true => evaluate::exact_match_share(model, rows, shard)?,
            false => (0, 0),
        };
        let mut sums = [nll, tokens as f64, hits as f64, counted as f64];
        sum_over_ranks(&mut sums)?;
        let [nll, tokens, hits, counted] = sums;
        let exact = args
            .predict_with_generate
            .then_some((hits as usize, counted as usize));
        Ok(evaluate::report(rows, nll, tokens as usize, exact))
    }

    fn eval_dataset(&self) -> Option<&Dataset> {
        Some(&self.eval)
    }
}
