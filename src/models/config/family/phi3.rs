//! Phi-3 / Phi-3.5 / Phi-4-mini (`model_type = "phi3"`): fused `qkv_proj` and `gate_up_proj` (one LoRA pair over
//! each fused output, as PEFT), partial rotary and LongRoPE (read by the generic RoPE keys), a sliding window on
//! every layer when it has one.

use super::interface::{Family, WindowKeys};

/// Phi-3.
#[derive(Debug)]
pub struct Phi3;

impl Family for Phi3 {
    fn model_type(&self) -> &'static str {
        "phi3"
    }

    fn causal_lm_class(&self) -> &'static str {
        "Phi3ForCausalLM"
    }

    fn slides_by_default(&self, _layer: usize, window: &WindowKeys) -> bool {
        window.sliding_window.is_some()
    }

    fn has_fused_projections(&self) -> bool {
        true
    }

    fn default_lora_targets(&self) -> Option<&'static [&'static str]> {
        None
    }
}
