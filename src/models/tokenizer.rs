//! The text side of a model: a `tokenizers` tokenizer (from `tokenizer.json` or GGUF metadata), its special
//! tokens, and its chat template rendered with minijinja the way transformers' `apply_chat_template` does.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::quantized::tokenizer::TokenizerFromGguf;
use serde::Serialize;

use crate::error::{Error, Result};

/// A byte range `[start, end)` of a text.
pub type Span = (usize, usize);

/// One chat message (`{"role": ..., "content": ...}`).
#[derive(Clone, Debug, PartialEq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

/// A tokenizer with its special tokens and chat template.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// Beginning-of-sequence token text, if known.
    pub bos_token: Option<String>,
    /// End-of-sequence token text, if known.
    pub eos_token: Option<String>,
    /// Jinja chat template, if the model has one.
    pub chat_template: Option<String>,
}

/// A special token of `tokenizer_config.json`: a string, an `AddedToken` object (`{"content": …}`) or `null`;
/// anything else is refused naming `key`, as transformers refuses it ("has to be either str or AddedToken").
fn token_text(cfg: &serde_json::Value, key: &str, path: &Path) -> Result<Option<String>> {
    match cfg.get(key) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Object(o)) if o.get("content").is_some_and(|c| c.is_string()) => {
            Ok(o["content"].as_str().map(str::to_string))
        }
        Some(other) => Err(Error::invalid_file(
            path,
            format!(
                "`{key}` = {other}: must be the token's text (a string) or an object with its text in `content`"
            ),
        )),
    }
}

/// The chat template of `tokenizer_config.json`: a string, or transformers' list of named templates (`[{"name":
/// …, "template": …}]`, of which it uses `default`); anything else is refused naming the key.
fn chat_template_of(cfg: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    let bad = |reason: String| Error::invalid_file(path, reason);
    match cfg.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(t)) => Ok(Some(t.clone())),
        Some(serde_json::Value::Array(named)) => {
            let mut names = Vec::new();
            for (i, entry) in named.iter().enumerate() {
                let field = |k: &str| entry.get(k).and_then(serde_json::Value::as_str);
                let (Some(name), Some(template)) = (field("name"), field("template")) else {
                    return Err(bad(format!(
                        "`chat_template[{i}]` must be an object with a string `name` and `template`"
                    )));
                };
                if name == "default" {
                    return Ok(Some(template.to_string()));
                }
                names.push(name);
            }
            Err(bad(format!(
                "`chat_template` lists named templates ({}) but none named `default`, the one transformers uses; \
                 name the one to use `default`",
                names.join(", ")
            )))
        }
        Some(other) => Err(bad(format!(
            "`chat_template` = {other}: must be a Jinja template (a string) or a list of named templates"
        ))),
    }
}

impl TextTokenizer {
    /// From a Hugging Face folder: `tokenizer.json` plus `tokenizer_config.json` (special tokens, chat template).
    pub fn from_folder(folder: &Path) -> Result<Self> {
        let path = folder.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path)
            .map_err(|e| Error::invalid_file(&path, format!("cannot load tokenizer: {e}")))?;
        let cfg_path = folder.join("tokenizer_config.json");
        let cfg: serde_json::Value = match std::fs::read_to_string(&cfg_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| Error::invalid_file(&cfg_path, format!("not valid JSON: {e}")))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => serde_json::Value::Null,
            Err(e) => return Err(Error::io("cannot read", &cfg_path, e)),
        };
        if !(cfg.is_object() || cfg.is_null()) {
            return Err(Error::invalid_file(
                &cfg_path,
                "must be a JSON object (`{\"eos_token\": …, \"chat_template\": …}`)",
            ));
        }
        let mut chat_template = chat_template_of(&cfg, &cfg_path)?;
        if chat_template.is_none() {
            chat_template = std::fs::read_to_string(folder.join("chat_template.jinja")).ok();
        }
        Ok(TextTokenizer {
            inner,
            bos_token: token_text(&cfg, "bos_token", &cfg_path)?,
            eos_token: token_text(&cfg, "eos_token", &cfg_path)?,
            chat_template,
        })
    }

    /// From GGUF metadata (`tokenizer.ggml.*`, `tokenizer.chat_template`).
    pub fn from_gguf(content: &gguf_file::Content, path: &Path) -> Result<Self> {
        let mut inner = tokenizers::Tokenizer::from_gguf(content).map_err(|e| {
            Error::invalid_file(
                path,
                format!("cannot build the tokenizer from GGUF metadata: {e}"),
            )
        })?;
        let md = &content.metadata;
        // Candle gives GPT-2-style vocabularies (e.g. `smollm`) a byte-level pre-tokenizer that adds a prefix space;
        // llama.cpp and transformers add one only when `tokenizer.ggml.add_space_prefix` says so.
        let pre = md
            .get("tokenizer.ggml.pre")
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
            .unwrap_or("gpt2");
        if !matches!(pre, "qwen2" | "smaug-bpe" | "lfm2" | "llama3") {
            let add_prefix_space = md
                .get("tokenizer.ggml.add_space_prefix")
                .and_then(|v| v.to_bool().ok())
                .unwrap_or(false);
            inner.with_pre_tokenizer(Some(
                tokenizers::pre_tokenizers::byte_level::ByteLevel::new(
                    add_prefix_space,
                    true,
                    true,
                ),
            ));
        }
        let tokens = md
            .get("tokenizer.ggml.tokens")
            .and_then(|v| v.to_vec().ok());
        let token_at = |key: &str| -> Option<String> {
            let id = md.get(key)?.to_u32().ok()? as usize;
            tokens?.get(id)?.to_string().ok().cloned()
        };
        Ok(TextTokenizer {
            inner,
            bos_token: token_at("tokenizer.ggml.bos_token_id"),
            eos_token: token_at("tokenizer.ggml.eos_token_id"),
            chat_template: md
                .get("tokenizer.chat_template")
                .and_then(|v| v.to_string().ok())
                .cloned(),
        })
    }

    /// Token ids of `text`, with the special tokens the tokenizer's post-processor adds when `add_special_tokens`.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("tokenization failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Token ids of `text` with the byte range each token covers.
    pub fn encode_with_offsets(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<(Vec<u32>, Vec<Span>)> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("tokenization failed: {e}")))?;
        Ok((enc.get_ids().to_vec(), enc.get_offsets().to_vec()))
    }

    /// Text of `ids` (special tokens skipped when `skip_special_tokens`).
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(format!("detokenization failed: {e}")))
    }

    /// The id of a token's text.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Writes `tokenizer.json` and a `tokenizer_config.json` (special tokens, chat template) into `dir`.
    pub fn save_folder(&self, dir: &Path) -> Result<()> {
        let path = dir.join("tokenizer.json");
        self.inner
            .save(&path, false)
            .map_err(|e| Error::Tokenizer(format!("cannot write {}: {e}", path.display())))?;
        let cfg = serde_json::json!({
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "chat_template": self.chat_template,
            "tokenizer_class": "PreTrainedTokenizerFast",
        });
        let path = dir.join("tokenizer_config.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&cfg).unwrap_or_default(),
        )
        .map_err(|e| Error::io("cannot write", &path, e))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Renders `messages` with the chat template, as transformers' `apply_chat_template(tokenize=False)`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            Error::Tokenizer(
                "the model has no chat template (none in tokenizer_config.json, no chat_template.jinja, none in \
                 the GGUF metadata)"
                    .into(),
            )
        })?;
        render_chat_template(
            template,
            messages,
            add_generation_prompt,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )
    }
}

/// transformers' `strftime_now(format)`: `datetime.now().strftime(format)`, the local time formatted by the C
/// library's `strftime` (in the C locale, as Python leaves `LC_TIME`). Llama 3.x templates put
/// `strftime_now("%d %b %Y")` into every system prompt ("Today Date: 26 Jul 2024").
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    if format.is_empty() {
        return Ok(String::new());
    }
    let fail = |what: &str| {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            format!("strftime_now: {what}"),
        )
    };
    let c_format = std::ffi::CString::new(format.as_str())
        .map_err(|_| fail("the format contains a NUL character"))?;
    // SAFETY: `time` accepts a null pointer; `localtime_r` writes only into `tm`; `strftime` writes at most
    // `buf.len()` bytes into `buf` and reads the NUL-terminated format and the `tm` filled above.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    let now = unsafe { libc::time(std::ptr::null_mut()) };
    if unsafe { libc::localtime_r(&now, &mut tm) }.is_null() {
        return Err(fail("cannot read the local time"));
    }
    // A conversion (two or three format bytes) expands to at most a few dozen bytes in the C locale.
    let mut buf = vec![0u8; 64 + 32 * format.len()];
    let n = unsafe { libc::strftime(buf.as_mut_ptr().cast(), buf.len(), c_format.as_ptr(), &tm) };
    // 0 is either an empty result (e.g. `%p` in some locales) or one that does not fit; both give "".
    buf.truncate(n);
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// Instructions a chat template may execute per rendering (minijinja's fuel).
const TEMPLATE_FUEL: u64 = 10_000_000;

/// Renders a Hugging Face chat template with minijinja (Python string methods, `raise_exception`,
/// `strftime_now`, Python's `json.dumps` as `tojson`, `tools` and `documents` set to none, and
/// `trim_blocks`/`lstrip_blocks` as transformers sets them). A template that runs away (more
/// than ten million instructions) is an error.
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    // A template comes with a downloaded model: bound its work (real chat templates use a few thousand units), so a
    // runaway loop is an error instead of a hang.
    env.set_fuel(Some(TEMPLATE_FUEL));
    env.set_unknown_method_callback(|state, value, method, args| {
        // minijinja-contrib's `str.count('')` never returns (it finds the empty string at the same place again and
        // again); Python counts the len + 1 places between characters.
        if let (Some(s), "count", [what]) = (value.as_str(), method, args) {
            if what.as_str() == Some("") {
                return Ok(minijinja::Value::from(s.chars().count() + 1));
            }
        }
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_function("strftime_now", strftime_now);
    env.add_filter("tojson", super::pyjson::tojson);
    env.add_template("chat", template)
        .map_err(|e| Error::Tokenizer(format!("the chat template does not parse: {e}")))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| Error::Tokenizer(e.to_string()))?;
    // minijinja panics on some expressions (`'{:.70000f}'.format(x)`, as Rust caps format precision at 65535;
    // `''[::-1]`, which indexes an empty string): a template from a model file that does that is a bad template, not
    // a crash. (The environment is dropped right after, so no state a panic interrupted is seen again.)
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token.unwrap_or(""),
            eos_token => eos_token.unwrap_or(""),
            // transformers always passes these (as None): `tools is defined` holds there.
            tools => minijinja::Value::from(()),
            documents => minijinja::Value::from(()),
        })
    }))
    .map_err(|_| {
        Error::Tokenizer("the chat template failed to render: it crashed the renderer".into())
    })?
    .map_err(|e| Error::Tokenizer(format!("the chat template failed to render: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `tokenizer_config.json` as transformers reads it: named templates pick `default`; special tokens and
    /// templates of the wrong type, and a file that is no object, are refused naming the key.
    #[test]
    fn tokenizer_config_values_follow_transformers() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models/tiny-llama");
        std::fs::copy(
            tiny.join("tokenizer.json"),
            dir.path().join("tokenizer.json"),
        )
        .unwrap();
        let load = |config: &str| {
            std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
            TextTokenizer::from_folder(dir.path()).map_err(|e| e.to_string())
        };
        let named = r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
                        "eos_token": {"content": "</s>", "lstrip": false}}"#;
        let t = load(named).unwrap();
        assert_eq!(t.chat_template.as_deref(), Some("D"));
        assert_eq!(t.eos_token.as_deref(), Some("</s>"));
        for (config, says) in [
            (
                r#"{"chat_template": [{"name": "tool_use", "template": "T"}]}"#,
                "none named `default`",
            ),
            (
                r#"{"chat_template": [{"name": "default"}]}"#,
                "`chat_template[0]` must be an object",
            ),
            (
                r#"{"chat_template": {"a": 1}}"#,
                "`chat_template` = {\"a\":1}",
            ),
            (r#"{"bos_token": ["<s>"]}"#, "`bos_token` = [\"<s>\"]"),
            (
                r#"{"eos_token": {"text": "</s>"}}"#,
                "`eos_token` = {\"text\":\"</s>\"}",
            ),
            ("\"text\"", "must be a JSON object"),
        ] {
            let err = load(config).err().unwrap();
            assert!(
                err.contains("tokenizer_config.json") && err.contains(says),
                "{err}"
            );
        }
    }

    #[test]
    fn renders_a_chatml_template() {
        let t = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let msgs = [ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
        }];
        let out = render_chat_template(t, &msgs, true, None, None).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = "{{ raise_exception('only user and assistant roles') }}";
        let err = render_chat_template(t, &[], false, None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("only user and assistant roles"), "{err}");
    }

    #[test]
    fn strftime_now_formats_the_local_date_like_python() {
        // Llama 3.x: `{%- set date_string = strftime_now("%d %b %Y") %}` -> e.g. "09 Mar 2025" (it was "" here).
        let date =
            render_chat_template("{{ strftime_now('%d %b %Y') }}", &[], false, None, None).unwrap();
        let shape: String = date
            .chars()
            .map(|c| {
                if c.is_ascii_digit() {
                    '0'
                } else if c.is_ascii_alphabetic() {
                    'a'
                } else {
                    c
                }
            })
            .collect();
        assert_eq!(shape, "00 aaa 0000", "{date:?}");
        let t = "{{ strftime_now('%Y') }}|{{ strftime_now('') }}|{{ strftime_now('100%% plain') }}";
        let out = render_chat_template(t, &[], false, None, None).unwrap();
        let (year, rest) = out.split_once('|').unwrap();
        assert!(
            year.len() == 4 && year.parse::<u32>().unwrap() >= 2024,
            "{out:?}"
        );
        assert_eq!(rest, "|100% plain");
    }

    #[test]
    fn a_runaway_template_is_an_error_not_a_hang() {
        let t = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}";
        let err = render_chat_template(t, &[], false, None, None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("fuel"), "{err}");
    }
}
