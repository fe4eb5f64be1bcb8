//! gpt-oss (`model_type = "gpt_oss"`): attention with biases (the output projection's too) and a learned sink
//! per head, sliding-window layers alternating with full ones, YaRN by default; experts with biases and a clamped
//! SwiGLU behind a router with a bias (`mlp.router`), stored stacked per projection.

use std::path::Path;

use serde_json::Value;

use super::experts::{ExpertKeys, Experts};
use super::interface::{Family, HubExperts, WindowKeys};
use crate::error::Result;
use crate::models::config::keys::{positive, HfConfig};
use crate::models::config::layers::MoeConfig;
use crate::ops::rope::{RopeScaling, YarnRopeScaling};
use crate::ops::ClampedSwiglu;

/// gpt-oss.
#[derive(Debug)]
pub struct GptOss;

impl Family for GptOss {
    fn model_type(&self) -> &'static str {
        "gpt_oss"
    }

    fn causal_lm_class(&self) -> &'static str {
        "GptOssForCausalLM"
    }

    fn default_rope_theta(&self) -> f64 {
        150_000.0
    }

    /// transformers' config defaults to YaRN when it names no RoPE parameters.
    fn default_rope_scaling(&self) -> Option<RopeScaling> {
        Some(RopeScaling::Yarn(YarnRopeScaling {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096,
            truncate: false,
            attention_factor: YarnRopeScaling::default_attention_factor(32.0, None, None),
        }))
    }

    fn attention_bias(&self, hf: &HfConfig) -> bool {
        hf.attention_bias.unwrap_or(true)
    }

    fn slides_by_default(&self, layer: usize, _window: &WindowKeys) -> bool {
        (layer + 1) % 2 != 0
    }

    fn experts(&self, hf: &HfConfig, path: &Path) -> Result<Option<MoeConfig>> {
        let alpha = positive(hf.swiglu_alpha, "swiglu_alpha", path)?.unwrap_or(1.702);
        let limit = positive(hf.swiglu_limit, "swiglu_limit", path)?.unwrap_or(7.0);
        let experts = Experts {
            keys: ExpertKeys::Mixtral,
            num_experts: hf.num_local_experts.or(hf.num_experts).unwrap_or(128),
            num_experts_per_tok: hf.num_experts_per_tok.unwrap_or(4),
            width: hf.intermediate_size,
            shared_width: None,
            clamped_swiglu: Some(ClampedSwiglu { alpha, limit }),
        };
        experts.read(hf, path).map(Some)
    }

    fn write_hf_keys(&self, moe: Option<&MoeConfig>, config: &mut Value) {
        if let Some(moe) = moe {
            ExpertKeys::Mixtral.write(moe, config);
        }
    }

    fn biases_attention_output(&self) -> bool {
        true
    }

    fn has_attention_sinks(&self) -> bool {
        true
    }

    fn is_moe(&self) -> bool {
        true
    }

    fn router_name(&self) -> &'static str {
        "mlp.router"
    }

    fn hub_experts(&self) -> HubExperts {
        HubExperts::Stacked
    }

    fn default_lora_targets(&self) -> Option<&'static [&'static str]> {
        None
    }
}
