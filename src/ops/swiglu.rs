//! SwiGLU gate `silu(gate) * up`: one op that keeps only its two inputs for the backward.

use candle_core::{DType, Device, Result, Tensor};

use super::autograd::{attach2, attach2_cpu};
use super::gemm::{with_slice, GemmFloat};
use super::vector::{map2, map3};

/// `silu(gate) * up`, element-wise, computed in float32 (f64 stays f64).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let dtype = gate.dtype();
    if gate.device().is_cpu() && up.dtype() == dtype && gate.dims() == up.dims() {
        match dtype {
            DType::F32 => return swiglu_cpu::<f32>(gate, up),
            DType::F64 => return swiglu_cpu::<f64>(gate, up),
            _ => {}
        }
    }
    let work = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let value =
        (gate.detach().to_dtype(work)?.silu()? * up.detach().to_dtype(work)?)?.to_dtype(dtype)?;
    attach2(
        "swiglu",
        gate,
        up,
        value,
        Box::new(move |gate, up, grad, needs| {
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
            Ok((d_gate, d_up))
        }),
    )
}

/// `σ(g)`.
#[inline(always)]
fn sigmoid<T: GemmFloat>(g: T) -> T {
    T::one() / (T::one() + (T::zero() - g).exp())
}

/// [`swiglu`] on CPU slices: one parallel, vectorized pass each way.
fn swiglu_cpu<T: GemmFloat>(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let value = with_slice::<T, _>(gate, |g| {
        with_slice::<T, _>(up, |u| Ok(map2(g, u, |g, u| g * sigmoid(g) * u)))
    })?;
    let shape = gate.shape().clone();
    attach2_cpu(
        "swiglu",
        gate,
        up,
        value,
        shape.clone(),
        Box::new(move |gate, up, grad, needs| {
            let (dg, du) = with_slice::<T, _>(gate, |g| {
                with_slice::<T, _>(up, |u| {
                    with_slice::<T, _>(grad, |dy| {
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
                    })
                })
            })?;
            let cpu = Device::Cpu;
            let tensor =
                |x: Option<Vec<T>>| x.map(|x| Tensor::from_vec(x, &shape, &cpu)).transpose();
            Ok((tensor(dg)?, tensor(du)?))
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check, rand_f64};

    #[test]
    fn gradients_match_finite_differences_and_composite() {
        let f = |xs: &[Tensor]| swiglu(&xs[0], &xs[1]);
        let r = |xs: &[Tensor]| xs[0].silu()? * &xs[1];
        let inputs = [(rand_f64(&[3, 7], 1) * 3.0).unwrap(), rand_f64(&[3, 7], 2)];
        check(&f, &r, &inputs, &[true, true], 21, 1e-6, 1e-12);
        check(&f, &r, &inputs, &[false, true], 21, 1e-6, 1e-12);
    }
}
