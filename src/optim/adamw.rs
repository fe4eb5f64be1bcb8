//! AdamW with float32 states and PyTorch semantics (`torch.optim.AdamW`, single-tensor path): decoupled weight
//! decay applied to the parameter before the moment update; and bitsandbytes' 32-bit kernel.

use super::adamw8bit::BnbStep;

/// `torch.optim.AdamW`'s scalars for one step, in float32 as the update applies them (the host loop and the CUDA
/// kernel share them, so both round alike).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TorchStep {
    /// `1 - lr · weight_decay`, when there is weight decay.
    pub decay: Option<f32>,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `1 - beta1` (the `lerp` weight of m).
    pub w1: f32,
    /// `beta2`.
    pub b2: f32,
    /// `1 - beta2`.
    pub w2: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2: f32,
    /// `eps`.
    pub eps: f32,
}

impl TorchStep {
    /// The scalars of update `step` (from 1).
    pub fn new(step: u64, lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) -> Self {
        let (b1, b2) = betas;
        TorchStep {
            decay: (weight_decay != 0.0).then_some((1.0 - lr * weight_decay) as f32),
            step_size: (lr / (1.0 - b1.powi(step as i32))) as f32,
            w1: (1.0 - b1) as f32,
            b2: b2 as f32,
            w2: (1.0 - b2) as f32,
            bc2: (1.0 - b2.powi(step as i32)).sqrt() as f32,
            eps: eps as f32,
        }
    }
}

/// One AdamW update of `p` in place, in one pass (`step` counts from 1).
#[allow(clippy::too_many_arguments)]
pub fn adamw_torch_update(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    step: u64,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
) {
    let s = TorchStep::new(step, lr, betas, eps, weight_decay);
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        if let Some(decay) = s.decay {
            *p *= decay;
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        *m += s.w1 * (*g - *m);
        *v = *v * s.b2 + s.w2 * *g * *g;
        let denom = v.sqrt() / s.bc2 + s.eps;
        *p -= s.step_size * *m / denom;
    }
}

/// One update of bitsandbytes' 32-bit Adam kernel (`kOptimizer32bit2State`): weight decay *after* the step,
/// `eps` scaled by the bias correction, float32 throughout (`paged_adamw_32bit`, and 8-bit optimizers' small
/// tensors).
#[allow(clippy::too_many_arguments)]
pub fn adamw_bnb32_update(
    p: &mut [f32],
    g: &[f32],
    s1: &mut [f32],
    s2: &mut [f32],
    step: u64,
    lr: f32,
    betas: (f32, f32),
    eps: f32,
    weight_decay: f32,
) {
    let s = BnbStep::new(step, lr, betas, eps, weight_decay);
    for (((p, g), s1), s2) in p.iter_mut().zip(g).zip(s1.iter_mut()).zip(s2.iter_mut()) {
        *s1 = *s1 * s.b1 + (1.0 - s.b1) * *g;
        *s2 = *s2 * s.b2 + (1.0 - s.b2) * (*g * *g);
        *p += s.step_size * (*s1 / (s2.sqrt() + s.denom_eps));
        if let Some(decay) = s.decay {
            *p *= decay;
        }
    }
}
