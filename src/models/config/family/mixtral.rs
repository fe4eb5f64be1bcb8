//! Mixtral (`model_type = "mixtral"`; GGUF: `llama` with experts): Mistral with a sparse mixture of experts in
//! every layer, stored in the Hub's `block_sparse_moe` names.

use std::path::Path;

use serde_json::Value;

use super::experts::{ExpertKeys, Experts};
use super::interface::{Family, GgufExperts, HubExperts, WindowKeys};
use crate::error::Result;
use crate::models::config::keys::HfConfig;
use crate::models::config::layers::MoeConfig;

/// Mixtral.
#[derive(Debug)]
pub struct Mixtral;

impl Family for Mixtral {
    fn model_type(&self) -> &'static str {
        "mixtral"
    }

    fn causal_lm_class(&self) -> &'static str {
        "MixtralForCausalLM"
    }

    fn gguf_name_with_experts(&self) -> Option<&'static str> {
        Some("llama")
    }

    fn default_rope_theta(&self) -> f64 {
        1_000_000.0
    }

    fn slides_by_default(&self, _layer: usize, window: &WindowKeys) -> bool {
        window.sliding_window.is_some()
    }

    fn experts(&self, hf: &HfConfig, path: &Path) -> Result<Option<MoeConfig>> {
        let experts = Experts {
            keys: ExpertKeys::Mixtral,
            num_experts: hf.num_local_experts.unwrap_or(8),
            num_experts_per_tok: hf.num_experts_per_tok.unwrap_or(2),
            width: hf.intermediate_size,
            shared_width: None,
            clamped_swiglu: None,
        };
        experts.read(hf, path).map(Some)
    }

    fn write_hf_keys(&self, moe: Option<&MoeConfig>, config: &mut Value) {
        if let Some(moe) = moe {
            ExpertKeys::Mixtral.write(moe, config);
        }
    }

    /// Its experts are as wide as `feed_forward_length`.
    fn gguf_experts(&self) -> Option<GgufExperts> {
        Some(GgufExperts {
            width_key: "feed_forward_length",
            shared_width_key: None,
            norm_topk_prob: true,
        })
    }

    fn is_moe(&self) -> bool {
        true
    }

    fn hub_experts(&self) -> HubExperts {
        HubExperts::PerExpert {
            block: "block_sparse_moe",
            gate: "w1",
            up: "w3",
            down: "w2",
        }
    }
}
