//! Llama 2/3/3.1/3.2, SmolLM2, TinyLlama (`model_type = "llama"`): the decoder the other families vary, so it keeps
//! every default of [`Family`].

use super::interface::Family;

/// Llama.
#[derive(Debug)]
pub struct Llama;

impl Family for Llama {
    fn model_type(&self) -> &'static str {
        "llama"
    }

    fn causal_lm_class(&self) -> &'static str {
        "LlamaForCausalLM"
    }

    fn known_models(&self) -> Option<&'static str> {
        Some("Llama 2/3/3.1/3.2, SmolLM2, TinyLlama")
    }
}
