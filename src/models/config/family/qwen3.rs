//! Qwen3 (`model_type = "qwen3"`): Qwen2's sliding window without its biases, and RMSNorm on each query and key
//! head before RoPE.

use super::interface::{Family, WindowKeys};
use super::qwen2::slides_from_max_window_layers;

/// Qwen3.
#[derive(Debug)]
pub struct Qwen3;

impl Family for Qwen3 {
    fn model_type(&self) -> &'static str {
        "qwen3"
    }

    fn causal_lm_class(&self) -> &'static str {
        "Qwen3ForCausalLM"
    }

    fn gates_sliding_window(&self) -> bool {
        true
    }

    fn slides_by_default(&self, layer: usize, window: &WindowKeys) -> bool {
        slides_from_max_window_layers(layer, window)
    }

    fn has_qk_norm(&self) -> bool {
        true
    }
}
