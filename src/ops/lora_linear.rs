//! The LoRA linear layer as one op: `y = x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ` with `W` frozen (dense or 4-bit) and
//! `A [r, in]`, `B [out, r]` trainable.
//!
//! As one op it keeps nothing for the backward but its inputs (which the graph holds anyway): the low-rank product
//! and the dropout mask are recomputed there (`r` is small; the mask is a pure function of the seed). The composite
//! form keeps the base output, both low-rank products, the scaled update and their sum — four activation-sized
//! tensors per layer — and runs three extra element-wise passes in each direction.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use super::autograd::attach3;
use super::frozen_linear::FrozenLinear;
use crate::rng::uniform;

/// The inverted-dropout mask (`0` or `1/(1−p)`) of `dims` for stream `seed`: a pure function of its arguments.
pub fn dropout_mask(
    seed: u64,
    p: f64,
    dims: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let keep = 1.0 - p;
    let n: usize = dims.iter().product();
    let mask: Vec<f32> = (0..n as u64)
        .map(|i| {
            if uniform(seed, i) < keep {
                (1.0 / keep) as f32
            } else {
                0.0
            }
        })
        .collect();
    Tensor::from_vec(mask, dims, device)?.to_dtype(dtype)
}

/// Dropout on the adapter input: probability and mask seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BranchDropout {
    /// Probability of dropping an element.
    pub p: f64,
    /// Seed of the mask.
    pub seed: u64,
}

/// `x·Wᵀ (+ b) + scaling·(dropout(x)·Aᵀ)·Bᵀ` for `x: [..., in]`; gradients flow to `x`, `a` and `b`. The branch runs
/// in the masters' dtype (`a`'s), the output has `x`'s dtype.
pub fn lora_linear(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
    dropout: Option<BranchDropout>,
) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let inp = *dims.last().unwrap_or(&0);
    let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    let (out_features, _) = base.weight.dims2()?;
    let mut out_dims = dims.clone();
    if let Some(last) = out_dims.last_mut() {
        *last = out_features;
    }
    let dtype = x.dtype();
    let master = a.dtype();
    // The adapter's input in the masters' dtype, dropped out when training.
    let branch_input = move |x2: &Tensor| -> Result<Tensor> {
        let xm = x2.to_dtype(master)?;
        match dropout {
            Some(d) => xm * dropout_mask(d.seed, d.p, &[rows, inp], master, x2.device())?,
            None => Ok(xm),
        }
    };
    let value = {
        let x2 = x.detach().contiguous()?.reshape((rows, inp))?;
        let w = base.weight.to_dense(dtype)?;
        let mut y = x2.matmul(&w.t()?)?;
        if let Some(bias) = &base.bias {
            y = y.broadcast_add(&bias.to_dtype(dtype)?)?;
        }
        let h = branch_input(&x2)?.matmul(&a.detach().t()?)?;
        let delta = (h.matmul(&b.detach().t()?)? * scaling)?.to_dtype(dtype)?;
        (y + delta)?.reshape(out_dims.as_slice())?
    };
    let base = base.clone();
    attach3(
        "lora-linear",
        x,
        a,
        b,
        value,
        Box::new(move |x, a, b, grad, needs| {
            let x2 = x.contiguous()?.reshape((rows, inp))?;
            let g2 = grad.contiguous()?.reshape((rows, out_features))?;
            let gm = g2.to_dtype(master)?;
            let xm = branch_input(&x2)?;
            // dL/dh for h = xm·Aᵀ.
            let gh = (gm.matmul(b)? * scaling)?;
            let ga = needs[1].then(|| gh.t()?.matmul(&xm)).transpose()?;
            let gb = if needs[2] {
                let h = xm.matmul(&a.t()?)?;
                Some((gm.t()?.matmul(&h)? * scaling)?)
            } else {
                None
            };
            let gx = if needs[0] {
                let w = base.weight.to_dense(dtype)?;
                let mut branch = gh.matmul(a)?;
                if let Some(d) = dropout {
                    branch =
                        (branch * dropout_mask(d.seed, d.p, &[rows, inp], master, x.device())?)?;
                }
                let gx = (g2.matmul(&w)? + branch.to_dtype(dtype)?)?;
                Some(gx.reshape(dims.as_slice())?)
            } else {
                None
            };
            Ok((gx, ga, gb))
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check, max_abs_diff, rand_f64};
    use crate::ops::FrozenWeight;
    use crate::quant::{Nf4Tensor, QuantConfig};

    fn composite(
        xs: &[Tensor],
        w: &Tensor,
        bias: &Tensor,
        dropout: Option<BranchDropout>,
    ) -> Result<Tensor> {
        let x = &xs[0];
        let (rows, inp) = (x.dim(0)? * x.dim(1)?, x.dim(2)?);
        let base = x.broadcast_matmul(&w.t()?)?.broadcast_add(bias)?;
        let xm = match dropout {
            Some(d) => x.broadcast_mul(
                &dropout_mask(d.seed, d.p, &[rows, inp], x.dtype(), x.device())?
                    .reshape(x.dims())?,
            )?,
            None => x.clone(),
        };
        let delta = (xm
            .broadcast_matmul(&xs[1].t()?)?
            .broadcast_matmul(&xs[2].t()?)?
            * 1.5)?;
        base + delta
    }

    #[test]
    fn gradients_match_finite_differences_and_the_composite_form() {
        let w = rand_f64(&[5, 4], 1);
        let bias = rand_f64(&[5], 2);
        let layer = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(w.clone()),
            Some(bias.clone()),
        ));
        for dropout in [None, Some(BranchDropout { p: 0.3, seed: 11 })] {
            let l = layer.clone();
            let f = move |xs: &[Tensor]| lora_linear(&xs[0], &l, &xs[1], &xs[2], 1.5, dropout);
            let (w2, b2) = (w.clone(), bias.clone());
            let r = move |xs: &[Tensor]| composite(xs, &w2, &b2, dropout);
            let inputs = [
                rand_f64(&[2, 3, 4], 3),
                rand_f64(&[2, 4], 4),
                rand_f64(&[5, 2], 5),
            ];
            check(&f, &r, &inputs, &[true, true, true], 20, 1e-5, 1e-10);
            // Frozen input (first layer of a frozen embedding): only A and B get gradients.
            check(&f, &r, &inputs, &[false, true, true], 10, 1e-5, 1e-10);
        }
    }

    #[test]
    fn four_bit_base_equals_its_dequantized_weight() {
        let w = (Tensor::randn(0f32, 1.0, (64, 128), &Device::Cpu).unwrap())
            .to_dtype(DType::F32)
            .unwrap();
        let q = Arc::new(Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap());
        let dense = q.dequantize(DType::F32).unwrap();
        let nf4 = Arc::new(FrozenLinear::new(FrozenWeight::Nf4(q), None));
        let plain = Arc::new(FrozenLinear::new(FrozenWeight::Dense(dense), None));
        let x = candle_core::Var::randn(0f32, 1.0, (3, 128), &Device::Cpu).unwrap();
        let a = candle_core::Var::randn(0f32, 0.1, (4, 128), &Device::Cpu).unwrap();
        let b = candle_core::Var::randn(0f32, 0.1, (64, 4), &Device::Cpu).unwrap();
        let run = |l: &Arc<FrozenLinear>| {
            let y = lora_linear(&x, l, &a, &b, 2.0, None).unwrap();
            let g = y.sqr().unwrap().sum_all().unwrap().backward().unwrap();
            [
                y,
                g.get(&x).unwrap().clone(),
                g.get(&a).unwrap().clone(),
                g.get(&b).unwrap().clone(),
            ]
        };
        for (p, q) in run(&nf4).iter().zip(run(&plain)) {
            let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
            assert_eq!(max_abs_diff(&f64s(p), &f64s(&q)), 0.0);
        }
    }
}
