//! AdamW with float32 states and PyTorch semantics (`torch.optim.AdamW`, single-tensor path): decoupled weight
//! decay applied to the parameter before the moment update.

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
    let (b1, b2) = betas;
    let decay = (1.0 - lr * weight_decay) as f32;
    let bias_correction1 = 1.0 - b1.powi(step as i32);
    let bias_correction2_sqrt = (1.0 - b2.powi(step as i32)).sqrt();
    let step_size = (lr / bias_correction1) as f32;
    let (w1, b2f, w2) = ((1.0 - b1) as f32, b2 as f32, (1.0 - b2) as f32);
    let (bc2, epsf) = (bias_correction2_sqrt as f32, eps as f32);
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        if weight_decay != 0.0 {
            *p *= decay;
        }
        // exp_avg.lerp_(grad, 1 - beta1)
        *m += w1 * (*g - *m);
        *v = *v * b2f + w2 * *g * *g;
        let denom = v.sqrt() / bc2 + epsf;
        *p -= step_size * *m / denom;
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
    let (b1, b2) = betas;
    let (correction2, step_size) = super::adamw8bit::bias_corrections(step, lr, b1, b2);
    for (((p, g), s1), s2) in p.iter_mut().zip(g).zip(s1.iter_mut()).zip(s2.iter_mut()) {
        *s1 = *s1 * b1 + (1.0 - b1) * *g;
        *s2 = *s2 * b2 + (1.0 - b2) * (*g * *g);
        *p += step_size * (*s1 / (s2.sqrt() + eps * correction2));
        if weight_decay > 0.0 {
            *p *= 1.0 - lr * weight_decay;
        }
    }
}
