//! Splitting a projection into attention heads and merging them back: `[b, t, h·d] ↔ [b, h, t, d]`.
//!
//! Candle does this as reshape → transpose → contiguous, three graph nodes whose backward each accumulates a
//! gradient (the transposed one strided). On the CPU each direction here is one pass and one node, its backward the
//! other direction.

use candle_core::{DType, Result, Tensor};
use rayon::prelude::*;

use super::autograd::attach1_cpu;
use super::gemm::{with_slice, GemmFloat};

/// The sizes of a `[b, t, h, d]` ↔ `[b, h, t, d]` permutation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
}

impl HeadDims {
    /// Offset of row `(batch, head, position)` in the `[b, t, h, d]` layout.
    pub fn token_major(&self, batch: usize, head: usize, position: usize) -> usize {
        ((batch * self.t + position) * self.h + head) * self.d
    }

    /// Offset of row `(batch, head, position)` in the `[b, h, t, d]` layout.
    pub fn head_major(&self, batch: usize, head: usize, position: usize) -> usize {
        ((batch * self.h + head) * self.t + position) * self.d
    }
}

/// `[b, t, h, d]` → `[b, h, t, d]` (`to_heads`) or back, `row(out_row, in_row)` writing each `d`-row (a copy, or a
/// rotation). One parallel task per output `(batch, head)` or `(batch, position)` block.
pub(crate) fn permute_rows<T: Copy + Send + Sync + Default>(
    x: &[T],
    dims: HeadDims,
    to_heads: bool,
    row: impl Fn(&mut [T], &[T], usize, usize) + Sync,
) -> Vec<T> {
    let HeadDims { t, h, d, .. } = dims;
    let mut out = vec![T::default(); x.len()];
    if to_heads {
        out.par_chunks_mut(t * d).enumerate().for_each(|(bh, o)| {
            let (batch, head) = (bh / h, bh % h);
            for (position, o) in o.chunks_mut(d).enumerate() {
                let i = dims.token_major(batch, head, position);
                row(o, &x[i..i + d], batch, position);
            }
        });
    } else {
        out.par_chunks_mut(h * d).enumerate().for_each(|(bt, o)| {
            let (batch, position) = (bt / t, bt % t);
            for (head, o) in o.chunks_mut(d).enumerate() {
                let i = dims.head_major(batch, head, position);
                row(o, &x[i..i + d], batch, position);
            }
        });
    }
    out
}

/// The shapes the slice path takes: a contiguous f32/f64 CPU tensor.
fn slice_path(x: &Tensor) -> bool {
    x.device().is_cpu() && x.is_contiguous() && matches!(x.dtype(), DType::F32 | DType::F64)
}

/// A [`permute_rows`] row that copies.
pub(crate) fn copy_row<T: Copy>(o: &mut [T], x: &[T], _: usize, _: usize) {
    o.copy_from_slice(x);
}

/// `x` (`[b, t, heads·d]`) as `[b, heads, t, d]`, contiguous.
pub fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, width) = x.dims3()?;
    let d = width / heads;
    if !slice_path(x) {
        return x.reshape((b, t, heads, d))?.transpose(1, 2)?.contiguous();
    }
    let dims = HeadDims { b, t, h: heads, d };
    match x.dtype() {
        DType::F32 => permute_cpu::<f32>(x, dims, true),
        _ => permute_cpu::<f64>(x, dims, true),
    }
}

/// `y` (`[b, heads, t, d]`) as `[b, t, heads·d]`, contiguous.
pub fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, heads, t, d) = y.dims4()?;
    if !slice_path(y) {
        return y.transpose(1, 2)?.contiguous()?.reshape((b, t, heads * d));
    }
    let dims = HeadDims { b, t, h: heads, d };
    match y.dtype() {
        DType::F32 => permute_cpu::<f32>(y, dims, false),
        _ => permute_cpu::<f64>(y, dims, false),
    }
}

fn permute_cpu<T: GemmFloat + Default>(
    x: &Tensor,
    dims: HeadDims,
    to_heads: bool,
) -> Result<Tensor> {
    let HeadDims { b, t, h, d } = dims;
    let (shape, back): (Vec<usize>, Vec<usize>) = if to_heads {
        (vec![b, h, t, d], vec![b, t, h * d])
    } else {
        (vec![b, t, h * d], vec![b, h, t, d])
    };
    let value = with_slice::<T, _>(x, |xs| Ok(permute_rows(xs, dims, to_heads, copy_row)))?;
    attach1_cpu(
        if to_heads {
            "split-heads"
        } else {
            "merge-heads"
        },
        x,
        value,
        shape.into(),
        Box::new(move |_, grad| {
            let grad = grad.contiguous()?;
            let g =
                with_slice::<T, _>(&grad, |gs| Ok(permute_rows(gs, dims, !to_heads, copy_row)))?;
            Ok(Some(Tensor::from_vec(g, back.as_slice(), grad.device())?))
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check, rand_f64};

    #[test]
    fn split_and_merge_match_candle_and_their_gradients_check() {
        let x = rand_f64(&[2, 5, 12], 3);
        check(
            &|xs: &[Tensor]| split_heads(&xs[0], 3),
            &|xs: &[Tensor]| xs[0].reshape((2, 5, 3, 4))?.transpose(1, 2)?.contiguous(),
            &[x],
            &[true],
            40,
            1e-6,
            1e-6,
        );
        let y = rand_f64(&[2, 3, 5, 4], 4);
        check(
            &|xs: &[Tensor]| merge_heads(&xs[0]),
            &|xs: &[Tensor]| xs[0].transpose(1, 2)?.contiguous()?.reshape((2, 5, 12)),
            &[y],
            &[true],
            40,
            1e-6,
            1e-6,
        );
    }
}
