//! From examples to the rows a trainer consumes: [`DataConfig`] (the `[data]` section: files, format, length,
//! which tokens carry the loss, packing) and [`Dataset`] (tokenized rows, from a JSONL file or from examples in
//! memory, with what happened on the way).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::formats::{read_jsonl, DataFormat, Example, ReadReport, TokenizedExample};
use super::packing::pack;
use crate::error::{Error, Result};
use crate::models::TextTokenizer;

/// How data becomes training rows (TRL's `SFTConfig` names where it has them).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Training JSONL file (a run config needs one; code that builds a [`Dataset`] in memory does not).
    pub train_file: Option<PathBuf>,
    /// Evaluation JSONL file.
    pub eval_file: Option<PathBuf>,
    /// Fraction of the training rows held out for evaluation when there is no `eval_file`.
    pub eval_split: Option<f64>,
    /// `auto`, `text`, `alpaca`, `messages`, `sharegpt` or `preference`.
    pub format: DataFormat,
    /// Longest sequence in tokens (longer examples are truncated and counted).
    pub max_length: usize,
    /// Pack several examples per row.
    pub packing: bool,
    /// Loss on completions only: the prompt of instruction examples (and everything but the assistant turns of
    /// conversations) is labelled −100.
    pub completion_only_loss: bool,
    /// Loss on the assistant turns of conversations only (TRL's name), also when `completion_only_loss` is off;
    /// instruction examples follow `completion_only_loss`.
    pub assistant_only_loss: bool,
    /// Count bad lines (and skip them) instead of stopping at the first.
    pub skip_bad_lines: bool,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            train_file: None,
            eval_file: None,
            eval_split: None,
            format: DataFormat::Auto,
            max_length: 1024,
            packing: false,
            completion_only_loss: true,
            assistant_only_loss: false,
            skip_bad_lines: false,
        }
    }
}

impl DataConfig {
    /// Checks lengths and fractions.
    pub fn validate(&self) -> Result<()> {
        if self.max_length < 2 {
            return Err(Error::InvalidInput(format!(
                "max_length = {}: must be at least 2 (each token learns to predict the next one)",
                self.max_length
            )));
        }
        if let Some(split) = self.eval_split {
            if !(0.0..1.0).contains(&split) {
                return Err(Error::InvalidInput(format!(
                    "eval_split {split} must be a fraction in [0, 1)"
                )));
            }
        }
        Ok(())
    }

    /// How this config would put the loss on every token, as [`Dataset::check_learnable`] says it: the keys that
    /// mask tokens now (`completion_only_loss`, `assistant_only_loss`), each `= false`, named after `section`
    /// (`"[data] "` for a run config); `None` when no key masks any.
    pub fn learn_all_keys(&self, section: &str) -> Option<String> {
        let keys: Vec<&str> = [
            ("completion_only_loss = false", self.completion_only_loss),
            ("assistant_only_loss = false", self.assistant_only_loss),
        ]
        .iter()
        .filter(|(_, on)| *on)
        .map(|(key, _)| *key)
        .collect();
        (!keys.is_empty()).then(|| format!("{section}{}", keys.join(" and ")))
    }

    /// Whether every token of `example` carries the loss (not only its completion).
    pub fn all_tokens(&self, example: &Example) -> bool {
        match example {
            Example::Text(_) => true,
            Example::Instruction { .. } => !self.completion_only_loss,
            Example::Chat(_) => !(self.completion_only_loss || self.assistant_only_loss),
            Example::Preference(_) => false,
        }
    }
}

/// Tokenized rows — one example each, or several when packed — and what happened on the way.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Dataset {
    /// The rows.
    pub rows: Vec<TokenizedExample>,
    /// Bad lines skipped: `(line, reason)` (with `skip_bad_lines`).
    pub skipped: Vec<(usize, String)>,
    /// Examples cut to `max_length`.
    pub truncated: usize,
    /// Examples in the rows (more than the rows when packed).
    pub examples: usize,
    /// Examples dropped for having no tokens at all (as TRL drops them).
    pub empty: usize,
}

impl From<Vec<TokenizedExample>> for Dataset {
    /// The rows, without the empty ones (counted in `empty`).
    fn from(rows: Vec<TokenizedExample>) -> Self {
        let total = rows.len();
        let rows: Vec<TokenizedExample> = rows
            .into_iter()
            .filter(|r| !r.input_ids.is_empty())
            .collect();
        Dataset {
            truncated: rows.iter().filter(|r| r.truncated).count(),
            examples: rows.len(),
            empty: total - rows.len(),
            rows,
            skipped: vec![],
        }
    }
}

impl Dataset {
    /// Tokenizes `examples` (in memory: any iterator) with `tokenizer`, truncating to `config.max_length` and
    /// labelling as `config` says.
    pub fn tokenize(
        examples: impl IntoIterator<Item = Example>,
        tokenizer: &TextTokenizer,
        config: &DataConfig,
    ) -> Result<Self> {
        Self::tokenize_each(examples, tokenizer, config, |_, e| e)
    }

    /// Tokenizes `examples` as [`Dataset::tokenize`], an error passed through `at` with the example's index.
    fn tokenize_each<E: std::borrow::Borrow<Example>>(
        examples: impl IntoIterator<Item = E>,
        tokenizer: &TextTokenizer,
        config: &DataConfig,
        at: impl Fn(usize, Error) -> Error,
    ) -> Result<Self> {
        config.validate()?;
        let rows = examples
            .into_iter()
            .enumerate()
            .map(|(i, e)| {
                let e = e.borrow();
                e.tokenize(tokenizer, config.max_length, config.all_tokens(e))
                    .map_err(|err| at(i, err))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Dataset::from(rows))
    }

    /// Reads and tokenizes a JSONL file (bad lines are errors naming the line, or skipped and recorded with
    /// `skip_bad_lines`).
    pub fn from_jsonl(path: &Path, tokenizer: &TextTokenizer, config: &DataConfig) -> Result<Self> {
        let (examples, read) = read_jsonl(path, config.format, config.skip_bad_lines)?;
        Self::from_read(path, &examples, &read, tokenizer, config)
    }

    /// Tokenizes the `examples` that [`read_jsonl`] read from `path` (with its `read` report): an example that
    /// cannot be tokenized is an error naming the file and its line, and so is a file whose every example is empty
    /// (dropped as TRL drops them), saying how many.
    pub fn from_read(
        path: &Path,
        examples: &[Example],
        read: &ReadReport,
        tokenizer: &TextTokenizer,
        config: &DataConfig,
    ) -> Result<Self> {
        let mut dataset = Self::tokenize_each(examples, tokenizer, config, |i, err| {
            let line = read.lines.get(i).copied().unwrap_or_default();
            Error::InvalidInput(format!("{}:{line}: {err}", path.display()))
        })?;
        dataset.skipped = read.skipped.clone();
        if dataset.rows.is_empty() {
            return Err(Error::InvalidInput(format!(
                "{}: every example is empty (all {} have no tokens) and was skipped, as TRL drops empty ones{}: \
                 the file has nothing to train on",
                path.display(),
                dataset.empty,
                match dataset.skipped.len() {
                    0 => String::new(),
                    n => format!(", and {n} bad lines were skipped"),
                }
            )));
        }
        Ok(dataset)
    }

    /// The training and evaluation sets `config` names: `train_file`, and `eval_file` or the last `eval_split`
    /// of the training rows (none without either). Packs the training rows with `packing`.
    pub fn train_and_eval(tokenizer: &TextTokenizer, config: &DataConfig) -> Result<(Self, Self)> {
        let train_file = config
            .train_file
            .as_ref()
            .ok_or_else(|| Error::InvalidInput("the data config names no train_file".into()))?;
        let mut train = Self::from_jsonl(train_file, tokenizer, config)?;
        let eval = match (&config.eval_file, config.eval_split) {
            (Some(file), _) => Self::from_jsonl(file, tokenizer, config)?,
            (None, Some(split)) if split > 0.0 => train.split_off(split),
            _ => Dataset::default(),
        };
        if config.packing {
            train = train.pack(config.max_length);
        }
        Ok((train, eval))
    }

    /// Moves the last `ceil(len · fraction)` rows (keeping at least one) into a new data set.
    pub fn split_off(&mut self, fraction: f64) -> Self {
        let n = ((self.rows.len() as f64) * fraction).ceil() as usize;
        let at = self.rows.len() - n.min(self.rows.len().saturating_sub(1));
        let held_out = Dataset::from(self.rows.split_off(at));
        self.truncated -= held_out.truncated;
        self.examples -= held_out.examples;
        held_out
    }

    /// The rows packed into rows of at most `max_length` tokens (see [`pack`]).
    pub fn pack(self, max_length: usize) -> Self {
        Dataset {
            rows: pack(&self.rows, max_length),
            ..self
        }
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// True when there are no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Tokens in the rows.
    pub fn tokens(&self) -> usize {
        self.rows.iter().map(|r| r.input_ids.len()).sum()
    }

    /// Tokens that carry the loss (see [`TokenizedExample::learned_tokens`]).
    pub fn learned_tokens(&self) -> usize {
        self.rows.iter().map(TokenizedExample::learned_tokens).sum()
    }

    /// An error when no token carries the loss — every label masked, or every row a single token — saying how many
    /// rows had nothing to learn and why that happens; `what` names the set ("the training set", a file), and
    /// `learn_all` how the caller would put the loss on every token (a config's keys, a command's flag), `None`
    /// when it does already.
    pub fn check_learnable(&self, what: &str, learn_all: Option<&str>) -> Result<()> {
        if self.learned_tokens() > 0 {
            return Ok(());
        }
        let fixes = match learn_all {
            Some(learn_all) => format!(
                "check that the answers are not empty and that the prompts are shorter than the maximum length, or \
                 put the loss on every token ({learn_all})"
            ),
            None => "give examples of at least two tokens".to_string(),
        };
        Err(Error::InvalidInput(format!(
            "{what}: none of its {} rows has a token to learn (every label is -100, or the row is a single token): \
             {fixes}",
            self.rows.len()
        )))
    }

    /// What a run prints about the file `name` this data set was read from: its skipped lines and how many of its
    /// examples were truncated (`truncated`, which counts rows split off since), one line each.
    pub fn file_notes(&self, name: &str, truncated: usize, max_length: usize) -> Vec<String> {
        let mut lines: Vec<String> = self
            .skipped
            .iter()
            .map(|(line, reason)| format!("warning: {name}:{line}: skipped ({reason})"))
            .collect();
        if truncated > 0 {
            lines.push(format!(
                "{name}: {truncated} examples truncated to {max_length} tokens"
            ));
        }
        if self.empty > 0 {
            lines.push(format!(
                "{name}: {} empty examples skipped (no tokens)",
                self.empty
            ));
        }
        lines
    }

    /// How full the rows are: "packed N examples into R rows of up to L tokens (F% full)".
    pub fn packing_note(&self, max_length: usize) -> String {
        format!(
            "packed {} examples into {} rows of up to {max_length} tokens ({:.1}% full)",
            self.examples,
            self.rows.len(),
            100.0 * self.tokens() as f64 / (self.rows.len() * max_length).max(1) as f64
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::ChatMessage;

    fn row(len: usize, truncated: bool) -> TokenizedExample {
        TokenizedExample {
            input_ids: vec![1; len],
            labels: vec![1; len],
            truncated,
            segments: vec![],
        }
    }

    #[test]
    fn loss_tokens_follow_completion_and_assistant_only() {
        let instruction = Example::Instruction {
            prompt: "q".into(),
            response: "a".into(),
        };
        let chat = Example::Chat(vec![ChatMessage {
            role: "assistant".into(),
            content: "a".into(),
        }]);
        let text = Example::Text("t".into());
        let config = |completion_only_loss, assistant_only_loss| DataConfig {
            completion_only_loss,
            assistant_only_loss,
            ..Default::default()
        };
        // (completion_only, assistant_only) → all tokens of (instruction, chat)?
        for ((c, a), want) in [
            ((true, false), (false, false)),
            ((false, false), (true, true)),
            ((false, true), (true, false)),
            ((true, true), (false, false)),
        ] {
            let cfg = config(c, a);
            assert_eq!((cfg.all_tokens(&instruction), cfg.all_tokens(&chat)), want);
            assert!(cfg.all_tokens(&text));
        }
    }

    #[test]
    fn split_off_holds_out_the_last_rows_and_keeps_one() {
        let mut data = Dataset::from(vec![
            row(3, true),
            row(4, false),
            row(5, true),
            row(6, false),
        ]);
        let eval = data.split_off(0.25);
        assert_eq!((data.len(), eval.len()), (3, 1));
        assert_eq!((data.truncated, eval.truncated), (2, 0));
        assert_eq!(eval.rows[0].input_ids.len(), 6);
        let mut one = Dataset::from(vec![row(2, false)]);
        assert!(one.split_off(0.5).is_empty() && one.len() == 1);
        let notes = data.file_notes("train.jsonl", data.truncated, 4);
        assert_eq!(notes, ["train.jsonl: 2 examples truncated to 4 tokens"]);
        assert!(DataConfig {
            eval_split: Some(1.5),
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
