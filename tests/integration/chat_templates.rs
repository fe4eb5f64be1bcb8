//! Real models' chat templates render exactly as transformers renders them.
//!
//! `tests/data/chat_templates/` holds the chat templates of Llama 3.2, Qwen3, Gemma 2, Gemma 3, Phi-3.5-mini,
//! Phi-4-mini and Mistral Nemo (sources in its README) and `golden.json`, their renderings by transformers'
//! `apply_chat_template(tokenize=False)` (`scripts/golden_chat.py`). Every case is rendered here through both public
//! entry points, `render_chat_template` and `TextTokenizer::apply_chat_template` (a tokenizer folder whose
//! `tokenizer_config.json` carries the template and the special tokens), and must equal the golden string byte for
//! byte; a case transformers rejects (`raise_exception`) must be rejected here with the same message.
//!
//! The clock: transformers' `strftime_now(fmt)` is `datetime.now().strftime(fmt)`; the generator pinned it, and
//! records each format a template used with its pinned output. Here the same formats are rendered by our
//! `strftime_now` (checked against the system clock by `strftime_now_is_the_local_clock`) and put in place of the
//! pinned text before comparing, so the rest of the string is still compared exactly.

use std::path::Path;

use candle_qlora::models::tokenizer::{render_chat_template, ChatMessage, TextTokenizer};
use serde::Deserialize;

use crate::common::data_path;

#[derive(Deserialize)]
struct Golden {
    transformers: String,
    templates: Vec<TemplateGolden>,
}

#[derive(Deserialize)]
struct TemplateGolden {
    file: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Format -> what the pinned clock gave for it.
    strftime_now: std::collections::BTreeMap<String, String>,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    messages: Vec<ChatMessage>,
    add_generation_prompt: bool,
    template_kwargs: serde_json::Map<String, serde_json::Value>,
    expected: Option<String>,
    error: Option<GoldenError>,
}

#[derive(Deserialize)]
struct GoldenError {
    class: String,
    message: String,
}

/// The cases every template has (see `scripts/golden_chat.py`).
const CASES: [&str; 6] = [
    "single_user",
    "system_multi_turn",
    "train_pair",
    "reasoning_in_content",
    "reasoning_in_history",
    "roles_not_alternating",
];

fn golden() -> Golden {
    let path = data_path("chat_templates/golden.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not valid: {e}", path.display()))
}

fn template_text(file: &str) -> String {
    let path = data_path(&format!("chat_templates/{file}"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Our `strftime_now(format)`, through the public renderer.
fn our_strftime(format: &str) -> String {
    let msgs = [ChatMessage {
        role: "user".into(),
        content: format.into(),
    }];
    render_chat_template(
        "{{ strftime_now(messages[0].content) }}",
        &msgs,
        false,
        None,
        None,
    )
    .unwrap_or_else(|e| panic!("strftime_now({format:?}) failed: {e}"))
}

/// Where two strings first differ, with both printed escaped (`\n` visible).
fn mismatch(label: &str, ours: &str, expected: &str) -> String {
    let at = ours
        .char_indices()
        .zip(expected.chars())
        .find(|((_, a), b)| a != b)
        .map(|((i, _), _)| i)
        .unwrap_or(ours.len().min(expected.len()));
    let near = |s: &str| -> String {
        let tail: String = s[at.min(s.len())..].chars().take(40).collect();
        format!("{tail:?}")
    };
    format!(
        "{label}: renders differently from transformers (first difference at byte {at})\n  ours:     {ours:?}\n  \
         expected: {expected:?}\n  from there: ours {} vs expected {}",
        near(ours),
        near(expected)
    )
}

/// A tokenizer folder (`tokenizer.json` with a one-token vocabulary, and `tokenizer_config.json` with the template
/// and special tokens, as a Hugging Face model ships them).
fn tokenizer_folder(dir: &Path, t: &TemplateGolden, template: &str) -> TextTokenizer {
    let tokenizer_json = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": null,
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"<unk>": 0}, "unk_token": "<unk>"},
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json.to_string()).unwrap();
    let cfg = serde_json::json!({
        "bos_token": t.bos_token,
        "eos_token": t.eos_token,
        "chat_template": template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let tok = TextTokenizer::from_folder(dir).unwrap();
    assert_eq!(tok.chat_template.as_deref(), Some(template));
    tok
}

/// Renders every case of one template both ways; returns the failures.
fn check_case(t: &TemplateGolden, template: &str, tok: &TextTokenizer, case: &Case) -> Vec<String> {
    let label = format!("{} / {}", t.file, case.name);
    assert!(
        case.template_kwargs.is_empty(),
        "{label}: the golden file passes template kwargs {:?}, which our API cannot pass",
        case.template_kwargs
    );
    // The clock is read at render time: take our dates before and after, and retry if midnight fell in between.
    let mut last = Vec::new();
    for _attempt in 0..3 {
        let before: Vec<String> = t.strftime_now.keys().map(|f| our_strftime(f)).collect();
        let via_fn = render_chat_template(
            template,
            &case.messages,
            case.add_generation_prompt,
            t.bos_token.as_deref(),
            t.eos_token.as_deref(),
        );
        let via_tok = tok.apply_chat_template(&case.messages, case.add_generation_prompt);
        let after: Vec<String> = t.strftime_now.keys().map(|f| our_strftime(f)).collect();
        if before != after {
            continue;
        }
        last.clear();
        for (how, got) in [
            ("render_chat_template", via_fn),
            ("TextTokenizer::apply_chat_template", via_tok),
        ] {
            let label = format!("{label} ({how})");
            match (&case.expected, &case.error, got) {
                (Some(expected), None, Ok(ours)) => {
                    let mut expected = expected.clone();
                    for ((_, pinned), now) in t.strftime_now.iter().zip(&before) {
                        assert!(
                            expected.contains(pinned.as_str()),
                            "{label}: the pinned date {pinned:?} is not in the golden string"
                        );
                        // Today's date has the pinned one's shape (digits for digits, letters for letters), so an
                        // empty or malformed strftime_now fails here too, not only in its own test.
                        let shape = |s: &str| -> String {
                            s.chars()
                                .map(|c| match c {
                                    '0'..='9' => '0',
                                    c if c.is_ascii_alphabetic() => 'a',
                                    c => c,
                                })
                                .collect()
                        };
                        if shape(now) != shape(pinned) {
                            last.push(format!(
                                "{label}: our strftime_now gives {now:?} where transformers' gave {pinned:?} \
                                 (for a pinned clock)"
                            ));
                        }
                        expected = expected.replace(pinned.as_str(), now);
                    }
                    if ours != expected {
                        last.push(mismatch(&label, &ours, &expected));
                    }
                }
                (Some(_), None, Err(e)) => {
                    last.push(format!("{label}: transformers renders it, ours fails: {e}"))
                }
                (None, Some(err), Ok(ours)) => last.push(format!(
                    "{label}: transformers raises {}({:?}), ours renders {ours:?}",
                    err.class, err.message
                )),
                (None, Some(err), Err(e)) => {
                    let e = e.to_string();
                    if !e.contains(&err.message) {
                        last.push(format!(
                            "{label}: ours fails as transformers does, but not with its message {:?}: {e}",
                            err.message
                        ));
                    }
                }
                _ => panic!("{label}: a golden case has exactly one of `expected` and `error`"),
            }
        }
        return last;
    }
    panic!("{label}: the date kept changing while rendering")
}

fn check_template(file: &str) {
    let golden = golden();
    let t = golden
        .templates
        .iter()
        .find(|t| t.file == file)
        .unwrap_or_else(|| panic!("{file} has no entry in golden.json"));
    let names: Vec<&str> = t.cases.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, CASES, "{file}: the golden cases");
    let template = template_text(file);
    let dir = tempfile::tempdir().unwrap();
    let tok = tokenizer_folder(dir.path(), t, &template);
    let failures: Vec<String> = t
        .cases
        .iter()
        .flat_map(|case| check_case(t, &template, &tok, case))
        .collect();
    assert!(
        failures.is_empty(),
        "{} of {} renderings differ from transformers {}:\n\n{}",
        failures.len(),
        2 * t.cases.len(),
        golden.transformers,
        failures.join("\n\n")
    );
}

#[test]
fn llama_3_2_renders_as_transformers() {
    check_template("meta-llama-Llama-3.2-3B-Instruct.jinja");
}

#[test]
fn qwen3_renders_as_transformers() {
    check_template("Qwen-Qwen3-0.6B.jinja");
}

#[test]
fn gemma_2_renders_as_transformers() {
    check_template("google-gemma-2-2b-it.jinja");
}

#[test]
fn gemma_3_renders_as_transformers() {
    check_template("google-gemma-3-it.jinja");
}

#[test]
fn phi_3_5_mini_renders_as_transformers() {
    check_template("microsoft-Phi-3.5-mini-instruct.jinja");
}

#[test]
fn phi_4_mini_renders_as_transformers() {
    check_template("microsoft-Phi-4-mini-instruct.jinja");
}

#[test]
fn mistral_nemo_renders_as_transformers() {
    check_template("mistralai-Mistral-Nemo-Instruct-2407.jinja");
}

/// Every template in the folder has golden renderings, and every golden entry has a test above.
#[test]
fn every_template_has_golden_renderings() {
    let mut on_disk: Vec<String> = std::fs::read_dir(data_path("chat_templates"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".jinja"))
        .collect();
    on_disk.sort();
    let mut in_golden: Vec<String> = golden().templates.into_iter().map(|t| t.file).collect();
    in_golden.sort();
    assert_eq!(on_disk, in_golden);
    assert_eq!(in_golden.len(), 7, "one test per template above");
}

/// `strftime_now` is the local clock formatted as Python's `datetime.now().strftime` formats it (the C library's
/// `strftime`, C locale): compared with `date +FORMAT`.
#[test]
fn strftime_now_is_the_local_clock() {
    for format in ["%d %b %Y", "%Y-%m-%d", "%B %-d, %Y (%A)", "%y/%m/%d %j %%"] {
        let system = || {
            let out = std::process::Command::new("date")
                .arg(format!("+{format}"))
                .env("LC_ALL", "C")
                .output()
                .expect("the `date` command");
            String::from_utf8(out.stdout)
                .unwrap()
                .trim_end_matches('\n')
                .to_string()
        };
        // Read ours between two reads of the system clock; retry if the date changed in between.
        let agreed = (0..3).any(|_| {
            let (s0, ours, s1) = (system(), our_strftime(format), system());
            assert!(
                s0 != s1 || ours == s0,
                "strftime_now({format:?}) = {ours:?}, `date` says {s0:?}"
            );
            s0 == s1
        });
        assert!(
            agreed,
            "the date kept changing while reading strftime_now({format:?})"
        );
    }
    assert_eq!(our_strftime(""), "");
    assert_eq!(our_strftime("plain text"), "plain text");
}
