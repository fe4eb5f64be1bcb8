//! Gemma 2 (`model_type = "gemma2"`): norms that store `w` and scale by `1 + w`, around each block's output too;
//! GeGLU with the tanh GELU; embeddings × √hidden, tied to the head; soft-capped attention scores and output
//! logits; sliding-window layers alternating with full ones, sliding first.

use super::interface::{Family, WindowKeys};
use crate::ops::GateActivation;

/// Gemma 2.
#[derive(Debug)]
pub struct Gemma2;

impl Family for Gemma2 {
    fn model_type(&self) -> &'static str {
        "gemma2"
    }

    fn causal_lm_class(&self) -> &'static str {
        "Gemma2ForCausalLM"
    }

    fn default_activation(&self) -> GateActivation {
        GateActivation::GeluTanh
    }

    fn activation_key(&self) -> &'static str {
        "hidden_activation"
    }

    fn ties_embeddings_by_default(&self) -> bool {
        true
    }

    fn slides_by_default(&self, layer: usize, _window: &WindowKeys) -> bool {
        (layer + 1) % 2 != 0
    }

    fn gguf_default_sliding_window(&self) -> Option<usize> {
        Some(4096)
    }

    fn gguf_default_softcapping(&self) -> Option<(f64, f64)> {
        Some((50.0, 30.0))
    }

    /// Gemma scales scores by 1/√head_dim, but the 27B model (46 layers) by 1/√(hidden / heads), as its config says.
    fn gguf_query_pre_attn_scalar(
        &self,
        layers: usize,
        hidden: usize,
        heads: usize,
    ) -> Option<f64> {
        (layers == 46).then(|| (hidden / heads.max(1)) as f64)
    }

    fn gguf_module(&self, module: &str) -> Option<&'static str> {
        gemma_gguf_module(module)
    }

    fn norm_weight_offset(&self) -> f64 {
        1.0
    }

    fn scales_embeddings(&self) -> bool {
        true
    }

    fn has_feedforward_norms(&self) -> bool {
        true
    }
}

/// llama.cpp's name of Gemma's norm after attention (the others' `post_attention_layernorm` is the MLP's input
/// norm, `ffn_norm`).
pub(super) fn gemma_gguf_module(module: &str) -> Option<&'static str> {
    (module == "post_attention_layernorm").then_some("post_attention_norm")
}
