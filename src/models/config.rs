//! One `ModelConfig` for the Llama family, read from a Hugging Face `config.json` or from GGUF metadata.

use std::path::Path;

use candle_core::quantized::gguf_file;
use serde::Deserialize;
use serde_json::Value;

use crate::error::{at_key, Error, Result};
use crate::files::read_json;
use crate::ops::rope::{Llama3RopeScaling, LongRopeScaling, RopeScaling, YarnRopeScaling};
use crate::ops::{ClampedSwiglu, GateActivation};

/// The architectures this implementation covers (family differences are configuration).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// Llama 2/3/3.1/3.2, SmolLM2, TinyLlama (`model_type = "llama"`).
    Llama,
    /// Mistral (`model_type = "mistral"`), with its sliding window.
    Mistral,
    /// Qwen2 / Qwen2.5 (`model_type = "qwen2"`): q/k/v projections have biases.
    Qwen2,
    /// Qwen3 (`model_type = "qwen3"`): RMSNorm on each query and key head before RoPE.
    Qwen3,
    /// Gemma 2 (`model_type = "gemma2"`): `(1 + w)` norms around attention and MLP, GeGLU, scaled embeddings,
    /// soft-capped attention and output logits, sliding-window layers alternating with global ones.
    Gemma2,
    /// Gemma 3 text (`model_type = "gemma3_text"`): Gemma 2 with query/key norms instead of soft-capping and a
    /// separate RoPE base for its sliding-window layers.
    Gemma3,
    /// Phi-3 / Phi-3.5 / Phi-4-mini (`model_type = "phi3"`): fused `qkv_proj` and `gate_up_proj`, partial rotary,
    /// LongRoPE.
    Phi3,
    /// Mixtral (`model_type = "mixtral"`): Mistral with a sparse mixture of experts in every layer.
    Mixtral,
    /// Qwen1.5-MoE / Qwen2-MoE (`model_type = "qwen2_moe"`): Qwen2 with experts and a gated shared expert.
    Qwen2Moe,
    /// Qwen3-MoE (`model_type = "qwen3_moe"`, e.g. Qwen3-30B-A3B): Qwen3 with experts.
    Qwen3Moe,
    /// gpt-oss (`model_type = "gpt_oss"`): attention with biases and per-head sinks, sliding-window layers
    /// alternating with full ones, YaRN; experts with biases and a clamped SwiGLU behind a router with a bias.
    GptOss,
}

/// The supported `model_type` values, for error messages.
pub const SUPPORTED_MODEL_TYPES: &str =
    "llama (Llama 2/3/3.1/3.2, SmolLM2, TinyLlama), mistral, qwen2, qwen3, \
     gemma2, gemma3_text, phi3, mixtral, qwen2_moe, qwen3_moe, gpt_oss";

impl Architecture {
    /// From a `model_type` (HF) or `general.architecture` (GGUF).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Architecture::Llama),
            "mistral" => Some(Architecture::Mistral),
            "qwen2" => Some(Architecture::Qwen2),
            "qwen3" => Some(Architecture::Qwen3),
            "gemma2" => Some(Architecture::Gemma2),
            "gemma3_text" | "gemma3" => Some(Architecture::Gemma3),
            "phi3" => Some(Architecture::Phi3),
            "mixtral" => Some(Architecture::Mixtral),
            "qwen2_moe" => Some(Architecture::Qwen2Moe),
            "qwen3_moe" => Some(Architecture::Qwen3Moe),
            "gpt_oss" => Some(Architecture::GptOss),
            _ => None,
        }
    }

    /// The `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Phi3 => "phi3",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::GptOss => "gpt_oss",
        }
    }

    /// The RoPE base when a config gives none (transformers' defaults).
    pub fn default_rope_theta(self) -> f64 {
        match self {
            Architecture::Gemma3 | Architecture::Mixtral => 1_000_000.0,
            Architecture::GptOss => 150_000.0,
            _ => 10_000.0,
        }
    }

    /// The transformers class of a causal LM of this family (`architectures` in `config.json`).
    pub fn causal_lm_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Phi3 => "Phi3ForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen2Moe => "Qwen2MoeForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::GptOss => "GptOssForCausalLM",
        }
    }

    /// Gemma: norms compute `x̂·(1 + w)` and wrap both attention and MLP (`post_attention_layernorm`,
    /// `pre_feedforward_layernorm`, `post_feedforward_layernorm`), embeddings are scaled by `√hidden`.
    pub fn is_gemma(self) -> bool {
        matches!(self, Architecture::Gemma2 | Architecture::Gemma3)
    }

    /// Each query and key head is RMS-normed before RoPE (`q_norm`, `k_norm`).
    pub fn has_qk_norm(self) -> bool {
        matches!(
            self,
            Architecture::Qwen3 | Architecture::Gemma3 | Architecture::Qwen3Moe
        )
    }

    /// Its feed-forward blocks can be mixtures of experts.
    pub fn is_moe(self) -> bool {
        matches!(
            self,
            Architecture::Mixtral
                | Architecture::Qwen2Moe
                | Architecture::Qwen3Moe
                | Architecture::GptOss
        )
    }

    /// The name of a sparse layer's router: `mlp.router` (gpt-oss) or `mlp.gate`.
    pub fn router_name(self) -> &'static str {
        match self {
            Architecture::GptOss => "mlp.router",
            _ => "mlp.gate",
        }
    }

    /// With `attention_bias`, the output projection has a bias too (gpt-oss; the others bias q/k/v only).
    pub fn biases_attention_output(self) -> bool {
        self == Architecture::GptOss
    }

    /// Each attention head has a learned sink logit joined to its softmax (`self_attn.sinks`, gpt-oss).
    pub fn has_attention_sinks(self) -> bool {
        self == Architecture::GptOss
    }

    /// Like Qwen2 / Qwen3, it reads `sliding_window` only with `use_sliding_window`.
    fn gates_sliding_window(self) -> bool {
        matches!(
            self,
            Architecture::Qwen2
                | Architecture::Qwen3
                | Architecture::Qwen2Moe
                | Architecture::Qwen3Moe
        )
    }

    /// q/k/v and gate/up are one projection each (`qkv_proj`, `gate_up_proj`).
    pub fn has_fused_projections(self) -> bool {
        self == Architecture::Phi3
    }

    /// What a stored norm weight `w` adds to the normed activations' scale: Gemma stores `w` and multiplies by
    /// `1 + w`. The model keeps the effective scale; loading adds this, writing a model subtracts it.
    pub fn norm_weight_offset(self) -> f64 {
        if self.is_gemma() {
            1.0
        } else {
            0.0
        }
    }

    /// The adapter targets PEFT picks for this family when `target_modules` is not set (`None`: PEFT has no default
    /// and asks for them).
    pub fn default_lora_targets(self) -> Option<&'static [&'static str]> {
        match self {
            Architecture::Phi3
            | Architecture::Qwen2Moe
            | Architecture::Qwen3Moe
            | Architecture::GptOss => None,
            _ => Some(&["q_proj", "v_proj"]),
        }
    }
}

/// Which keys a layer's queries see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerAttention {
    /// Every earlier position (`full_attention`).
    Full,
    /// The last `sliding_window` positions (`sliding_attention`).
    Sliding,
}

/// The mixture-of-experts settings of a model (Mixtral, Qwen2-MoE, Qwen3-MoE), in transformers' terms.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_local_experts`, `num_experts`).
    pub num_experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub num_experts_per_tok: usize,
    /// Each expert's MLP width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub moe_intermediate_size: usize,
    /// Qwen2-MoE's shared expert's MLP width, when it has one.
    pub shared_expert_intermediate_size: Option<usize>,
    /// The chosen experts' probabilities are renormalized to sum to 1 (always in Mixtral).
    pub norm_topk_prob: bool,
    /// Per layer: whether its feed-forward block is sparse (Qwen's `mlp_only_layers` and `decoder_sparse_step`
    /// make some dense, of width `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// The auxiliary loss's weight in the training loss (`router_aux_loss_coef`).
    pub router_aux_loss_coef: f64,
    /// Whether training adds the auxiliary loss (`output_router_logits`, as transformers decides it).
    pub output_router_logits: bool,
    /// gpt-oss's experts: gate and up interleaved in one projection (`gate_up_proj[..., 0::2]` the gate), biases on
    /// both projections and on the router, the top-k's logits softmaxed, and this clamped SwiGLU.
    pub clamped_swiglu: Option<ClampedSwiglu>,
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
            .is_gemma()
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

    /// This configuration as a Hugging Face `config.json` object (transformers 4 key names, which transformers 5
    /// reads too); [`ModelConfig::from_hf_config`] reads it back to an equal configuration.
    pub fn to_hf_config(&self) -> Value {
        let arch = self.architecture;
        let activation_key = if arch.is_gemma() {
            "hidden_activation"
        } else {
            "hidden_act"
        };
        let mut v = serde_json::json!({
            "architectures": [arch.causal_lm_class()],
            "model_type": arch.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            activation_key: self.activation.hidden_act(),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "layer_types": self.layer_types.iter().map(|t| match t {
                LayerAttention::Full => "full_attention",
                LayerAttention::Sliding => "sliding_attention",
            }).collect::<Vec<_>>(),
            "sliding_window": self.sliding_window,
        });
        if arch.gates_sliding_window() {
            v["use_sliding_window"] = self.sliding_window.is_some().into();
        }
        if arch == Architecture::Qwen2Moe {
            v["qkv_bias"] = self.attention_bias.into();
        }
        if let Some(moe) = &self.moe {
            // Mixtral and gpt-oss name the count `num_local_experts` and the experts' width `intermediate_size`.
            let mixtral_keys = matches!(arch, Architecture::Mixtral | Architecture::GptOss);
            let experts_key = if mixtral_keys {
                "num_local_experts"
            } else {
                "num_experts"
            };
            v[experts_key] = moe.num_experts.into();
            v["num_experts_per_tok"] = moe.num_experts_per_tok.into();
            v["router_aux_loss_coef"] = moe.router_aux_loss_coef.into();
            v["output_router_logits"] = moe.output_router_logits.into();
            if let Some(c) = moe.clamped_swiglu {
                v["swiglu_alpha"] = c.alpha.into();
                v["swiglu_limit"] = c.limit.into();
            }
            if !mixtral_keys {
                v["moe_intermediate_size"] = moe.moe_intermediate_size.into();
                v["norm_topk_prob"] = moe.norm_topk_prob.into();
                v["decoder_sparse_step"] = 1.into();
                let dense: Vec<usize> = (0..moe.sparse_layers.len())
                    .filter(|l| !moe.sparse_layers[*l])
                    .collect();
                v["mlp_only_layers"] = dense.into();
            }
            if let Some(width) = moe.shared_expert_intermediate_size {
                v["shared_expert_intermediate_size"] = width.into();
            }
        }
        if self.rotary_dim != self.head_dim {
            v["partial_rotary_factor"] = (self.rotary_dim as f64 / self.head_dim as f64).into();
        }
        if let Some(theta) = self.sliding_rope_theta {
            v["rope_local_base_freq"] = theta.into();
        }
        let optional = [
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ];
        for (key, value) in optional {
            v[key] = value.into();
        }
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Llama3(s)) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings});
            }
            Some(RopeScaling::Linear { factor }) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": factor});
            }
            Some(RopeScaling::LongRope(s)) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "longrope",
                    "short_factor": s.short_factor, "long_factor": s.long_factor,
                    "attention_factor": s.attention_factor});
                v["original_max_position_embeddings"] = s.original_max_position_embeddings.into();
            }
            Some(RopeScaling::Yarn(s)) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": s.factor,
                    "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                    "attention_factor": s.attention_factor});
            }
        }
        v
    }

    /// The default layer types of a family whose `config.json` does not list them (transformers' rules).
    fn default_layer_types(
        architecture: Architecture,
        layers: usize,
        sliding_window: Option<usize>,
        max_window_layers: Option<usize>,
        sliding_window_pattern: Option<usize>,
    ) -> Vec<LayerAttention> {
        (0..layers)
            .map(|i| {
                let sliding = match architecture {
                    Architecture::Llama => false,
                    Architecture::Mistral | Architecture::Phi3 | Architecture::Mixtral => {
                        sliding_window.is_some()
                    }
                    Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                        sliding_window.is_some() && i >= max_window_layers.unwrap_or(0)
                    }
                    // Qwen2-MoE's own rule: odd-numbered layers below `max_window_layers` (default 28).
                    Architecture::Qwen2Moe => {
                        sliding_window.is_some()
                            && i % 2 == 0
                            && i < max_window_layers.unwrap_or(28)
                    }
                    Architecture::Gemma2 | Architecture::GptOss => (i + 1) % 2 != 0,
                    Architecture::Gemma3 => {
                        (i + 1) % sliding_window_pattern.unwrap_or(6).max(1) != 0
                    }
                };
                if sliding {
                    LayerAttention::Sliding
                } else {
                    LayerAttention::Full
                }
            })
            .collect()
    }
}

/// The largest vocabulary, width, head count or context a config may declare (real models stay far below).
const MAX_SIZE: usize = 1 << 24;
/// The most experts a sparse layer may have (models have at most a few hundred).
const MAX_EXPERTS: usize = 1 << 12;
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
    hidden_act: Option<String>,
    hidden_activation: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
    query_pre_attn_scalar: Option<f64>,
    attn_logit_softcapping: Option<f64>,
    final_logit_softcapping: Option<f64>,
    qkv_bias: Option<bool>,
    num_local_experts: Option<usize>,
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    router_aux_loss_coef: Option<f64>,
    output_router_logits: Option<bool>,
    swiglu_alpha: Option<f64>,
    swiglu_limit: Option<f64>,
}

/// The mixture of experts a `config.json` declares, with transformers 5.23's defaults for what it leaves out.
fn moe_of(hf: &HfConfig, architecture: Architecture, path: &Path) -> Result<Option<MoeConfig>> {
    let qwen2 = architecture == Architecture::Qwen2Moe;
    let (experts, per_token, width, shared) = match architecture {
        Architecture::Mixtral => (
            hf.num_local_experts.unwrap_or(8),
            hf.num_experts_per_tok.unwrap_or(2),
            hf.intermediate_size,
            None,
        ),
        Architecture::Qwen2Moe | Architecture::Qwen3Moe => (
            hf.num_experts
                .or(hf.num_local_experts)
                .unwrap_or(if qwen2 { 60 } else { 128 }),
            hf.num_experts_per_tok.unwrap_or(if qwen2 { 4 } else { 8 }),
            hf.moe_intermediate_size
                .unwrap_or(if qwen2 { 1408 } else { 768 }),
            qwen2.then(|| hf.shared_expert_intermediate_size.unwrap_or(5632)),
        ),
        Architecture::GptOss => (
            hf.num_local_experts.or(hf.num_experts).unwrap_or(128),
            hf.num_experts_per_tok.unwrap_or(4),
            hf.intermediate_size,
            None,
        ),
        _ => return Ok(None),
    };
    if per_token == 0 || per_token > experts {
        return Err(bad(
            path,
            format!("num_experts_per_tok = {per_token}: a token goes to 1 to {experts} experts (the model has {experts})"),
        ));
    }
    let step = hf.decoder_sparse_step.unwrap_or(1);
    if step == 0 {
        return Err(bad(path, "`decoder_sparse_step` must be at least 1".into()));
    }
    let dense = hf.mlp_only_layers.clone().unwrap_or_default();
    // transformers: sparse unless listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th layer.
    let sparse_layers = (0..hf.num_hidden_layers)
        .map(|l| {
            matches!(architecture, Architecture::Mixtral | Architecture::GptOss)
                || (!dense.contains(&l) && (l + 1) % step == 0)
        })
        .collect();
    let clamped_swiglu = match architecture {
        Architecture::GptOss => {
            let alpha = positive(hf.swiglu_alpha, "swiglu_alpha", path)?.unwrap_or(1.702);
            let limit = positive(hf.swiglu_limit, "swiglu_limit", path)?.unwrap_or(7.0);
            Some(ClampedSwiglu { alpha, limit })
        }
        _ => None,
    };
    let coef = hf.router_aux_loss_coef.unwrap_or(0.001);
    if !coef.is_finite() || coef < 0.0 {
        return Err(bad(
            path,
            format!("`router_aux_loss_coef` must be a non-negative number, not {coef}"),
        ));
    }
    Ok(Some(MoeConfig {
        num_experts: experts,
        num_experts_per_tok: per_token,
        moe_intermediate_size: width,
        shared_expert_intermediate_size: shared,
        // gpt-oss's softmax over the top-k logits is the renormalized top-k of the softmax.
        norm_topk_prob: matches!(architecture, Architecture::Mixtral | Architecture::GptOss)
            || hf.norm_topk_prob.unwrap_or(false),
        sparse_layers,
        router_aux_loss_coef: coef,
        output_router_logits: hf.output_router_logits.unwrap_or(false),
        clamped_swiglu,
    }))
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

/// RoPE as a config declares it.
struct RopeSettings {
    theta: Option<f64>,
    scaling: Option<RopeScaling>,
    sliding_theta: Option<f64>,
    /// Leading dimensions of each head that RoPE rotates.
    rotary_dim: usize,
}

/// A `rope_scaling` / `rope_parameters` object's scaling (`obj` is the whole config, for keys transformers 4 kept
/// at the top level).
fn rope_scaling_of(
    scaling: &Value,
    obj: &Value,
    path: &Path,
    rotary_dim: usize,
) -> Result<Option<RopeScaling>> {
    let rope_type = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<Option<f64>> {
        match opt_f64(scaling, key, path)? {
            Some(v) => Ok(Some(v)),
            None => opt_f64(obj, key, path),
        }
    };
    match rope_type {
        "default" => Ok(None),
        "llama3" => {
            let s: Llama3RopeScaling = serde_json::from_value(scaling.clone()).map_err(|e| {
                bad(path, format!("`rope_scaling` of type llama3 is incomplete: {e}"))
            })?;
            Ok(Some(RopeScaling::Llama3(s)))
        }
        "linear" => match number("factor")? {
            Some(factor) if factor > 0.0 => Ok(Some(RopeScaling::Linear { factor })),
            _ => Err(bad(
                path,
                "`rope_scaling` of type linear needs a positive `factor`".into(),
            )),
        },
        "longrope" | "su" => {
            let factors = |key: &str| -> Result<Vec<f64>> {
                let v: Vec<f64> = scaling
                    .get(key)
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .ok_or_else(|| {
                        bad(path, format!("`rope_scaling` of type longrope needs `{key}` (a list of numbers)"))
                    })?;
                if v.len() != rotary_dim / 2 || v.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
                    return Err(bad(
                        path,
                        format!(
                            "`rope_scaling.{key}` must hold {} positive numbers (rotary dimension / 2), not {}",
                            rotary_dim / 2,
                            v.len()
                        ),
                    ));
                }
                Ok(v)
            };
            let original = number("original_max_position_embeddings")?
                .filter(|v| *v >= 2.0)
                .ok_or_else(|| {
                    bad(
                        path,
                        "LongRoPE needs `original_max_position_embeddings` (at least 2)".into(),
                    )
                })? as usize;
            let max = opt_f64(obj, "max_position_embeddings", path)?.unwrap_or(original as f64);
            let factor = number("factor")?.unwrap_or(max / original as f64);
            let attention_factor = match opt_f64(scaling, "attention_factor", path)? {
                Some(f) => f,
                None => LongRopeScaling::default_attention_factor(factor, original),
            };
            Ok(Some(RopeScaling::LongRope(LongRopeScaling {
                short_factor: factors("short_factor")?,
                long_factor: factors("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            })))
        }
        "yarn" => {
            let original = number("original_max_position_embeddings")?
                .filter(|v| *v >= 1.0)
                .ok_or_else(|| {
                    bad(
                        path,
                        "YaRN needs `original_max_position_embeddings` (at least 1)".into(),
                    )
                })? as usize;
            let max = opt_f64(obj, "max_position_embeddings", path)?.unwrap_or(original as f64);
            let factor = opt_f64(scaling, "factor", path)?.unwrap_or(max / original as f64);
            if !(factor.is_finite() && factor > 0.0) {
                return Err(bad(path, format!("YaRN's `factor` must be positive, not {factor}")));
            }
            let attention_factor = match opt_f64(scaling, "attention_factor", path)? {
                Some(f) => f,
                None => YarnRopeScaling::default_attention_factor(
                    factor,
                    opt_f64(scaling, "mscale", path)?,
                    opt_f64(scaling, "mscale_all_dim", path)?,
                ),
            };
            // transformers reads `beta_fast or 32`, `beta_slow or 1`: a 0 means the default too.
            let beta = |key: &str, default: f64| -> Result<f64> {
                Ok(opt_f64(scaling, key, path)?.filter(|v| *v != 0.0).unwrap_or(default))
            };
            Ok(Some(RopeScaling::Yarn(YarnRopeScaling {
                factor,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                original_max_position_embeddings: original,
                truncate: scaling.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                attention_factor,
            })))
        }
        other => Err(bad(
            path,
            format!("rope scaling type `{other}` is not supported (supported: default, llama3, linear, longrope, yarn); remove it to use plain RoPE"),
        )),
    }
}

/// Reads RoPE settings from `rope_theta`/`rope_scaling`/`partial_rotary_factor`/`rope_local_base_freq`
/// (transformers 4.x) or `rope_parameters` (5.x, per layer type for Gemma 3).
fn rope_settings(obj: &Value, path: &Path, head_dim: usize) -> Result<RopeSettings> {
    let params = obj.get("rope_parameters").filter(|v| v.is_object());
    let (full, sliding) = match params {
        Some(p) if p.get("full_attention").is_some() => (
            p.get("full_attention").filter(|v| v.is_object()),
            p.get("sliding_attention").filter(|v| v.is_object()),
        ),
        _ => (params, None),
    };
    let in_params = |key: &str| -> Result<Option<f64>> {
        full.map(|p| opt_f64(p, key, path))
            .transpose()
            .map(Option::flatten)
    };
    let partial_rotary_factor = match opt_f64(obj, "partial_rotary_factor", path)? {
        Some(f) => f,
        None => in_params("partial_rotary_factor")?.unwrap_or(1.0),
    };
    if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
        return Err(bad(
            path,
            format!("`partial_rotary_factor` must be in (0, 1], not {partial_rotary_factor}"),
        ));
    }
    let rotary_dim = (head_dim as f64 * partial_rotary_factor) as usize;
    let theta = match opt_f64(obj, "rope_theta", path)? {
        Some(t) => Some(t),
        None => in_params("rope_theta")?,
    };
    let scaling = match obj.get("rope_scaling").filter(|v| v.is_object()).or(full) {
        Some(s) => rope_scaling_of(s, obj, path, rotary_dim)?,
        None => None,
    };
    let sliding_theta = match opt_f64(obj, "rope_local_base_freq", path)? {
        Some(t) => Some(t),
        None => sliding
            .map(|p| opt_f64(p, "rope_theta", path))
            .transpose()?
            .flatten(),
    };
    Ok(RopeSettings {
        theta,
        scaling,
        sliding_theta,
        rotary_dim,
    })
}

/// The gated MLP activation a config names (Gemma's default is the tanh GELU, the others' SiLU).
fn activation_of(
    name: Option<&str>,
    architecture: Architecture,
    path: &Path,
) -> Result<GateActivation> {
    match name {
        None if architecture.is_gemma() => Ok(GateActivation::GeluTanh),
        None => Ok(GateActivation::Silu),
        Some(name) => GateActivation::from_hidden_act(name).ok_or_else(|| {
            bad(
                path,
                format!(
                    "activation `{name}` is not supported (supported: silu, gelu_pytorch_tanh)"
                ),
            )
        }),
    }
}

/// `layer_types` as written in a config.
fn parse_layer_types(names: &[String], layers: usize, path: &Path) -> Result<Vec<LayerAttention>> {
    if names.len() != layers {
        return Err(bad(
            path,
            format!(
                "`layer_types` lists {} layers, but num_hidden_layers is {layers}",
                names.len()
            ),
        ));
    }
    names
        .iter()
        .enumerate()
        .map(|(i, n)| match n.as_str() {
            "full_attention" => Ok(LayerAttention::Full),
            "sliding_attention" => Ok(LayerAttention::Sliding),
            other => Err(bad(
                path,
                format!("`layer_types[{i}]` = `{other}` is not supported (full_attention, sliding_attention)"),
            )),
        })
        .collect()
}

/// `layers`, refused before anything per layer is built when no model has that many.
fn layer_count(layers: usize, path: &Path) -> Result<usize> {
    if layers > MAX_LAYERS {
        return Err(bad(
            path,
            format!("num_hidden_layers = {layers} is more than any model has (at most {MAX_LAYERS}); the file is damaged"),
        ));
    }
    Ok(layers)
}

/// A positive finite value, or an error naming `key`.
fn positive(value: Option<f64>, key: &str, path: &Path) -> Result<Option<f64>> {
    match value {
        Some(v) if !(v.is_finite() && v > 0.0) => Err(bad(
            path,
            format!("`{key}` must be a positive number, not {v}"),
        )),
        v => Ok(v),
    }
}

impl ModelConfig {
    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_config_file(path: &Path) -> Result<Self> {
        Self::from_hf_config(&read_json::<Value>(path)?, path)
    }

    /// Parses a `config.json` object; `path` names it in errors.
    pub fn from_hf_config(obj: &Value, path: &Path) -> Result<Self> {
        if obj.get("model_type").and_then(Value::as_str) == Some("gemma3") {
            // GGUF's `gemma3` is the text model; a Hugging Face `gemma3` folder is the vision-language model.
            return Err(bad(
                path,
                "model_type `gemma3` is Gemma 3 with its vision tower (Gemma3ForConditionalGeneration), which is not \
                 supported; the text-only models (`gemma3_text`, e.g. gemma-3-1b) and GGUF files of the language \
                 model are"
                    .into(),
            ));
        }
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
        let head_dim = hf
            .head_dim
            .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        let rope = rope_settings(obj, path, head_dim)?;
        // Qwen2/3 ignore `sliding_window` unless `use_sliding_window` (transformers' config does the same).
        let sliding_window =
            if architecture.gates_sliding_window() && hf.use_sliding_window != Some(true) {
                None
            } else {
                hf.sliding_window
            };
        if sliding_window == Some(0) {
            return Err(bad(path, "`sliding_window` must be at least 1".into()));
        }
        layer_count(hf.num_hidden_layers, path)?;
        let layer_types = match &hf.layer_types {
            Some(names) => parse_layer_types(names, hf.num_hidden_layers, path)?,
            None => Self::default_layer_types(
                architecture,
                hf.num_hidden_layers,
                sliding_window,
                hf.max_window_layers,
                hf.sliding_window_pattern,
            ),
        };
        let activation = activation_of(
            hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref()),
            architecture,
            path,
        )?;
        let moe = moe_of(&hf, architecture, path)?;
        let config = ModelConfig {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            rotary_dim: rope.rotary_dim,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope.theta.unwrap_or(architecture.default_rope_theta()),
            rope_scaling: match rope.scaling {
                // gpt-oss's config defaults to YaRN when it names no RoPE parameters.
                None if architecture == Architecture::GptOss
                    && obj.get("rope_scaling").is_none_or(Value::is_null)
                    && obj.get("rope_parameters").is_none_or(Value::is_null) =>
                {
                    Some(RopeScaling::Yarn(YarnRopeScaling {
                        factor: 32.0,
                        beta_fast: 32.0,
                        beta_slow: 1.0,
                        original_max_position_embeddings: 4096,
                        truncate: false,
                        attention_factor: YarnRopeScaling::default_attention_factor(
                            32.0, None, None,
                        ),
                    }))
                }
                scaling => scaling,
            },
            // Gemma 3's sliding layers always have their own (default 10⁴) base.
            sliding_rope_theta: match architecture {
                Architecture::Gemma3 => Some(rope.sliding_theta.unwrap_or(10_000.0)),
                _ => rope.sliding_theta,
            },
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(architecture.is_gemma()),
            attention_bias: match architecture {
                Architecture::Qwen2 => true,
                Architecture::Qwen2Moe => hf.qkv_bias.unwrap_or(true),
                Architecture::GptOss => hf.attention_bias.unwrap_or(true),
                _ => hf.attention_bias.unwrap_or(false),
            },
            activation,
            layer_types,
            sliding_window,
            query_pre_attn_scalar: positive(
                hf.query_pre_attn_scalar,
                "query_pre_attn_scalar",
                path,
            )?,
            attn_logit_softcapping: positive(
                hf.attn_logit_softcapping,
                "attn_logit_softcapping",
                path,
            )?,
            final_logit_softcapping: positive(
                hf.final_logit_softcapping,
                "final_logit_softcapping",
                path,
            )?,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
            moe,
        };
        config.validate(path, ConfigKeys::Json)?;
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
        let experts = md
            .get(&format!("{arch_name}.expert_count"))
            .and_then(|v| v.to_u32().ok())
            .filter(|n| *n > 0);
        // llama.cpp's names for the mixtures of experts; it writes Mixtral as `llama` with experts.
        let architecture = match (arch_name.as_str(), experts) {
            ("qwen2moe", _) => Some(Architecture::Qwen2Moe),
            ("qwen3moe", _) => Some(Architecture::Qwen3Moe),
            ("llama", Some(_)) => Some(Architecture::Mixtral),
            (name, _) => Architecture::parse(name),
        }
        .ok_or_else(|| {
            bad(path, format!("GGUF architecture `{arch_name}` is not supported; supported: {SUPPORTED_MODEL_TYPES} \
                 (qwen2moe, qwen3moe in llama.cpp's names, and Mixtral as `llama` with experts)"))
        })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        if experts.is_some() && !architecture.is_moe() {
            return Err(bad(
                path,
                format!(
                    "GGUF files of `{arch_name}` with experts (`expert_count`) are not supported; load the model's \
                     Hugging Face folder instead (GGUF mixtures of experts load as llama (Mixtral), qwen2moe and \
                     qwen3moe)"
                ),
            ));
        }
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
        // llama.cpp writes the head width as `attention.key_length` where it differs from hidden / heads, and the
        // rotated dimensions as `rope.dimension_count`.
        let head_dim =
            get_u("attention.key_length").unwrap_or(hidden_size / num_attention_heads.max(1));
        let rotary_dim = get_u("rope.dimension_count").unwrap_or(head_dim);
        let num_hidden_layers = layer_count(get_u("block_count")?, path)?;
        let gemma2 = architecture == Architecture::Gemma2;
        // llama.cpp's defaults where its Gemma 2 keys are missing: a 4096 window, caps of 50 and 30.
        let sliding_window = get_u("attention.sliding_window")
            .ok()
            .or(gemma2.then_some(4096))
            .filter(|w| *w > 0);
        let softcap = |k: &str, gemma2_default: f64| {
            get_f(k)
                .or(gemma2.then_some(gemma2_default))
                .filter(|v| *v > 0.0)
        };
        let rope_scaling = match md
            .get(&key("rope.scaling.type"))
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
        {
            None | Some("none") => None,
            // A missing factor is an error (it was plain RoPE before); `validate` refuses a non-positive one.
            Some("linear") => Some(RopeScaling::Linear {
                factor: get_f("rope.scaling.factor").ok_or_else(|| {
                    bad(
                        path,
                        format!(
                            "GGUF metadata `{}` is missing (rope scaling `linear` needs it)",
                            key("rope.scaling.factor")
                        ),
                    )
                })?,
            }),
            Some(other) => {
                return Err(bad(
                    path,
                    format!(
                        "GGUF rope scaling `{other}` is not supported (supported: none, linear)"
                    ),
                ))
            }
        };
        let u32_key = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        // What llama.cpp fixes per architecture: every layer sparse, the top-k renormalized by Mixtral and qwen3moe
        // (not by qwen2moe), Mixtral's experts as wide as `feed_forward_length`; transformers' defaults for the
        // auxiliary loss, which a GGUF does not carry.
        let moe = match architecture.is_moe() {
            false => None,
            true => {
                let experts = experts.ok_or_else(|| {
                    bad(
                        path,
                        format!("GGUF metadata `{}` is missing", key("expert_count")),
                    )
                })? as usize;
                let per_token = get_u("expert_used_count")?;
                if per_token == 0 || per_token > experts {
                    return Err(bad(
                        path,
                        format!(
                            "GGUF metadata `{}` = {per_token}: must be between 1 and the {experts} experts",
                            key("expert_used_count")
                        ),
                    ));
                }
                Some(MoeConfig {
                    num_experts: experts,
                    num_experts_per_tok: per_token,
                    moe_intermediate_size: match architecture {
                        Architecture::Mixtral => get_u("feed_forward_length")?,
                        _ => get_u("expert_feed_forward_length")?,
                    },
                    shared_expert_intermediate_size: (architecture == Architecture::Qwen2Moe)
                        .then(|| get_u("expert_shared_feed_forward_length"))
                        .transpose()?,
                    norm_topk_prob: architecture != Architecture::Qwen2Moe,
                    sparse_layers: vec![true; num_hidden_layers],
                    router_aux_loss_coef: 0.001,
                    output_router_logits: false,
                    clamped_swiglu: None,
                })
            }
        };
        let config = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: get_u("feed_forward_length")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: get_u("attention.head_count_kv").unwrap_or(num_attention_heads),
            head_dim,
            rotary_dim,
            rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: get_f("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling,
            // llama.cpp's Gemma 3 uses a fixed 10⁴ base on its sliding layers.
            sliding_rope_theta: (architecture == Architecture::Gemma3).then_some(10_000.0),
            max_position_embeddings: get_u("context_length")?,
            tie_word_embeddings: !has_output,
            attention_bias: matches!(architecture, Architecture::Qwen2 | Architecture::Qwen2Moe),
            activation: activation_of(None, architecture, path)?,
            layer_types: Self::default_layer_types(
                architecture,
                num_hidden_layers,
                sliding_window,
                None,
                None,
            ),
            sliding_window,
            // llama.cpp keeps no `query_pre_attn_scalar`: Gemma scales scores by 1/√head_dim, but the 27B models
            // (46 layers of Gemma 2, 62 of Gemma 3) by 1/√(hidden / heads), as their configs say.
            query_pre_attn_scalar: match (architecture, num_hidden_layers) {
                (Architecture::Gemma2, 46) | (Architecture::Gemma3, 62) => {
                    Some((hidden_size / num_attention_heads.max(1)) as f64)
                }
                _ => None,
            },
            attn_logit_softcapping: softcap("attn_logit_softcapping", 50.0),
            final_logit_softcapping: softcap("final_logit_softcapping", 30.0),
            bos_token_id: u32_key("tokenizer.ggml.bos_token_id"),
            eos_token_ids: u32_key("tokenizer.ggml.eos_token_id").into_iter().collect(),
            moe,
        };
        config.validate(path, ConfigKeys::Gguf(&arch_name))?;
        Ok(config)
    }

    /// Refuses what no model has and what would make every value NaN or infinite: head counts and widths that do
    /// not fit together, sizes beyond any model, and a norm epsilon, RoPE base or RoPE scaling that is not a
    /// positive finite number. Every parsed configuration goes through it; `keys` names the values as the file
    /// does.
    pub(crate) fn validate(&self, path: &Path, keys: ConfigKeys<'_>) -> Result<()> {
        self.validate_numbers(path, keys)?;
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
        if self.rotary_dim == 0 || self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return Err(bad(
                path,
                format!(
                    "the rotated dimensions ({}, head_dim × partial_rotary_factor) must be even, positive and at most head_dim ({})",
                    self.rotary_dim, self.head_dim
                ),
            ));
        }
        let zero = [
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((key, _)) = zero.iter().find(|(_, v)| *v == 0) {
            return Err(bad(
                path,
                format!("`{}` = 0: must be at least 1", keys.name(key)),
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
        let moe = self.moe.as_ref();
        let sizes = [
            sizes.as_slice(),
            &[
                ("num_experts", moe.map_or(0, |m| m.num_experts), MAX_EXPERTS),
                (
                    "moe_intermediate_size",
                    moe.map_or(0, |m| m.moe_intermediate_size),
                    MAX_SIZE,
                ),
                (
                    "shared_expert_intermediate_size",
                    moe.and_then(|m| m.shared_expert_intermediate_size)
                        .unwrap_or(0),
                    MAX_SIZE,
                ),
            ],
        ]
        .concat();
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

/// Where a configuration's values come from, to name them as that file does in errors.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ConfigKeys<'a> {
    /// A Hugging Face `config.json`.
    Json,
    /// GGUF metadata of this `general.architecture`.
    Gguf(&'a str),
}

impl ConfigKeys<'_> {
    /// The key of `field` (a `config.json` name) in this kind of file.
    fn name(self, field: &str) -> String {
        let ConfigKeys::Gguf(arch) = self else {
            return field.to_string();
        };
        let gguf = match field {
            "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
            "rope_theta" => "rope.freq_base",
            "intermediate_size" => "feed_forward_length",
            "max_position_embeddings" => "context_length",
            "rope_scaling.factor" => "rope.scaling.factor",
            "rope_scaling.attention_factor" => "rope.scaling.attn_factor",
            "rope_scaling.short_factor" => "rope_factors_short (tensor)",
            "rope_scaling.long_factor" => "rope_factors_long (tensor)",
            other => other,
        };
        format!("{arch}.{gguf}")
    }
}

impl ModelConfig {
    /// The norm epsilon, RoPE bases and RoPE scaling: each a positive finite number (a zero or negative epsilon
    /// divides by zero or takes the root of a negative number, a non-positive base or scaling factor gives
    /// infinite or NaN frequencies), and Llama 3's band with `high_freq_factor > low_freq_factor` (equal ones
    /// divide by zero in the smoothing, transformers warns on both).
    fn validate_numbers(&self, path: &Path, keys: ConfigKeys<'_>) -> Result<()> {
        let mut checks: Vec<(&str, f64, &str)> = vec![
            ("rms_norm_eps", self.rms_norm_eps, "models use 1e-6 to 1e-5"),
            ("rope_theta", self.rope_theta, "models use 1e4 to 1e6"),
        ];
        if let Some(theta) = self.sliding_rope_theta {
            checks.push(("rope_local_base_freq", theta, "Gemma 3 uses 1e4"));
        }
        let factor_hint = "1 is no scaling, larger extends the context";
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                checks.push(("rope_scaling.factor", *factor, factor_hint))
            }
            Some(RopeScaling::Llama3(s)) => {
                checks.push(("rope_scaling.factor", s.factor, factor_hint));
                checks.push((
                    "rope_scaling.low_freq_factor",
                    s.low_freq_factor,
                    "Llama 3.1 uses 1",
                ));
                checks.push((
                    "rope_scaling.high_freq_factor",
                    s.high_freq_factor,
                    "Llama 3.1 uses 4",
                ));
            }
            Some(RopeScaling::Yarn(s)) => {
                checks.push(("rope_scaling.factor", s.factor, factor_hint));
                checks.push(("rope_scaling.beta_fast", s.beta_fast, "the default is 32"));
                checks.push(("rope_scaling.beta_slow", s.beta_slow, "the default is 1"));
                checks.push((
                    "rope_scaling.attention_factor",
                    s.attention_factor,
                    "leave it out for YaRN's default",
                ));
            }
            Some(RopeScaling::LongRope(s)) => {
                checks.push((
                    "rope_scaling.attention_factor",
                    s.attention_factor,
                    "leave it out for LongRoPE's default",
                ));
                for (key, factors) in [
                    ("rope_scaling.short_factor", &s.short_factor),
                    ("rope_scaling.long_factor", &s.long_factor),
                ] {
                    if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                        checks.push((key, *f, "every factor is a positive number"));
                    }
                }
            }
        }
        if let Some((key, value, hint)) =
            checks.iter().find(|(_, v, _)| !(v.is_finite() && *v > 0.0))
        {
            return Err(bad(
                path,
                format!(
                    "`{}` = {value}: must be a positive finite number ({hint}); with it every value the model \
                     computes is NaN or infinite",
                    keys.name(key)
                ),
            ));
        }
        if let Some(RopeScaling::Llama3(s)) = &self.rope_scaling {
            if s.high_freq_factor <= s.low_freq_factor {
                return Err(bad(
                    path,
                    format!(
                        "`rope_scaling.high_freq_factor` = {} must be greater than `rope_scaling.low_freq_factor` = {} \
                         (Llama 3.1 uses 4 and 1)",
                        s.high_freq_factor, s.low_freq_factor
                    ),
                ));
            }
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
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3(s)) if s.factor == 8.0));
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
        v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0});
        let err = parse(v).unwrap_err().to_string();
        assert!(err.contains("`dynamic`") && err.contains("yarn"), "{err}");
        let mut v = llama();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("YaRN needs `original_max_position_embeddings`"),
            "{err}"
        );
    }

    fn gemma3_v4() -> Value {
        json!({"model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
               "max_position_embeddings": 1024, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
               "sliding_window_pattern": 6, "query_pre_attn_scalar": 256})
    }

    #[test]
    fn reads_gemma3_written_by_transformers_4() {
        let c = parse(gemma3_v4()).unwrap();
        let full: Vec<usize> = (0..12)
            .filter(|&i| c.layer_types[i] == LayerAttention::Full)
            .collect();
        assert_eq!(full, vec![5, 11]);
        assert_eq!(c.window_of(0), Some(512));
        assert_eq!(c.window_of(5), None);
        assert_eq!(c.sliding_rope_theta, Some(10000.0));
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(c.activation, GateActivation::GeluTanh);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.attention_scale(), 1.0 / 16.0);
        assert_eq!(c.embedding_multiplier(), Some(8.0));
        // transformers 5 writes the same as per-layer-type RoPE parameters.
        let mut v5 = gemma3_v4();
        for key in ["rope_theta", "rope_local_base_freq", "rope_scaling"] {
            v5.as_object_mut().unwrap().remove(key);
        }
        v5["rope_parameters"] = json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}});
        assert_eq!(parse(v5).unwrap(), c);
    }

    #[test]
    fn sliding_windows_follow_transformers_defaults() {
        // Gemma 2 alternates, sliding first.
        let mut v = gemma3_v4();
        v["model_type"] = json!("gemma2");
        v["num_hidden_layers"] = json!(4);
        let c = parse(v).unwrap();
        use LayerAttention::{Full, Sliding};
        assert_eq!(c.layer_types, vec![Sliding, Full, Sliding, Full]);
        // Qwen2 ignores `sliding_window` unless `use_sliding_window`; then layers from `max_window_layers` slide.
        let mut v = llama();
        v["model_type"] = json!("qwen2");
        v["sliding_window"] = json!(32768);
        assert_eq!(parse(v.clone()).unwrap().sliding_window, None);
        v["use_sliding_window"] = json!(true);
        v["max_window_layers"] = json!(1);
        let c = parse(v).unwrap();
        assert_eq!(c.layer_types, vec![Full, Sliding]);
        // Mistral slides on every layer when it has a window; an explicit list wins.
        let mut v = llama();
        v["model_type"] = json!("mistral");
        v["sliding_window"] = json!(4096);
        assert_eq!(
            parse(v.clone()).unwrap().layer_types,
            vec![Sliding, Sliding]
        );
        v["layer_types"] = json!(["full_attention", "sliding_attention"]);
        assert_eq!(parse(v.clone()).unwrap().layer_types, vec![Full, Sliding]);
        v["layer_types"] = json!(["full_attention"]);
        assert!(parse(v.clone())
            .unwrap_err()
            .to_string()
            .contains("lists 1 layers"));
        v["layer_types"] = json!(["full_attention", "chunked_attention"]);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("chunked_attention"));
    }

    #[test]
    fn reads_phi3_longrope_and_partial_rotary() {
        let mut v = llama();
        v["model_type"] = json!("phi3");
        v["num_key_value_heads"] = json!(4);
        v["partial_rotary_factor"] = json!(0.5);
        v["max_position_embeddings"] = json!(131072);
        v["original_max_position_embeddings"] = json!(4096);
        v["rope_scaling"] = json!({"type": "su", "short_factor": [1.0, 1.0, 1.5, 2.0],
                                   "long_factor": [2.0, 3.0, 4.0, 5.0]});
        let c = parse(v.clone()).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (16, 8));
        let Some(RopeScaling::LongRope(s)) = &c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(s.original_max_position_embeddings, 4096);
        let expected = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt();
        assert!((s.attention_factor - expected).abs() < 1e-12);
        let linears = c.layer_linears(0);
        assert_eq!(linears.len(), 4);
        assert_eq!(linears[0], ("self_attn.qkv_proj".into(), [16 * 4 * 3, 64]));
        v["rope_scaling"]["long_factor"] = json!([2.0, 3.0]);
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("long_factor") && err.contains("4 positive numbers"),
            "{err}"
        );
    }

    #[test]
    fn bad_family_settings_are_named() {
        let mut v = gemma3_v4();
        v["hidden_activation"] = json!("relu");
        assert!(parse(v).unwrap_err().to_string().contains("relu"));
        let mut v = gemma3_v4();
        v["attn_logit_softcapping"] = json!(-1.0);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("attn_logit_softcapping"));
        let mut v = llama();
        v["partial_rotary_factor"] = json!(1.5);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("partial_rotary_factor"));
    }

    /// Qwen3-30B-A3B's config (the Hub's `config.json`, keys we read): every layer sparse, 128 experts of width
    /// 768, 8 per token, renormalized; `mlp_only_layers` and `decoder_sparse_step` make layers dense as
    /// transformers does; impossible expert counts are named.
    #[test]
    fn reads_mixture_of_experts_configs() {
        let qwen3_30b_a3b = json!({
            "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "router_aux_loss_coef": 0.001, "output_router_logits": false, "tie_word_embeddings": false,
            "use_sliding_window": false, "sliding_window": null
        });
        let c = parse(qwen3_30b_a3b.clone()).unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (
                moe.num_experts,
                moe.num_experts_per_tok,
                moe.moe_intermediate_size
            ),
            (128, 8, 768)
        );
        assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|s| *s));
        assert!(c.architecture.has_qk_norm() && !c.attention_bias);
        let layer = c.layer_linears(0);
        assert_eq!(layer.len(), 4 + 1 + 2 * 128);
        assert_eq!(layer[4], ("mlp.gate".into(), [128, 2048]));
        assert_eq!(
            layer[5],
            ("mlp.experts.0.gate_up_proj".into(), [1536, 2048])
        );
        assert_eq!(layer[6], ("mlp.experts.0.down_proj".into(), [2048, 768]));

        let mut v = qwen3_30b_a3b.clone();
        v["mlp_only_layers"] = json!([0]);
        v["decoder_sparse_step"] = json!(2);
        let sparse = parse(v).unwrap().moe.unwrap().sparse_layers;
        assert_eq!(&sparse[..4], &[false, true, false, true]);
        assert_eq!(
            parse(
                json!({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "max_position_embeddings": 64})
            )
            .unwrap()
            .moe
            .unwrap()
            .num_experts,
            8,
            "Mixtral's default"
        );
        for (key, value, says) in [
            (
                "num_experts_per_tok",
                json!(129),
                "num_experts_per_tok = 129",
            ),
            ("decoder_sparse_step", json!(0), "decoder_sparse_step"),
            ("router_aux_loss_coef", json!(-1.0), "router_aux_loss_coef"),
            ("num_experts", json!(1 << 20), "num_experts"),
        ] {
            let mut v = qwen3_30b_a3b.clone();
            v[key] = value;
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains(says), "{key}: {err}");
        }
    }

    /// GGUF metadata that would make every value NaN is refused naming llama.cpp's key.
    #[test]
    fn gguf_numbers_that_give_nan_are_refused_by_their_key() {
        use gguf_file::Value as V;
        let content = |changes: &[(&str, V)]| {
            let mut metadata: std::collections::HashMap<String, V> = [
                ("general.architecture", V::String("llama".into())),
                ("llama.embedding_length", V::U32(64)),
                ("llama.attention.head_count", V::U32(4)),
                ("llama.feed_forward_length", V::U32(128)),
                ("llama.block_count", V::U32(2)),
                ("llama.context_length", V::U32(256)),
                ("llama.vocab_size", V::U32(100)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            for (k, v) in changes {
                metadata.insert(k.to_string(), v.clone());
            }
            gguf_file::Content {
                magic: gguf_file::VersionedMagic::GgufV3,
                metadata,
                tensor_infos: Default::default(),
                tensor_data_offset: 0,
            }
        };
        let path = Path::new("m.gguf");
        assert!(ModelConfig::from_gguf(&content(&[]), path, true).is_ok());
        for (changes, says) in [
            (
                vec![("llama.attention.layer_norm_rms_epsilon", V::F32(0.0))],
                "`llama.attention.layer_norm_rms_epsilon` = 0: must be a positive finite number",
            ),
            (
                vec![("llama.rope.freq_base", V::F32(f32::NAN))],
                "`llama.rope.freq_base` = NaN",
            ),
            (
                vec![("llama.rope.freq_base", V::F32(f32::INFINITY))],
                "`llama.rope.freq_base` = inf",
            ),
            (
                vec![
                    ("llama.rope.scaling.type", V::String("linear".into())),
                    ("llama.rope.scaling.factor", V::F32(-2.0)),
                ],
                "`llama.rope.scaling.factor` = -2",
            ),
            (
                vec![("llama.rope.scaling.type", V::String("linear".into()))],
                "`llama.rope.scaling.factor` is missing",
            ),
            (
                vec![("llama.context_length", V::U32(0))],
                "`llama.context_length` = 0: must be at least 1",
            ),
        ] {
            let err = ModelConfig::from_gguf(&content(&changes), path, true)
                .unwrap_err()
                .to_string();
            assert!(err.contains("m.gguf") && err.contains(says), "{err}");
        }
    }

    /// What `to_hf_config` writes reads back to the same configuration, for every family's tiny model.
    #[test]
    fn hf_config_round_trips() {
        let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models");
        let mut checked = 0;
        for entry in std::fs::read_dir(&models).unwrap() {
            let path = entry.unwrap().path().join("config.json");
            if path.exists() {
                let c = ModelConfig::from_hf_config_file(&path).unwrap();
                assert_eq!(parse(c.to_hf_config()).unwrap(), c, "{}", path.display());
                checked += 1;
            }
        }
        assert!(checked >= 10);
        let c = parse(gemma3_v4()).unwrap();
        assert_eq!(parse(c.to_hf_config()).unwrap(), c);
    }
}
