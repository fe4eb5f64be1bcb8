//! The low-rank linear op on CPU slices: forward and backward as matrix products into buffers the op owns, with a
//! residual, the bias and a layout change to or from attention heads folded in.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::{DType, Result, Shape, Tensor};

use super::branch::{mask_values, BranchDropout, CallShapes, LowRank, OutputValue};
use crate::ops::autograd::op::{Apply, Op, Value};
use crate::ops::cpu::gemm::{matmul, matmul_into, Mat};
use crate::ops::cpu::nf4_matvec::nf4_matvec;
use crate::ops::cpu::{gradient, with_slice, with_slices, CpuFloat};
use crate::ops::frozen_linear::{decoding_codes, FrozenLinear, FrozenWeight};
use crate::ops::head_layout::{copy_row, permute_rows, HeadDims};
use crate::ops::rope::RotatedRows;

/// A layout change fused into the op, so that the token-major tensor exists only inside it.
pub(super) enum Fused<T> {
    /// Input and output are token-major (`[..., in]` → `[..., out]`).
    Nothing,
    /// The input arrives as attention heads `[b, h, t, d]`, merged before the products; its gradient is split back.
    InputHeads(HeadDims),
    /// The output leaves as attention heads `[b, h, t, d]`, rotated by RoPE when tables are given.
    OutputHeads(HeadDims, Option<RotatedRows<T>>),
}

impl<T: CpuFloat> Fused<T> {
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

/// Runs `f` on the frozen weight's `[out, in]` values in `T` (a 4-bit weight is dequantized into a fresh buffer).
fn with_weight<T: CpuFloat, R>(
    weight: &FrozenWeight,
    f: impl FnOnce(&[T]) -> Result<R>,
) -> Result<R> {
    with_slice(&weight.to_dense(T::DTYPE)?, f)
}

/// The op on slices (inputs `[x, A, B]`; [`LowRankCpu::apply_plus`] adds a residual).
pub(super) struct LowRankCpu<T> {
    base: Arc<FrozenLinear>,
    bias: Option<Vec<T>>,
    scaling: f64,
    dropout: Option<BranchDropout>,
    output: OutputValue,
    fused: Fused<T>,
    shapes: CallShapes,
    /// The rank.
    r: usize,
}

/// The gradients of `x` (in its layout), `A` and `B`, each when asked for.
type Gradients<T> = (Option<Vec<T>>, Option<Vec<T>>, Option<Vec<T>>);

impl<T: CpuFloat> LowRankCpu<T> {
    pub(super) fn new(
        x: &Tensor,
        base: &Arc<FrozenLinear>,
        branch: &LowRank,
        output: OutputValue,
        fused: Fused<T>,
    ) -> Result<Self> {
        let bias = match &base.bias {
            Some(bias) => Some(bias.to_dtype(T::DTYPE)?.to_vec1()?),
            None => None,
        };
        Ok(LowRankCpu {
            base: base.clone(),
            bias,
            scaling: branch.scaling,
            dropout: branch.dropout,
            output,
            shapes: fused.shapes(x, base)?,
            fused,
            r: branch.a.dim(0)?,
        })
    }

    /// `residual + op(x)` as one op: inputs `[x, A‖B, residual]` (Candle's ops take three inputs, so `A` and `B`
    /// enter as one small concatenation whose own backward splits their gradient).
    pub(super) fn apply_plus(
        self,
        x: &Tensor,
        branch: &LowRank,
        residual: &Tensor,
    ) -> Result<Tensor> {
        if residual.dims() != self.shapes.out_dims.as_slice() {
            candle_core::bail!(
                "low-rank linear: residual of shape {:?} added to an output of shape {:?}",
                residual.dims(),
                self.shapes.out_dims
            );
        }
        let ab = Tensor::cat(&[branch.a.flatten_all()?, branch.b.flatten_all()?], 0)?;
        WithResidual(self).apply([x, &ab, residual])
    }

    /// The element counts of `A` and `B`.
    fn factor_lens(&self) -> (usize, usize) {
        (self.r * self.shapes.inp, self.shapes.out * self.r)
    }

    /// The dropped-out input and its mask, when there is dropout.
    fn branch_input(&self, xs: &[T]) -> Option<(Vec<T>, Vec<T>)> {
        self.dropout.map(|d| {
            let mask = mask_values::<T>(d.seed, d.p, self.shapes.rows * self.shapes.inp);
            let dropped = xs.iter().zip(&mask).map(|(x, m)| *x * *m).collect();
            (dropped, mask)
        })
    }

    /// What the base product accumulates onto: the residual and the bias (each when there is one).
    fn start(&self, residual: Option<&[T]>) -> Option<Vec<T>> {
        let (rows, out) = (self.shapes.rows, self.shapes.out);
        let mut start = residual.map(<[T]>::to_vec);
        if let Some(bias) = &self.bias {
            match &mut start {
                Some(y) => y
                    .chunks_mut(out)
                    .for_each(|row| row.iter_mut().zip(bias).for_each(|(v, b)| *v += *b)),
                None => start = Some(bias.repeat(rows)),
            }
        }
        start
    }

    /// `start + x·Wᵀ` multiplied straight from the 4-bit codes when decoding in float32 (see [`decoding_codes`]),
    /// instead of dequantizing the weight for a few rows; `None` otherwise.
    fn base_from_codes(&self, xs: &[T], start: Option<&[T]>) -> Result<Option<Vec<T>>> {
        let codes = decoding_codes(&self.base.weight, self.shapes.rows);
        let Some(q) = codes.filter(|_| T::DTYPE == DType::F32) else {
            return Ok(None);
        };
        let x: Vec<f32> = xs.iter().map(|v| v.to_f64() as f32).collect();
        let y = nf4_matvec(q, &x, self.shapes.rows)?;
        let y = y.into_iter().map(|v| T::from_f64(f64::from(v)));
        Ok(Some(match start {
            Some(start) => start.iter().zip(y).map(|(s, v)| *s + v).collect(),
            None => y.collect(),
        }))
    }

    /// `y = residual + bias + x·Wᵀ + s·(dropout(x)·Aᵀ)·Bᵀ`, accumulated in one buffer, in the output's layout.
    fn forward(&self, xs: &[T], av: &[T], bv: &[T], residual: Option<&[T]>) -> Result<Vec<T>> {
        let CallShapes { inp, rows, out, .. } = self.shapes;
        let r = self.r;
        let xs = &*self.fused.input_rows(xs);
        let start = self.start(residual);
        let mut y = match self.base_from_codes(xs, start.as_deref())? {
            Some(y) => y,
            None => with_weight::<T, _>(&self.base.weight, |w| {
                let (x, wt) = (Mat::new(xs, rows, inp), Mat::new(w, out, inp).t());
                Ok(match start {
                    Some(mut y) => {
                        matmul_into(&mut y, x, wt, 1.0, true);
                        y
                    }
                    None => matmul(x, wt, 1.0),
                })
            })?,
        };
        let dropped = self.branch_input(xs);
        let xm = dropped.as_ref().map_or(xs, |(d, _)| d.as_slice());
        let h = matmul(Mat::new(xm, rows, inp), Mat::new(av, r, inp).t(), 1.0);
        let b = Mat::new(bv, out, r).t();
        matmul_into(&mut y, Mat::new(&h, rows, r), b, self.scaling, true);
        self.fused.output(y)
    }

    /// The gradients of `x`, `A` and `B` marked in `needs` for the output gradient `gs`.
    fn backward(
        &self,
        xs: &[T],
        av: &[T],
        bv: &[T],
        gs: &[T],
        needs: [bool; 3],
    ) -> Result<Gradients<T>> {
        let CallShapes { inp, rows, out, .. } = self.shapes;
        let (r, scaling) = (self.r, self.scaling);
        let xs = &*self.fused.input_rows(xs);
        let gs = &*self.fused.output_gradient(gs)?;
        let g = Mat::new(gs, rows, out);
        let dropped = self.branch_input(xs);
        let xm = dropped.as_ref().map_or(xs, |(d, _)| d.as_slice());
        // dL/dh for h = dropout(x)·Aᵀ.
        let gh = matmul(g, Mat::new(bv, out, r), scaling);
        let gh_mat = Mat::new(&gh, rows, r);
        let ga = needs[1].then(|| matmul(gh_mat.t(), Mat::new(xm, rows, inp), 1.0));
        let gb = needs[2].then(|| {
            let h = matmul(Mat::new(xm, rows, inp), Mat::new(av, r, inp).t(), 1.0);
            // gBᵀ = s·hᵀ·g, transposed after: gemm runs this product faster with `r` output rows than with `r`
            // output columns.
            let gbt = matmul(Mat::new(&h, rows, r).t(), g, scaling);
            Mat::new(&gbt, r, out).t().to_vec()
        });
        let gx = if needs[0] {
            // g·W + dropout'(dL/dh·A): the base, then the branch added in (masked first when there is dropout).
            let mut gx = with_weight::<T, _>(&self.base.weight, |w| {
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
            Some(self.fused.input_gradient(gx))
        } else {
            None
        };
        Ok((gx, ga, gb))
    }

    /// The shapes of `x`'s, `A`'s and `B`'s gradients.
    fn gradient_shapes(&self) -> [Shape; 3] {
        let CallShapes {
            ref dims, inp, out, ..
        } = self.shapes;
        [
            dims.as_slice().into(),
            (self.r, inp).into(),
            (out, self.r).into(),
        ]
    }
}

impl<T: CpuFloat> Op<3> for LowRankCpu<T> {
    const NAME: &'static str = "low-rank-linear";

    fn fwd(&mut self, [x, a, b]: [&Tensor; 3]) -> Result<Value> {
        if self.output == OutputValue::Skipped {
            return Value::unread(&self.shapes.out_dims.as_slice().into(), x);
        }
        let y = with_slices([x, a, b], |[xs, av, bv]| self.forward(xs, av, bv, None))?;
        Ok(Value::cpu(y, self.shapes.out_dims.as_slice()))
    }

    fn bwd(
        &self,
        [x, a, b]: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let (gx, ga, gb) = with_slices([x, a, b, grad], |[xs, av, bv, gs]| {
            self.backward(xs, av, bv, gs, needs)
        })?;
        let [x_shape, a_shape, b_shape] = self.gradient_shapes();
        Ok([
            gradient(gx, &x_shape)?,
            gradient(ga, &a_shape)?,
            gradient(gb, &b_shape)?,
        ])
    }
}

/// [`LowRankCpu`] with a residual added (inputs `[x, A‖B, residual]`; the residual's gradient is the output's).
struct WithResidual<T>(LowRankCpu<T>);

impl<T: CpuFloat> Op<3> for WithResidual<T> {
    const NAME: &'static str = "low-rank-linear-residual";

    fn fwd(&mut self, [x, ab, residual]: [&Tensor; 3]) -> Result<Value> {
        let op = &self.0;
        if op.output == OutputValue::Skipped {
            return Value::unread(&op.shapes.out_dims.as_slice().into(), x);
        }
        let (a_len, _) = op.factor_lens();
        let y = with_slices([x, ab, residual], |[xs, ab, res]| {
            let (av, bv) = ab.split_at(a_len);
            op.forward(xs, av, bv, Some(res))
        })?;
        Ok(Value::cpu(y, op.shapes.out_dims.as_slice()))
    }

    fn bwd(
        &self,
        [x, ab, _]: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let op = &self.0;
        let (a_len, b_len) = op.factor_lens();
        let (gx, ga, gb) = with_slices([x, ab, grad], |[xs, ab, gs]| {
            let (av, bv) = ab.split_at(a_len);
            op.backward(xs, av, bv, gs, [needs[0], needs[1], needs[1]])
        })?;
        let [x_shape, ..] = op.gradient_shapes();
        let gab = match (ga, gb) {
            (Some(ga), Some(gb)) => Some([ga, gb].concat()),
            _ => None,
        };
        Ok([
            gradient(gx, &x_shape)?,
            gradient(gab, &(a_len + b_len).into())?,
            needs[2].then(|| grad.clone()),
        ])
    }
}
