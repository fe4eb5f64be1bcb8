//! RMSNorm `y = x / sqrt(mean(x²) + eps) * w`, computed in float32 (or f64) whatever the input dtype.
//!
//! The weight may be trainable (a `Var`) or frozen; a frozen weight gets no gradient.

use candle_core::{DType, Result, Tensor, D};
use rayon::prelude::*;

use super::autograd::op::{Apply, Op, Value};
use super::cpu::vector::{self, simd};
use super::cpu::{gradient, slice_dtype, with_slice, with_slices, CpuFloat};
use crate::precision::master_dtype;

/// RMSNorm over the last dimension of `x` with weight `w` (`[hidden]`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    RmsNorm {
        eps,
        path: Path::Composed,
    }
    .apply([x, w])
}

/// The RMSNorm op (inputs `[x, w]`).
struct RmsNorm {
    eps: f64,
    /// Chosen by the forward, followed by the backward.
    path: Path,
}

/// How the op computes.
#[derive(Clone, Copy)]
enum Path {
    /// On CPU slices, with the weight's values (the usual case: a frozen weight, which gets no gradient).
    Slices(DType),
    /// By `kernels/norm.cu` on a CUDA device (a frozen weight).
    #[cfg(feature = "cuda")]
    Cuda,
    /// Candle's ops: any dtype, device, and a trainable weight.
    Composed,
}

/// `(x̂, r)`: the normalized input and `r = 1/sqrt(mean(x²)+eps)` per row, in the working dtype.
fn normalize(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let x = x.to_dtype(master_dtype(x.dtype()))?;
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok((x.broadcast_mul(&r)?, r))
}

/// `1/sqrt(mean(x²) + eps)` of one row, accumulated in f64.
fn inverse_rms<T: CpuFloat>(row: &[T], eps: f64) -> T {
    let mean = vector::sum_zip(row, row, |v, _| v.to_f64() * v.to_f64()) / row.len() as f64;
    T::from_f64(1.0 / (mean + eps).sqrt())
}

impl RmsNorm {
    /// The weight's values in `T`, checked against the rows of `x`.
    fn weight_values<T: CpuFloat>(x: &Tensor, w: &Tensor) -> Result<(Vec<T>, usize)> {
        let h = x.dim(D::Minus1)?;
        let w: Vec<T> = w.to_dtype(T::DTYPE)?.to_vec1()?;
        if w.len() != h {
            candle_core::bail!("rms_norm: weight of {} for rows of {h}", w.len());
        }
        Ok((w, h))
    }

    /// One pass per row.
    fn cpu_fwd<T: CpuFloat>(&self, x: &Tensor, w: &Tensor) -> Result<Value> {
        let (w, h) = Self::weight_values::<T>(x, w)?;
        let eps = self.eps;
        let value = with_slice::<T, _>(x, |xs| {
            let mut y = vec![T::zero(); xs.len()];
            y.par_chunks_mut(h)
                .zip(xs.par_chunks(h))
                .for_each(|(y, x)| {
                    simd(
                        #[inline(always)]
                        || {
                            let r = inverse_rms(x, eps);
                            y.iter_mut()
                                .zip(x.iter().zip(&w))
                                .for_each(|(y, (&x, &w))| *y = x * r * w);
                        },
                    )
                });
            Ok(y)
        })?;
        Ok(Value::cpu(value, x.shape()))
    }

    /// `dx = r·(g⊙w − x̂·mean(g⊙w⊙x̂))` with `x̂ = x·r`, one pass per row.
    fn cpu_bwd<T: CpuFloat>(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> Result<Option<Tensor>> {
        let (w, h) = Self::weight_values::<T>(x, w)?;
        let eps = self.eps;
        let gx = with_slices([x, grad], |[xs, gs]| {
            let mut gx = vec![T::zero(); xs.len()];
            gx.par_chunks_mut(h)
                .zip(xs.par_chunks(h).zip(gs.par_chunks(h)))
                .for_each(|(gx, (x, g))| {
                    simd(
                        #[inline(always)]
                        || {
                            let r = inverse_rms(x, eps);
                            // g⊙w first, in the output row.
                            gx.iter_mut()
                                .zip(g.iter().zip(&w))
                                .for_each(|(o, (&g, &w))| *o = g * w);
                            let proj = vector::sum_zip(gx, x, |gw, x| (gw * x * r).to_f64());
                            let proj = T::from_f64(proj / h as f64);
                            gx.iter_mut()
                                .zip(x)
                                .for_each(|(o, &x)| *o = r * (*o - x * r * proj));
                        },
                    )
                });
            Ok(gx)
        })?;
        gradient(Some(gx), x.shape())
    }

    fn composed_fwd(&self, x: &Tensor, w: &Tensor) -> Result<Value> {
        let (xhat, _) = normalize(&x.detach(), self.eps)?;
        let y = xhat.broadcast_mul(&w.detach().to_dtype(xhat.dtype())?)?;
        Ok(Value::Tensor(y.to_dtype(x.dtype())?))
    }

    /// `dx = r * (g·w - x̂ * mean(g·w · x̂))`,  `dw = Σ_rows g · x̂`.
    fn composed_bwd(
        &self,
        [x, w]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let (xhat, r) = normalize(x, self.eps)?;
        let gx = if needs[0] {
            let gw = grad
                .to_dtype(xhat.dtype())?
                .broadcast_mul(&w.to_dtype(xhat.dtype())?)?;
            let proj = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
            let gx = (gw - xhat.broadcast_mul(&proj)?)?.broadcast_mul(&r)?;
            Some(gx.to_dtype(x.dtype())?)
        } else {
            None
        };
        let gw = if needs[1] {
            let h = xhat.dim(D::Minus1)?;
            let gw = (grad.to_dtype(xhat.dtype())? * xhat)?
                .reshape(((), h))?
                .sum(0)?;
            Some(gw.to_dtype(w.dtype())?)
        } else {
            None
        };
        Ok([gx, gw])
    }
}

#[cfg(feature = "cuda")]
impl RmsNorm {
    /// Whether the kernels take these inputs: a frozen weight, a float input on a CUDA device.
    fn cuda_applies(x: &Tensor, w: &Tensor) -> bool {
        x.device().is_cuda()
            && crate::cuda::fused_kernels()
            && !w.track_op()
            && x.rank() > 0
            && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
    }

    /// Kernel `which` (`rms_norm_fwd` or `rms_norm_bwd`) over the rows of `x`; `grad` for the backward.
    fn cuda_run(
        &self,
        which: &str,
        x: &Tensor,
        w: &Tensor,
        grad: Option<&Tensor>,
    ) -> Result<Value> {
        use crate::cuda::{
            alloc, device_of, hold, kernel, rows_grid, run, storage, suffix, with_float_type, NORM,
        };
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        let h = x.dim(D::Minus1)?;
        let rows = (x.elem_count() / h.max(1)) as u64;
        let (x, w) = (x.contiguous()?, w.to_dtype(DType::F32)?.contiguous()?);
        let grad = grad.map(|g| g.contiguous()).transpose()?;
        let device = device_of(&x)?;
        let (eps, width) = (self.eps as f32, h as u64);
        let name = format!("{which}{}", suffix(x.dtype())?);
        with_float_type!(x.dtype(), T => {
            let mut out = alloc::<T>(&device, x.elem_count())?;
            let (xh, wh) = (hold(&x)?, hold(&w)?);
            let (xv, wv) = (xh.view::<T>()?, wh.view::<f32>()?);
            let gh = grad.as_ref().map(hold).transpose()?;
            let gv = gh.as_ref().map(|g| g.view::<T>()).transpose()?;
            let func = kernel(&device, &NORM, &name)?;
            let mut args = func.builder();
            args.arg(&xv).arg(&wv);
            if let Some(gv) = &gv {
                args.arg(gv);
            }
            args.arg(&eps).arg(&rows).arg(&width).arg(&mut out);
            run(&mut args, rows_grid(rows))?;
            Ok(Value::Cuda(storage(out, &device), x.shape().clone()))
        })
    }
}

impl Op<2> for RmsNorm {
    const NAME: &'static str = "rms-norm";

    fn fwd(&mut self, [x, w]: [&Tensor; 2]) -> Result<Value> {
        // The slice path takes a frozen weight on the CPU (any dtype: its values are read in x's).
        let slices = slice_dtype(&[x]).filter(|_| !w.track_op() && x.rank() > 0);
        self.path = slices.map_or(Path::Composed, Path::Slices);
        #[cfg(feature = "cuda")]
        if Self::cuda_applies(x, w) {
            self.path = Path::Cuda;
        }
        match self.path {
            Path::Slices(DType::F32) => self.cpu_fwd::<f32>(x, w),
            Path::Slices(_) => self.cpu_fwd::<f64>(x, w),
            #[cfg(feature = "cuda")]
            Path::Cuda => self.cuda_run("rms_norm_fwd", x, w, None),
            Path::Composed => self.composed_fwd(x, w),
        }
    }

    fn bwd(
        &self,
        [x, w]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        match self.path {
            Path::Slices(DType::F32) => Ok([self.cpu_bwd::<f32>(x, w, grad)?, None]),
            Path::Slices(_) => Ok([self.cpu_bwd::<f64>(x, w, grad)?, None]),
            #[cfg(feature = "cuda")]
            Path::Cuda => {
                let dx = self.cuda_run("rms_norm_bwd", x, w, Some(grad))?;
                Ok([Some(dx.into_tensor()?), None])
            }
            Path::Composed => self.composed_bwd([x, w], grad, needs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, rand_f64};

    fn reference(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
        candle_nn::ops::rms_norm_slow(x, w, eps as f32)
    }

    #[test]
    fn trainable_weight() {
        // An eps exactly representable in f32, since the reference takes it as f32.
        let eps = 1.0 / 131072.0;
        let f = |xs: &[Tensor]| rms_norm(&xs[0], &xs[1], eps);
        let r = |xs: &[Tensor]| reference(&xs[0], &xs[1], eps);
        check(
            &f,
            &r,
            &[rand_f64(&[2, 3, 6], 1), (rand_f64(&[6], 2) + 1.0).unwrap()],
            &[true, true],
            36,
            1e-6,
            1e-12,
        );
    }

    #[test]
    fn frozen_weight_odd_width() {
        let eps = 1.0 / 1048576.0;
        let f = |xs: &[Tensor]| rms_norm(&xs[0], &xs[1], eps);
        let r = |xs: &[Tensor]| reference(&xs[0], &xs[1], eps);
        check(
            &f,
            &r,
            &[rand_f64(&[5, 7], 3), (rand_f64(&[7], 4) + 1.0).unwrap()],
            &[true, false],
            35,
            1e-6,
            1e-12,
        );
    }

    #[test]
    fn bf16_input_is_normalized_in_f32() {
        let x = rand_f64(&[4, 8], 5).to_dtype(DType::BF16).unwrap();
        let w = Tensor::ones(8, DType::F32, &candle_core::Device::Cpu).unwrap();
        let y = rms_norm(&x, &w, 1e-5).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let r = reference(&x.to_dtype(DType::F32).unwrap(), &w, 1e-5)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let d = (y.to_dtype(DType::F32).unwrap() - r.to_dtype(DType::F32).unwrap())
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap();
        assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0);
    }
}
