//! RMSNorm `y = x / sqrt(mean(x²) + eps) * w`, computed in float32 (or f64) whatever the input dtype.
//!
//! The weight may be trainable (a `Var`) or frozen; a frozen weight gets no gradient.

use candle_core::{DType, Device, Result, Tensor, D};
use rayon::prelude::*;

use super::autograd::{attach1, attach1_cpu, attach2};
use super::gemm::{with_slice, GemmFloat};
use super::vector::{self, simd};

/// Working precision: f64 stays f64 (gradient checks), everything else is computed in f32.
fn work_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// `(x̂, r)`: the normalized input and `r = 1/sqrt(mean(x²)+eps)` per row, in the working dtype.
fn normalize(x: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let x = x.to_dtype(work_dtype(x.dtype()))?;
    let r = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    Ok((x.broadcast_mul(&r)?, r))
}

/// RMSNorm over the last dimension of `x` with weight `w` (`[hidden]`).
pub fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let dtype = x.dtype();
    // The usual case — a frozen weight on the CPU — runs on slices.
    if x.device().is_cpu() && !w.track_op() && x.rank() > 0 {
        match dtype {
            DType::F32 => return rms_norm_cpu::<f32>(x, w, eps),
            DType::F64 => return rms_norm_cpu::<f64>(x, w, eps),
            _ => {}
        }
    }
    let value = {
        let (xhat, _) = normalize(&x.detach(), eps)?;
        xhat.broadcast_mul(&w.detach().to_dtype(xhat.dtype())?)?
            .to_dtype(dtype)?
    };
    // dx = r * (g·w - x̂ * mean(g·w · x̂)),  dw = Σ_rows g · x̂
    let grad_x = move |x: &Tensor, w: &Tensor, grad: &Tensor| -> Result<Tensor> {
        let (xhat, r) = normalize(x, eps)?;
        let gw = grad
            .to_dtype(xhat.dtype())?
            .broadcast_mul(&w.to_dtype(xhat.dtype())?)?;
        let proj = (&gw * &xhat)?.mean_keepdim(D::Minus1)?;
        (gw - xhat.broadcast_mul(&proj)?)?
            .broadcast_mul(&r)?
            .to_dtype(x.dtype())
    };
    let grad_w = move |x: &Tensor, w: &Tensor, grad: &Tensor| -> Result<Tensor> {
        let (xhat, _) = normalize(x, eps)?;
        let h = xhat.dim(D::Minus1)?;
        (grad.to_dtype(xhat.dtype())? * xhat)?
            .reshape(((), h))?
            .sum(0)?
            .to_dtype(w.dtype())
    };
    if w.track_op() {
        attach2(
            "rms-norm",
            x,
            w,
            value,
            Box::new(move |x, w, grad, needs| {
                let gx = if needs[0] {
                    Some(grad_x(x, w, grad)?)
                } else {
                    None
                };
                let gw = if needs[1] {
                    Some(grad_w(x, w, grad)?)
                } else {
                    None
                };
                Ok((gx, gw))
            }),
        )
    } else {
        let w = w.detach();
        attach1(
            "rms-norm",
            x,
            value,
            Box::new(move |x, grad| Ok(Some(grad_x(x, &w, grad)?))),
        )
    }
}

/// `1/sqrt(mean(x²) + eps)` of one row, accumulated in f64.
fn inverse_rms<T: GemmFloat>(row: &[T], eps: f64) -> T {
    let mean = vector::sum_zip(row, row, |v, _| v.to_f64() * v.to_f64()) / row.len() as f64;
    T::from_f64(1.0 / (mean + eps).sqrt())
}

/// [`rms_norm`] on CPU slices with a frozen weight: one pass per row each way.
fn rms_norm_cpu<T: GemmFloat>(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let h = x.dim(D::Minus1)?;
    let w: Vec<T> = w.to_dtype(T::DTYPE)?.to_vec1()?;
    if w.len() != h {
        candle_core::bail!("rms_norm: weight of {} for rows of {h}", w.len());
    }
    let value = with_slice::<T, _>(x, |xs| {
        let mut y = vec![T::zero(); xs.len()];
        y.par_chunks_mut(h)
            .zip(xs.par_chunks(h))
            .for_each(|(y, x)| {
                simd(|| {
                    let r = inverse_rms(x, eps);
                    y.iter_mut()
                        .zip(x.iter().zip(&w))
                        .for_each(|(y, (&x, &w))| *y = x * r * w);
                })
            });
        Ok(y)
    })?;
    let shape = x.shape().clone();
    attach1_cpu(
        "rms-norm",
        x,
        value,
        shape.clone(),
        Box::new(move |x, grad| {
            // dx = r·(g⊙w − x̂·mean(g⊙w⊙x̂)) with x̂ = x·r.
            let gx = with_slice::<T, _>(x, |xs| {
                with_slice::<T, _>(grad, |gs| {
                    let mut gx = vec![T::zero(); xs.len()];
                    gx.par_chunks_mut(h)
                        .zip(xs.par_chunks(h).zip(gs.par_chunks(h)))
                        .for_each(|(gx, (x, g))| {
                            simd(|| {
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
                            })
                        });
                    Ok(gx)
                })
            })?;
            Ok(Some(Tensor::from_vec(gx, &shape, &Device::Cpu)?))
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check, rand_f64};

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
