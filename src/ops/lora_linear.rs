//! The LoRA linear layer as one op: `y = x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ` with `W` frozen (dense or 4-bit) and
//! `A [r, in]`, `B [out, r]` trainable.
//!
//! As one op it keeps nothing for the backward but its inputs (which the graph holds anyway): the low-rank product
//! and the dropout mask are recomputed there (`r` is small; the mask is a pure function of the seed). The composite
//! form keeps the base output, both low-rank products, the scaled update and their sum — four activation-sized
//! tensors per layer — and runs three extra element-wise passes in each direction.
//!
//! On the CPU in f32/f64 the op runs on slices ([`super::gemm`]): the bias, the scaling and the sum of the two
//! paths are folded into the GEMMs, so each direction is its matrix products and nothing else. Other dtypes and
//! devices compose Candle ops (same maths).

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use super::autograd::{attach3, attach3_cpu};
use super::frozen_linear::{FrozenLinear, FrozenWeight};
use super::gemm::{matmul, matmul_into, with_slice, GemmFloat, Mat};
use super::heads::{copy_row, merge_heads, permute_rows, split_heads, HeadDims};
use super::rope::{rope_split_heads, RotatedRows};
use crate::rng::uniform;

/// The `n` values of the inverted-dropout mask (`0` or `1/(1−p)`) for stream `seed`.
fn mask_values<T: candle_core::WithDType>(seed: u64, p: f64, n: usize) -> Vec<T> {
    let keep = 1.0 - p;
    let kept = T::from_f64((1.0 / keep) as f32 as f64);
    (0..n as u64)
        .map(|i| {
            if uniform(seed, i) < keep {
                kept
            } else {
                T::zero()
            }
        })
        .collect()
}

/// The inverted-dropout mask (`0` or `1/(1−p)`) of `dims` for stream `seed`: a pure function of its arguments.
pub fn dropout_mask(
    seed: u64,
    p: f64,
    dims: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    Tensor::from_vec(mask_values::<f32>(seed, p, n), dims, device)?.to_dtype(dtype)
}

/// Dropout on the adapter input: probability and mask seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BranchDropout {
    /// Probability of dropping an element.
    pub p: f64,
    /// Seed of the mask.
    pub seed: u64,
}

/// Whether [`lora_linear`] computes its output's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputValue {
    /// The output holds `x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ`.
    Computed,
    /// The output holds zeros and only its gradients are right: for a recomputation whose output value nobody reads
    /// ([`super::Pass::Recompute`]). Honoured by the CPU slice path; the composed path computes the value anyway.
    Skipped,
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
    output: OutputValue,
) -> Result<Tensor> {
    match slice_dtype(x, base, a, b) {
        Some(DType::F32) => lora_linear_cpu::<f32>(
            x,
            base,
            a,
            b,
            scaling,
            dropout,
            output,
            Fused::Nothing,
            None,
        ),
        Some(DType::F64) => lora_linear_cpu::<f64>(
            x,
            base,
            a,
            b,
            scaling,
            dropout,
            output,
            Fused::Nothing,
            None,
        ),
        _ => lora_linear_composed(x, base, a, b, scaling, dropout),
    }
}

/// `residual + lora_linear(x, ..)` (a residual connection around the projection). On the CPU slice path one op that
/// accumulates the product onto the residual, so that the graph keeps no separate projection output.
#[allow(clippy::too_many_arguments)]
pub fn lora_linear_plus(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
    dropout: Option<BranchDropout>,
    output: OutputValue,
    residual: &Tensor,
) -> Result<Tensor> {
    let res = Some(residual);
    match slice_dtype(x, base, a, b) {
        Some(DType::F32) => {
            lora_linear_cpu::<f32>(x, base, a, b, scaling, dropout, output, Fused::Nothing, res)
        }
        Some(DType::F64) => {
            lora_linear_cpu::<f64>(x, base, a, b, scaling, dropout, output, Fused::Nothing, res)
        }
        _ => residual + lora_linear_composed(x, base, a, b, scaling, dropout)?,
    }
}

/// [`lora_linear`] of `x: [b, t, in]` with its output split into `heads` attention heads `[b, heads, t, d]` and
/// rotated when `rope` (cos, sin) is given: equal to `rope_split_heads(lora_linear(x, ..), heads, cos, sin)` (or
/// `split_heads`). On the CPU slice path this is one op, so the graph never keeps the token-major output.
#[allow(clippy::too_many_arguments)]
pub fn lora_linear_to_heads(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
    dropout: Option<BranchDropout>,
    heads: usize,
    rope: Option<(&Tensor, &Tensor)>,
) -> Result<Tensor> {
    let (batch, t, _) = x.dims3()?;
    let (out, _) = base.weight.dims2()?;
    if heads == 0 || out % heads != 0 {
        candle_core::bail!("lora-linear: {out} output features do not split into {heads} heads");
    }
    let dims = HeadDims {
        b: batch,
        t,
        h: heads,
        d: out / heads,
    };
    let computed = OutputValue::Computed;
    match slice_dtype(x, base, a, b) {
        Some(DType::F32) => {
            if let Some(fused) = Fused::<f32>::output_heads(dims, x, rope)? {
                return lora_linear_cpu(x, base, a, b, scaling, dropout, computed, fused, None);
            }
        }
        Some(DType::F64) => {
            if let Some(fused) = Fused::<f64>::output_heads(dims, x, rope)? {
                return lora_linear_cpu(x, base, a, b, scaling, dropout, computed, fused, None);
            }
        }
        _ => {}
    }
    let y = lora_linear(x, base, a, b, scaling, dropout, computed)?;
    match rope {
        Some((cos, sin)) => rope_split_heads(&y, heads, cos, sin),
        None => split_heads(&y, heads),
    }
}

/// [`lora_linear`] of attention heads `y: [b, h, t, d]` merged into `[b, t, h·d]`, plus `residual` when given: equal
/// to `residual + lora_linear(merge_heads(y), ..)`. On the CPU slice path one op, so that the graph keeps neither
/// the merged copy nor a separate projection output.
pub fn lora_linear_from_heads(
    y: &Tensor,
    base: &Arc<FrozenLinear>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
    dropout: Option<BranchDropout>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (batch, h, t, d) = y.dims4()?;
    let heads = HeadDims { b: batch, t, h, d };
    let computed = OutputValue::Computed;
    match slice_dtype(y, base, a, b) {
        Some(DType::F32) => {
            let fused = Fused::InputHeads(heads);
            lora_linear_cpu::<f32>(y, base, a, b, scaling, dropout, computed, fused, residual)
        }
        Some(DType::F64) => {
            let fused = Fused::InputHeads(heads);
            lora_linear_cpu::<f64>(y, base, a, b, scaling, dropout, computed, fused, residual)
        }
        _ => {
            let merged = merge_heads(y)?;
            match residual {
                Some(res) => lora_linear_plus(&merged, base, a, b, scaling, dropout, computed, res),
                None => lora_linear(&merged, base, a, b, scaling, dropout, computed),
            }
        }
    }
}

/// A layout change fused into the slice op, so that the token-major tensor exists only inside it.
enum Fused<T> {
    /// Input and output are token-major (`[..., in]` → `[..., out]`).
    Nothing,
    /// The input arrives as attention heads `[b, h, t, d]`, merged before the products; its gradient is split back.
    InputHeads(HeadDims),
    /// The output leaves as attention heads `[b, h, t, d]`, rotated by RoPE when tables are given.
    OutputHeads(HeadDims, Option<RotatedRows<T>>),
}

impl<T: GemmFloat + Default> Fused<T> {
    /// [`Fused::OutputHeads`] for a projection of `x`, or `None` when the RoPE tables do not fit the slice path.
    fn output_heads(
        dims: HeadDims,
        x: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
    ) -> Result<Option<Self>> {
        let Some((cos, sin)) = rope else {
            return Ok(Some(Fused::OutputHeads(dims, None)));
        };
        let split = (dims.b, dims.h, dims.t, dims.d);
        Ok(RotatedRows::for_heads(split, x, cos, sin)?
            .map(|rows| Fused::OutputHeads(dims, Some(rows))))
    }

    /// The shapes of a call on `x` (heads counted as their merged rows), with the output's dims as the op returns it.
    fn shapes(&self, x: &Tensor, base: &FrozenLinear) -> Result<CallShapes> {
        let mut shapes = match self {
            Fused::InputHeads(d) => {
                let mut merged = CallShapes::of_dims(&[d.b, d.t, d.h * d.d], base)?;
                merged.dims = x.dims().to_vec();
                merged
            }
            _ => CallShapes::of_dims(x.dims(), base)?,
        };
        if let Fused::OutputHeads(d, _) = self {
            shapes.out_dims = vec![d.b, d.h, d.t, d.d];
        }
        Ok(shapes)
    }

    /// The op's input as token-major rows.
    fn input_rows<'a>(&self, x: &'a [T]) -> Cow<'a, [T]> {
        match self {
            Fused::InputHeads(dims) => Cow::Owned(permute_rows(x, *dims, false, copy_row)),
            _ => Cow::Borrowed(x),
        }
    }

    /// The input's gradient, from token-major rows to the input's layout.
    fn input_gradient(&self, gx: Vec<T>) -> Vec<T> {
        match self {
            Fused::InputHeads(dims) => permute_rows(&gx, *dims, true, copy_row),
            _ => gx,
        }
    }

    /// The output, from token-major rows to the op's layout.
    fn output(&self, y: Vec<T>) -> Result<Vec<T>> {
        Ok(match self {
            Fused::OutputHeads(dims, Some(rows)) => rows.permute(&y, *dims, true)?,
            Fused::OutputHeads(dims, None) => permute_rows(&y, *dims, true, copy_row),
            _ => y,
        })
    }

    /// The output's gradient as token-major rows (the transpose of [`Fused::output`]).
    fn output_gradient<'a>(&self, g: &'a [T]) -> Result<Cow<'a, [T]>> {
        Ok(match self {
            Fused::OutputHeads(dims, Some(rows)) => Cow::Owned(rows.permute(g, *dims, false)?),
            Fused::OutputHeads(dims, None) => Cow::Owned(permute_rows(g, *dims, false, copy_row)),
            _ => Cow::Borrowed(g),
        })
    }
}

/// The element type of the slice path, when it applies: everything on the CPU in one dtype (f32, or f64), the
/// frozen weight dense in that dtype or 4-bit (dequantized to f32).
fn slice_dtype(x: &Tensor, base: &FrozenLinear, a: &Tensor, b: &Tensor) -> Option<DType> {
    let dtype = x.dtype();
    let weight_ok = match &base.weight {
        FrozenWeight::Dense(w) => w.dtype() == dtype,
        FrozenWeight::Nf4(_) => dtype == DType::F32,
        FrozenWeight::Nf4OnDevice(_) => false,
    };
    let same = a.dtype() == dtype && b.dtype() == dtype;
    (x.device().is_cpu() && same && weight_ok && matches!(dtype, DType::F32 | DType::F64))
        .then_some(dtype)
}

/// Runs `f` on the frozen weight's `[out, in]` values in `T` (a 4-bit weight is dequantized into a fresh buffer).
fn with_weight<T: GemmFloat, R>(
    weight: &FrozenWeight,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    with_slice(&weight.to_dense(T::DTYPE)?, f)
}

/// The shapes of a call on `x: [..., in]`.
struct CallShapes {
    /// `x`'s dims.
    dims: Vec<usize>,
    /// Input features.
    inp: usize,
    /// Rows of the flattened input.
    rows: usize,
    /// Output features.
    out: usize,
    /// The output's dims.
    out_dims: Vec<usize>,
}

impl CallShapes {
    fn of(x: &Tensor, base: &FrozenLinear) -> Result<Self> {
        Self::of_dims(x.dims(), base)
    }

    fn of_dims(dims: &[usize], base: &FrozenLinear) -> Result<Self> {
        let dims = dims.to_vec();
        let inp = *dims.last().unwrap_or(&0);
        let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
        let (out, _) = base.weight.dims2()?;
        let mut out_dims = dims.clone();
        if let Some(last) = out_dims.last_mut() {
            *last = out;
        }
        Ok(CallShapes {
            dims,
            inp,
            rows,
            out,
            out_dims,
        })
    }
}

/// [`lora_linear`] on CPU slices (see the module doc), with `fused`'s layout change on the way in or out.
#[allow(clippy::too_many_arguments)]
fn lora_linear_cpu<T: GemmFloat + Default>(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
    dropout: Option<BranchDropout>,
    output: OutputValue,
    fused: Fused<T>,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let CallShapes {
        dims,
        inp,
        rows,
        out,
        out_dims,
    } = fused.shapes(x, base)?;
    let r = a.dim(0)?;
    if let Some(residual) = residual {
        if residual.dims() != out_dims.as_slice() {
            candle_core::bail!(
                "lora-linear: residual of shape {:?} added to an output of shape {out_dims:?}",
                residual.dims()
            );
        }
    }
    let bias: Option<Vec<T>> = match &base.bias {
        Some(bias) => Some(bias.to_dtype(T::DTYPE)?.to_vec1()?),
        None => None,
    };
    // What the base product accumulates onto: the residual and the bias (each when there is one).
    let start = |residual: Option<&Tensor>| -> Result<Option<Vec<T>>> {
        let mut start = match residual {
            Some(res) => Some(with_slice::<T, _>(res, |v| Ok(v.to_vec()))?),
            None => None,
        };
        if let Some(bias) = &bias {
            match &mut start {
                Some(y) => y
                    .chunks_mut(out)
                    .for_each(|row| row.iter_mut().zip(bias).for_each(|(v, b)| *v += *b)),
                None => start = Some(bias.repeat(rows)),
            }
        }
        Ok(start)
    };
    // dropout(x), materialized only when there is dropout.
    let branch_input = move |xs: &[T]| -> Option<(Vec<T>, Vec<T>)> {
        dropout.map(|d| {
            let mask = mask_values::<T>(d.seed, d.p, rows * inp);
            let dropped = xs.iter().zip(&mask).map(|(x, m)| *x * *m).collect();
            (dropped, mask)
        })
    };
    let y = if output == OutputValue::Skipped {
        vec![T::zero(); rows * out]
    } else {
        with_slice::<T, _>(x, |xs| {
            let xs = &*fused.input_rows(xs);
            with_slice::<T, _>(a, |av| {
                with_slice::<T, _>(b, |bv| {
                    // y = residual + bias + x·Wᵀ + s·(dropout(x)·Aᵀ)·Bᵀ, accumulated in one buffer.
                    let start = start(residual)?;
                    let mut y = with_weight::<T, _>(&base.weight, |w| {
                        let (x, wt) = (Mat::new(xs, rows, inp), Mat::new(w, out, inp).t());
                        Ok(match start {
                            Some(mut y) => {
                                matmul_into(&mut y, x, wt, 1.0, true);
                                y
                            }
                            None => matmul(x, wt, 1.0),
                        })
                    })?;
                    let dropped = branch_input(xs);
                    let xm = dropped.as_ref().map_or(xs, |(d, _)| d.as_slice());
                    let h = matmul(Mat::new(xm, rows, inp), Mat::new(av, r, inp).t(), 1.0);
                    matmul_into(
                        &mut y,
                        Mat::new(&h, rows, r),
                        Mat::new(bv, out, r).t(),
                        scaling,
                        true,
                    );
                    fused.output(y)
                })
            })
        })?
    };
    let base = base.clone();
    let backward = move |x: &Tensor, a: &Tensor, b: &Tensor, grad: &Tensor, needs: [bool; 3]| {
        with_slice::<T, _>(x, |xs| {
            let xs = &*fused.input_rows(xs);
            with_slice::<T, _>(a, |av| {
                with_slice::<T, _>(b, |bv| {
                    with_slice::<T, _>(grad, |gs| {
                        let gs = &*fused.output_gradient(gs)?;
                        let g = Mat::new(gs, rows, out);
                        let dropped = branch_input(xs);
                        let xm = dropped.as_ref().map_or(xs, |(d, _)| d.as_slice());
                        // dL/dh for h = dropout(x)·Aᵀ.
                        let gh = matmul(g, Mat::new(bv, out, r), scaling);
                        let gh_mat = Mat::new(&gh, rows, r);
                        let ga = needs[1].then(|| matmul(gh_mat.t(), Mat::new(xm, rows, inp), 1.0));
                        let gb = needs[2].then(|| {
                            let h = matmul(Mat::new(xm, rows, inp), Mat::new(av, r, inp).t(), 1.0);
                            // gBᵀ = s·hᵀ·g, transposed after: gemm runs this product with `r` output rows
                            // up to twice as fast as with `r` output columns.
                            let gbt = matmul(Mat::new(&h, rows, r).t(), g, scaling);
                            Mat::new(&gbt, r, out).t().to_vec()
                        });
                        let gx = if needs[0] {
                            // g·W + dropout'(dL/dh·A): the base, then the branch added in (masked
                            // first when there is dropout).
                            let mut gx = with_weight::<T, _>(&base.weight, |w| {
                                Ok(matmul(g, Mat::new(w, out, inp), 1.0))
                            })?;
                            let a_mat = Mat::new(av, r, inp);
                            match &dropped {
                                Some((_, mask)) => {
                                    let branch = matmul(gh_mat, a_mat, 1.0);
                                    gx.iter_mut()
                                        .zip(branch.iter().zip(mask))
                                        .for_each(|(v, (b, m))| *v += *b * *m);
                                }
                                None => matmul_into(&mut gx, gh_mat, a_mat, 1.0, true),
                            }
                            let gx = fused.input_gradient(gx);
                            Some(Tensor::from_vec(gx, dims.as_slice(), &Device::Cpu)?)
                        } else {
                            None
                        };
                        let ga = ga
                            .map(|v| Tensor::from_vec(v, (r, inp), &Device::Cpu))
                            .transpose()?;
                        let gb = gb
                            .map(|v| Tensor::from_vec(v, (out, r), &Device::Cpu))
                            .transpose()?;
                        Ok((gx, ga, gb))
                    })
                })
            })
        })
    };
    let Some(residual) = residual else {
        return attach3_cpu(
            "lora-linear",
            x,
            a,
            b,
            y,
            out_dims.into(),
            Box::new(backward),
        );
    };
    // Candle's custom ops take three inputs: `A` and `B` enter as one small concatenation (whose own backward
    // splits their gradient), the residual as the third, its gradient the output's.
    let a_len = r * inp;
    let ab = Tensor::cat(&[a.flatten_all()?, b.flatten_all()?], 0)?;
    attach3_cpu(
        "lora-linear-residual",
        x,
        &ab,
        residual,
        y,
        out_dims.into(),
        Box::new(move |x, ab, _, grad, needs| {
            let a = ab.narrow(0, 0, a_len)?.reshape((r, inp))?;
            let b = ab.narrow(0, a_len, out * r)?.reshape((out, r))?;
            let (gx, ga, gb) = backward(x, &a, &b, grad, [needs[0], needs[1], needs[1]])?;
            let gab = match (ga, gb) {
                (Some(ga), Some(gb)) => {
                    Some(Tensor::cat(&[ga.flatten_all()?, gb.flatten_all()?], 0)?)
                }
                _ => None,
            };
            Ok((gx, gab, needs[2].then(|| grad.clone())))
        }),
    )
}

/// [`lora_linear`] composed of Candle ops: any dtype and device.
fn lora_linear_composed(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    a: &Tensor,
    b: &Tensor,
    scaling: f64,
    dropout: Option<BranchDropout>,
) -> Result<Tensor> {
    let CallShapes {
        dims,
        inp,
        rows,
        out: out_features,
        out_dims,
    } = CallShapes::of(x, base)?;
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
            let f = move |xs: &[Tensor]| {
                lora_linear(
                    &xs[0],
                    &l,
                    &xs[1],
                    &xs[2],
                    1.5,
                    dropout,
                    OutputValue::Computed,
                )
            };
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
    fn head_layouts_fused_in_equal_the_separate_ops() {
        use crate::ops::{rope, RopeTables};
        let tables = RopeTables::new(2, 8, 10000.0, None, &Device::Cpu).unwrap();
        let shared = tables.range(1, 3).unwrap();
        let positions = Tensor::new(&[[0u32, 1, 2], [4, 0, 1]], &Device::Cpu).unwrap();
        let per_sequence = tables.gather(&positions).unwrap();
        // 6 output features as 3 heads of 2; heads of 2 as the input of a 6 → 5 projection.
        let to_heads = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(rand_f64(&[6, 4], 21)),
            Some(rand_f64(&[6], 22)),
        ));
        let from_heads = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(rand_f64(&[5, 6], 23)),
            None,
        ));
        for dropout in [None, Some(BranchDropout { p: 0.3, seed: 11 })] {
            for tables in [None, Some(&shared), Some(&per_sequence)] {
                let rope_of = move || tables.map(|(c, s)| (c, s));
                let l = to_heads.clone();
                let f = |xs: &[Tensor]| {
                    lora_linear_to_heads(&xs[0], &l, &xs[1], &xs[2], 1.5, dropout, 3, rope_of())
                };
                let r = |xs: &[Tensor]| {
                    let y = lora_linear(
                        &xs[0],
                        &l,
                        &xs[1],
                        &xs[2],
                        1.5,
                        dropout,
                        OutputValue::Computed,
                    )?;
                    let heads = split_heads(&y, 3)?;
                    match rope_of() {
                        Some((c, s)) => rope(&heads, c, s),
                        None => Ok(heads),
                    }
                };
                let inputs = [
                    rand_f64(&[2, 3, 4], 3),
                    rand_f64(&[2, 4], 4),
                    rand_f64(&[6, 2], 5),
                ];
                check(&f, &r, &inputs, &[true, true, true], 20, 1e-5, 1e-10);
            }
            let l = from_heads.clone();
            let f = |xs: &[Tensor]| {
                lora_linear_from_heads(&xs[0], &l, &xs[1], &xs[2], 1.5, dropout, None)
            };
            let r = |xs: &[Tensor]| {
                let merged = merge_heads(&xs[0])?;
                lora_linear(
                    &merged,
                    &l,
                    &xs[1],
                    &xs[2],
                    1.5,
                    dropout,
                    OutputValue::Computed,
                )
            };
            let inputs = [
                rand_f64(&[2, 3, 3, 2], 6),
                rand_f64(&[2, 6], 7),
                rand_f64(&[5, 2], 8),
            ];
            check(&f, &r, &inputs, &[true, true, true], 20, 1e-5, 1e-10);
            check(&f, &r, &inputs, &[false, true, true], 10, 1e-5, 1e-10);
        }
    }

    #[test]
    fn residuals_added_in_the_op_equal_a_separate_sum() {
        let with_bias = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(rand_f64(&[5, 6], 31)),
            Some(rand_f64(&[5], 32)),
        ));
        let computed = OutputValue::Computed;
        for dropout in [None, Some(BranchDropout { p: 0.3, seed: 13 })] {
            let l = with_bias.clone();
            let f = |xs: &[Tensor]| {
                lora_linear_plus(&xs[0], &l, &xs[1], &xs[2], 1.5, dropout, computed, &xs[3])
            };
            let r = |xs: &[Tensor]| {
                &xs[3] + lora_linear(&xs[0], &l, &xs[1], &xs[2], 1.5, dropout, computed)?
            };
            let inputs = [
                rand_f64(&[2, 3, 6], 33),
                rand_f64(&[2, 6], 34),
                rand_f64(&[5, 2], 35),
                rand_f64(&[2, 3, 5], 36),
            ];
            check(&f, &r, &inputs, &[true, true, true, true], 20, 1e-5, 1e-10);
            // A frozen input, a frozen residual, a frozen B.
            check(&f, &r, &inputs, &[false, true, true, true], 10, 1e-5, 1e-10);
            check(&f, &r, &inputs, &[true, true, true, false], 10, 1e-5, 1e-10);
            check(&f, &r, &inputs, &[true, true, false, true], 10, 1e-5, 1e-10);
            let f = |xs: &[Tensor]| {
                lora_linear_from_heads(&xs[0], &l, &xs[1], &xs[2], 1.5, dropout, Some(&xs[3]))
            };
            let r = |xs: &[Tensor]| {
                let merged = merge_heads(&xs[0])?;
                &xs[3] + lora_linear(&merged, &l, &xs[1], &xs[2], 1.5, dropout, computed)?
            };
            let inputs = [
                rand_f64(&[2, 3, 3, 2], 37),
                rand_f64(&[2, 6], 38),
                rand_f64(&[5, 2], 39),
                rand_f64(&[2, 3, 5], 40),
            ];
            check(&f, &r, &inputs, &[true, true, true, true], 20, 1e-5, 1e-10);
        }
        // A residual of the wrong shape is an error, not a panic.
        let x = rand_f64(&[2, 3, 6], 41);
        let (a, b) = (rand_f64(&[2, 6], 42), rand_f64(&[5, 2], 43));
        let wrong = rand_f64(&[2, 3, 4], 44);
        let err =
            lora_linear_plus(&x, &with_bias, &a, &b, 1.5, None, computed, &wrong).unwrap_err();
        assert!(err.to_string().contains("residual"), "{err}");
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
            let y = lora_linear(&x, l, &a, &b, 2.0, None, OutputValue::Computed).unwrap();
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

    #[test]
    fn skipped_output_keeps_every_gradient() {
        let w = rand_f64(&[5, 4], 1);
        let layer = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(w),
            Some(rand_f64(&[5], 2)),
        ));
        let x = candle_core::Var::from_tensor(&rand_f64(&[2, 3, 4], 3)).unwrap();
        let a = candle_core::Var::from_tensor(&rand_f64(&[2, 4], 4)).unwrap();
        let b = candle_core::Var::from_tensor(&rand_f64(&[5, 2], 5)).unwrap();
        let upstream = rand_f64(&[2, 3, 5], 6);
        let dropout = Some(BranchDropout { p: 0.3, seed: 7 });
        let run = |output| {
            let y = lora_linear(&x, &layer, &a, &b, 1.5, dropout, output).unwrap();
            let g = (&y * &upstream)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let grads = [&x, &a, &b].map(|v| g.get(v).unwrap().clone());
            (y, grads)
        };
        let (computed, g1) = run(OutputValue::Computed);
        let (skipped, g2) = run(OutputValue::Skipped);
        assert!(max_abs_diff(&computed, &computed.zeros_like().unwrap()) > 0.1);
        assert_eq!(max_abs_diff(&skipped, &skipped.zeros_like().unwrap()), 0.0);
        for (p, q) in g1.iter().zip(&g2) {
            assert_eq!(max_abs_diff(p, q), 0.0);
        }
    }
}
