//! Splitting a projection into attention heads and merging them back: `[b, t, h·d] ↔ [b, h, t, d]`.
//!
//! Candle does this as reshape → transpose → contiguous, three graph nodes whose backward each accumulates a
//! gradient (the transposed one strided). On the CPU each direction here is one pass and one node, its backward the
//! other direction.

use candle_core::{DType, Device, Result, Tensor};

use super::autograd::op::{Apply, Op, Value};
use super::cpu::{with_slice, CpuFloat};
use super::head_layout::{copy_row, permute_rows, HeadDims};

/// The shapes the slice path takes: a contiguous f32/f64 CPU tensor.
fn slice_path(x: &Tensor) -> bool {
    x.device().is_cpu() && x.is_contiguous() && matches!(x.dtype(), DType::F32 | DType::F64)
}

/// `x` (`[b, t, heads·d]`) as `[b, heads, t, d]`, contiguous.
pub fn split_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, t, width) = x.dims3()?;
    let d = width / heads;
    #[cfg(feature = "cuda")]
    if super::rows_cuda::applies(x) {
        use super::rows_cuda::{move_rows, RowLayout};
        let dims = HeadDims { b, t, h: heads, d };
        return move_rows(x, dims, None, RowLayout::TokenMajor, RowLayout::HeadMajor);
    }
    if !slice_path(x) {
        return x.reshape((b, t, heads, d))?.transpose(1, 2)?.contiguous();
    }
    let dims = HeadDims { b, t, h: heads, d };
    match x.dtype() {
        DType::F32 => PermuteHeads::<f32>::new(dims, true).apply([x]),
        _ => PermuteHeads::<f64>::new(dims, true).apply([x]),
    }
}

/// `y` (`[b, heads, t, d]`) as `[b, t, heads·d]`, contiguous.
pub fn merge_heads(y: &Tensor) -> Result<Tensor> {
    let (b, heads, t, d) = y.dims4()?;
    #[cfg(feature = "cuda")]
    if super::rows_cuda::applies(y) {
        use super::rows_cuda::{move_rows, RowLayout};
        let dims = HeadDims { b, t, h: heads, d };
        return move_rows(y, dims, None, RowLayout::HeadMajor, RowLayout::TokenMajor);
    }
    if !slice_path(y) {
        return y.transpose(1, 2)?.contiguous()?.reshape((b, t, heads * d));
    }
    let dims = HeadDims { b, t, h: heads, d };
    match y.dtype() {
        DType::F32 => PermuteHeads::<f32>::new(dims, false).apply([y]),
        _ => PermuteHeads::<f64>::new(dims, false).apply([y]),
    }
}

/// [`split_heads`] (`to_heads`) or [`merge_heads`] on CPU slices (input `x`); the backward is the other one.
struct PermuteHeads<T> {
    dims: HeadDims,
    to_heads: bool,
    element: std::marker::PhantomData<T>,
}

impl<T> PermuteHeads<T> {
    fn new(dims: HeadDims, to_heads: bool) -> Self {
        PermuteHeads {
            dims,
            to_heads,
            element: std::marker::PhantomData,
        }
    }

    /// The dims of the output (`to_heads`) or of the input.
    fn dims(&self, heads_layout: bool) -> Vec<usize> {
        let HeadDims { b, t, h, d } = self.dims;
        if heads_layout {
            vec![b, h, t, d]
        } else {
            vec![b, t, h * d]
        }
    }
}

impl<T: CpuFloat> Op<1> for PermuteHeads<T> {
    const NAME: &'static str = "permute-heads";

    fn fwd(&mut self, [x]: [&Tensor; 1]) -> Result<Value> {
        let value = with_slice::<T, _>(x, |xs| {
            Ok(permute_rows(xs, self.dims, self.to_heads, copy_row))
        })?;
        Ok(Value::cpu(value, self.dims(self.to_heads)))
    }

    fn bwd(&self, _: [&Tensor; 1], grad: &Tensor, _: [bool; 1]) -> Result<[Option<Tensor>; 1]> {
        let g = with_slice::<T, _>(grad, |gs| {
            Ok(permute_rows(gs, self.dims, !self.to_heads, copy_row))
        })?;
        let dims = self.dims(!self.to_heads);
        Ok([Some(Tensor::from_vec(g, dims, &Device::Cpu)?)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, rand_f64};

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
