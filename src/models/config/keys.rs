//! The keys of a Hugging Face `config.json` this crate reads ([`HfConfig`]), as the file has them — defaults are
//! applied by the configuration and its family — and the errors that name a value of the file.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The keys of a `config.json` this crate reads (the others are ignored; `null` is "not set"). Which ones a family
/// reads, and their defaults, are its own (`family`).
#[derive(Deserialize)]
pub struct HfConfig {
    /// The family's name (`llama`, `qwen2_moe`, …).
    pub model_type: String,
    /// Vocabulary size.
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// MLP width (Mixtral's and gpt-oss's experts' too).
    pub intermediate_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads.
    pub num_key_value_heads: Option<usize>,
    /// Per-head width.
    pub head_dim: Option<usize>,
    /// RMSNorm epsilon.
    pub rms_norm_eps: Option<f64>,
    /// Longest sequence.
    pub max_position_embeddings: usize,
    /// The output head shares the embedding matrix.
    pub tie_word_embeddings: Option<bool>,
    /// Attention projections carry biases.
    pub attention_bias: Option<bool>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token(s).
    pub eos_token_id: Option<TokenIds>,
    /// The MLP's activation (most families).
    pub hidden_act: Option<String>,
    /// The MLP's activation (Gemma).
    pub hidden_activation: Option<String>,
    /// Keys a sliding-window layer sees.
    pub sliding_window: Option<usize>,
    /// Qwen: whether `sliding_window` applies.
    pub use_sliding_window: Option<bool>,
    /// Qwen: the layers from which (Qwen2-MoE: below which) layers slide.
    pub max_window_layers: Option<usize>,
    /// Gemma 3 (transformers 4): every this-many-th layer is a full one.
    pub sliding_window_pattern: Option<usize>,
    /// Each layer's attention kind.
    pub layer_types: Option<Vec<String>>,
    /// Gemma: scores scale by `query_pre_attn_scalar^-½`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 2: the cap of attention scores.
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma 2: the cap of output logits.
    pub final_logit_softcapping: Option<f64>,
    /// Qwen2-MoE: q/k/v projections carry biases.
    pub qkv_bias: Option<bool>,
    /// Experts per sparse layer (Mixtral, gpt-oss).
    pub num_local_experts: Option<usize>,
    /// Experts per sparse layer (Qwen-MoE).
    pub num_experts: Option<usize>,
    /// Experts each token goes to.
    pub num_experts_per_tok: Option<usize>,
    /// Each expert's MLP width (Qwen-MoE).
    pub moe_intermediate_size: Option<usize>,
    /// Qwen2-MoE: the shared expert's MLP width.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Qwen-MoE: the chosen experts' probabilities are renormalized.
    pub norm_topk_prob: Option<bool>,
    /// Qwen-MoE: only every this-many-th layer is sparse.
    pub decoder_sparse_step: Option<usize>,
    /// Qwen-MoE: layers that stay dense.
    pub mlp_only_layers: Option<Vec<usize>>,
    /// The auxiliary load-balancing loss's weight.
    pub router_aux_loss_coef: Option<f64>,
    /// Whether training adds the auxiliary loss.
    pub output_router_logits: Option<bool>,
    /// gpt-oss: the clamped SwiGLU's `alpha`.
    pub swiglu_alpha: Option<f64>,
    /// gpt-oss: the clamped SwiGLU's `limit`.
    pub swiglu_limit: Option<f64>,
}

/// One token id or several (`eos_token_id`).
#[derive(Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// The ids as a list.
    pub fn into_vec(self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![id],
            TokenIds::Many(ids) => ids,
        }
    }
}

/// The error of a configuration file `path`: `reason` says which value and what to do.
pub(super) fn bad(path: &Path, reason: String) -> Error {
    Error::invalid_file(path, reason)
}

/// A positive finite value, or an error naming `key`.
pub(super) fn positive(value: Option<f64>, key: &str, path: &Path) -> Result<Option<f64>> {
    match value {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(bad(
            path,
            format!("`{key}` must be a positive number, not {v}"),
        )),
        v => Ok(v),
    }
}
