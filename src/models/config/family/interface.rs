//! The [`Family`] interface every family implements (defaults are Llama's), and the descriptions its methods
//! return.

use std::fmt;
use std::path::Path;

use serde_json::Value;

use crate::error::Result;
use crate::models::config::keys::HfConfig;
use crate::models::config::layers::MoeConfig;
use crate::ops::rope::RopeScaling;
use crate::ops::GateActivation;

/// What sets a family apart from the Llama decoder. Every method but the names defaults to Llama's answer, so a
/// family's file states only its differences. Its `Debug` form is its name (`Llama`, `Qwen2Moe`).
pub trait Family: fmt::Debug + Send + Sync {
    /// Its `model_type` in `config.json` (also read as GGUF's `general.architecture`).
    fn model_type(&self) -> &'static str;

    /// The transformers class of a causal LM of this family (`architectures` in `config.json`).
    fn causal_lm_class(&self) -> &'static str;

    /// The models the family's `model_type` covers, where its name does not say (in the list of supported types).
    fn known_models(&self) -> Option<&'static str> {
        None
    }

    /// Why a `config.json` of `model_type` is refused, when that is a variant of this family this crate does not
    /// load (checked before anything else in the file).
    fn refused_model_type(&self, _model_type: &str) -> Option<&'static str> {
        None
    }

    /// llama.cpp's own names of the family (GGUF's `general.architecture`), besides its `model_type`.
    fn gguf_names(&self) -> &'static [&'static str] {
        &[]
    }

    /// The `general.architecture` llama.cpp writes this family's files under when they have experts
    /// (`expert_count`), taking precedence over the family of that name (Mixtral as `llama`).
    fn gguf_name_with_experts(&self) -> Option<&'static str> {
        None
    }

    /// The RoPE base when a config gives none (transformers' defaults).
    fn default_rope_theta(&self) -> f64 {
        10_000.0
    }

    /// The RoPE scaling of a `config.json` that has neither `rope_scaling` nor `rope_parameters`.
    fn default_rope_scaling(&self) -> Option<RopeScaling> {
        None
    }

    /// The sliding-window layers' own RoPE base when the file gives none (`None`: the full layers' RoPE).
    fn default_sliding_rope_theta(&self) -> Option<f64> {
        None
    }

    /// The gated MLP's activation when the file names none.
    fn default_activation(&self) -> GateActivation {
        GateActivation::Silu
    }

    /// The `config.json` key of the activation.
    fn activation_key(&self) -> &'static str {
        "hidden_act"
    }

    /// Whether the output head is the embedding matrix when `tie_word_embeddings` is not set.
    fn ties_embeddings_by_default(&self) -> bool {
        false
    }

    /// Whether the attention projections have biases, as a `config.json` says or the family fixes it.
    fn attention_bias(&self, hf: &HfConfig) -> bool {
        hf.attention_bias.unwrap_or(false)
    }

    /// Like Qwen2: `sliding_window` counts only with `use_sliding_window` (read and written so).
    fn gates_sliding_window(&self) -> bool {
        false
    }

    /// Whether layer `layer` slides when the file lists no `layer_types` (transformers' rule for the family).
    fn slides_by_default(&self, _layer: usize, _window: &WindowKeys) -> bool {
        false
    }

    /// The mixture of experts a `config.json` declares, with transformers' defaults for what it leaves out
    /// (`None`: a dense family).
    fn experts(&self, _hf: &HfConfig, _path: &Path) -> Result<Option<MoeConfig>> {
        Ok(None)
    }

    /// Writes the keys only this family's `config.json` has: `config` holds the others, `moe` is the experts
    /// [`Family::experts`] read.
    fn write_hf_keys(&self, _moe: Option<&MoeConfig>, _config: &mut Value) {}

    /// Whether llama.cpp's files of the family have q/k/v biases.
    fn gguf_attention_bias(&self) -> bool {
        false
    }

    /// llama.cpp's keys of the family's experts (`None`: a dense family).
    fn gguf_experts(&self) -> Option<GgufExperts> {
        self.is_moe().then_some(GgufExperts {
            width_key: "expert_feed_forward_length",
            shared_width_key: None,
            norm_topk_prob: true,
        })
    }

    /// llama.cpp's sliding window when a GGUF file has none.
    fn gguf_default_sliding_window(&self) -> Option<usize> {
        None
    }

    /// llama.cpp's attention-score and output-logit caps when a GGUF file has none.
    fn gguf_default_softcapping(&self) -> Option<(f64, f64)> {
        None
    }

    /// The `query_pre_attn_scalar` of a GGUF file's model, which llama.cpp does not keep, from its shape.
    fn gguf_query_pre_attn_scalar(
        &self,
        _layers: usize,
        _hidden: usize,
        _heads: usize,
    ) -> Option<f64> {
        None
    }

    /// llama.cpp's name of a layer's module (`post_attention_layernorm`), where the family's differs from the
    /// others'.
    fn gguf_module(&self, _module: &str) -> Option<&'static str> {
        None
    }

    /// What a stored norm weight `w` adds to the normed activations' scale: Gemma stores `w` and multiplies by
    /// `1 + w`. The model keeps the effective scale; loading adds this, writing a model subtracts it.
    fn norm_weight_offset(&self) -> f64 {
        0.0
    }

    /// Token embeddings are multiplied by `√hidden` (Gemma).
    fn scales_embeddings(&self) -> bool {
        false
    }

    /// Norms wrap both blocks' outputs too (`post_attention_layernorm` after attention, `pre_feedforward_layernorm`
    /// and `post_feedforward_layernorm` around the MLP; Gemma).
    fn has_feedforward_norms(&self) -> bool {
        false
    }

    /// Each query and key head is RMS-normed before RoPE (`q_norm`, `k_norm`).
    fn has_qk_norm(&self) -> bool {
        false
    }

    /// q/k/v and gate/up are one projection each (`qkv_proj`, `gate_up_proj`).
    fn has_fused_projections(&self) -> bool {
        false
    }

    /// With `attention_bias`, the output projection has a bias too (gpt-oss; the others bias q/k/v only).
    fn biases_attention_output(&self) -> bool {
        false
    }

    /// Each attention head has a learned sink logit joined to its softmax (`self_attn.sinks`).
    fn has_attention_sinks(&self) -> bool {
        false
    }

    /// Its feed-forward blocks can be mixtures of experts.
    fn is_moe(&self) -> bool {
        false
    }

    /// The name of a sparse layer's router.
    fn router_name(&self) -> &'static str {
        "mlp.gate"
    }

    /// How the family's Hugging Face checkpoints store a sparse layer's experts.
    fn hub_experts(&self) -> HubExperts {
        HubExperts::PerExpert {
            block: "mlp",
            gate: "gate_proj",
            up: "up_proj",
            down: "down_proj",
        }
    }

    /// The adapter targets PEFT picks for this family when `target_modules` is not set (`None`: PEFT has no
    /// default and asks for them).
    fn default_lora_targets(&self) -> Option<&'static [&'static str]> {
        Some(&["q_proj", "v_proj"])
    }
}

/// The keys of a file that decide which layers slide when it lists no `layer_types`.
#[derive(Clone, Copy, Debug, Default)]
pub struct WindowKeys {
    /// The window, if the model has one.
    pub sliding_window: Option<usize>,
    /// Qwen's `max_window_layers`.
    pub max_window_layers: Option<usize>,
    /// Gemma 3's `sliding_window_pattern` (transformers 4).
    pub sliding_window_pattern: Option<usize>,
}

/// The metadata llama.cpp describes a family's experts with (besides `expert_count` and `expert_used_count`).
#[derive(Clone, Copy, Debug)]
pub struct GgufExperts {
    /// The key of each expert's MLP width.
    pub width_key: &'static str,
    /// The key of the shared expert's width, for a family that has one.
    pub shared_width_key: Option<&'static str>,
    /// Whether the chosen experts' probabilities are renormalized (llama.cpp fixes it per architecture).
    pub norm_topk_prob: bool,
}

/// How a family's Hugging Face checkpoints store a sparse layer's experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HubExperts {
    /// A tensor per expert and projection, `{block}.experts.{e}.{gate}.weight` (and `up`, `down`), the router
    /// `{block}.gate.weight`.
    PerExpert {
        /// The layer's module holding router and experts (`mlp`; Mixtral's `block_sparse_moe`).
        block: &'static str,
        /// The gate projection's name (`gate_proj`; Mixtral's `w1`).
        gate: &'static str,
        /// The up projection's name (`up_proj`; Mixtral's `w3`).
        up: &'static str,
        /// The down projection's name (`down_proj`; Mixtral's `w2`).
        down: &'static str,
    },
    /// Each projection of all experts one `[experts, in, out]` tensor with its bias (gpt-oss's
    /// `mlp.experts.gate_up_proj`, `mlp.experts.down_proj`).
    Stacked,
}
