//! Prompts for online reinforcement learning (GRPO), in TRL's prompt-only form — `{"prompt": text or [messages],
//! …other columns}`, the other columns handed to the rewards — and rollouts generated elsewhere, one line per
//! prompt: `{"prompt": …, "completions": [text, …], "rewards"?: [number or null, …], …other columns}`.
//!
//! A text prompt is tokenized with the tokenizer's special tokens (as TRL calls the tokenizer on it); messages are
//! rendered with the chat template and a generation prompt, then tokenized without adding any. A rollout's
//! completion text is tokenized as it stands, nothing added: a completion that ended carries its end-of-sequence
//! token in the text.

use std::path::Path;

use serde_json::{Map, Value};

use super::formats::{read_json_lines, ReadReport};
use super::preference_json::{is_conversational, messages, Turns};
use crate::error::{Error, Result};
use crate::models::TextTokenizer;

/// One prompt with its other columns and its tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    /// The prompt as the line holds it (text or messages), as the rewards receive it.
    pub prompt: Value,
    /// Its tokens, as the model sees them before the completion.
    pub ids: Vec<u32>,
    /// The line's other columns (the rewards' extra arguments, e.g. the reference answer).
    pub columns: Map<String, Value>,
    /// The line in its file (from 1), for messages.
    pub line: usize,
}

/// Completions of one prompt generated elsewhere, with their rewards when the file gives them.
#[derive(Clone, Debug, PartialEq)]
pub struct Rollout {
    /// The completions' texts, in order.
    pub completions: Vec<String>,
    /// One reward per completion (`None`: skipped, as TRL's `None`), when the file gives them.
    pub rewards: Option<Vec<Option<f64>>>,
}

/// Prompts read from a file (and, for a rollouts file, their completions).
#[derive(Clone, Debug, Default)]
pub struct PromptDataset {
    /// The prompts, in file order.
    pub prompts: Vec<Prompt>,
    /// Each prompt's rollout, for a rollouts file (same order); empty otherwise.
    pub rollouts: Vec<Rollout>,
    /// Lines skipped as bad (with `skip_bad_lines`).
    pub skipped: Vec<(usize, String)>,
}

/// A line's prompt (text or messages) and its other columns, `keys_apart` left out.
fn prompt_and_columns(
    v: &Value,
    keys_apart: &[&str],
) -> std::result::Result<(Value, Turns, Map<String, Value>), String> {
    let obj = v
        .as_object()
        .ok_or("a line must be a JSON object with a \"prompt\"")?;
    let prompt = obj
        .get("prompt")
        .ok_or("`prompt` is missing (GRPO reads prompt-only data: {\"prompt\": …, …columns for the rewards})")?;
    let turns = match prompt {
        Value::String(s) => Turns::Text(s.clone()),
        p if is_conversational(p) => Turns::Chat(messages(p, "prompt")?),
        _ => {
            return Err(
                "`prompt` must be a string or a list of messages ({\"role\", \"content\"})".into(),
            )
        }
    };
    let columns = obj
        .iter()
        .filter(|(k, _)| k.as_str() != "prompt" && !keys_apart.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    Ok((prompt.clone(), turns, columns))
}

/// The tokens of a prompt, as TRL's GRPO tokenizes it.
pub fn prompt_ids(tokenizer: &TextTokenizer, prompt: &Turns) -> Result<Vec<u32>> {
    match prompt {
        Turns::Text(text) => tokenizer.encode(text, true),
        Turns::Chat(messages) => {
            let text = tokenizer.apply_chat_template(messages, true)?;
            tokenizer.encode(&text, false)
        }
    }
}

/// A rollout line's completions and rewards.
fn rollout(v: &Value) -> std::result::Result<Rollout, String> {
    let completions = v
        .get("completions")
        .and_then(Value::as_array)
        .ok_or("`completions` is missing or not a list of texts")?
        .iter()
        .enumerate()
        .map(|(i, c)| {
            c.as_str().map(str::to_string).ok_or(format!(
                "completions[{i}] must be a string (the completion's text)"
            ))
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let rewards = match v.get("rewards") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => Some(
            list.iter()
                .enumerate()
                .map(|(i, r)| match r {
                    Value::Null => Ok(None),
                    r => r
                        .as_f64()
                        .map(Some)
                        .ok_or(format!("rewards[{i}] must be a number or null")),
                })
                .collect::<std::result::Result<Vec<_>, _>>()?,
        ),
        Some(_) => return Err("`rewards` must be a list of numbers (one per completion)".into()),
    };
    if let Some(r) = &rewards {
        if r.len() != completions.len() {
            return Err(format!(
                "{} rewards for {} completions: give one reward per completion (or none, to score them with \
                 [grpo] reward_funcs)",
                r.len(),
                completions.len()
            ));
        }
    }
    Ok(Rollout {
        completions,
        rewards,
    })
}

impl PromptDataset {
    /// Reads prompt-only data (`rollouts = false`) or rollouts (`rollouts = true`) from a JSONL file, tokenizing
    /// the prompts; a bad line is an error naming the file and line (or skipped and recorded with
    /// `skip_bad_lines`). A prompt longer than `max_prompt_length` tokens is an error naming its line.
    pub fn from_jsonl(
        path: &Path,
        tokenizer: &TextTokenizer,
        rollouts: bool,
        skip_bad_lines: bool,
        max_prompt_length: usize,
    ) -> Result<Self> {
        let apart: &[&str] = if rollouts {
            &["completions", "rewards"]
        } else {
            &[]
        };
        let (read, report): (Vec<_>, ReadReport) = read_json_lines(path, skip_bad_lines, |v| {
            let (prompt, turns, columns) = prompt_and_columns(v, apart)?;
            let rollout = rollouts.then(|| rollout(v)).transpose()?;
            Ok((prompt, turns, columns, rollout))
        })?;
        let mut dataset = PromptDataset {
            skipped: report.skipped,
            ..Default::default()
        };
        for ((prompt, turns, columns, rollout), line) in read.into_iter().zip(report.lines) {
            let at = |e: String| Error::InvalidInput(format!("{}:{line}: {e}", path.display()));
            let ids = prompt_ids(tokenizer, &turns).map_err(|e| at(e.to_string()))?;
            if ids.is_empty() {
                return Err(at("the prompt has no tokens; give it some text".into()));
            }
            if ids.len() > max_prompt_length {
                return Err(at(format!(
                    "the prompt has {} tokens, more than [data] max_length = {max_prompt_length}: shorten it, or \
                     raise max_length",
                    ids.len()
                )));
            }
            dataset.prompts.push(Prompt {
                prompt,
                ids,
                columns,
                line,
            });
            dataset.rollouts.extend(rollout);
        }
        Ok(dataset)
    }

    /// The number of prompts.
    pub fn len(&self) -> usize {
        self.prompts.len()
    }

    /// True when there are none.
    pub fn is_empty(&self) -> bool {
        self.prompts.is_empty()
    }

    /// Splits off the last `fraction` of the prompts (and rollouts), for evaluation.
    pub fn split_off(&mut self, fraction: f64) -> Self {
        let keep = self.len() - ((self.len() as f64 * fraction).round() as usize).min(self.len());
        PromptDataset {
            prompts: self.prompts.split_off(keep),
            rollouts: match self.rollouts.is_empty() {
                true => Vec::new(),
                false => self.rollouts.split_off(keep),
            },
            skipped: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(
        line: &str,
        apart: &[&str],
    ) -> std::result::Result<(Value, Turns, Map<String, Value>), String> {
        prompt_and_columns(&serde_json::from_str(line).unwrap(), apart)
    }

    #[test]
    fn prompts_keep_their_other_columns_and_bad_lines_are_named() {
        let (_, turns, columns) = parse(r#"{"prompt": "2+2=", "answer": "4"}"#, &[]).unwrap();
        assert_eq!(turns, Turns::Text("2+2=".into()));
        assert_eq!(columns["answer"], "4");
        let (_, turns, _) =
            parse(r#"{"prompt": [{"role": "user", "content": "hi"}]}"#, &[]).unwrap();
        assert!(matches!(turns, Turns::Chat(m) if m[0].content == "hi"));
        assert!(parse(r#"{"question": "x"}"#, &[])
            .unwrap_err()
            .contains("`prompt` is missing"));
        assert!(parse(r#"{"prompt": 3}"#, &[])
            .unwrap_err()
            .contains("string or a list"));
        let v: Value = serde_json::from_str(
            r#"{"prompt": "p", "completions": ["a", "b"], "rewards": [1.0, null], "x": 1}"#,
        )
        .unwrap();
        let r = rollout(&v).unwrap();
        assert_eq!(r.rewards, Some(vec![Some(1.0), None]));
        let (_, _, columns) = prompt_and_columns(&v, &["completions", "rewards"]).unwrap();
        assert_eq!(columns.keys().collect::<Vec<_>>(), vec!["x"]);
        for (line, says) in [
            (
                r#"{"prompt": "p", "completions": ["a"], "rewards": [1, 2]}"#,
                "2 rewards for 1",
            ),
            (r#"{"prompt": "p", "completions": [1]}"#, "completions[0]"),
            (r#"{"prompt": "p"}"#, "`completions` is missing"),
            (
                r#"{"prompt": "p", "completions": ["a"], "rewards": ["x"]}"#,
                "rewards[0]",
            ),
        ] {
            let err = rollout(&serde_json::from_str(line).unwrap()).unwrap_err();
            assert!(err.contains(says), "{line}: {err}");
        }
    }
}
