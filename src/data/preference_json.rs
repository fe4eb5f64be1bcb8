//! Preference examples as JSON lines hold them, in TRL's forms:
//!
//! | form | keys |
//! |---|---|
//! | standard, explicit prompt | `{"prompt": str, "chosen": str, "rejected": str}` |
//! | conversational, explicit prompt | `{"prompt": [messages], "chosen": [messages], "rejected": [messages]}` |
//! | implicit prompt (either form) | `{"chosen": …, "rejected": …}`: the prompt is their common beginning |

use serde_json::{Map, Value};

use crate::models::tokenizer::ChatMessage;

/// A prompt or a completion: text, or a list of chat messages.
#[derive(Clone, Debug, PartialEq)]
pub enum Turns {
    /// Plain text (the standard form).
    Text(String),
    /// Chat messages (the conversational form).
    Chat(Vec<ChatMessage>),
}

/// One preference example: a prompt and two completions, the chosen one preferred.
#[derive(Clone, Debug, PartialEq)]
pub struct PreferenceExample {
    /// The prompt (extracted from the completions for the implicit-prompt form).
    pub prompt: Turns,
    /// The preferred completion.
    pub chosen: Turns,
    /// The other completion.
    pub rejected: Turns,
}

/// Whether `v` is a list of chat messages (TRL's `is_conversational`: a list whose first item has a `role`).
pub(crate) fn is_conversational(v: &Value) -> bool {
    v.as_array()
        .and_then(|l| l.first())
        .and_then(Value::as_object)
        .is_some_and(|m| m.contains_key("role"))
}

/// The messages of `key`.
pub(crate) fn messages(v: &Value, key: &str) -> std::result::Result<Vec<ChatMessage>, String> {
    let list = v
        .as_array()
        .ok_or(format!("`{key}` must be a list of messages"))?;
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let field = |name: &str| {
                m.get(name)
                    .and_then(Value::as_str)
                    .map(str::to_string)
                    .ok_or(format!("{key}[{i}].{name} must be a string"))
            };
            let role = field("role")?;
            if !["system", "user", "assistant"].contains(&role.as_str()) {
                return Err(format!(
                    "{key}[{i}] has unknown role `{role}` (use system, user or assistant)"
                ));
            }
            Ok(ChatMessage {
                role,
                content: field("content")?,
            })
        })
        .collect()
}

/// The form of an example, from the first of `chosen`, `rejected` and `prompt` that shows one (text, or a list of
/// messages): whether it is conversational, and the key that showed it. An error when none does, naming
/// `chosen`'s problem (or its absence).
fn form(obj: &Map<String, Value>) -> std::result::Result<(bool, &'static str), String> {
    for key in ["chosen", "rejected", "prompt"] {
        match obj.get(key) {
            Some(Value::String(_)) => return Ok((false, key)),
            Some(v) if is_conversational(v) => return Ok((true, key)),
            _ => {}
        }
    }
    match obj.get("chosen") {
        None => Err("`chosen` is missing".into()),
        Some(Value::Array(l)) if l.is_empty() => {
            Err("`chosen` is an empty list: give the chosen answer as a string or a list of messages".into())
        }
        Some(_) => Err(
            "`chosen` must be a string or a list of messages ({\"role\": …, \"content\": …}), and `rejected` the same"
                .into(),
        ),
    }
}

/// `key` read as text or as messages, the form `conversational` says (shown by the key `shown_by`).
fn turns(
    obj: &Map<String, Value>,
    key: &str,
    (conversational, shown_by): (bool, &str),
) -> std::result::Result<Turns, String> {
    let v = obj.get(key).ok_or(format!("`{key}` is missing"))?;
    match (conversational, v) {
        (false, Value::String(s)) => Ok(Turns::Text(s.clone())),
        (true, _) if is_conversational(v) => Ok(Turns::Chat(messages(v, key)?)),
        (true, Value::Array(l)) if l.is_empty() => Err(format!(
            "`{key}` is an empty list: give at least one message, as `{shown_by}` is a list of messages"
        )),
        (false, _) => Err(format!(
            "`{key}` must be a string, as `{shown_by}` is (or write every field as a list of messages)"
        )),
        (true, _) => Err(format!(
            "`{key}` must be a list of messages, as `{shown_by}` is (or write every field as text)"
        )),
    }
}

/// Index where the prompt ends in the implicit-prompt form: the first place `chosen` and `rejected` differ, one
/// earlier if a space precedes it (TRL's `extract_prompt`, so the space goes with the completions).
fn shared_prefix<T: PartialEq>(chosen: &[T], rejected: &[T], space: Option<&T>) -> usize {
    let n = chosen.len().min(rejected.len());
    match (0..n).find(|&i| chosen[i] != rejected[i]) {
        Some(i) if i > 0 && space.is_some_and(|s| chosen[i - 1] == *s) => i - 1,
        Some(i) => i,
        // One is a prefix of the other: TRL's loop ends on its last index.
        None => n.saturating_sub(1),
    }
}

impl PreferenceExample {
    /// Reads a JSON line holding `chosen` and `rejected` (and `prompt`, unless implicit).
    pub fn from_json(obj: &Map<String, Value>) -> std::result::Result<Self, String> {
        if !obj.contains_key("chosen") {
            return Err("`chosen` is missing".into());
        }
        let form = form(obj)?;
        let (chosen, rejected) = (turns(obj, "chosen", form)?, turns(obj, "rejected", form)?);
        let example = match (chosen, rejected) {
            (chosen, rejected) if obj.contains_key("prompt") => PreferenceExample {
                prompt: turns(obj, "prompt", form)?,
                chosen,
                rejected,
            },
            (Turns::Text(c), Turns::Text(r)) => {
                let (c, r): (Vec<char>, Vec<char>) = (c.chars().collect(), r.chars().collect());
                let at = shared_prefix(&c, &r, Some(&' '));
                PreferenceExample {
                    prompt: Turns::Text(c[..at].iter().collect()),
                    chosen: Turns::Text(c[at..].iter().collect()),
                    rejected: Turns::Text(r[at..].iter().collect()),
                }
            }
            (Turns::Chat(c), Turns::Chat(r)) => {
                let at = shared_prefix(&c, &r, None);
                PreferenceExample {
                    prompt: Turns::Chat(c[..at].to_vec()),
                    chosen: Turns::Chat(c[at..].to_vec()),
                    rejected: Turns::Chat(r[at..].to_vec()),
                }
            }
            _ => unreachable!("both read in the form of `chosen`"),
        };
        // Equal answers give a zero margin, so a zero gradient and a tie in the reward accuracy: nothing to learn
        // or to measure, in either form (TRL would train and count them).
        if example.chosen == example.rejected {
            return Err(
                "`chosen` and `rejected` are the same: there is no preference to learn".into(),
            );
        }
        Ok(example)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(line: &str) -> std::result::Result<PreferenceExample, String> {
        let v: Value = serde_json::from_str(line).unwrap();
        PreferenceExample::from_json(v.as_object().unwrap())
    }

    #[test]
    fn implicit_prompts_are_the_common_beginning_as_trl_extracts_them() {
        let e =
            example(r#"{"chosen": "The sky is blue.", "rejected": "The sky is green."}"#).unwrap();
        assert_eq!(e.prompt, Turns::Text("The sky is".into()));
        assert_eq!(e.chosen, Turns::Text(" blue.".into()));
        assert_eq!(e.rejected, Turns::Text(" green.".into()));
        let chat = example(
            r#"{"chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}"#,
        )
        .unwrap();
        assert!(matches!(&chat.prompt, Turns::Chat(m) if m.len() == 1 && m[0].content == "q"));
        assert!(matches!(&chat.chosen, Turns::Chat(m) if m.len() == 1 && m[0].content == "a"));
        let same = example(r#"{"chosen": "x y", "rejected": "x y"}"#).unwrap_err();
        assert!(same.contains("the same"), "{same}");
        // With an explicit prompt too, empty answers included.
        for line in [
            r#"{"prompt": "x", "chosen": " y", "rejected": " y"}"#,
            r#"{"prompt": "x", "chosen": "", "rejected": ""}"#,
        ] {
            let same = example(line).unwrap_err();
            assert!(same.contains("the same"), "{line}: {same}");
        }
    }

    #[test]
    fn mixed_forms_and_missing_keys_are_named() {
        let err = example(r#"{"prompt": "p", "chosen": "a", "rejected": [{"role": "assistant", "content": "b"}]}"#)
            .unwrap_err();
        assert!(err.contains("`rejected` must be a string"), "{err}");
        let err = example(r#"{"prompt": "p", "chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]}"#)
            .unwrap_err();
        assert!(err.contains("`prompt` must be a list of messages"), "{err}");
        let err = example(r#"{"prompt": "p", "chosen": "a"}"#).unwrap_err();
        assert!(err.contains("`rejected` is missing"), "{err}");
        let err = example(r#"{"chosen": [{"role": "bot", "content": "a"}], "rejected": [{"role": "user", "content": "b"}]}"#)
            .unwrap_err();
        assert!(err.contains("unknown role `bot`"), "{err}");
    }

    #[test]
    fn a_field_of_the_wrong_form_is_told_the_form_another_field_shows() {
        let err = example(r#"{"prompt": "p", "chosen": 5, "rejected": "r"}"#).unwrap_err();
        assert!(
            err.contains("`chosen` must be a string, as `rejected` is"),
            "{err}"
        );
        let err = example(r#"{"chosen": 5, "rejected": 6}"#).unwrap_err();
        assert!(
            err.contains("`chosen` must be a string or a list of messages"),
            "{err}"
        );
        let err = example(
            r#"{"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": [{"role": "assistant", "content": "b"}]}"#,
        )
        .unwrap_err();
        assert!(
            err.contains("`chosen` is an empty list: give at least one message, as `rejected`"),
            "{err}"
        );
        let err = example(
            r#"{"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": []}"#,
        )
        .unwrap_err();
        assert!(
            err.contains("`chosen` is an empty list: give at least one message, as `prompt`"),
            "{err}"
        );
    }

    #[test]
    fn shared_prefix_follows_trl_at_the_edges() {
        let chars = |s: &str| s.chars().collect::<Vec<_>>();
        assert_eq!(shared_prefix(&chars("ab c"), &chars("ab d"), Some(&' ')), 2);
        assert_eq!(shared_prefix(&chars("abc"), &chars("abd"), Some(&' ')), 2);
        assert_eq!(shared_prefix(&chars("abc"), &chars("abcd"), Some(&' ')), 2);
        assert_eq!(shared_prefix(&chars("x"), &chars("y"), Some(&' ')), 0);
    }
}
