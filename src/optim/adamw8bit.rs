//! bitsandbytes' blockwise 8-bit AdamW (`kOptimizerStatic8bit2StateBlockwise`, bnb ≥ 0.44): both moments stored as
//! 8-bit codes of the dynamic maps (signed for m, unsigned for v) with one float32 absmax per 256 elements.
//!
//! Per element with a finite gradient: dequantize, update the moments, step the parameter, decay it (decoupled,
//! *after* the step); a NaN/Inf gradient zeroes that element's moments and leaves the parameter. Then the new block
//! absmax (padding included, as the kernel's block reduction sees it) and the re-quantization by the 8-bit search
//! with the sign fix for m. Float32 IEEE arithmetic in the kernel's operation order (the CUDA build's fast-math
//! approximations of pow and division are not reproduced; see the golden script).

use rayon::prelude::*;

use crate::quant::dynamic_map::quantize_dynamic;

/// Elements per absmax block.
pub const BLOCK: usize = 256;

/// `(correction2, step_size)` as the kernels compute them, with `beta^step` formed in float64 by repeated
/// multiplication (so it is the same on every platform) and rounded to float32.
pub fn bias_corrections(step: u64, lr: f32, b1: f32, b2: f32) -> (f32, f32) {
    let pow = |b: f32| {
        let mut acc = 1f64;
        for _ in 0..step {
            acc *= b as f64;
        }
        acc as f32
    };
    let correction1 = 1.0f32 - pow(b1);
    let correction2 = (1.0f32 - pow(b2)).sqrt();
    let step_size = (-lr * correction2) / correction1;
    (correction2, step_size)
}

/// bitsandbytes' scalars for one step of its 32-bit and 8-bit Adam kernels, in float32 (the host loops and the
/// CUDA kernels share them, so both round alike).
#[derive(Clone, Copy, Debug)]
pub(crate) struct BnbStep {
    /// `beta1`.
    pub b1: f32,
    /// `beta2`.
    pub b2: f32,
    /// `-lr · sqrt(1 - beta2^step) / (1 - beta1^step)`.
    pub step_size: f32,
    /// `eps · sqrt(1 - beta2^step)`, added to `sqrt(v)`.
    pub denom_eps: f32,
    /// `1 - lr · weight_decay`, applied after the step when there is weight decay.
    pub decay: Option<f32>,
}

impl BnbStep {
    /// The scalars of update `step` (from 1).
    pub fn new(step: u64, lr: f32, betas: (f32, f32), eps: f32, weight_decay: f32) -> Self {
        let (b1, b2) = betas;
        let (correction2, step_size) = bias_corrections(step, lr, b1, b2);
        BnbStep {
            b1,
            b2,
            step_size,
            denom_eps: correction2 * eps,
            decay: (weight_decay > 0.0).then_some(1.0 - lr * weight_decay),
        }
    }
}

/// The 8-bit state of one parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct Adam8bitState {
    /// First-moment codes (signed map).
    pub state1: Vec<u8>,
    /// Second-moment codes (unsigned map).
    pub state2: Vec<u8>,
    /// First-moment absmax per 256 elements.
    pub absmax1: Vec<f32>,
    /// Second-moment absmax per 256 elements.
    pub absmax2: Vec<f32>,
}

impl Adam8bitState {
    /// Zero state for `n` elements, as bitsandbytes initializes it.
    pub fn zeros(n: usize) -> Self {
        let blocks = n.div_ceil(BLOCK);
        Adam8bitState {
            state1: vec![0; n],
            state2: vec![0; n],
            absmax1: vec![0.0; blocks],
            absmax2: vec![0.0; blocks],
        }
    }

    /// Bytes of state per element (≈ 2 + 8/256).
    pub fn size_in_bytes(&self) -> usize {
        self.state1.len() + self.state2.len() + 4 * (self.absmax1.len() + self.absmax2.len())
    }
}

/// Hyper-parameters of one 8-bit step.
#[derive(Clone, Copy, Debug)]
pub struct Adam8bitStep<'a> {
    /// Step count (from 1).
    pub step: u64,
    /// Learning rate.
    pub lr: f32,
    /// (beta1, beta2).
    pub betas: (f32, f32),
    /// Epsilon.
    pub eps: f32,
    /// Decoupled weight decay.
    pub weight_decay: f32,
    /// Signed dynamic map (m).
    pub qmap1: &'a [f32; 256],
    /// Unsigned dynamic map (v).
    pub qmap2: &'a [f32; 256],
}

/// One 8-bit AdamW update of `p` with gradient `g`, in one pass per 256-block.
pub fn adamw8bit_update(p: &mut [f32], g: &[f32], state: &mut Adam8bitState, h: &Adam8bitStep<'_>) {
    let BnbStep {
        b1,
        b2,
        step_size,
        denom_eps,
        decay,
    } = BnbStep::new(h.step, h.lr, h.betas, h.eps, h.weight_decay);
    let (q1, q2) = (h.qmap1, h.qmap2);
    // Blocks are independent: update them in parallel (the result does not depend on the thread count).
    p.par_chunks_mut(BLOCK)
        .zip(g.par_chunks(BLOCK))
        .zip(state.state1.par_chunks_mut(BLOCK))
        .zip(state.state2.par_chunks_mut(BLOCK))
        .zip(
            state
                .absmax1
                .par_iter_mut()
                .zip(state.absmax2.par_iter_mut()),
        )
        .for_each(|((((p, g), c1s), c2s), (a1, a2))| {
            let len = p.len();
            let mut s1 = [0f32; BLOCK];
            let mut s2 = [0f32; BLOCK];
            let mut max1 = f32::MIN;
            let mut max2 = f32::MIN;
            for j in 0..BLOCK {
                // Padding beyond the tensor: g = 0, codes 128 / 0 (the kernel's load defaults).
                let (gj, c1, c2) = if j < len {
                    (g[j], c1s[j], c2s[j])
                } else {
                    (0.0, 128, 0)
                };
                if gj.is_finite() {
                    let v = q2[c2 as usize] * *a2;
                    s2[j] = v * b2 + (1.0 - b2) * gj * gj;
                    let m = q1[c1 as usize] * *a1;
                    s1[j] = m * b1 + (1.0 - b1) * gj;
                } else {
                    s1[j] = 0.0;
                    s2[j] = 0.0;
                }
                max1 = max1.max(s1[j].abs());
                max2 = max2.max(s2[j].abs());
            }
            *a1 = max1;
            *a2 = max2;
            for j in 0..len {
                if g[j].is_finite() {
                    p[j] += step_size * (s1[j] / (s2[j].sqrt() + denom_eps));
                    if let Some(decay) = decay {
                        p[j] *= decay;
                    }
                }
                let mut c1 = quantize_dynamic(q1, s1[j] / max1);
                // Keep the sign of m through quantization.
                if q1[c1 as usize].is_sign_negative() != s1[j].is_sign_negative() {
                    c1 = if s1[j] > 0.0 {
                        c1.wrapping_add(1)
                    } else {
                        c1.wrapping_sub(1)
                    };
                }
                c1s[j] = c1;
                c2s[j] = quantize_dynamic(q2, s2[j] / max2);
            }
        });
}
