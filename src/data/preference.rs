//! Preference pairs for DPO, tokenized as TRL 1.16's `DPOTrainer` does it (the JSON forms are read by
//! `preference_json`):
//!
//! | form | keys |
//! |---|---|
//! | standard, explicit prompt | `{"prompt": str, "chosen": str, "rejected": str}` |
//! | conversational, explicit prompt | `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}` |
//! | implicit prompt (either form) | `{"chosen": …, "rejected": …}`: the prompt is their common beginning |
//!
//! Tokenization (TRL's `_prepare_dataset` and `DataCollatorForPreference`): standard completions get the EOS text
//! appended unless they end with it, and `prompt`, `prompt + chosen`, `prompt + rejected` are tokenized with the
//! tokenizer's special tokens; conversations are rendered with the chat template (the prompt with the generation
//! prompt). The completion starts where the tokenized prompt and the tokenized prompt + completion first differ
//! (the shorter of the two such points). A pair whose prompt alone fills `max_length` is dropped (with
//! `keep_start`), and each sequence is cut to `max_length` from the end (`keep_start`) or the start (`keep_end`).

use std::path::Path;

use super::dataset::DataConfig;
use super::formats::{read_jsonl, DataFormat, Example, TokenizedExample};
use super::preference_json::{PreferenceExample, Turns};
use crate::error::{Error, Result};
use crate::models::tokenizer::{ChatMessage, TextTokenizer};
use crate::names::named_enum;
use crate::ops::IGNORE_INDEX;

named_enum! {
    /// Which end of a too-long sequence is kept (TRL's `truncation_mode`).
    #[derive(Default)]
    pub enum TruncationMode ("truncation mode") {
        /// Keep the first `max_length` tokens (TRL's default).
        #[default]
        KeepStart = "keep_start",
        /// Keep the last `max_length` tokens (deprecated in TRL).
        KeepEnd = "keep_end",
    }
}

/// A tokenized pair: the prompt followed by each completion, labelled on the completion only (−100 on the prompt).
#[derive(Clone, Debug, PartialEq)]
pub struct PreferencePair {
    /// Prompt + chosen completion.
    pub chosen: TokenizedExample,
    /// Prompt + rejected completion.
    pub rejected: TokenizedExample,
}

impl PreferencePair {
    /// The longer of the two sequences, in tokens.
    pub fn longest(&self) -> usize {
        self.chosen
            .input_ids
            .len()
            .max(self.rejected.input_ids.len())
    }

    /// Tokens of both sequences.
    pub fn tokens(&self) -> usize {
        self.chosen.input_ids.len() + self.rejected.input_ids.len()
    }
}

/// The sequences of `pairs` as one batch holds them: every chosen sequence, then every rejected one (TRL's
/// concatenated batch).
pub fn chosen_then_rejected<'a>(pairs: &[&'a PreferencePair]) -> Vec<&'a TokenizedExample> {
    let chosen = pairs.iter().map(|p| &p.chosen);
    chosen.chain(pairs.iter().map(|p| &p.rejected)).collect()
}

impl PreferenceExample {
    /// Token ids of the prompt, prompt + chosen and prompt + rejected, as TRL 1.16 tokenizes them.
    fn token_ids(&self, tokenizer: &TextTokenizer) -> Result<[Vec<u32>; 3]> {
        match (&self.prompt, &self.chosen, &self.rejected) {
            (Turns::Text(p), Turns::Text(c), Turns::Text(r)) => {
                let eos = tokenizer.eos_token.as_deref().ok_or_else(|| {
                    Error::Tokenizer(
                        "the tokenizer has no EOS token, which DPO appends to text completions: set eos_token \
                         in tokenizer_config.json"
                            .into(),
                    )
                })?;
                let with_eos = |s: &str| match s.ends_with(eos) {
                    true => s.to_string(),
                    false => format!("{s}{eos}"),
                };
                Ok([
                    tokenizer.encode(p, true)?,
                    tokenizer.encode(&format!("{p}{}", with_eos(c)), true)?,
                    tokenizer.encode(&format!("{p}{}", with_eos(r)), true)?,
                ])
            }
            (Turns::Chat(p), Turns::Chat(c), Turns::Chat(r)) => {
                if tokenizer.chat_template.is_none() {
                    return Err(Error::InvalidInput(
                        "conversational preference pairs need the model's chat template, and this model has none: \
                         use a model with one, or write prompt/chosen/rejected as text"
                            .into(),
                    ));
                }
                let render = |messages: &[ChatMessage], generation: bool| -> Result<Vec<u32>> {
                    tokenizer.encode(&tokenizer.apply_chat_template(messages, generation)?, false)
                };
                let joined = |completion: &[ChatMessage]| [p.as_slice(), completion].concat();
                Ok([
                    render(p, true)?,
                    render(&joined(c), false)?,
                    render(&joined(r), false)?,
                ])
            }
            _ => Err(Error::InvalidInput(
                "a preference example mixes text and messages".into(),
            )),
        }
    }

    /// The tokenized pair, or `None` when the prompt alone fills `max_length` with `keep_start` (TRL drops those
    /// pairs: nothing of the completions would be left) or a completion has no token.
    pub fn tokenize(
        &self,
        tokenizer: &TextTokenizer,
        max_length: Option<usize>,
        truncation: TruncationMode,
    ) -> Result<Option<PreferencePair>> {
        let [prompt, with_chosen, with_rejected] = self.token_ids(tokenizer)?;
        let common = |ids: &[u32]| prompt.iter().zip(ids).take_while(|(a, b)| a == b).count();
        let prompt_len = common(&with_chosen).min(common(&with_rejected));
        if max_length.is_some_and(|m| prompt_len >= m) && truncation == TruncationMode::KeepStart {
            return Ok(None);
        }
        let sequence = |ids: Vec<u32>| {
            let labels: Vec<i64> = ids
                .iter()
                .enumerate()
                .map(|(i, &id)| match i < prompt_len {
                    true => IGNORE_INDEX,
                    false => id as i64,
                })
                .collect();
            let n = ids.len();
            let keep = match max_length {
                Some(m) if n > m => match truncation {
                    TruncationMode::KeepStart => 0..m,
                    TruncationMode::KeepEnd => n - m..n,
                },
                _ => 0..n,
            };
            TokenizedExample {
                truncated: keep.len() < n,
                input_ids: ids[keep.clone()].to_vec(),
                labels: labels[keep].to_vec(),
                segments: vec![],
            }
        };
        let pair = PreferencePair {
            chosen: sequence(with_chosen),
            rejected: sequence(with_rejected),
        };
        // A completion with no token left (empty, or cut off) has nothing to compare.
        let learns = |e: &TokenizedExample| e.labels.iter().any(|l| *l != IGNORE_INDEX);
        Ok((learns(&pair.chosen) && learns(&pair.rejected)).then_some(pair))
    }
}

/// Tokenized preference pairs and what happened on the way.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PreferenceDataset {
    /// The pairs.
    pub pairs: Vec<PreferencePair>,
    /// Bad lines skipped: `(line, reason)` (with `skip_bad_lines`).
    pub skipped: Vec<(usize, String)>,
    /// Pairs with a sequence cut to `max_length`.
    pub truncated: usize,
    /// Pairs dropped because a completion has no token (it is empty, or the prompt alone fills `max_length`).
    pub dropped: usize,
}

impl From<Vec<PreferencePair>> for PreferenceDataset {
    fn from(pairs: Vec<PreferencePair>) -> Self {
        PreferenceDataset {
            truncated: pairs
                .iter()
                .filter(|p| p.chosen.truncated || p.rejected.truncated)
                .count(),
            pairs,
            ..Default::default()
        }
    }
}

impl PreferenceDataset {
    /// Tokenizes `examples` (see [`PreferenceExample::tokenize`]); an error names the example (counted from 1).
    pub fn tokenize(
        examples: impl IntoIterator<Item = PreferenceExample>,
        tokenizer: &TextTokenizer,
        max_length: Option<usize>,
        truncation: TruncationMode,
    ) -> Result<Self> {
        let mut pairs = Vec::new();
        let mut dropped = 0;
        for (i, example) in examples.into_iter().enumerate() {
            match example.tokenize(tokenizer, max_length, truncation) {
                Ok(Some(pair)) => pairs.push(pair),
                Ok(None) => dropped += 1,
                Err(e) => {
                    return Err(Error::InvalidInput(format!(
                        "preference example {}: {e}",
                        i + 1
                    )))
                }
            }
        }
        Ok(PreferenceDataset {
            dropped,
            ..PreferenceDataset::from(pairs)
        })
    }

    /// Reads and tokenizes a JSONL file of preference pairs (format `auto` or `preference`); a line that is not a
    /// pair is an error naming it (or skipped and recorded with `skip_bad_lines`).
    pub fn from_jsonl(
        path: &Path,
        tokenizer: &TextTokenizer,
        config: &DataConfig,
        truncation: TruncationMode,
    ) -> Result<Self> {
        if ![DataFormat::Auto, DataFormat::Preference].contains(&config.format) {
            return Err(Error::InvalidInput(format!(
                "[data] format = \"{}\": DPO reads preference pairs; use format = \"preference\" (or \"auto\")",
                config.format
            )));
        }
        config.validate()?;
        let (examples, read) = read_jsonl(path, DataFormat::Preference, config.skip_bad_lines)?;
        let examples = examples.into_iter().map(|e| match e {
            Example::Preference(p) => p,
            _ => unreachable!("read as preference pairs"),
        });
        let mut dataset = Self::tokenize(examples, tokenizer, Some(config.max_length), truncation)
            .map_err(|e| Error::InvalidInput(format!("{}: {e}", path.display())))?;
        dataset.skipped = read.skipped;
        Ok(dataset)
    }

    /// The training and evaluation pairs `config` names: `train_file`, and `eval_file` or the last `eval_split`
    /// of the training pairs (none without either).
    pub fn train_and_eval(
        tokenizer: &TextTokenizer,
        config: &DataConfig,
        truncation: TruncationMode,
    ) -> Result<(Self, Self)> {
        let train_file = config
            .train_file
            .as_ref()
            .ok_or_else(|| Error::InvalidInput("the data config names no train_file".into()))?;
        let mut train = Self::from_jsonl(train_file, tokenizer, config, truncation)?;
        if train.is_empty() {
            // Only `keep_start` drops a pair for its prompt: with `keep_end` the completions were empty.
            let (why, fix) = match truncation {
                TruncationMode::KeepStart => (
                    format!(
                        "no completion token left: the prompt alone fills [data] max_length = {}, or the \
                         completions are empty",
                        config.max_length
                    ),
                    "raise [data] max_length above the prompts' length, or set [dpo] truncation_mode = \
                     \"keep_end\" (which TRL deprecates) to cut the prompts' start instead",
                ),
                TruncationMode::KeepEnd => (
                    "every pair has an empty completion".to_string(),
                    "give each pair a chosen and a rejected answer",
                ),
            };
            return Err(Error::InvalidInput(format!(
                "{}: every pair was dropped ({why}): {fix}",
                train_file.display()
            )));
        }
        let eval = match (&config.eval_file, config.eval_split) {
            (Some(file), _) => Self::from_jsonl(file, tokenizer, config, truncation)?,
            (None, Some(split)) if split > 0.0 => train.split_off(split),
            _ => PreferenceDataset::default(),
        };
        Ok((train, eval))
    }

    /// Moves the last `ceil(len · fraction)` pairs (keeping at least one) into a new data set.
    pub fn split_off(&mut self, fraction: f64) -> Self {
        let n = ((self.pairs.len() as f64) * fraction).ceil() as usize;
        let at = self.pairs.len() - n.min(self.pairs.len().saturating_sub(1));
        let held_out = PreferenceDataset::from(self.pairs.split_off(at));
        self.truncated -= held_out.truncated;
        held_out
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.pairs.len()
    }

    /// True when there are no pairs.
    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Tokens of every sequence (two per pair).
    pub fn tokens(&self) -> usize {
        self.pairs.iter().map(PreferencePair::tokens).sum()
    }

    /// What a run prints about the file `name`: skipped lines, truncated and dropped pairs, one line each.
    pub fn file_notes(&self, name: &str, max_length: Option<usize>) -> Vec<String> {
        let mut lines: Vec<String> = self
            .skipped
            .iter()
            .map(|(line, reason)| format!("warning: {name}:{line}: skipped ({reason})"))
            .collect();
        let max = max_length.map_or("max_length".to_string(), |m| format!("{m} tokens"));
        if self.truncated > 0 {
            lines.push(format!(
                "{name}: {} pairs truncated to {max}",
                self.truncated
            ));
        }
        if self.dropped > 0 {
            lines.push(format!(
                "{name}: {} pairs dropped: no completion token left (the prompt alone fills {max}, as TRL drops \
                 them, or a completion is empty)",
                self.dropped
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_drop_when_the_prompt_fills_max_length_and_truncate_at_either_end() {
        let folder = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/dpo/tiny-llama-chat");
        let chars = TextTokenizer::from_folder(&folder).unwrap();
        let example = PreferenceExample {
            prompt: Turns::Text("t5 t6 t7".into()),
            chosen: Turns::Text(" t8 t9".into()),
            rejected: Turns::Text(" t10".into()),
        };
        let pair = example
            .tokenize(&chars, None, TruncationMode::KeepStart)
            .unwrap()
            .unwrap();
        assert_eq!(pair.chosen.input_ids.len(), 6);
        assert_eq!(
            pair.chosen
                .labels
                .iter()
                .filter(|l| **l == IGNORE_INDEX)
                .count(),
            3
        );
        assert_eq!(pair.rejected.input_ids.len(), 5);
        assert!(example
            .tokenize(&chars, Some(3), TruncationMode::KeepStart)
            .unwrap()
            .is_none());
        let start = example
            .tokenize(&chars, Some(5), TruncationMode::KeepStart)
            .unwrap()
            .unwrap();
        assert_eq!(start.chosen.input_ids, pair.chosen.input_ids[..5].to_vec());
        assert!(start.chosen.truncated && !start.rejected.truncated);
        let end = example
            .tokenize(&chars, Some(3), TruncationMode::KeepEnd)
            .unwrap()
            .unwrap();
        assert_eq!(end.chosen.input_ids, pair.chosen.input_ids[3..].to_vec());
        assert_eq!(end.chosen.learned_tokens(), 2);
    }
}
