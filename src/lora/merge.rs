//! Merging an adapter into its base: `W' = W + s·B·A` (DoRA: `W' = (m / ‖W + s·B·A‖) ⊙ (W + s·B·A)` per row),
//! computed in float32 from the dequantized base — the recommended way to deploy a QLoRA adapter (one rounding,
//! at the final dtype, instead of PEFT's dequantize → add → re-quantize).

use candle_core::{DType, Result, Tensor};

use super::linear::{LoraAdapter, LoraLinear};

/// The merged float32 weight `[out, in]` of `layer` with `adapter`.
pub fn merged_weight(layer: &LoraLinear, adapter: &LoraAdapter) -> Result<Tensor> {
    let w = layer.base.weight.to_dense(DType::F32)?;
    let delta = (adapter
        .b
        .as_tensor()
        .detach()
        .matmul(&adapter.a.as_tensor().detach())?
        * adapter.scaling)?;
    let merged = (w + delta)?;
    match &adapter.magnitude {
        None => Ok(merged),
        Some(m) => {
            let norm = merged.sqr()?.sum_keepdim(1)?.sqrt()?;
            merged.broadcast_mul(&m.as_tensor().detach().unsqueeze(1)?.broadcast_div(&norm)?)
        }
    }
}

/// The merged weight of the active adapter, or the base weight (f32) when none is active.
pub fn effective_weight(layer: &LoraLinear) -> Result<Tensor> {
    match layer.active_adapter() {
        Some(a) => merged_weight(layer, a),
        None => layer.base.weight.to_dense(DType::F32),
    }
}
