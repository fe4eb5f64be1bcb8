//! GRPO's rewards: a closure over a generation batch's prompts, completions and the prompts' other columns giving one
//! float per completion (or `None` to skip it, as TRL's), and the ones a run config names — the final answer checked
//! against a column, a regular expression, DAPO's overlong penalty, and a command in any language that reads JSON
//! lines and writes one reward per line.

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use regex::Regex;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::trainer::settings::grpo::RewardSpec;

/// What a reward sees of a generation batch: one entry per completion (a prompt's entries repeat for each of its
/// completions, as TRL hands them).
pub struct RewardInputs<'a> {
    /// Each completion's prompt, as its data line holds it (text, or a list of messages).
    pub prompts: &'a [&'a Value],
    /// The completions' texts (special tokens left out).
    pub completions: &'a [String],
    /// The completions' tokens (an ended completion's last token is its end-of-sequence token).
    pub completion_ids: &'a [Vec<u32>],
    /// The prompts' other columns (e.g. the reference answer).
    pub columns: &'a [&'a Map<String, Value>],
}

/// A reward function: one value per completion, `None` to skip one.
pub type RewardFn = dyn Fn(&RewardInputs<'_>) -> Result<Vec<Option<f64>>> + Send + Sync;

/// A named reward (the name is logged: `rewards/{name}/mean`).
#[derive(Clone)]
pub struct Reward {
    /// The name in the logs.
    pub name: String,
    func: Arc<RewardFn>,
}

impl std::fmt::Debug for Reward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Reward({})", self.name)
    }
}

impl Reward {
    /// A reward computed by `func`.
    pub fn new(
        name: impl Into<String>,
        func: impl Fn(&RewardInputs<'_>) -> Result<Vec<Option<f64>>> + Send + Sync + 'static,
    ) -> Self {
        Reward {
            name: name.into(),
            func: Arc::new(func),
        }
    }

    /// The rewards of `inputs`: an error when the function fails or gives another number of values than
    /// completions.
    pub fn score(&self, inputs: &RewardInputs<'_>) -> Result<Vec<Option<f64>>> {
        let values = (self.func)(inputs)
            .map_err(|e| Error::InvalidInput(format!("reward `{}`: {e}", self.name)))?;
        if values.len() != inputs.completions.len() {
            return Err(Error::InvalidInput(format!(
                "reward `{}` returned {} rewards for {} completions: return exactly one per completion (None to \
                 skip one)",
                self.name,
                values.len(),
                inputs.completions.len()
            )));
        }
        Ok(values)
    }

    /// The reward a run config names (`[[grpo.reward_funcs]]`).
    pub fn from_spec(spec: &RewardSpec) -> Result<Self> {
        let name = spec.name();
        let compile = |p: &str| {
            Regex::new(p).map_err(|e| {
                Error::InvalidInput(format!("[grpo] reward `{name}`: bad pattern {p:?}: {e}"))
            })
        };
        Ok(match spec.clone() {
            RewardSpec::ExactAnswer {
                column, pattern, ..
            } => {
                let pattern = pattern.map(|p| compile(&p)).transpose()?;
                Reward::new(name, move |x| exact_answers(x, &column, pattern.as_ref()))
            }
            RewardSpec::Regex {
                pattern, reward, ..
            } => {
                let pattern = compile(&pattern)?;
                let reward = reward.unwrap_or(1.0);
                Reward::new(name, move |x| {
                    Ok(x.completions
                        .iter()
                        .map(|c| Some(if pattern.is_match(c) { reward } else { 0.0 }))
                        .collect())
                })
            }
            RewardSpec::OverlongPenalty {
                max_completion_len,
                soft_punish_cache,
                ..
            } => Reward::new(name, move |x| {
                Ok(x.completion_ids
                    .iter()
                    .map(|ids| {
                        Some(overlong_penalty(
                            ids.len(),
                            max_completion_len,
                            soft_punish_cache,
                        ))
                    })
                    .collect())
            }),
            RewardSpec::Command {
                command,
                timeout_seconds,
                ..
            } => {
                let timeout = Duration::from_secs_f64(timeout_seconds.unwrap_or(600.0));
                Reward::new(name, move |x| command_rewards(&command, timeout, x))
            }
        })
    }
}

/// TRL's `get_soft_overlong_punishment`: 0 up to `max − cache` tokens, linear to −1 at `max`, −1 beyond.
pub fn overlong_penalty(length: usize, max: usize, cache: usize) -> f64 {
    let expected = max.saturating_sub(cache);
    if length <= expected {
        0.0
    } else if length <= max {
        (expected as f64 - length as f64) / cache as f64
    } else {
        -1.0
    }
}

/// A number written as people write answers (`1,000`, `$5`, `3.50`, `-2.`), if it is one.
fn as_number(text: &str) -> Option<f64> {
    let t = text
        .trim()
        .trim_end_matches('.')
        .replace([',', '$', ' '], "");
    t.parse::<f64>().ok().filter(|v| v.is_finite())
}

/// Whether two answers are the same: as numbers when both are, else as trimmed text.
pub fn same_answer(given: &str, reference: &str) -> bool {
    match (as_number(given), as_number(reference)) {
        (Some(a), Some(b)) => a == b,
        _ => given.trim() == reference.trim(),
    }
}

/// The final answer of a completion: `pattern`'s first group at its last match, or else the last number.
pub fn final_answer(completion: &str, pattern: Option<&Regex>) -> Option<String> {
    static NUMBER: std::sync::OnceLock<Regex> = std::sync::OnceLock::new();
    let number = NUMBER.get_or_init(|| Regex::new(r"-?\$?\d[\d,]*(?:\.\d+)?").expect("valid"));
    match pattern {
        Some(p) => p
            .captures_iter(completion)
            .last()
            .and_then(|c| c.get(1))
            .map(|m| m.as_str().to_string()),
        None => number
            .find_iter(completion)
            .last()
            .map(|m| m.as_str().to_string()),
    }
}

/// 1 for each completion whose final answer equals its prompt's `column`, else 0 (an error when a prompt lacks
/// the column).
fn exact_answers(
    x: &RewardInputs<'_>,
    column: &str,
    pattern: Option<&Regex>,
) -> Result<Vec<Option<f64>>> {
    x.completions
        .iter()
        .zip(x.columns)
        .map(|(completion, columns)| {
            let reference = match columns.get(column) {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Number(n)) => n.to_string(),
                Some(other) => other.to_string(),
                None => {
                    return Err(Error::InvalidInput(format!(
                        "the prompt has no column `{column}` holding the reference answer: add it to every line \
                         of the prompt data, or set `column` to the column that has it"
                    )))
                }
            };
            let right = final_answer(completion, pattern).is_some_and(|a| same_answer(&a, &reference));
            Ok(Some(if right { 1.0 } else { 0.0 }))
        })
        .collect()
}

/// Runs `command` on one JSON line per completion and reads one reward per line (a number, or `null`).
fn command_rewards(
    command: &[String],
    timeout: Duration,
    x: &RewardInputs<'_>,
) -> Result<Vec<Option<f64>>> {
    let shown = command.join(" ");
    let fail = |m: String| Error::InvalidInput(format!("reward command `{shown}`: {m}"));
    let mut input = String::new();
    for i in 0..x.completions.len() {
        let mut line = x.columns[i].clone();
        line.insert("prompt".into(), x.prompts[i].clone());
        line.insert("completion".into(), Value::String(x.completions[i].clone()));
        input.push_str(&Value::Object(line).to_string());
        input.push('\n');
    }
    let mut child = Command::new(&command[0])
        .args(&command[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot start it ({e}); check the program's path")))?;
    // Writing and reading run beside the wait, so a command that reads slowly or writes a lot cannot block us.
    let mut stdin = child.stdin.take().expect("piped");
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let mut stdout = child.stdout.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        stdout.read_to_string(&mut s).map(|_| s)
    });
    let mut stderr = child.stderr.take().expect("piped");
    let errors = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        s
    });
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().map_err(|e| fail(e.to_string()))? {
            break status;
        }
        if started.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            return Err(fail(format!(
                "no answer within {:.0} s (timeout_seconds): it was stopped; make it faster or raise the timeout",
                timeout.as_secs_f64()
            )));
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let written = writer.join().expect("writer thread");
    let output = reader.join().expect("reader thread");
    let stderr = errors.join().expect("stderr thread");
    let tail: String = stderr
        .lines()
        .rev()
        .take(5)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    if !status.success() {
        return Err(fail(format!(
            "it exited with {status}; its last error lines:\n{tail}"
        )));
    }
    if let Err(e) = written {
        return Err(fail(format!(
            "it stopped reading its input ({e}); it must read every line"
        )));
    }
    let output = output.map_err(|e| fail(format!("its output is not UTF-8 text ({e})")))?;
    let lines: Vec<&str> = output.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.len() != x.completions.len() {
        return Err(fail(format!(
            "it wrote {} rewards for {} completions: write one line per input line (a number, or null)",
            lines.len(),
            x.completions.len()
        )));
    }
    lines
        .iter()
        .enumerate()
        .map(|(i, l)| match serde_json::from_str::<Value>(l.trim()) {
            Ok(Value::Null) => Ok(None),
            Ok(v) if v.as_f64().is_some() => Ok(v.as_f64()),
            _ => Err(fail(format!(
                "output line {}: {l:?} is not a number or null",
                i + 1
            ))),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs<'a>(
        prompts: &'a [&'a Value],
        completions: &'a [String],
        ids: &'a [Vec<u32>],
        columns: &'a [&'a Map<String, Value>],
    ) -> RewardInputs<'a> {
        RewardInputs {
            prompts,
            completions,
            completion_ids: ids,
            columns,
        }
    }

    #[test]
    fn answers_compare_as_numbers() {
        assert!(same_answer("1,000", "1000"));
        assert!(same_answer("$1000.0", "1000"));
        assert!(same_answer("-2.", "-2"));
        assert!(!same_answer("12", "1.2"));
        assert!(same_answer(" Paris ", "Paris"));
        assert_eq!(final_answer("3 + 4 = 7, so 7.", None).as_deref(), Some("7"));
        let p = Regex::new(r"answer: (\S+)").unwrap();
        assert_eq!(
            final_answer("answer: 3 answer: 5", Some(&p)).as_deref(),
            Some("5")
        );
        assert_eq!(overlong_penalty(10, 20, 5), 0.0);
        assert_eq!(overlong_penalty(18, 20, 5), -0.6);
        assert_eq!(overlong_penalty(21, 20, 5), -1.0);
    }

    #[test]
    fn configured_rewards_score_and_a_bad_command_is_an_error() {
        let prompt = Value::String("2+2=".into());
        let mut columns = Map::new();
        columns.insert("answer".into(), Value::from(4));
        let completions = vec!["4".to_string(), "5".to_string()];
        let ids = vec![vec![1], vec![2, 3]];
        let p = [&prompt, &prompt];
        let c = [&columns, &columns];
        let x = inputs(&p, &completions, &ids, &c);
        let exact = Reward::from_spec(&RewardSpec::ExactAnswer {
            name: None,
            column: "answer".into(),
            pattern: None,
        })
        .unwrap();
        assert_eq!(exact.score(&x).unwrap(), vec![Some(1.0), Some(0.0)]);
        let missing = Reward::from_spec(&RewardSpec::ExactAnswer {
            name: None,
            column: "solution".into(),
            pattern: None,
        })
        .unwrap();
        assert!(missing
            .score(&x)
            .unwrap_err()
            .to_string()
            .contains("`solution`"));
        // A command in another language: one reward per line, `null` skips.
        let script = r#"import sys, json
for line in sys.stdin:
    x = json.loads(line)
    print("null" if x["completion"] == "5" else float(x["answer"]))"#;
        let cmd = Reward::from_spec(&RewardSpec::Command {
            name: None,
            command: vec!["python3".into(), "-c".into(), script.into()],
            timeout_seconds: Some(60.0),
        })
        .unwrap();
        assert_eq!(cmd.score(&x).unwrap(), vec![Some(4.0), None]);
        for (script, says) in [
            ("import sys; sys.stdin.read(); print(1)", "1 rewards for 2"),
            (
                "import sys; sys.stdin.read(); print('x'); print(2)",
                "not a number",
            ),
            ("import sys; sys.exit(3)", "exited"),
            ("import time; time.sleep(30)", "timeout"),
        ] {
            let cmd = Reward::from_spec(&RewardSpec::Command {
                name: Some("bad".into()),
                command: vec!["python3".into(), "-c".into(), script.into()],
                timeout_seconds: Some(2.0),
            })
            .unwrap();
            let err = cmd.score(&x).unwrap_err().to_string();
            assert!(err.contains(says), "{script}: {err}");
        }
        let wrong = Reward::new("short", |_| Ok(vec![Some(1.0)]));
        assert!(wrong
            .score(&x)
            .unwrap_err()
            .to_string()
            .contains("1 rewards for 2"));
    }
}
