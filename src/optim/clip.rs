//! Global L2-norm gradient clipping (`torch.nn.utils.clip_grad_norm_`).

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

/// Scales the gradients of `params` in `grads` so that their global L2 norm is at most `max_norm` (0 disables)
/// and returns the norm before clipping (what transformers logs as `grad_norm`).
pub fn clip_grad_norm(params: &[Var], grads: &mut GradStore, max_norm: f64) -> Result<f64> {
    // Summed on the gradients' device in float64 and read once: one synchronization per step, not per tensor.
    let mut total: Option<Tensor> = None;
    for p in params {
        if let Some(g) = grads.get(p) {
            let squares = g.to_dtype(DType::F64)?.sqr()?.sum_all()?;
            total = Some(match total {
                Some(t) => (t + squares)?,
                None => squares,
            });
        }
    }
    let norm = match total {
        Some(t) => t.to_scalar::<f64>()?.sqrt(),
        None => 0.0,
    };
    if max_norm > 0.0 {
        // torch: clip_coef = max_norm / (norm + 1e-6), applied only when below 1.
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for p in params {
                if let Some(g) = grads.get(p) {
                    let scaled = (g * coef)?;
                    grads.insert(p, scaled);
                }
            }
        }
    }
    Ok(norm)
}
