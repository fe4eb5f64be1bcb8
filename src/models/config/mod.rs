//! One `ModelConfig` for every family, read from a Hugging Face `config.json` (`json`) or from GGUF metadata
//! (`gguf`), checked (`validate`). What sets a family apart is its own file in [`family`], behind the [`Family`]
//! interface; the keys of `config.json` are in `keys`, each layer's attention and experts in `layers`.

pub mod family;
mod gguf;
mod json;
mod keys;
mod layers;
pub(crate) mod validate;

pub use family::{
    supported_model_types, Architecture, Family, GgufExperts, HubExperts, WindowKeys,
};
pub use keys::{HfConfig, TokenIds};
pub use layers::{LayerAttention, MoeConfig};

use crate::ops::rope::RopeScaling;
use crate::ops::GateActivation;

/// Everything the model needs to know about its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The family: what sets it apart from Llama ([`Family`]).
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
    /// Per-head width (independent of `hidden_size / heads` in Qwen3 and Gemma).
    pub head_dim: usize,
    /// Leading dimensions of each head that RoPE rotates (`head_dim · partial_rotary_factor`).
    pub rotary_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base (of the full-attention layers, where the sliding ones differ).
    pub rope_theta: f64,
    /// RoPE scaling (of the full-attention layers), if any.
    pub rope_scaling: Option<RopeScaling>,
    /// The sliding-window layers' own RoPE base, unscaled (Gemma 3's `rope_local_base_freq`); `None`: the same
    /// RoPE as the full layers.
    pub sliding_rope_theta: Option<f64>,
    /// Longest sequence the position tables cover.
    pub max_position_embeddings: usize,
    /// The output head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2; gpt-oss's output projection too).
    pub attention_bias: bool,
    /// The gated MLP's activation.
    pub activation: GateActivation,
    /// Each layer's attention kind (`layer_types`).
    pub layer_types: Vec<LayerAttention>,
    /// Keys a sliding-window layer sees, the query's own included; `None`: sliding layers see everything.
    pub sliding_window: Option<usize>,
    /// Attention scores are scaled by `query_pre_attn_scalar^-½` instead of `head_dim^-½` (Gemma).
    pub query_pre_attn_scalar: Option<f64>,
    /// Attention scores become `cap·tanh(score/cap)` (Gemma 2).
    pub attn_logit_softcapping: Option<f64>,
    /// Output logits become `cap·tanh(logit/cap)` (Gemma 2).
    pub final_logit_softcapping: Option<f64>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens (generation stops at any).
    pub eos_token_ids: Vec<u32>,
    /// The mixture of experts, for Mixtral and Qwen2/3-MoE.
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    /// The attention score scale.
    pub fn attention_scale(&self) -> f64 {
        1.0 / self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .sqrt()
    }

    /// The factor token embeddings are multiplied by before the first layer (Gemma's `√hidden`), if any.
    pub fn embedding_multiplier(&self) -> Option<f64> {
        self.architecture
            .scales_embeddings()
            .then(|| (self.hidden_size as f64).sqrt())
    }

    /// The sliding window of layer `layer`, if it has one.
    pub fn window_of(&self, layer: usize) -> Option<usize> {
        match self.layer_types.get(layer) {
            Some(LayerAttention::Sliding) => self.sliding_window,
            _ => None,
        }
    }

    /// Output size of the query projection.
    pub fn q_width(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Output size of the key and of the value projection.
    pub fn kv_width(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The linear modules of decoder layer `layer`, relative to it (`self_attn.q_proj`, ...), with their
    /// `[out, in]` shapes, in transformers' order. A sparse layer's are its router (`mlp.gate`), each expert's fused
    /// gate/up and down projections (`mlp.experts.{e}.gate_up_proj`, `mlp.experts.{e}.down_proj`, as transformers
    /// 5 holds them), and Qwen2-MoE's shared expert and its gate.
    pub fn layer_linears(&self, layer: usize) -> Vec<(String, [usize; 2])> {
        let (h, i, q, kv) = (
            self.hidden_size,
            self.intermediate_size,
            self.q_width(),
            self.kv_width(),
        );
        let named = |list: &[(&str, [usize; 2])]| -> Vec<(String, [usize; 2])> {
            list.iter().map(|(n, s)| (n.to_string(), *s)).collect()
        };
        if self.architecture.has_fused_projections() {
            return named(&[
                ("self_attn.qkv_proj", [q + 2 * kv, h]),
                ("self_attn.o_proj", [h, q]),
                ("mlp.gate_up_proj", [2 * i, h]),
                ("mlp.down_proj", [h, i]),
            ]);
        }
        let mut out = named(&[
            ("self_attn.q_proj", [q, h]),
            ("self_attn.k_proj", [kv, h]),
            ("self_attn.v_proj", [kv, h]),
            ("self_attn.o_proj", [h, q]),
        ]);
        let mlp = |prefix: &str, width: usize| {
            [
                (format!("{prefix}.gate_proj"), [width, h]),
                (format!("{prefix}.up_proj"), [width, h]),
                (format!("{prefix}.down_proj"), [h, width]),
            ]
        };
        match self
            .moe
            .as_ref()
            .filter(|m| m.sparse_layers.get(layer) == Some(&true))
        {
            None => out.extend(mlp("mlp", i)),
            Some(moe) => {
                let e = moe.moe_intermediate_size;
                out.push((self.architecture.router_name().into(), [moe.num_experts, h]));
                for x in 0..moe.num_experts {
                    out.push((format!("mlp.experts.{x}.gate_up_proj"), [2 * e, h]));
                    out.push((format!("mlp.experts.{x}.down_proj"), [h, e]));
                }
                if let Some(width) = moe.shared_expert_intermediate_size {
                    out.extend(mlp("mlp.shared_expert", width));
                    out.push(("mlp.shared_expert_gate".into(), [1, h]));
                }
            }
        }
        out
    }
}
