//! Qwen3-MoE (`model_type = "qwen3_moe"`, e.g. Qwen3-30B-A3B; GGUF's `qwen3moe`): Qwen3 with experts.

use std::path::Path;

use serde_json::Value;

use super::experts::{ExpertKeys, Experts};
use super::interface::{Family, WindowKeys};
use super::qwen2::slides_from_max_window_layers;
use crate::error::Result;
use crate::models::config::keys::HfConfig;
use crate::models::config::layers::MoeConfig;

/// Qwen3-MoE.
#[derive(Debug)]
pub struct Qwen3Moe;

impl Family for Qwen3Moe {
    fn model_type(&self) -> &'static str {
        "qwen3_moe"
    }

    fn causal_lm_class(&self) -> &'static str {
        "Qwen3MoeForCausalLM"
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["qwen3moe"]
    }

    fn gates_sliding_window(&self) -> bool {
        true
    }

    fn slides_by_default(&self, layer: usize, window: &WindowKeys) -> bool {
        slides_from_max_window_layers(layer, window)
    }

    fn experts(&self, hf: &HfConfig, path: &Path) -> Result<Option<MoeConfig>> {
        let experts = Experts {
            keys: ExpertKeys::Qwen,
            num_experts: hf.num_experts.or(hf.num_local_experts).unwrap_or(128),
            num_experts_per_tok: hf.num_experts_per_tok.unwrap_or(8),
            width: hf.moe_intermediate_size.unwrap_or(768),
            shared_width: None,
            clamped_swiglu: None,
        };
        experts.read(hf, path).map(Some)
    }

    fn write_hf_keys(&self, moe: Option<&MoeConfig>, config: &mut Value) {
        if let Some(moe) = moe {
            ExpertKeys::Qwen.write(moe, config);
        }
    }

    fn has_qk_norm(&self) -> bool {
        true
    }

    fn is_moe(&self) -> bool {
        true
    }

    fn default_lora_targets(&self) -> Option<&'static [&'static str]> {
        None
    }
}
