//! AdamW with PyTorch semantics (`torch.optim.AdamW`, single-tensor path: decoupled weight decay applied to the
//! parameter before the moment update) in float32, or in float64 for float64 parameters; and bitsandbytes' 32-bit
//! kernel.

use super::adamw8bit::BnbStep;

/// The float types AdamW's host update runs in: float32 (the trainer's masters) and float64 (a float64 model's).
pub trait AdamFloat:
    Copy
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
{
    /// `x` rounded to this type.
    fn of(x: f64) -> Self;
    /// The square root.
    fn sqrt(self) -> Self;
}

impl AdamFloat for f32 {
    fn of(x: f64) -> Self {
        x as f32
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl AdamFloat for f64 {
    fn of(x: f64) -> Self {
        x
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// `torch.optim.AdamW`'s scalars for one step, in the parameters' float type as the update applies them (the host
/// loop and the CUDA kernel share the float32 ones, so both round alike).
#[derive(Clone, Copy, Debug)]
pub(crate) struct TorchStep<T = f32> {
    /// `1 - lr · weight_decay`, when there is weight decay.
    pub decay: Option<T>,
    /// `lr / (1 - beta1^step)`.
    pub step_size: T,
    /// `1 - beta1` (the `lerp` weight of m).
    pub w1: T,
    /// `beta2`.
    pub b2: T,
    /// `1 - beta2`.
    pub w2: T,
    /// `sqrt(1 - beta2^step)`.
    pub bc2: T,
    /// `eps`.
    pub eps: T,
}

impl<T: AdamFloat> TorchStep<T> {
    /// The scalars of update `step` (from 1).
    pub fn new(step: u64, lr: f64, betas: (f64, f64), eps: f64, weight_decay: f64) -> Self {
        let (b1, b2) = betas;
        TorchStep {
            decay: (weight_decay != 0.0).then(|| T::of(1.0 - lr * weight_decay)),
            step_size: T::of(lr / (1.0 - b1.powi(step as i32))),
            w1: T::of(1.0 - b1),
            b2: T::of(b2),
            w2: T::of(1.0 - b2),
            bc2: T::of((1.0 - b2.powi(step as i32)).sqrt()),
            eps: T::of(eps),
        }
    }
}

/// One AdamW update of `p` in place, in one pass (`step` counts from 1).
#[allow(clippy::too_many_arguments)]
pub fn adamw_torch_update<T: AdamFloat>(
    p: &mut [T],
    g: &[T],
    m: &mut [T],
    v: &mut [T],
    step: u64,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
) {
    let s = TorchStep::<T>::new(step, lr, betas, eps, weight_decay);
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
