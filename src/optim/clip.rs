//! Global L2-norm gradient clipping (`torch.nn.utils.clip_grad_norm_`).

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};

/// Scales the gradients of `params` in `grads` so that their global L2 norm is at most `max_norm` (0 disables)
/// and returns the norm before clipping (what transformers logs as `grad_norm`).
pub fn clip_grad_norm(params: &[Var], grads: &mut GradStore, max_norm: f64) -> Result<f64> {
    let norm = match squared_norm(params, grads)? {
        Some(t) => t.to_scalar::<f64>()?.sqrt(),
        None => 0.0,
    };
    scale_to_norm(params, grads, norm, max_norm)?;
    Ok(norm)
}

/// The squared global L2 norm of the gradients of `params`, as a float64 scalar on the gradients' device (`None`
/// without gradients): summed there, so reading it is one synchronization, not one per tensor.
pub fn squared_norm(params: &[Var], grads: &GradStore) -> Result<Option<Tensor>> {
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
    Ok(total)
}

/// Scales the gradients of global norm `norm` down to `max_norm` (torch: `clip_coef = max_norm / (norm + 1e-6)`,
/// applied only when below 1; 0 disables).
pub fn scale_to_norm(
    params: &[Var],
    grads: &mut GradStore,
    norm: f64,
    max_norm: f64,
) -> Result<()> {
    if max_norm <= 0.0 {
        return Ok(());
    }
    let coef = max_norm / (norm + 1e-6);
    if coef < 1.0 {
        for p in params {
            if let Some(g) = grads.get(p) {
                let scaled = (g * coef)?;
                grads.insert(p, scaled);
            }
        }
    }
    Ok(())
}
