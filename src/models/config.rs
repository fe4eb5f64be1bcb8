//! One `ModelConfig` for the Llama family, read from a Hugging Face `config.json` or from GGUF metadata.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::Deserialize;
use serde_json::Value;

use crate::error::{at_key, Error, Result};
use crate::files::read_json;
use crate::ops::rope::Llama3RopeScaling;

/// The architectures this implementation covers (family differences are configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3/3.1/3.2, SmolLM2, TinyLlama (`model_type = "llama"`).
    Llama,
    /// Mistral (`model_type = "mistral"`).
    Mistral,
    /// Qwen2 / Qwen2.5 (`model_type = "qwen2"`): q/k/v projections have biases.
    Qwen2,
}

/// The supported `model_type` values, for error messages.
pub const SUPPORTED_MODEL_TYPES: &str =
    "llama (Llama 2/3/3.1/3.2, SmolLM2, TinyLlama), mistral, qwen2";

impl Architecture {
    /// From a `model_type` (HF) or `general.architecture` (GGUF).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Architecture::Llama),
            "mistral" => Some(Architecture::Mistral),
            "qwen2" => Some(Architecture::Qwen2),
            _ => None,
        }
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
        }
    }
}

/// Everything the model needs to know about its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Family.
    pub architecture: Architecture,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than the query heads).
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// Llama-3 RoPE scaling, if any.
    pub rope_scaling: Option<Llama3RopeScaling>,
    /// Longest sequence the position tables cover.
    pub max_position_embeddings: usize,
    /// The output head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2).
    pub attention_bias: bool,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (generation stops at any).
    pub eos_token_ids: Vec<u32>,
}

/// The largest vocabulary, width, head count or context a config may declare (real models stay far below).
const MAX_SIZE: usize = 1 << 24;
/// The most decoder layers a config may declare (models have at most a few hundred).
const MAX_LAYERS: usize = 1 << 12;
/// The most entries (`max_position_embeddings × head_dim`) of each RoPE table, float32: 2 GiB for cos and sin each.
const MAX_ROPE_ENTRIES: usize = 1 << 29;

fn bad(path: &Path, reason: String) -> Error {
    Error::invalid_file(path, reason)
}

/// The keys of a Hugging Face `config.json` this crate reads (the others are ignored; `null` is "not set").
#[derive(Deserialize)]
struct HfConfig {
    model_type: String,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f64>,
    max_position_embeddings: usize,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

/// One token id or several (`eos_token_id`).
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![id],
            TokenIds::Many(ids) => ids,
        }
    }
}

fn opt_f64(obj: &Value, key: &str, path: &Path) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| bad(path, format!("`{key}` must be a number"))),
    }
}

/// Reads RoPE settings from `rope_theta`/`rope_scaling` (transformers 4.x) or `rope_parameters` (5.x).
fn rope_settings(obj: &Value, path: &Path) -> Result<(f64, Option<Llama3RopeScaling>)> {
    let params = obj.get("rope_parameters").filter(|v| v.is_object());
    let theta = match opt_f64(obj, "rope_theta", path)? {
        Some(t) => t,
        None => params
            .map(|p| opt_f64(p, "rope_theta", path))
            .transpose()?
            .flatten()
            .unwrap_or(10_000.0),
    };
    let scaling = obj.get("rope_scaling").filter(|v| v.is_object()).or(params);
    let Some(scaling) = scaling else {
        return Ok((theta, None));
    };
    let rope_type = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match rope_type {
        "default" => Ok((theta, None)),
        "llama3" => {
            let s: Llama3RopeScaling = serde_json::from_value(scaling.clone())
                .map_err(|e| bad(path, format!("`rope_scaling` of type llama3 is incomplete: {e}")))?;
            Ok((theta, Some(s)))
        }
        other => Err(bad(
            path,
            format!("rope scaling type `{other}` is not supported (supported: default, llama3); remove it to use plain RoPE"),
        )),
    }
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_config_file(path: &Path) -> Result<Self> {
        Self::from_hf_config(&read_json::<Value>(path)?, path)
    }

    /// Parses a `config.json` object; `path` names it in errors.
    pub fn from_hf_config(obj: &Value, path: &Path) -> Result<Self> {
        let hf: HfConfig =
            serde_path_to_error::deserialize(obj).map_err(|e| bad(path, at_key(e)))?;
        let architecture = Architecture::parse(&hf.model_type).ok_or_else(|| {
            bad(
                path,
                format!(
                    "model_type `{}` is not supported; supported: {SUPPORTED_MODEL_TYPES}",
                    hf.model_type
                ),
            )
        })?;
        let (rope_theta, rope_scaling) = rope_settings(obj, path)?;
        let config = ModelConfig {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            attention_bias: architecture == Architecture::Qwen2
                || hf.attention_bias.unwrap_or(false),
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
        };
        config.validate(path)?;
        Ok(config)
    }

    /// Reads the `<arch>.*` metadata of a GGUF file. `has_output` says whether the file has `output.weight`
    /// (otherwise the head is tied to the embeddings).
    pub fn from_gguf(content: &gguf_file::Content, path: &Path, has_output: bool) -> Result<Self> {
        let md = &content.metadata;
        let arch_name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| {
                bad(
                    path,
                    "GGUF metadata `general.architecture` is missing".into(),
                )
            })?
            .clone();
        let architecture = Architecture::parse(&arch_name).ok_or_else(|| {
            bad(path, format!("GGUF architecture `{arch_name}` is not supported; supported: {SUPPORTED_MODEL_TYPES}"))
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        let get_u = |k: &str| -> Result<usize> {
            md.get(&key(k))
                .ok_or_else(|| bad(path, format!("GGUF metadata `{}` is missing", key(k))))?
                .to_u64()
                .map(|v| v as usize)
                .map_err(|_| {
                    bad(
                        path,
                        format!("GGUF metadata `{}` is not an integer", key(k)),
                    )
                })
        };
        let get_f = |k: &str| -> Option<f64> {
            md.get(&key(k))
                .and_then(|v| v.to_f32().ok())
                .map(|v| v as f64)
        };
        let hidden_size = get_u("embedding_length")?;
        let num_attention_heads = get_u("attention.head_count")?;
        let vocab_size = match get_u("vocab_size") {
            Ok(v) => v,
            Err(_) => md
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.len())
                .ok_or_else(|| {
                    bad(
                        path,
                        "neither `vocab_size` nor `tokenizer.ggml.tokens` is in the GGUF metadata"
                            .into(),
                    )
                })?,
        };
        let head_dim =
            get_u("rope.dimension_count").unwrap_or(hidden_size / num_attention_heads.max(1));
        let u32_key = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        let config = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: get_u("feed_forward_length")?,
            num_hidden_layers: get_u("block_count")?,
            num_attention_heads,
            num_key_value_heads: get_u("attention.head_count_kv").unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: get_f("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling: None,
            max_position_embeddings: get_u("context_length")?,
            tie_word_embeddings: !has_output,
            attention_bias: architecture == Architecture::Qwen2,
            bos_token_id: u32_key("tokenizer.ggml.bos_token_id"),
            eos_token_ids: u32_key("tokenizer.ggml.eos_token_id").into_iter().collect(),
        };
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || self.num_attention_heads % self.num_key_value_heads != 0
        {
            return Err(bad(
                path,
                format!(
                    "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if self.head_dim == 0
            || self.head_dim % 2 != 0
            || self.hidden_size == 0
            || self.vocab_size == 0
        {
            return Err(bad(
                path,
                format!(
                    "inconsistent sizes: head_dim {} (must be even and positive), hidden_size {}, vocab_size {}",
                    self.head_dim, self.hidden_size, self.vocab_size
                ),
            ));
        }
        // Sizes no model has are a damaged file: refuse them before anything is computed or allocated from them.
        let sizes = [
            ("vocab_size", self.vocab_size, MAX_SIZE),
            ("hidden_size", self.hidden_size, MAX_SIZE),
            ("intermediate_size", self.intermediate_size, MAX_SIZE),
            ("num_attention_heads", self.num_attention_heads, MAX_SIZE),
            ("head_dim", self.head_dim, MAX_SIZE),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_SIZE,
            ),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
        ];
        if let Some((key, value, max)) = sizes.iter().find(|(_, v, max)| v > max) {
            return Err(bad(
                path,
                format!("{key} = {value} is more than any model has (at most {max}); the file is damaged"),
            ));
        }
        // The RoPE tables are built for every position up front.
        let rope_entries = self.max_position_embeddings * self.head_dim;
        if rope_entries > MAX_ROPE_ENTRIES {
            return Err(bad(
                path,
                format!(
                    "max_position_embeddings {} × head_dim {} = {rope_entries} RoPE table entries, more than {MAX_ROPE_ENTRIES} \
                     (4 GiB of tables); lower max_position_embeddings",
                    self.max_position_embeddings, self.head_dim
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_hf_config(&v, Path::new("config.json"))
    }

    fn llama() -> Value {
        json!({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": [1, 2]})
    }

    #[test]
    fn reads_llama_and_defaults() {
        let c = parse(llama()).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert!(!c.attention_bias && !c.tie_word_embeddings);
    }

    #[test]
    fn reads_rope_parameters_of_transformers_5() {
        let mut v = llama();
        v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = parse(v).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert_eq!(c.rope_scaling.unwrap().factor, 8.0);
    }

    #[test]
    fn errors_name_the_key_and_list_supported_types() {
        let mut v = llama();
        v.as_object_mut().unwrap().remove("hidden_size");
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains("missing field `hidden_size`"),
            "{err}"
        );
        let mut v = llama();
        v["model_type"] = json!("gpt2");
        let err = parse(v).unwrap_err().to_string();
        assert!(err.contains("gpt2") && err.contains("qwen2"), "{err}");
        let mut v = llama();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        assert!(parse(v).unwrap_err().to_string().contains("yarn"));
    }
}
