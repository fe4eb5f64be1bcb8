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
    #[cfg(feature = "cuda")]
    if let Some(total) = cuda_squared_norm(params, grads)? {
        return Ok(Some(total));
    }
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

/// [`squared_norm`] of float32 gradients on one CUDA device by the crate's kernels (`None` elsewhere, or without
/// gradients): Candle's reductions would upload each tensor's layout, a host-to-device copy per parameter.
#[cfg(feature = "cuda")]
fn cuda_squared_norm(params: &[Var], grads: &GradStore) -> Result<Option<Tensor>> {
    use crate::cuda::{alloc, device_of, hold, kernel, run, tensor, ADAMW};
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    let present: Vec<&Tensor> = params.iter().filter_map(|p| grads.get(p)).collect();
    let Some(first) = present.first() else {
        return Ok(None);
    };
    if !present.iter().all(|g| {
        g.dtype() == DType::F32 && g.device().same_device(first.device()) && g.device().is_cuda()
    }) {
        return Ok(None);
    }
    let device = device_of(first)?;
    let one_block = |threads| LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut partials = alloc::<f64>(&device, present.len())?;
    let squares = kernel(&device, &ADAMW, "sum_squares")?;
    for (i, g) in present.iter().enumerate() {
        let g = g.contiguous()?;
        let held = hold(&g)?;
        let view = held.view::<f32>()?;
        let n = g.elem_count() as u64;
        let mut slot = partials.slice_mut(i..i + 1);
        let mut args = squares.builder();
        args.arg(&view).arg(&n).arg(&mut slot);
        run(&mut args, one_block(1024))?;
    }
    let mut total = alloc::<f64>(&device, 1)?;
    let count = present.len() as u64;
    let sum = kernel(&device, &ADAMW, "sum_partials")?;
    let mut args = sum.builder();
    args.arg(&partials).arg(&count).arg(&mut total);
    run(&mut args, one_block(32))?;
    Ok(Some(tensor(total, &device, ())))
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
