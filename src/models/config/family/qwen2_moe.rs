//! Qwen1.5-MoE / Qwen2-MoE (`model_type = "qwen2_moe"`; GGUF's `qwen2moe`): Qwen2 with experts and a gated shared
//! expert, its q/k/v biases set by `qkv_bias`, and a sliding-window rule of its own.

use std::path::Path;

use serde_json::Value;

use super::experts::{ExpertKeys, Experts};
use super::interface::{Family, GgufExperts, WindowKeys};
use crate::error::Result;
use crate::models::config::keys::HfConfig;
use crate::models::config::layers::MoeConfig;

/// Qwen2-MoE.
#[derive(Debug)]
pub struct Qwen2Moe;

impl Family for Qwen2Moe {
    fn model_type(&self) -> &'static str {
        "qwen2_moe"
    }

    fn causal_lm_class(&self) -> &'static str {
        "Qwen2MoeForCausalLM"
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen2moe"]
    }

    fn attention_bias(&self, hf: &HfConfig) -> bool {
        hf.qkv_bias.unwrap_or(true)
    }

    fn gates_sliding_window(&self) -> bool {
        true
    }

    /// Odd-numbered layers (counting from 1) below `max_window_layers` (default 28).
    fn slides_by_default(&self, layer: usize, window: &WindowKeys) -> bool {
        window.sliding_window.is_some()
            && layer % 2 == 0
            && layer < window.max_window_layers.unwrap_or(28)
    }

    fn experts(&self, hf: &HfConfig, path: &Path) -> Result<Option<MoeConfig>> {
        let experts = Experts {
            keys: ExpertKeys::Qwen,
            num_experts: hf.num_experts.or(hf.num_local_experts).unwrap_or(60),
            num_experts_per_tok: hf.num_experts_per_tok.unwrap_or(4),
            width: hf.moe_intermediate_size.unwrap_or(1408),
            shared_width: Some(hf.shared_expert_intermediate_size.unwrap_or(5632)),
            clamped_swiglu: None,
        };
        experts.read(hf, path).map(Some)
    }

    fn write_hf_keys(&self, moe: Option<&MoeConfig>, config: &mut Value) {
        config["qkv_bias"] = config["attention_bias"].clone();
        if let Some(moe) = moe {
            ExpertKeys::Qwen.write(moe, config);
        }
    }

    fn gguf_attention_bias(&self) -> bool {
        true
    }

    /// Its shared expert's width; llama.cpp does not renormalize its top-k.
    fn gguf_experts(&self) -> Option<GgufExperts> {
        Some(GgufExperts {
            width_key: "expert_feed_forward_length",
            shared_width_key: Some("expert_shared_feed_forward_length"),
            norm_topk_prob: false,
        })
    }

    fn is_moe(&self) -> bool {
        true
    }

    fn default_lora_targets(&self) -> Option<&'static [&'static str]> {
        None
    }
}
