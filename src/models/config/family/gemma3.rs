//! Gemma 3 text (`model_type = "gemma3_text"`; GGUF's `gemma3`): Gemma 2 with query/key norms instead of
//! soft-capping, a full layer every `sliding_window_pattern` layers, and a RoPE base of its own for the
//! sliding-window layers.

use super::gemma2::{gemma_gguf_module, Gemma2};
use super::interface::{Family, WindowKeys};
use crate::ops::GateActivation;

/// Gemma 3's language model.
#[derive(Debug)]
pub struct Gemma3;

impl Family for Gemma3 {
    fn model_type(&self) -> &'static str {
        "gemma3_text"
    }

    fn causal_lm_class(&self) -> &'static str {
        "Gemma3ForCausalLM"
    }

    /// GGUF's `gemma3` is the text model; a Hugging Face `gemma3` folder is the vision-language model.
    fn refused_model_type(&self, model_type: &str) -> Option<&'static str> {
        (model_type == "gemma3").then_some(
            "model_type `gemma3` is Gemma 3 with its vision tower (Gemma3ForConditionalGeneration), which is not \
             supported; the text-only models (`gemma3_text`, e.g. gemma-3-1b) and GGUF files of the language \
             model are",
        )
    }

    fn gguf_names(&self) -> &'static [&'static str] {
        &["gemma3"]
    }

    fn default_rope_theta(&self) -> f64 {
        1_000_000.0
    }

    /// Its sliding layers always have their own base (llama.cpp fixes it at 10⁴ too).
    fn default_sliding_rope_theta(&self) -> Option<f64> {
        Some(10_000.0)
    }

    fn default_activation(&self) -> GateActivation {
        Gemma2.default_activation()
    }

    fn activation_key(&self) -> &'static str {
        Gemma2.activation_key()
    }

    fn ties_embeddings_by_default(&self) -> bool {
        Gemma2.ties_embeddings_by_default()
    }

    fn slides_by_default(&self, layer: usize, window: &WindowKeys) -> bool {
        (layer + 1) % window.sliding_window_pattern.unwrap_or(6).max(1) != 0
    }

    /// Gemma scales scores by 1/√head_dim, but the 27B model (62 layers) by 1/√(hidden / heads), as its config says.
    fn gguf_query_pre_attn_scalar(
        &self,
        layers: usize,
        hidden: usize,
        heads: usize,
    ) -> Option<f64> {
        (layers == 62).then(|| (hidden / heads.max(1)) as f64)
    }

    fn gguf_module(&self, module: &str) -> Option<&'static str> {
        gemma_gguf_module(module)
    }

    fn norm_weight_offset(&self) -> f64 {
        Gemma2.norm_weight_offset()
    }

    fn scales_embeddings(&self) -> bool {
        Gemma2.scales_embeddings()
    }

    fn has_feedforward_norms(&self) -> bool {
        Gemma2.has_feedforward_norms()
    }

    fn has_qk_norm(&self) -> bool {
        true
    }
}
