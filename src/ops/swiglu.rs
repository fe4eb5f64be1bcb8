//! SwiGLU gate `silu(gate) * up`: one op that keeps only its two inputs for the backward.

use candle_core::{DType, Result, Tensor};

use super::autograd::{Apply, Op, Value};
use super::cpu::vector::{map2, map3};
use super::cpu::{gradient, slice_dtype, with_slices, CpuFloat};
use super::work_dtype;

/// `silu(gate) * up`, element-wise, computed in float32 (f64 stays f64).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    Swiglu.apply([gate, up])
}

/// The SwiGLU op (inputs `[gate, up]`).
struct Swiglu;

/// `σ(g)`.
#[inline(always)]
fn sigmoid<T: CpuFloat>(g: T) -> T {
    T::one() / (T::one() + (T::zero() - g).exp())
}

/// The element type of the slice path for these inputs, if it applies.
fn slice_path(gate: &Tensor, up: &Tensor) -> Option<DType> {
    slice_dtype(&[gate, up]).filter(|_| gate.dims() == up.dims())
}

impl Swiglu {
    /// One parallel, vectorized pass.
    fn cpu_fwd<T: CpuFloat>(gate: &Tensor, up: &Tensor) -> Result<Value> {
        let value = with_slices([gate, up], |[g, u]| {
            Ok(map2(g, u, |g, u: T| g * sigmoid(g) * u))
        })?;
        Ok(Value::cpu(value, gate.shape()))
    }

    fn cpu_bwd<T: CpuFloat>(
        [gate, up]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let (dg, du) = with_slices([gate, up, grad], |[g, u, dy]| {
            // silu'(g) = σ(g)·(1 + g·(1 − σ(g)))
            let dg = needs[0].then(|| {
                let dsilu = |g: T| {
                    let s = sigmoid(g);
                    s * (T::one() + g * (T::one() - s))
                };
                map3(g, u, dy, |g, u, dy| dy * u * dsilu(g))
            });
            let du = needs[1].then(|| map2(g, dy, |g, dy| dy * g * sigmoid(g)));
            Ok((dg, du))
        })?;
        Ok([gradient(dg, gate.shape())?, gradient(du, up.shape())?])
    }

    /// Any dtype and device: Candle's ops.
    fn composed_fwd(gate: &Tensor, up: &Tensor) -> Result<Value> {
        let work = work_dtype(gate.dtype());
        let value = (gate.detach().to_dtype(work)?.silu()? * up.detach().to_dtype(work)?)?;
        Ok(Value::Tensor(value.to_dtype(gate.dtype())?))
    }

    fn composed_bwd(
        [gate, up]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let work = work_dtype(gate.dtype());
        let (g, u, dy) = (
            gate.to_dtype(work)?,
            up.to_dtype(work)?,
            grad.to_dtype(work)?,
        );
        let sig = candle_nn::ops::sigmoid(&g)?;
        let silu = (&g * &sig)?;
        let d_gate = if needs[0] {
            // silu'(g) = σ(g)·(1 + g·(1 − σ(g)))
            let dsilu = (&sig * ((&g * (1.0 - &sig)?)? + 1.0)?)?;
            Some((&dy * &u)?.mul(&dsilu)?.to_dtype(gate.dtype())?)
        } else {
            None
        };
        let d_up = if needs[1] {
            Some((&dy * &silu)?.to_dtype(up.dtype())?)
        } else {
            None
        };
        Ok([d_gate, d_up])
    }
}

impl Op<2> for Swiglu {
    const NAME: &'static str = "swiglu";

    fn fwd(&mut self, [gate, up]: [&Tensor; 2]) -> Result<Value> {
        match slice_path(gate, up) {
            Some(DType::F32) => Self::cpu_fwd::<f32>(gate, up),
            Some(DType::F64) => Self::cpu_fwd::<f64>(gate, up),
            _ => Self::composed_fwd(gate, up),
        }
    }

    fn bwd(
        &self,
        inputs: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        match slice_path(inputs[0], inputs[1]) {
            Some(DType::F32) => Self::cpu_bwd::<f32>(inputs, grad, needs),
            Some(DType::F64) => Self::cpu_bwd::<f64>(inputs, grad, needs),
            _ => Self::composed_bwd(inputs, grad, needs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, rand_f64};

    #[test]
    fn gradients_match_finite_differences_and_composite() {
        let f = |xs: &[Tensor]| swiglu(&xs[0], &xs[1]);
        let r = |xs: &[Tensor]| xs[0].silu()? * &xs[1];
        let inputs = [(rand_f64(&[3, 7], 1) * 3.0).unwrap(), rand_f64(&[3, 7], 2)];
        check(&f, &r, &inputs, &[true, true], 21, 1e-6, 1e-12);
        check(&f, &r, &inputs, &[false, true], 21, 1e-6, 1e-12);
    }
}
