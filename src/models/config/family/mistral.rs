//! Mistral (`model_type = "mistral"`): Llama with a sliding window on every layer when it has one.

use super::interface::{Family, WindowKeys};

/// Mistral.
#[derive(Debug)]
pub struct Mistral;

impl Family for Mistral {
    fn model_type(&self) -> &'static str {
        "mistral"
    }

    fn causal_lm_class(&self) -> &'static str {
        "MistralForCausalLM"
    }

    fn slides_by_default(&self, _layer: usize, window: &WindowKeys) -> bool {
        window.sliding_window.is_some()
    }
}
