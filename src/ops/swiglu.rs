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

/// Whether the kernels take these inputs: one float dtype and shape on a CUDA device.
#[cfg(feature = "cuda")]
fn cuda_path(gate: &Tensor, up: &Tensor) -> bool {
    gate.device().is_cuda()
        && gate.dtype() == up.dtype()
        && gate.dims() == up.dims()
        && matches!(gate.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

#[cfg(feature = "cuda")]
impl Swiglu {
    /// `kernels/swiglu.cu`, one pass each way.
    fn cuda_fwd(gate: &Tensor, up: &Tensor) -> Result<Value> {
        use crate::cuda::{
            alloc, device_of, grid, hold, kernel, run, storage, suffix, with_float_type, SWIGLU,
        };
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        let (gate, up) = (gate.contiguous()?, up.contiguous()?);
        let device = device_of(&gate)?;
        let n = gate.elem_count() as u64;
        let func = kernel(
            &device,
            &SWIGLU,
            &format!("swiglu_fwd{}", suffix(gate.dtype())?),
        )?;
        with_float_type!(gate.dtype(), T => {
            let mut y = alloc::<T>(&device, gate.elem_count())?;
            let (gh, uh) = (hold(&gate)?, hold(&up)?);
            let (gv, uv) = (gh.view::<T>()?, uh.view::<T>()?);
            let mut args = func.builder();
            args.arg(&gv).arg(&uv).arg(&n).arg(&mut y);
            run(&mut args, grid(n))?;
            Ok(Value::Cuda(storage(y, &device), gate.shape().clone()))
        })
    }

    fn cuda_bwd(
        [gate, up]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        use crate::cuda::{
            alloc, device_of, grid, hold, kernel, run, suffix, tensor, with_float_type, SWIGLU,
        };
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        let (gate, up, grad) = (gate.contiguous()?, up.contiguous()?, grad.contiguous()?);
        let device = device_of(&gate)?;
        let (len, n) = (gate.elem_count(), gate.elem_count() as u64);
        let which = needs[0] as i32 | (needs[1] as i32) << 1;
        let func = kernel(
            &device,
            &SWIGLU,
            &format!("swiglu_bwd{}", suffix(gate.dtype())?),
        )?;
        with_float_type!(gate.dtype(), T => {
            // A gradient that is not asked for gets a one-element placeholder the kernel never writes.
            let mut d_gate = alloc::<T>(&device, if needs[0] { len } else { 1 })?;
            let mut d_up = alloc::<T>(&device, if needs[1] { len } else { 1 })?;
            let (gh, uh, dh) = (hold(&gate)?, hold(&up)?, hold(&grad)?);
            let (gv, uv, dv) = (gh.view::<T>()?, uh.view::<T>()?, dh.view::<T>()?);
            let mut args = func.builder();
            args.arg(&gv).arg(&uv).arg(&dv).arg(&n).arg(&which).arg(&mut d_gate).arg(&mut d_up);
            run(&mut args, grid(n))?;
            let keep = |slice, need: bool| need.then(|| tensor(slice, &device, gate.shape().clone()));
            Ok([keep(d_gate, needs[0]), keep(d_up, needs[1])])
        })
    }
}

impl Op<2> for Swiglu {
    const NAME: &'static str = "swiglu";

    fn fwd(&mut self, [gate, up]: [&Tensor; 2]) -> Result<Value> {
        #[cfg(feature = "cuda")]
        if cuda_path(gate, up) {
            return Self::cuda_fwd(gate, up);
        }
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
        #[cfg(feature = "cuda")]
        if cuda_path(inputs[0], inputs[1]) {
            return Self::cuda_bwd(inputs, grad, needs);
        }
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
