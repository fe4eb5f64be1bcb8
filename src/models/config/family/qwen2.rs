//! Qwen2 / Qwen2.5 (`model_type = "qwen2"`): q/k/v projections with biases, and a sliding window only with
//! `use_sliding_window`, on the layers from `max_window_layers` on.

use super::interface::{Family, WindowKeys};
use crate::models::config::keys::HfConfig;

/// Qwen2.
#[derive(Debug)]
pub struct Qwen2;

/// Qwen's sliding layers (Qwen2, Qwen3, Qwen3-MoE): those from `max_window_layers` on, when there is a window.
pub(super) fn slides_from_max_window_layers(layer: usize, window: &WindowKeys) -> bool {
    window.sliding_window.is_some() && layer >= window.max_window_layers.unwrap_or(0)
}

impl Family for Qwen2 {
    fn model_type(&self) -> &'static str {
        "qwen2"
    }

    fn causal_lm_class(&self) -> &'static str {
        "Qwen2ForCausalLM"
    }

    /// Always, whatever `attention_bias` says (transformers' Qwen2 has no such key).
    fn attention_bias(&self, _hf: &HfConfig) -> bool {
        true
    }

    fn gates_sliding_window(&self) -> bool {
        true
    }

    fn slides_by_default(&self, layer: usize, window: &WindowKeys) -> bool {
        slides_from_max_window_layers(layer, window)
    }

    fn gguf_attention_bias(&self) -> bool {
        true
    }
}
