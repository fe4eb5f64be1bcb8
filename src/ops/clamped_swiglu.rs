//! gpt-oss's expert activation on its interleaved gate/up projection: with `gate = x[..., 0::2]` and
//! `up = x[..., 1::2]`, `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`, the output is
//! `(u + 1) · g · σ(α·g)` (transformers' `GptOssExperts._apply_gate`).
//!
//! One op over the interleaved tensor, so neither half is copied out; its derivative follows PyTorch's `clamp`,
//! which passes the gradient where the input lies inside the closed range (a value equal to the limit still gets
//! it). Composed of Candle's ops on detached tensors, so it runs on any device.

use candle_core::{Result, Tensor, D};

use super::autograd::op::{Apply, Op, Value};
use crate::precision::master_dtype;

/// The constants of gpt-oss's clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ClampedSwiglu {
    /// The sigmoid's gain (1.702).
    pub alpha: f64,
    /// The clamp: the gate from above, the up projection on both sides (7.0).
    pub limit: f64,
}

/// `(clamp(up) + 1) · g · σ(α·g)`, `g = min(gate, limit)`, over `gate_up` (`[..., 2·width]`, gate and up
/// interleaved): `[..., width]`, computed in float32 (f64 stays f64), in `gate_up`'s dtype.
pub fn clamped_swiglu(gate_up: &Tensor, params: ClampedSwiglu) -> Result<Tensor> {
    if gate_up.dim(D::Minus1)? % 2 != 0 {
        candle_core::bail!(
            "clamped_swiglu: the interleaved gate/up width must be even, not {}",
            gate_up.dim(D::Minus1)?
        );
    }
    ClampedSwigluOp(params).apply([gate_up])
}

struct ClampedSwigluOp(ClampedSwiglu);

/// `[..., 2w]` → the `(gate, up)` halves `[..., w]`, in the working dtype.
fn halves(gate_up: &Tensor) -> Result<(Tensor, Tensor)> {
    let mut dims = gate_up.dims().to_vec();
    let last = dims.pop().expect("at least one dimension") / 2;
    dims.extend([last, 2]);
    let x = gate_up
        .detach()
        .to_dtype(master_dtype(gate_up.dtype()))?
        .reshape(dims)?;
    Ok((
        x.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?,
        x.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?,
    ))
}

/// 1 where `lo ≤ x ≤ hi`, else 0 (in `x`'s dtype).
fn inside(x: &Tensor, lo: f64, hi: f64) -> Result<Tensor> {
    let above = x.ge(lo)?;
    let below = x.le(hi)?;
    above.to_dtype(x.dtype())? * below.to_dtype(x.dtype())?
}

impl Op<1> for ClampedSwigluOp {
    const NAME: &'static str = "clamped-swiglu";

    fn fwd(&mut self, [gate_up]: [&Tensor; 1]) -> Result<Value> {
        let ClampedSwiglu { alpha, limit } = self.0;
        let (gate, up) = halves(gate_up)?;
        let g = gate.minimum(limit)?;
        let u = up.clamp(-limit, limit)?;
        let glu = (&g * candle_nn::ops::sigmoid(&(&g * alpha)?)?)?;
        let y = ((u + 1.0)? * glu)?;
        Ok(Value::Tensor(y.to_dtype(gate_up.dtype())?))
    }

    /// With `s = σ(α·g)`: `∂y/∂gate = [gate ≤ limit]·(u + 1)·(s + α·g·s·(1 − s))`, `∂y/∂up = [|up| ≤ limit]·g·s`.
    fn bwd(
        &self,
        [gate_up]: [&Tensor; 1],
        grad: &Tensor,
        _: [bool; 1],
    ) -> Result<[Option<Tensor>; 1]> {
        let ClampedSwiglu { alpha, limit } = self.0;
        let (gate, up) = halves(gate_up)?;
        let dy = grad.to_dtype(gate.dtype())?;
        let g = gate.minimum(limit)?;
        let u = up.clamp(-limit, limit)?;
        let s = candle_nn::ops::sigmoid(&(&g * alpha)?)?;
        let ds = ((&g * alpha)? * (&s * (1.0 - &s)?)?)?;
        let d_gate =
            ((&dy * (u + 1.0)?)? * (&s + ds)?)?.mul(&inside(&gate, f64::NEG_INFINITY, limit)?)?;
        let d_up = ((&dy * (&g * &s)?)? * inside(&up, -limit, limit)?)?;
        let d = Tensor::stack(&[d_gate, d_up], D::Minus1)?
            .reshape(gate_up.shape())?
            .to_dtype(gate_up.dtype())?;
        Ok([Some(d)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, rand_f64};
    use candle_core::{DType, Device};

    const GPT_OSS: ClampedSwiglu = ClampedSwiglu {
        alpha: 1.702,
        limit: 7.0,
    };

    /// The activation composed of Candle's differentiable ops (no clamp: the inputs stay inside or outside the
    /// range by a margin, where the clamp's derivative is a constant).
    fn composite(x: &Tensor, p: ClampedSwiglu) -> Result<Tensor> {
        let (n, w2) = x.dims2()?;
        let pairs = x.reshape((n, w2 / 2, 2))?;
        let gate = pairs.narrow(2, 0, 1)?.squeeze(2)?;
        let up = pairs.narrow(2, 1, 1)?.squeeze(2)?;
        let cut = |t: &Tensor, above: f64| -> Result<Tensor> {
            // `t` where below the limit, the limit (as a constant) above it.
            let mask = t.le(above)?.to_dtype(t.dtype())?;
            (t * &mask)? + ((1.0 - mask)? * above)?
        };
        let g = cut(&gate, p.limit)?;
        let u = cut(&up, p.limit)?.neg()?;
        let u = cut(&u, p.limit)?.neg()?;
        let s = ((&g * -p.alpha)?.exp()? + 1.0)?.recip()?;
        (u + 1.0)? * (g * s)?
    }

    /// Values well inside and well outside the clamp, so the finite differences do not straddle a kink.
    fn inputs(seed: u64) -> Tensor {
        let x = (rand_f64(&[5, 12], seed) * 6.0).unwrap();
        let v: Vec<f64> = x.flatten_all().unwrap().to_vec1().unwrap();
        let v: Vec<f64> = v
            .into_iter()
            .map(|e| {
                if (e.abs() - 7.0).abs() < 0.1 {
                    e * 0.8
                } else {
                    e
                }
            })
            .collect();
        Tensor::from_vec(v, (5, 12), &Device::Cpu).unwrap()
    }

    #[test]
    fn gradients_match_finite_differences_and_composite() {
        let f = |xs: &[Tensor]| clamped_swiglu(&xs[0], GPT_OSS);
        let r = |xs: &[Tensor]| composite(&xs[0], GPT_OSS);
        // A small limit puts many values past the clamp on both sides.
        let tight = ClampedSwiglu {
            alpha: 1.702,
            limit: 1.5,
        };
        let f_tight = move |xs: &[Tensor]| clamped_swiglu(&xs[0], tight);
        let r_tight = move |xs: &[Tensor]| composite(&xs[0], tight);
        for seed in [1, 2] {
            check(&f, &r, &[inputs(seed)], &[true], 30, 1e-6, 1e-12);
            let x = (rand_f64(&[5, 12], seed + 10) * 4.0).unwrap();
            check(&f_tight, &r_tight, &[x], &[true], 30, 1e-6, 1e-12);
        }
    }

    /// transformers' values: `(clamp(up, ±7) + 1) · min(gate, 7) · σ(1.702 · min(gate, 7))` at hand-picked
    /// points, in float32 too; an odd width is refused.
    #[test]
    fn values_and_shape() {
        let x = Tensor::new(&[[9.0f64, 8.0, 1.0, -9.0, -2.0, 0.5]], &Device::Cpu).unwrap();
        let y: Vec<f64> = clamped_swiglu(&x, GPT_OSS)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
        let want = [
            8.0 * 7.0 * sig(1.702 * 7.0),
            -6.0 * 1.0 * sig(1.702),
            1.5 * -2.0 * sig(-3.404),
        ];
        for (g, w) in y.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{g} vs {w}");
        }
        let y32: Vec<f32> = clamped_swiglu(&x.to_dtype(DType::F32).unwrap(), GPT_OSS)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (g, w) in y32.iter().zip(want) {
            assert!((*g as f64 - w).abs() < 1e-5 * w.abs().max(1.0));
        }
        let odd = Tensor::zeros((2, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(clamped_swiglu(&odd, GPT_OSS).is_err());
    }
}
