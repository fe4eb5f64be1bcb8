//! The checks of a run that need its data or the file system but no weights, made once the data is tokenized and
//! before the model loads (`Trainer::from_run_config`), so a mistake is reported in seconds: evaluation asked for
//! with no evaluation data, a best-model metric the evaluation does not compute, examples longer than the model's
//! context, an `output_dir` that cannot be a folder or that overlaps the base model's or the continued adapter's
//! folder.
//! What a config alone decides is checked when it is read (`TrainingArguments::validate`, `RunConfig::load`).

use std::path::Path;

use super::args::{IntervalStrategy, TrainingArguments};
use super::best_model::best_metric_problem;
use super::config::RunConfig;
use crate::error::{Error, Result};
use crate::files::apart::check_output_apart;
use crate::loading::load_model_config;

/// What the checks need to know of a run's tokenized data (each training method describes its own).
pub(crate) struct DataFacts {
    /// Evaluation examples (or pairs).
    pub eval_examples: usize,
    /// Per set (its name as the message says it), the length in tokens of each example the model reads whole: a
    /// row, a packed row's examples (their positions restart), a pair's chosen and rejected sequences.
    pub lengths: Vec<(&'static str, Vec<usize>)>,
    /// The metrics an evaluation computes besides the loss, named without `eval_` (DPO's `rewards/accuracies`, …),
    /// which `metric_for_best_model` may name.
    pub eval_metrics: &'static [&'static str],
}

/// Checks `config` against its tokenized data (`facts`), the model's configuration (read alone, without the
/// weights) and the file system.
pub(crate) fn check_before_loading(config: &RunConfig, facts: &DataFacts) -> Result<()> {
    let p = config.path.display();
    let args = &config.training;
    if let Some(asked) = evaluation_without_data(args, facts) {
        let (split, larger) = match config.data.eval_split {
            Some(split) if config.data.eval_file.is_none() => (
                format!(" ([data] eval_split = {split} holds none of the examples)"),
                "a larger eval_split",
            ),
            _ => (
                String::new(),
                "eval_split, the share of the training examples held out",
            ),
        };
        return Err(Error::InvalidInput(format!(
            "{p}: [training] {asked} asks for evaluations, but the run has no evaluation data{split}: add \
             [data] eval_file (or {larger}), or set eval_strategy = \"no\" and eval_on_start = false"
        )));
    }
    if let Some(problem) = best_metric_problem(args, facts.eval_metrics) {
        return Err(Error::InvalidInput(format!("{p}: [training] {problem}")));
    }
    check_output_dir(&config.training.output_dir, &p.to_string())?;
    // A run writes its adapter and checkpoints into output_dir, and removes an earlier run's there with
    // overwrite_output_dir: never where it reads its base or the adapter it continues.
    let mut inputs = vec![(
        "[model] name_or_path",
        Path::new(&config.model.name_or_path),
    )];
    if let Some(adapter) = &config.model.adapter {
        inputs.push(("[model] adapter", adapter.as_path()));
    }
    let output = ("[training] output_dir", Path::new(&args.output_dir));
    check_output_apart(output, &inputs, "run")
        .map_err(|e| Error::InvalidInput(format!("{p}: {e}")))?;
    // Examples longer than the model's context would stop the run at the first batch holding one. TRL truncates
    // to max_length only (never to the model's context), so a max_length above the context is the mistake.
    let model = load_model_config(&config.model.name_or_path, config.model.revision.as_deref())?;
    let context = model.max_position_embeddings;
    if let Some((set, longer, longest)) = longer_than(facts, context) {
        return Err(Error::InvalidInput(format!(
            "{p}: the {set} has {longer} example(s) longer than the model's context of {context} positions \
             (max_position_embeddings; the longest has {longest} tokens, [data] max_length = {}): set [data] \
             max_length = {context} or less, so longer examples are truncated to it",
            config.data.max_length
        )));
    }
    Ok(())
}

/// The same data checks for a trainer built in code (`Trainer::new`, `Trainer::new_dpo`), on the model it holds:
/// evaluation asked for with no evaluation data, a best-model metric it does not compute, examples longer than the
/// model's `context`. (A run config's were
/// made before its weights loaded, by [`check_before_loading`].)
pub(crate) fn check_trainer_data(
    args: &TrainingArguments,
    facts: &DataFacts,
    context: usize,
) -> Result<()> {
    if let Some(asked) = evaluation_without_data(args, facts) {
        return Err(Error::InvalidInput(format!(
            "TrainingArguments: {asked} asks for evaluations, but the trainer was given no evaluation data: pass \
             evaluation examples, or set eval_strategy to No and eval_on_start to false"
        )));
    }
    if let Some(problem) = best_metric_problem(args, facts.eval_metrics) {
        return Err(Error::InvalidInput(format!("TrainingArguments: {problem}")));
    }
    if let Some((set, longer, longest)) = longer_than(facts, context) {
        return Err(Error::InvalidInput(format!(
            "the {set} has {longer} example(s) longer than the model's context of {context} positions (the \
             longest has {longest} tokens): tokenize with a max_length of {context} or less"
        )));
    }
    Ok(())
}

/// What asks for evaluations when there is no evaluation data (transformers' Trainer refuses evaluation without
/// an eval_dataset), if anything does.
fn evaluation_without_data(args: &TrainingArguments, facts: &DataFacts) -> Option<&'static str> {
    if facts.eval_examples > 0 {
        return None;
    }
    match args.eval_strategy {
        IntervalStrategy::Steps => Some("eval_strategy = \"steps\""),
        IntervalStrategy::Epoch => Some("eval_strategy = \"epoch\""),
        IntervalStrategy::No => args.eval_on_start.then_some("eval_on_start = true"),
    }
}

/// The first set with examples longer than `context` tokens: its name, how many, and the longest's length.
fn longer_than(facts: &DataFacts, context: usize) -> Option<(&'static str, usize, usize)> {
    facts.lengths.iter().find_map(|(set, lengths)| {
        let longer = lengths.iter().filter(|&&l| l > context).count();
        (longer > 0).then(|| {
            (
                *set,
                longer,
                lengths.iter().max().copied().unwrap_or_default(),
            )
        })
    })
}

/// An error unless `output_dir` is, or can be created as, a folder: neither it nor a folder above it is a file.
fn check_output_dir(output_dir: &str, config: &str) -> Result<()> {
    let dir = Path::new(output_dir);
    if let Some(file) = dir.ancestors().find(|a| a.is_file()) {
        let what = if file == dir {
            "is a file".to_string()
        } else {
            format!("is inside {}, which is a file", file.display())
        };
        return Err(Error::InvalidInput(format!(
            "{config}: [training] output_dir = \"{output_dir}\" {what}, not a folder: name a folder for the \
             checkpoints, logs and adapter (it is created if missing)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_output_dir_that_is_or_is_inside_a_file_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("notes.txt");
        std::fs::write(&file, "x").unwrap();
        let err = check_output_dir(file.to_str().unwrap(), "run.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run.toml: [training] output_dir")
                && err.contains("notes.txt\" is a file"),
            "{err}"
        );
        let inside = file.join("out");
        let err = check_output_dir(inside.to_str().unwrap(), "run.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("which is a file"), "{err}");
        check_output_dir(dir.path().join("new/out").to_str().unwrap(), "run.toml").unwrap();
    }
}
