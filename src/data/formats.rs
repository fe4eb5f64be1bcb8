//! JSONL data in the formats people fine-tune with, one example per line, and its tokenization into ids and labels:
//!
//! | format | keys | loss on |
//! |---|---|---|
//! | `text` | `{"text"}` | every token (as transformers does with `labels = input_ids`) |
//! | `alpaca` | `{"instruction", "input"?, "output"}` | the output (the prompt is labelled −100) |
//! | `messages` | `{"messages": [{"role", "content"}, ...]}` | the assistant turns |
//! | `sharegpt` | `{"conversations": [{"from": "human"/"gpt"/"system", "value"}, ...]}` | the assistant (gpt) turns |
//! | `preference` | `{"prompt"?, "chosen", "rejected"}` (text or messages) | DPO only (see [`super::preference`]) |
//!
//! Instruction and chat examples are rendered with the tokenizer's chat template (alpaca falls back to the Alpaca
//! prompt when there is none). `auto` picks the format from each line's keys.

use std::path::Path;

use serde_json::Value;

use super::preference_json::PreferenceExample;
use crate::error::{Error, Result};
use crate::models::tokenizer::{ChatMessage, TextTokenizer};
use crate::names::named_enum;
use crate::ops::IGNORE_INDEX;

named_enum! {
    /// The data format of a JSONL file.
    #[derive(Default)]
    pub enum DataFormat ("data format") {
        /// Detect per line from the keys.
        #[default]
        Auto = "auto",
        /// `{"text": ...}`.
        Text = "text",
        /// `{"instruction", "input"?, "output"}`.
        Alpaca = "alpaca",
        /// `{"messages": [...]}`.
        Messages = "messages",
        /// `{"conversations": [...]}`.
        ShareGpt = "sharegpt",
        /// `{"prompt"?, "chosen", "rejected"}`: preference pairs for DPO.
        Preference = "preference",
    }
}

/// One parsed example.
#[derive(Clone, Debug, PartialEq)]
pub enum Example {
    /// Plain text, trained on every token.
    Text(String),
    /// An instruction (prompt) and its response (completion).
    Instruction {
        /// The prompt shown to the model.
        prompt: String,
        /// The response to learn.
        response: String,
    },
    /// A conversation; assistant turns are learned.
    Chat(Vec<ChatMessage>),
    /// A preference pair (DPO's data; an SFT run refuses it).
    Preference(PreferenceExample),
}

/// Token ids with their labels (−100 where no loss is taken).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizedExample {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// Labels aligned with `input_ids` (the loss shifts them).
    pub labels: Vec<i64>,
    /// True if the example was longer than the maximum length and cut.
    pub truncated: bool,
    /// For a packed row, the lengths of the examples it holds, in order (see [`crate::data::pack`]); empty for a
    /// single example.
    pub segments: Vec<usize>,
}

impl TokenizedExample {
    /// An example of `ids` learning every token (labels = ids, as plain text's), not truncated, not packed.
    pub fn learning_every_token(ids: Vec<u32>) -> Self {
        TokenizedExample {
            labels: ids.iter().map(|&i| i as i64).collect(),
            input_ids: ids,
            truncated: false,
            segments: vec![],
        }
    }

    /// The tokens whose loss is taken: labels after the first (a position predicts the next token's label) that
    /// are not −100.
    pub fn learned_tokens(&self) -> usize {
        self.labels
            .iter()
            .skip(1)
            .filter(|l| **l != IGNORE_INDEX)
            .count()
    }
}

fn parse_line(v: &Value, format: DataFormat) -> std::result::Result<Example, String> {
    let obj = v.as_object().ok_or("the line is not a JSON object")?;
    let format = match format {
        DataFormat::Auto => {
            if obj.contains_key("chosen") && obj.contains_key("rejected") {
                DataFormat::Preference
            } else if obj.contains_key("messages") {
                DataFormat::Messages
            } else if obj.contains_key("conversations") {
                DataFormat::ShareGpt
            } else if obj.contains_key("instruction") {
                DataFormat::Alpaca
            } else if obj.contains_key("text") {
                DataFormat::Text
            } else {
                return Err(format!(
                    "cannot tell the format from keys {:?}: expected `text`, `instruction`/`output`, `messages`, \
                     `conversations` or `chosen`/`rejected`",
                    obj.keys().collect::<Vec<_>>()
                ));
            }
        }
        f => f,
    };
    let string = |key: &str| -> std::result::Result<String, String> {
        match obj.get(key) {
            Some(Value::String(s)) => Ok(s.clone()),
            Some(_) => Err(format!("`{key}` must be a string")),
            None => Err(format!("`{key}` is missing")),
        }
    };
    match format {
        DataFormat::Text => Ok(Example::Text(string("text")?)),
        DataFormat::Alpaca => {
            let instruction = string("instruction")?;
            let input = match obj.get("input") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(_) => return Err("`input` must be a string".into()),
            };
            let prompt = if input.is_empty() {
                instruction
            } else {
                format!("{instruction}\n\n{input}")
            };
            Ok(Example::Instruction {
                prompt,
                response: string("output")?,
            })
        }
        DataFormat::Messages | DataFormat::ShareGpt => {
            let (key, role_key, content_key) = if format == DataFormat::Messages {
                ("messages", "role", "content")
            } else {
                ("conversations", "from", "value")
            };
            let list = obj
                .get(key)
                .and_then(Value::as_array)
                .ok_or(format!("`{key}` must be a list"))?;
            let mut messages = Vec::with_capacity(list.len());
            for (i, m) in list.iter().enumerate() {
                let role = m
                    .get(role_key)
                    .and_then(Value::as_str)
                    .ok_or(format!("{key}[{i}].{role_key} must be a string"))?;
                let content = m
                    .get(content_key)
                    .and_then(Value::as_str)
                    .ok_or(format!("{key}[{i}].{content_key} must be a string"))?;
                let role = match role {
                    "human" | "user" => "user",
                    "gpt" | "assistant" | "model" => "assistant",
                    "system" => "system",
                    other => {
                        return Err(format!(
                            "{key}[{i}] has unknown role `{other}` (use system, user or assistant)"
                        ))
                    }
                };
                messages.push(ChatMessage {
                    role: role.into(),
                    content: content.into(),
                });
            }
            if !messages.iter().any(|m| m.role == "assistant") {
                return Err(format!("`{key}` has no assistant turn to learn"));
            }
            Ok(Example::Chat(messages))
        }
        DataFormat::Preference => PreferenceExample::from_json(obj).map(Example::Preference),
        DataFormat::Auto => unreachable!("resolved above"),
    }
}

/// What [`read_jsonl`] found.
#[derive(Clone, Debug, Default)]
pub struct ReadReport {
    /// Lines skipped as bad (only with `skip_bad_lines`).
    pub skipped: Vec<(usize, String)>,
    /// The line (from 1) of each example read, in order, for messages about an example.
    pub lines: Vec<usize>,
}

/// Reads a JSONL file of examples in `format`; see [`read_json_lines`].
pub fn read_jsonl(
    path: &Path,
    format: DataFormat,
    skip_bad_lines: bool,
) -> Result<(Vec<Example>, ReadReport)> {
    read_json_lines(path, skip_bad_lines, |v| parse_line(v, format))
}

/// Reads a JSONL file, each line's JSON value read by `parse`. A bad line is an error naming the file and line,
/// unless `skip_bad_lines`, which counts it in the report instead (also a line that is not UTF-8). Blank lines are
/// ignored, and so is a UTF-8 byte order mark at the start (as Python's `utf-8-sig` and the datasets library's JSON
/// loader read it).
pub fn read_json_lines<T>(
    path: &Path,
    skip_bad_lines: bool,
    mut parse: impl FnMut(&Value) -> std::result::Result<T, String>,
) -> Result<(Vec<T>, ReadReport)> {
    let bytes = std::fs::read(path).map_err(|e| Error::io("cannot read data file", path, e))?;
    let bytes = bytes.strip_prefix(b"\xef\xbb\xbf").unwrap_or(&bytes);
    let mut examples = Vec::new();
    let mut report = ReadReport::default();
    for (i, raw) in bytes.split(|&b| b == b'\n').enumerate() {
        let line_no = i + 1;
        let line = match std::str::from_utf8(raw.strip_suffix(b"\r").unwrap_or(raw)) {
            Ok(line) if line.trim().is_empty() => continue,
            Ok(line) => Ok(line),
            Err(e) => Err(format!(
                "not valid UTF-8 (byte {} of the line); save the file as UTF-8",
                e.valid_up_to() + 1
            )),
        };
        let parsed = line.and_then(|line| {
            serde_json::from_str::<Value>(line).map_err(|e| format!("not valid JSON ({e})"))
        });
        match parsed.and_then(|v| parse(&v)) {
            Ok(ex) => {
                examples.push(ex);
                report.lines.push(line_no);
            }
            Err(reason) if skip_bad_lines => report.skipped.push((line_no, reason)),
            Err(reason) => {
                // A run config and `qlora eval` both read data here: named in the words of each.
                return Err(Error::InvalidInput(format!(
                    "{}:{line_no}: {reason} (fix the line, or skip bad lines: [data] skip_bad_lines = true, \
                     --skip-bad-lines for qlora eval)",
                    path.display()
                )));
            }
        }
    }
    if let (true, Some((line, reason))) = (examples.is_empty(), report.skipped.first()) {
        return Err(Error::InvalidInput(format!(
            "{}: every line was skipped as bad ({} lines; the first, line {line}: {reason}): fix the lines",
            path.display(),
            report.skipped.len()
        )));
    }
    if examples.is_empty() {
        return Err(Error::InvalidInput(format!(
            "{}: no examples in the file",
            path.display()
        )));
    }
    Ok((examples, report))
}

/// Tokens covering the character ranges `spans` of `text` (by the tokenizer's offsets).
fn tokens_with_mask(
    tokenizer: &TextTokenizer,
    text: &str,
    spans: &[(usize, usize)],
    add_special: bool,
) -> Result<(Vec<u32>, Vec<bool>)> {
    let (ids, offsets) = tokenizer.encode_with_offsets(text, add_special)?;
    let mask = offsets
        .iter()
        .map(|(s, e)| e > s && spans.iter().any(|(a, b)| *s >= *a && *e <= *b))
        .collect();
    Ok((ids, mask))
}

impl Example {
    /// Tokenizes into ids and labels, truncated to `max_length` tokens (keeping the start). `all_tokens` puts the
    /// loss on every token of instruction and chat examples too.
    pub fn tokenize(
        &self,
        tokenizer: &TextTokenizer,
        max_length: usize,
        all_tokens: bool,
    ) -> Result<TokenizedExample> {
        let (ids, learn): (Vec<u32>, Vec<bool>) = match self {
            Example::Text(t) => {
                let ids = tokenizer.encode(t, true)?;
                let n = ids.len();
                (ids, vec![true; n])
            }
            Example::Instruction { prompt, response } => {
                if tokenizer.chat_template.is_some() {
                    let chat = vec![
                        ChatMessage {
                            role: "user".into(),
                            content: prompt.clone(),
                        },
                        ChatMessage {
                            role: "assistant".into(),
                            content: response.clone(),
                        },
                    ];
                    return Example::Chat(chat).tokenize(tokenizer, max_length, all_tokens);
                }
                let prompt_text = format!(
                    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{prompt}\n\n### Response:\n"
                );
                let full = format!(
                    "{prompt_text}{response}{}",
                    tokenizer.eos_token.clone().unwrap_or_default()
                );
                tokens_with_mask(tokenizer, &full, &[(prompt_text.len(), full.len())], true)?
            }
            Example::Chat(messages) => {
                if tokenizer.chat_template.is_none() {
                    return Err(Error::InvalidInput(
                        "chat examples (`messages`, `conversations`) need the model's chat template, and this model \
                         has none: use a model with one, or write the data as instructions \
                         ({\"instruction\", \"output\"}) or plain text ({\"text\"})"
                            .into(),
                    ));
                }
                let full = tokenizer
                    .apply_chat_template(messages, false)
                    .map_err(|e| match (messages.iter().find(|m| m.role != "system"), e) {
                        (Some(first), Error::Tokenizer(why)) if first.role == "assistant" => {
                            Error::Tokenizer(format!(
                                "the conversation starts with an assistant turn, and the model's chat template \
                                 refuses it ({why}); start it with the user's message (a system message may come \
                                 first)"
                            ))
                        }
                        (_, e) => e,
                    })?;
                let mut spans = Vec::new();
                for (i, m) in messages.iter().enumerate() {
                    if m.role == "assistant" {
                        let before = tokenizer.apply_chat_template(&messages[..i], true)?;
                        let through = tokenizer.apply_chat_template(&messages[..=i], false)?;
                        if !full.starts_with(&through) || !through.starts_with(&before) {
                            return Err(Error::Tokenizer(
                                "the chat template does not render conversations incrementally; assistant turns cannot be located".into(),
                            ));
                        }
                        spans.push((before.len(), through.len()));
                    }
                }
                tokens_with_mask(tokenizer, &full, &spans, false)?
            }
            Example::Preference(_) => {
                return Err(Error::InvalidInput(
                    "a preference pair (`chosen`/`rejected`) is DPO's data: add a [dpo] section to the run config \
                     to train on pairs, or give supervised examples"
                        .into(),
                ))
            }
        };
        let truncated = ids.len() > max_length;
        let n = ids.len().min(max_length);
        let labels = ids[..n]
            .iter()
            .zip(&learn[..n])
            .map(|(id, l)| {
                if *l || all_tokens {
                    *id as i64
                } else {
                    IGNORE_INDEX
                }
            })
            .collect();
        Ok(TokenizedExample {
            input_ids: ids[..n].to_vec(),
            labels,
            truncated,
            segments: vec![],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_formats_and_reports_bad_lines_with_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.jsonl");
        std::fs::write(
            &p,
            "{\"text\": \"hello\"}\n\n{\"instruction\": \"Add\", \"input\": \"1+1\", \"output\": \"2\"}\n{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"yo\"}]}\n{\"conversations\": [{\"from\": \"human\", \"value\": \"a\"}, {\"from\": \"gpt\", \"value\": \"b\"}]}\n",
        )
        .unwrap();
        let (ex, _) = read_jsonl(&p, DataFormat::Auto, false).unwrap();
        assert_eq!(ex.len(), 4);
        assert_eq!(
            ex[1],
            Example::Instruction {
                prompt: "Add\n\n1+1".into(),
                response: "2".into()
            }
        );
        assert!(matches!(&ex[3], Example::Chat(m) if m[1].role == "assistant"));

        std::fs::write(&p, "{\"text\": \"ok\"}\n{\"text\": 3}\nnot json\n").unwrap();
        let err = read_jsonl(&p, DataFormat::Auto, false)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("d.jsonl:2") && err.contains("`text` must be a string"),
            "{err}"
        );
        let (ex, report) = read_jsonl(&p, DataFormat::Auto, true).unwrap();
        assert_eq!(ex.len(), 1);
        assert_eq!(
            report.skipped.iter().map(|s| s.0).collect::<Vec<_>>(),
            vec![2, 3]
        );
        let err = read_jsonl(&dir.path().join("missing.jsonl"), DataFormat::Auto, false)
            .unwrap_err()
            .to_string();
        assert!(err.contains("missing.jsonl"), "{err}");
    }
}
