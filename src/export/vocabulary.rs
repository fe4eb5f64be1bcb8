//! The tokenizer as llama.cpp's converter writes it into a GGUF file (`tokenizer.ggml.*`): a GPT-2 style
//! byte-level BPE vocabulary from `tokenizer.json` (tokens, token types, merges, the pre-tokenizer's name), or a
//! SentencePiece vocabulary from `tokenizer.model` (tokens, scores, token types: Llama 2's and Mistral's), then the
//! special tokens' ids, whether they are added, and the chat template.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value;

use crate::error::{Error, Result};
use crate::files::read_json;
use crate::models::{ModelConfig, TextTokenizer};

/// A metadata entry: key and value.
pub(super) type Entry = (String, Value);

/// A metadata entry.
pub(super) fn entry(key: impl Into<String>, value: Value) -> Entry {
    (key.into(), value)
}

/// llama.cpp's token types (SentencePiece's).
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// The special tokens the converter looks up, with their keys' names in `tokenizer.ggml.*`.
const SPECIAL_TOKENS: [(&str, &str); 7] = [
    ("bos", "bos"),
    ("eos", "eos"),
    ("unk", "unknown"),
    ("sep", "seperator"),
    ("pad", "padding"),
    ("cls", "cls"),
    ("mask", "mask"),
];

/// The `tokenizer.*` keys for a folder's tokenizer, as the converter writes them for `arch`: Llama's
/// `add_space_prefix` (from `tokenizer_config.json`) first; the vocabulary — SentencePiece's from `tokenizer.model`
/// where a Llama has one ([`sentencepiece_vocabulary`]), else GPT-2 style from `tokenizer.json`
/// ([`byte_level_vocabulary`]); then the special tokens' ids (`tokenizer_config.json`, else `config.json`), whether
/// they are added (`add_bos_token`, or the post-processor's templates), and the chat template.
pub(super) fn tokenizer_metadata(
    folder: &Path,
    config: &ModelConfig,
    arch: &str,
    given_pre: Option<&str>,
) -> Result<Vec<Entry>> {
    let path = folder.join("tokenizer.json");
    if !path.exists() {
        return Err(Error::invalid_file(
            &path,
            "is missing: llama.cpp needs the tokenizer in the GGUF file",
        ));
    }
    let json: serde_json::Value = read_json(&path)?;
    let tokenizer_config =
        read_json::<serde_json::Value>(&folder.join("tokenizer_config.json")).ok();
    let mut out = Vec::new();
    if arch == "llama" {
        if let Some(add) = tokenizer_config
            .as_ref()
            .and_then(|c| c["add_prefix_space"].as_bool())
        {
            out.push(entry("tokenizer.ggml.add_space_prefix", Value::Bool(add)));
        }
    }
    let sentencepiece = folder.join("tokenizer.model");
    match arch == "llama" && sentencepiece.exists() {
        true => out.extend(sentencepiece_vocabulary(
            &sentencepiece,
            config.vocab_size,
            tokenizer_config.as_ref(),
        )?),
        false => out.extend(byte_level_vocabulary(
            &path, &json, config, arch, given_pre,
        )?),
    }
    let tokenizer = TextTokenizer::from_folder(folder)?;
    let model_config = read_json::<serde_json::Value>(&folder.join("config.json")).ok();
    let mut texts: HashMap<&str, String> = HashMap::new();
    for (kind, key) in SPECIAL_TOKENS {
        let text = tokenizer_config
            .as_ref()
            .and_then(|c| special_text(&c[format!("{kind}_token")]));
        let id = text
            .as_deref()
            .and_then(|t| tokenizer.token_to_id(t))
            .or_else(|| {
                model_config
                    .as_ref()
                    .and_then(|c| c[format!("{kind}_token_id")].as_u64())
                    .map(|i| i as u32)
            });
        if let Some(text) = text {
            texts.insert(kind, text);
        }
        if let Some(id) = id {
            out.push(entry(
                format!("tokenizer.ggml.{key}_token_id"),
                Value::U32(id),
            ));
        }
    }
    for (kind, added) in
        added_special_tokens(&json["post_processor"], tokenizer_config.as_ref(), &texts)
    {
        out.push(entry(
            format!("tokenizer.ggml.add_{kind}_token"),
            Value::Bool(added),
        ));
    }
    if let Some(template) = &tokenizer.chat_template {
        out.push(entry(
            "tokenizer.chat_template",
            Value::String(template.clone()),
        ));
    }
    if arch == "llama" && config.vocab_size == 49_152 {
        // The converter's rule for Granite's small models, which their vocabulary size names (SmolLM's too): no
        // beginning-of-sequence token, the key's value replaced where it is.
        let no_bos = entry("tokenizer.ggml.add_bos_token", Value::Bool(false));
        match out.iter_mut().find(|(k, _)| k == &no_bos.0) {
            Some(existing) => *existing = no_bos,
            None => out.push(no_bos),
        }
    }
    Ok(out)
}

/// A GPT-2 style vocabulary (`tokenizer.ggml.model = gpt2`) from `tokenizer.json` at `path`: every id below the
/// config's vocabulary size (`[PAD<id>]` where the tokenizer has none), added tokens as control tokens (special,
/// or looking special: `<|…|>`) or user-defined ones, the pre-tokenizer's name and the merges. A SentencePiece-style
/// one (Unigram, or BPE with byte fallback) is refused, naming what to do for `arch`.
fn byte_level_vocabulary(
    path: &Path,
    json: &serde_json::Value,
    config: &ModelConfig,
    arch: &str,
    given_pre: Option<&str>,
) -> Result<Vec<Entry>> {
    let model = &json["model"];
    if model["type"] == "Unigram" || model["byte_fallback"] == true {
        let what_to_do = match arch {
            "llama" => "copy the model's tokenizer.model, from which llama.cpp's converter reads it, into the folder",
            _ => "it is written from a Llama folder's tokenizer.model only so far; export the adapter alone \
                  (--adapter-only) for a GGUF of the base converted by llama.cpp",
        };
        return Err(Error::invalid_file(
            path,
            format!(
                "a SentencePiece-style tokenizer (Unigram, or BPE with byte fallback), which llama.cpp keeps as its \
                 `llama` vocabulary with scores: {what_to_do}"
            ),
        ));
    }
    let pre = match (given_pre, pre_tokenizer_name(&json["pre_tokenizer"])) {
        (Some(given), _) => given.to_string(),
        (None, Some(known)) => known.to_string(),
        (None, None) => {
            return Err(Error::invalid_file(
                path,
                format!(
                    "its pre-tokenizer {} is not one llama.cpp is known to name (Llama 3's, Qwen 2's, GPT-2's, \
                     SmolLM's): name llama.cpp's for it (--tokenizer-pre, e.g. `default`)",
                    json["pre_tokenizer"]
                ),
            ))
        }
    };
    let mut tokens: Vec<Option<(String, i32)>> = vec![None; config.vocab_size];
    for (token, id) in model["vocab"].as_object().into_iter().flatten() {
        if let Some(slot) = id.as_u64().and_then(|i| tokens.get_mut(i as usize)) {
            *slot = Some((token.clone(), NORMAL));
        }
    }
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else {
            continue;
        };
        if let Some(slot) = tokens.get_mut(id as usize) {
            *slot = Some(match added["special"] == true || looks_special(content) {
                true => (content.to_string(), CONTROL),
                // User-defined spaces are pre-normalized for llama.cpp (Gemma's `▁`).
                false => (content.replace('\u{2581}', " "), USER_DEFINED),
            });
        }
    }
    let (names, types): (Vec<Value>, Vec<Value>) = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            let (name, kind) = t.unwrap_or_else(|| (format!("[PAD{i}]"), UNUSED));
            (Value::String(name), Value::I32(kind))
        })
        .unzip();
    let mut out = vec![
        entry("tokenizer.ggml.model", Value::String("gpt2".into())),
        entry("tokenizer.ggml.pre", Value::String(pre)),
        entry("tokenizer.ggml.tokens", Value::Array(names)),
        entry("tokenizer.ggml.token_type", Value::Array(types)),
    ];
    let merges: Vec<Value> = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(pair) => Some(
                pair.iter()
                    .filter_map(|p| p.as_str())
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
            _ => None,
        })
        .map(Value::String)
        .collect();
    if !merges.is_empty() {
        out.push(entry("tokenizer.ggml.merges", Value::Array(merges)));
    }
    Ok(out)
}

/// A SentencePiece vocabulary (`tokenizer.ggml.model = llama`) as the converter reads it from `tokenizer.model`
/// (at `path`): every piece's text, score and type (unknown, control, unused and byte pieces keep theirs; normal and
/// user-defined ones are normal), ids up to `vocab_size` (`[PAD<id>]`, score −10000, unused beyond the model's);
/// then the tokens of `added_tokens.json` (user-defined, score −1000) and `tokenizer_config.json`'s
/// `added_tokens_decoder` (control where special or looking special, else user-defined; score −1000).
fn sentencepiece_vocabulary(
    path: &Path,
    vocab_size: usize,
    tokenizer_config: Option<&serde_json::Value>,
) -> Result<Vec<Entry>> {
    let bytes = std::fs::read(path).map_err(|e| Error::io("cannot read", path, e))?;
    let pieces = sentencepiece_pieces(&bytes).map_err(|reason| {
        Error::invalid_file(path, format!("not a SentencePiece model: {reason}"))
    })?;
    let mut tokens: Vec<(String, f32, i32)> = (0..vocab_size)
        .map(|i| (format!("[PAD{i}]"), -10000.0, UNUSED))
        .collect();
    for (slot, (piece, score, kind)) in tokens.iter_mut().zip(pieces) {
        let kind = match kind {
            UNKNOWN | CONTROL | UNUSED | BYTE => kind,
            _ => NORMAL,
        };
        *slot = (piece, score, kind);
    }
    let folder = path.parent().unwrap_or(Path::new("."));
    let added_file = folder.join("added_tokens.json");
    if added_file.exists() {
        let added: serde_json::Map<String, serde_json::Value> = read_json(&added_file)?;
        for (text, id) in added {
            if let Some(slot) = id.as_u64().and_then(|i| tokens.get_mut(i as usize)) {
                *slot = (text, -1000.0, USER_DEFINED);
            }
        }
    }
    let decoder = tokenizer_config.and_then(|c| c["added_tokens_decoder"].as_object());
    for (id, token) in decoder.into_iter().flatten() {
        let (Some(slot), Some(content)) = (
            id.parse::<usize>().ok().and_then(|i| tokens.get_mut(i)),
            token["content"].as_str(),
        ) else {
            continue;
        };
        *slot = match token["special"] == true || looks_special(content) {
            true => (content.to_string(), -1000.0, CONTROL),
            // User-defined spaces are pre-normalized for llama.cpp.
            false => (content.replace('\u{2581}', " "), -1000.0, USER_DEFINED),
        };
    }
    let mut names = Vec::with_capacity(vocab_size);
    let mut scores = Vec::with_capacity(vocab_size);
    let mut types = Vec::with_capacity(vocab_size);
    for (name, score, kind) in tokens {
        names.push(Value::String(name));
        scores.push(Value::F32(score));
        types.push(Value::I32(kind));
    }
    Ok(vec![
        entry("tokenizer.ggml.model", Value::String("llama".into())),
        entry("tokenizer.ggml.pre", Value::String("default".into())),
        entry("tokenizer.ggml.tokens", Value::Array(names)),
        entry("tokenizer.ggml.scores", Value::Array(scores)),
        entry("tokenizer.ggml.token_type", Value::Array(types)),
    ])
}

/// The pieces of a SentencePiece `ModelProto` (protobuf): field 1, each a message of its text (field 1), score
/// (field 2, a float) and type (field 3; normal when absent). The other fields are skipped.
fn sentencepiece_pieces(bytes: &[u8]) -> std::result::Result<Vec<(String, f32, i32)>, String> {
    let mut pieces = Vec::new();
    for field in ProtoFields::new(bytes) {
        if let (1, ProtoValue::Bytes(message)) = field? {
            let (mut text, mut score, mut kind) = (String::new(), 0f32, NORMAL);
            for inner in ProtoFields::new(message) {
                match inner? {
                    (1, ProtoValue::Bytes(b)) => {
                        text = String::from_utf8(b.to_vec())
                            .map_err(|_| format!("piece {} is not UTF-8", pieces.len()))?
                    }
                    (2, ProtoValue::Fixed32(bits)) => score = f32::from_bits(bits),
                    (3, ProtoValue::Varint(v)) => kind = v as i32,
                    _ => {}
                }
            }
            pieces.push((text, score, kind));
        }
    }
    if pieces.is_empty() {
        return Err("it holds no pieces".into());
    }
    Ok(pieces)
}

/// A protobuf field's value, by wire type.
enum ProtoValue<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32(u32),
}

/// The fields of a protobuf message, in order: `(number, value)`.
struct ProtoFields<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> ProtoFields<'a> {
    fn new(bytes: &'a [u8]) -> Self {
        ProtoFields { bytes, at: 0 }
    }

    fn varint(&mut self) -> std::result::Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .bytes
                .get(self.at)
                .ok_or("a number runs past the end")?;
            self.at += 1;
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("a number longer than 64 bits".into())
    }

    fn take(&mut self, n: usize) -> std::result::Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or("a field runs past the end")?;
        let taken = &self.bytes[self.at..end];
        self.at = end;
        Ok(taken)
    }
}

impl<'a> Iterator for ProtoFields<'a> {
    type Item = std::result::Result<(u64, ProtoValue<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.at >= self.bytes.len() {
            return None;
        }
        let field = (|| {
            let key = self.varint()?;
            let value = match key & 7 {
                0 => ProtoValue::Varint(self.varint()?),
                1 => {
                    self.take(8)?;
                    ProtoValue::Fixed64
                }
                2 => {
                    let n = self.varint()? as usize;
                    ProtoValue::Bytes(self.take(n)?)
                }
                5 => {
                    let b = self.take(4)?;
                    ProtoValue::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                }
                other => return Err(format!("unknown wire type {other}")),
            };
            Ok((key >> 3, value))
        })();
        if field.is_err() {
            // Nothing after a malformed field can be read.
            self.at = self.bytes.len();
        }
        Some(field)
    }
}

/// The text of a special token in `tokenizer_config.json`: a string, or an added token's `content`.
fn special_text(v: &serde_json::Value) -> Option<String> {
    v.as_str()
        .or_else(|| v["content"].as_str())
        .map(str::to_string)
}

/// Whether an added token not marked special is one all the same, by the converter's rule: `<|…|>`, `<｜…｜>`,
/// `<unused…>`, and a few models' own.
fn looks_special(token: &str) -> bool {
    matches!(token, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (token.starts_with("<|") && token.ends_with("|>"))
        || (token.starts_with("<｜") && token.ends_with("｜>"))
        || (token.starts_with("<unused") && token.ends_with('>'))
}

/// Whether the special tokens are added, as the converter (gguf-py's `SpecialVocab`) reads them from the
/// post-processors in order: a byte-level one adds neither beginning nor end (unless set already), RoBERTa's adds
/// both and a separator, a template adds what its single-sequence form starts and ends with and a separator when its
/// pair form puts one (or the end-of-sequence token) between `A` and `B`; `tokenizer_config.json`'s `add_*_token`
/// then decides what they left open.
fn added_special_tokens(
    post_processor: &serde_json::Value,
    tokenizer_config: Option<&serde_json::Value>,
    texts: &HashMap<&str, String>,
) -> Vec<(&'static str, bool)> {
    let mut added: Vec<(&'static str, bool)> = Vec::new();
    fn set(added: &mut Vec<(&'static str, bool)>, kind: &'static str, value: bool) {
        match added.iter_mut().find(|(k, _)| *k == kind) {
            Some(entry) => entry.1 = value,
            None => added.push((kind, value)),
        }
    }
    let processors = match post_processor["processors"].as_array() {
        Some(list) => list.iter().collect(),
        None => vec![post_processor],
    };
    let special =
        |item: &serde_json::Value| item["SpecialToken"]["id"].as_str().map(str::to_string);
    let sequence = |item: &serde_json::Value| item["Sequence"]["id"].as_str().map(str::to_string);
    for processor in processors {
        match processor["type"].as_str() {
            Some("ByteLevel") => {
                for kind in ["bos", "eos"] {
                    if !added.iter().any(|(k, _)| *k == kind) {
                        set(&mut added, kind, false);
                    }
                }
            }
            Some("RobertaProcessing") => ["bos", "eos", "sep"]
                .into_iter()
                .for_each(|k| set(&mut added, k, true)),
            Some("TemplateProcessing") => {
                let (mut first, mut last) = (None, None);
                if let Some(single) = processor["single"].as_array().filter(|s| s.len() > 1) {
                    let is = |kind: &str, text: &Option<String>| {
                        text.is_some()
                            && (texts.get(kind).is_none() || texts.get(kind) == text.as_ref())
                    };
                    first = special(&single[0]);
                    last = special(&single[single.len() - 1]);
                    if first.is_some() {
                        set(&mut added, "bos", is("bos", &first));
                    }
                    if last.is_some() {
                        set(&mut added, "eos", is("eos", &last));
                    }
                }
                if let Some(pair) = processor["pair"].as_array().filter(|p| !p.is_empty()) {
                    // The pair's items between the single template's leading and trailing special tokens: `A … B`.
                    let start = usize::from(first.is_some() && special(&pair[0]) == first);
                    let stop = pair.len()
                        - usize::from(last.is_some() && special(&pair[pair.len() - 1]) == last);
                    let inner = &pair[start..stop.max(start)];
                    let ends_are_a_b = inner.len() > 2
                        && sequence(&inner[0]).as_deref() == Some("A")
                        && sequence(&inner[inner.len() - 1]).as_deref() == Some("B");
                    if ends_are_a_b {
                        let middle = &inner[1..inner.len() - 1];
                        let separates = |item: &serde_json::Value| {
                            special(item).is_some_and(|t| {
                                texts.get("sep") == Some(&t) || texts.get("eos") == Some(&t)
                            })
                        };
                        let add_sep = (separates(&middle[0]) && last.is_none())
                            || (middle.len() == 2 && separates(&middle[1]));
                        set(&mut added, "sep", add_sep);
                    }
                }
            }
            _ => {}
        }
    }
    // `tokenizer_config.json` decides only what the post-processor leaves open.
    for (kind, _) in SPECIAL_TOKENS {
        let value = tokenizer_config.and_then(|c| c[format!("add_{kind}_token")].as_bool());
        if let Some(value) = value.filter(|_| !added.iter().any(|(k, _)| *k == kind)) {
            set(&mut added, kind, value);
        }
    }
    added
}

/// llama.cpp's name (`tokenizer.ggml.pre`) of a byte-level pre-tokenizer, from how it splits words: GPT-2's
/// (ByteLevel's own expression), Llama 3's or Qwen 2's (their expressions), or SmolLM's (digits one by one, then
/// GPT-2's).
fn pre_tokenizer_name(pre: &serde_json::Value) -> Option<&'static str> {
    const LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    let parts: Vec<&serde_json::Value> = match pre["type"].as_str()? {
        "Sequence" => pre["pretokenizers"].as_array()?.iter().collect(),
        _ => vec![pre],
    };
    let split = parts
        .iter()
        .find(|k| k["type"] == "Split")
        .and_then(|k| k["pattern"]["Regex"].as_str());
    let digits_alone = parts
        .iter()
        .any(|k| k["type"] == "Digits" && k["individual_digits"] == true);
    let byte_level_splits = parts
        .iter()
        .any(|k| k["type"] == "ByteLevel" && k["use_regex"] != false);
    match (split, digits_alone, byte_level_splits) {
        (Some(LLAMA3), false, false) => Some("llama-bpe"),
        (Some(QWEN2), false, false) => Some("qwen2"),
        (None, true, true) => Some("smollm"),
        (None, false, true) => Some("gpt-2"),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts() -> HashMap<&'static str, String> {
        HashMap::from([("bos", "<s>".to_string()), ("eos", "</s>".to_string())])
    }

    #[test]
    fn post_processors_decide_before_the_tokenizer_config() {
        let config = serde_json::json!({"add_bos_token": true, "add_eos_token": true, "add_sep_token": false});
        let byte_level = serde_json::json!({"type": "ByteLevel"});
        assert_eq!(
            added_special_tokens(&byte_level, Some(&config), &texts()),
            [("bos", false), ("eos", false), ("sep", false)]
        );
        let roberta = serde_json::json!({"type": "RobertaProcessing"});
        assert_eq!(
            added_special_tokens(&roberta, None, &texts()),
            [("bos", true), ("eos", true), ("sep", true)]
        );
        assert_eq!(
            added_special_tokens(&serde_json::Value::Null, Some(&config), &texts()),
            [("bos", true), ("eos", true), ("sep", false)]
        );
    }

    #[test]
    fn a_pair_template_names_the_separator() {
        let special = |t: &str| serde_json::json!({"SpecialToken": {"id": t, "type_id": 0}});
        let sequence = |s: &str| serde_json::json!({"Sequence": {"id": s, "type_id": 0}});
        // Llama's: `<s> A` and `<s> A <s> B`: the middle token is no separator.
        let llama = serde_json::json!({"type": "TemplateProcessing",
            "single": [special("<s>"), sequence("A")],
            "pair": [special("<s>"), sequence("A"), special("<s>"), sequence("B")]});
        assert_eq!(
            added_special_tokens(&llama, None, &texts()),
            [("bos", true), ("sep", false)]
        );
        // `<s> A` and `<s> A </s> B`: the end-of-sequence token separates.
        let separated = serde_json::json!({"type": "TemplateProcessing",
            "single": [special("<s>"), sequence("A")],
            "pair": [special("<s>"), sequence("A"), special("</s>"), sequence("B")]});
        assert_eq!(
            added_special_tokens(&separated, None, &texts()),
            [("bos", true), ("sep", true)]
        );
    }

    #[test]
    fn malformed_protobuf_is_an_error_not_a_panic() {
        assert!(sentencepiece_pieces(&[0x0a, 0x05, 0x0a]).is_err());
        assert!(sentencepiece_pieces(&[0xff; 11]).is_err());
        assert!(sentencepiece_pieces(&[]).is_err());
    }
}
