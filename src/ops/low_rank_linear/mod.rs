//! A frozen linear layer with a trainable low-rank update, as one op: `y = x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ` with
//! `W` frozen (dense or 4-bit) and `A [r, in]`, `B [out, r]` trainable — the math of a LoRA projection
//! ([`crate::lora::LoraLinear`] is the layer that holds named adapters and calls this).
//!
//! As one op it keeps nothing for the backward but its inputs (which the graph holds anyway): the low-rank product
//! and the dropout mask are recomputed there (`r` is small; the mask is a pure function of the seed). The composite
//! form keeps the base output, both low-rank products, the scaled update and their sum — four activation-sized
//! tensors per layer — and runs three extra element-wise passes in each direction.
//!
//! On the CPU in f32/f64 the op runs on slices (its `cpu` module): the bias, the scaling, a residual and the sum of the two
//! paths are folded into the GEMMs, and a change of layout to or from attention heads (with RoPE) is fused in, so
//! each direction is its matrix products and one pass. On a CUDA device (`cuda` module) the products are cuBLAS
//! GEMMs, and the head layouts (with RoPE) and a residual are fused in as well — the moves of `rows_cuda` run
//! inside the op, the products accumulate onto a copy of the residual — so the graph keeps neither a token-major
//! projection, a merged copy of the heads, nor a projection output apart from its residual sum. Other dtypes and
//! devices compose Candle's ops (same maths).

mod branch;
mod composed;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::autograd::op::{Apply, Op, Value};
use super::cpu::CpuFloat;
use super::frozen_linear::{FrozenLinear, FrozenWeight};
use super::head_layout::HeadDims;
use super::heads::{merge_heads, split_heads};
use super::rope::{rope_split_heads, RotatedRows};
use branch::CallShapes;
use composed::LowRankComposed;
use cpu::{Fused, LowRankCpu};

pub use branch::{dropout_mask, BranchDropout, LowRank, OutputValue};

/// `x·Wᵀ (+ b) + scaling·(dropout(x)·Aᵀ)·Bᵀ` for `x: [..., in]`; gradients flow to `x`, `A` and `B`. The branch
/// runs in the masters' dtype (`A`'s), the output has `x`'s dtype.
pub fn low_rank_linear(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    branch: &LowRank,
    output: OutputValue,
) -> Result<Tensor> {
    fn on_slices<T: CpuFloat>(
        x: &Tensor,
        base: &Arc<FrozenLinear>,
        branch: &LowRank,
        output: OutputValue,
    ) -> Result<Tensor> {
        LowRankCpu::<T>::new(x, base, branch, output, Fused::Nothing)?
            .apply([x, branch.a, branch.b])
    }
    match slice_path(x, base, branch) {
        Some(DType::F32) => on_slices::<f32>(x, base, branch, output),
        Some(DType::F64) => on_slices::<f64>(x, base, branch, output),
        _ => composed(x, base, branch),
    }
}

/// `residual + low_rank_linear(x, ..)` (a residual connection around the projection). On the CPU slice path one op
/// that accumulates the product onto the residual, so that the graph keeps no separate projection output.
pub fn low_rank_linear_plus(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    branch: &LowRank,
    output: OutputValue,
    residual: &Tensor,
) -> Result<Tensor> {
    fn on_slices<T: CpuFloat>(
        x: &Tensor,
        base: &Arc<FrozenLinear>,
        branch: &LowRank,
        output: OutputValue,
        residual: &Tensor,
    ) -> Result<Tensor> {
        LowRankCpu::<T>::new(x, base, branch, output, Fused::Nothing)?
            .apply_plus(x, branch, residual)
    }
    match slice_path(x, base, branch) {
        Some(DType::F32) => on_slices::<f32>(x, base, branch, output, residual),
        Some(DType::F64) => on_slices::<f64>(x, base, branch, output, residual),
        _ => {
            #[cfg(feature = "cuda")]
            if let Some(y) = cuda_plus(x, x.dims(), None, base, branch, residual)? {
                return Ok(y);
            }
            residual + composed(x, base, branch)?
        }
    }
}

/// [`low_rank_linear`] of `x: [b, t, in]` with its output split into `heads` attention heads `[b, heads, t, d]`
/// and rotated when `rope` (cos, sin) is given: equal to `rope_split_heads(low_rank_linear(x, ..), heads, cos, sin)`
/// (or `split_heads`). On the CPU slice path this is one op, so the graph never keeps the token-major output.
pub fn low_rank_linear_to_heads(
    x: &Tensor,
    base: &Arc<FrozenLinear>,
    branch: &LowRank,
    heads: usize,
    rope: Option<(&Tensor, &Tensor)>,
) -> Result<Tensor> {
    let (batch, t, _) = x.dims3()?;
    let (out, _) = base.weight.dims2()?;
    if heads == 0 || out % heads != 0 {
        candle_core::bail!(
            "low-rank linear: {out} output features do not split into {heads} heads"
        );
    }
    let dims = HeadDims {
        b: batch,
        t,
        h: heads,
        d: out / heads,
    };
    /// The fused op, when the RoPE tables fit the slice path.
    fn on_slices<T: CpuFloat>(
        x: &Tensor,
        base: &Arc<FrozenLinear>,
        branch: &LowRank,
        dims: HeadDims,
        rope: Option<(&Tensor, &Tensor)>,
    ) -> Result<Option<Tensor>> {
        let rows = match rope {
            None => None,
            Some((cos, sin)) => {
                let split = (dims.b, dims.h, dims.t, dims.d);
                match RotatedRows::for_heads(split, x, cos, sin)? {
                    Some(rows) => Some(rows),
                    None => return Ok(None),
                }
            }
        };
        let fused = Fused::OutputHeads(dims, rows);
        let op = LowRankCpu::<T>::new(x, base, branch, OutputValue::Computed, fused)?;
        op.apply([x, branch.a, branch.b]).map(Some)
    }
    let fused = match slice_path(x, base, branch) {
        Some(DType::F32) => on_slices::<f32>(x, base, branch, dims, rope)?,
        Some(DType::F64) => on_slices::<f64>(x, base, branch, dims, rope)?,
        _ => None,
    };
    if let Some(y) = fused {
        return Ok(y);
    }
    #[cfg(feature = "cuda")]
    if cuda::applies(x, branch.a, branch.b) {
        use crate::ops::rows_cuda::{MoveRows, RowLayout};
        let rows = MoveRows::new(dims, rope, RowLayout::TokenMajor, RowLayout::HeadMajor)?;
        let linear = composed_op(x.dims(), base, branch)?;
        return cuda::ToHeads { linear, rows }.apply([x, branch.a, branch.b]);
    }
    let y = low_rank_linear(x, base, branch, OutputValue::Computed)?;
    match rope {
        Some((cos, sin)) => rope_split_heads(&y, heads, cos, sin),
        None => split_heads(&y, heads),
    }
}

/// [`low_rank_linear`] of attention heads `y: [b, h, t, d]` merged into `[b, t, h·d]`, plus `residual` when given:
/// equal to `residual + low_rank_linear(merge_heads(y), ..)`. On the CPU slice path one op, so that the graph keeps
/// neither the merged copy nor a separate projection output.
pub fn low_rank_linear_from_heads(
    y: &Tensor,
    base: &Arc<FrozenLinear>,
    branch: &LowRank,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (batch, h, t, d) = y.dims4()?;
    let heads = HeadDims { b: batch, t, h, d };
    fn on_slices<T: CpuFloat>(
        y: &Tensor,
        base: &Arc<FrozenLinear>,
        branch: &LowRank,
        heads: HeadDims,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let fused = Fused::InputHeads(heads);
        let op = LowRankCpu::<T>::new(y, base, branch, OutputValue::Computed, fused)?;
        match residual {
            Some(residual) => op.apply_plus(y, branch, residual),
            None => op.apply([y, branch.a, branch.b]),
        }
    }
    match slice_path(y, base, branch) {
        Some(DType::F32) => on_slices::<f32>(y, base, branch, heads, residual),
        Some(DType::F64) => on_slices::<f64>(y, base, branch, heads, residual),
        _ => {
            #[cfg(feature = "cuda")]
            if let Some(res) = residual {
                use crate::ops::rows_cuda::{MoveRows, RowLayout};
                let mover =
                    MoveRows::new(heads, None, RowLayout::HeadMajor, RowLayout::TokenMajor)?;
                let rows_dims = [batch, t, h * d];
                if let Some(out) = cuda_plus(y, &rows_dims, Some(mover), base, branch, res)? {
                    return Ok(out);
                }
            }
            let merged = merge_heads(y)?;
            let computed = OutputValue::Computed;
            match residual {
                Some(res) => low_rank_linear_plus(&merged, base, branch, computed, res),
                None => low_rank_linear(&merged, base, branch, computed),
            }
        }
    }
}

/// The element type of the slice path, when it applies: everything on the CPU in one dtype (f32, or f64), the
/// frozen weight dense in that dtype or 4-bit (dequantized to f32).
fn slice_path(x: &Tensor, base: &FrozenLinear, branch: &LowRank) -> Option<DType> {
    let dtype = super::cpu::slice_dtype(&[x, branch.a, branch.b])?;
    let weight_fits = match &base.weight {
        FrozenWeight::Dense(w) => w.dtype() == dtype,
        FrozenWeight::Nf4(_) => dtype == DType::F32,
        FrozenWeight::Nf4OnDevice(_) | FrozenWeight::Deferred(_) | FrozenWeight::Sharded(_) => {
            false
        }
    };
    weight_fits.then_some(dtype)
}

/// [`low_rank_linear`] off the CPU slice path.
fn composed(x: &Tensor, base: &Arc<FrozenLinear>, branch: &LowRank) -> Result<Tensor> {
    composed_op(x.dims(), base, branch)?.apply([x, branch.a, branch.b])
}

/// The op off the CPU slice path for an input of `dims`.
fn composed_op(
    dims: &[usize],
    base: &Arc<FrozenLinear>,
    branch: &LowRank,
) -> Result<LowRankComposed> {
    Ok(LowRankComposed {
        base: base.clone(),
        scaling: branch.scaling,
        dropout: branch.dropout,
        shapes: CallShapes::of_dims(dims, base)?,
    })
}

/// `residual + low_rank_linear(x)` on a CUDA device as one op (`x` as attention heads when `heads` moves them),
/// when the CUDA path applies.
#[cfg(feature = "cuda")]
fn cuda_plus(
    x: &Tensor,
    rows_dims: &[usize],
    heads: Option<crate::ops::rows_cuda::MoveRows>,
    base: &Arc<FrozenLinear>,
    branch: &LowRank,
    residual: &Tensor,
) -> Result<Option<Tensor>> {
    if !cuda::applies(x, branch.a, branch.b) {
        return Ok(None);
    }
    let linear = composed_op(rows_dims, base, branch)?;
    if residual.dims() != linear.shapes.out_dims.as_slice() {
        candle_core::bail!(
            "low-rank linear: residual of shape {:?} added to an output of shape {:?}",
            residual.dims(),
            linear.shapes.out_dims
        );
    }
    let factors = (branch.a.dims2()?, branch.b.dims2()?);
    let ab = Tensor::cat(&[branch.a.flatten_all()?, branch.b.flatten_all()?], 0)?;
    cuda::PlusResidual {
        linear,
        heads,
        factors,
    }
    .apply([x, &ab, residual])
    .map(Some)
}

// The choice of path sits here, above both: `composed.rs` and `cuda.rs` import nothing from this file.
impl Op<3> for LowRankComposed {
    const NAME: &'static str = "low-rank-linear";

    fn fwd(&mut self, [x, a, b]: [&Tensor; 3]) -> Result<Value> {
        #[cfg(feature = "cuda")]
        if cuda::applies(x, a, b) {
            return self.cuda_fwd([x, a, b], None);
        }
        self.composed_fwd([x, a, b])
    }

    fn bwd(
        &self,
        [x, a, b]: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        #[cfg(feature = "cuda")]
        if cuda::applies(x, a, b) {
            return self.cuda_bwd([x, a, b], grad, needs);
        }
        self.composed_bwd([x, a, b], grad, needs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::checkpoint::OutputGradient;
    use crate::ops::autograd::gradcheck::{
        check, f32_chain_bound, max_abs_diff, rand_f64, F32_UNIT_ROUNDOFF,
    };
    use crate::ops::frozen_linear::FrozenWeight;
    use crate::quant::{Nf4Tensor, QuantConfig};
    use candle_core::Device;

    /// The branch `1.5·B·A·dropout(x)` (or another scale).
    fn branch<'a>(
        a: &'a Tensor,
        b: &'a Tensor,
        scaling: f64,
        dropout: Option<BranchDropout>,
    ) -> LowRank<'a> {
        LowRank {
            a,
            b,
            scaling,
            dropout,
        }
    }

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
                low_rank_linear(
                    &xs[0],
                    &l,
                    &branch(&xs[1], &xs[2], 1.5, dropout),
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
        use crate::ops::rope::{rope, RopeTables};
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
                    low_rank_linear_to_heads(
                        &xs[0],
                        &l,
                        &branch(&xs[1], &xs[2], 1.5, dropout),
                        3,
                        rope_of(),
                    )
                };
                let r = |xs: &[Tensor]| {
                    let y = low_rank_linear(
                        &xs[0],
                        &l,
                        &branch(&xs[1], &xs[2], 1.5, dropout),
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
                low_rank_linear_from_heads(&xs[0], &l, &branch(&xs[1], &xs[2], 1.5, dropout), None)
            };
            let r = |xs: &[Tensor]| {
                let merged = merge_heads(&xs[0])?;
                low_rank_linear(
                    &merged,
                    &l,
                    &branch(&xs[1], &xs[2], 1.5, dropout),
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
                low_rank_linear_plus(
                    &xs[0],
                    &l,
                    &branch(&xs[1], &xs[2], 1.5, dropout),
                    computed,
                    &xs[3],
                )
            };
            let r = |xs: &[Tensor]| {
                &xs[3]
                    + low_rank_linear(&xs[0], &l, &branch(&xs[1], &xs[2], 1.5, dropout), computed)?
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
                low_rank_linear_from_heads(
                    &xs[0],
                    &l,
                    &branch(&xs[1], &xs[2], 1.5, dropout),
                    Some(&xs[3]),
                )
            };
            let r = |xs: &[Tensor]| {
                let merged = merge_heads(&xs[0])?;
                &xs[3]
                    + low_rank_linear(&merged, &l, &branch(&xs[1], &xs[2], 1.5, dropout), computed)?
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
            low_rank_linear_plus(&x, &with_bias, &branch(&a, &b, 1.5, None), computed, &wrong)
                .unwrap_err();
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
            let y =
                low_rank_linear(&x, l, &branch(&a, &b, 2.0, None), OutputValue::Computed).unwrap();
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
        // The backward starts from the output's gradient, as a recomputed block's does: the value is not read.
        let run = |output| {
            let y = low_rank_linear(&x, &layer, &branch(&a, &b, 1.5, dropout), output).unwrap();
            let g = OutputGradient::new(upstream.clone())
                .apply([&y])
                .unwrap()
                .backward()
                .unwrap();
            let grads = [&x, &a, &b].map(|v| g.get(v).unwrap().clone());
            (y, grads)
        };
        let (computed, g1) = run(OutputValue::Computed);
        let (skipped, g2) = run(OutputValue::Skipped);
        // A skipped output has the shape but takes no memory: one element under it.
        let elements = |t: &Tensor| match &*t.storage_and_layout().0 {
            candle_core::Storage::Cpu(s) => s.as_slice::<f64>().unwrap().len(),
            _ => unreachable!("a CPU test"),
        };
        assert_eq!(skipped.dims(), computed.dims());
        assert_eq!((elements(&computed), elements(&skipped)), (30, 1));
        for (p, q) in g1.iter().zip(&g2) {
            assert_eq!(max_abs_diff(p, q), 0.0);
        }
    }

    /// Decoding with an adapter multiplies by the 4-bit codes in place, and equals the dequantizing path (up to
    /// float summation order), with a residual and without.
    #[test]
    fn decoding_with_an_adapter_reads_the_codes() {
        use crate::ops::frozen_linear::InferenceMode;
        let f32 = |t: Tensor| t.to_dtype(DType::F32).unwrap();
        let w = f32(rand_f64(&[48, 128], 21));
        let q = Arc::new(Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap());
        let base = Arc::new(FrozenLinear::new(FrozenWeight::Nf4(q), None));
        let (a, b) = (f32(rand_f64(&[4, 128], 22)), f32(rand_f64(&[48, 4], 23)));
        let lora = branch(&a, &b, 1.5, None);
        let x = f32(rand_f64(&[1, 2, 128], 24));
        let residual = f32(rand_f64(&[1, 2, 48], 25));
        let plain = low_rank_linear(&x, &base, &lora, OutputValue::Computed).unwrap();
        let plain_plus =
            low_rank_linear_plus(&x, &base, &lora, OutputValue::Computed, &residual).unwrap();
        let (decoded, decoded_plus) = {
            let _decoding = InferenceMode::enter();
            (
                low_rank_linear(&x, &base, &lora, OutputValue::Computed).unwrap(),
                low_rank_linear_plus(&x, &base, &lora, OutputValue::Computed, &residual).unwrap(),
            )
        };
        let f64 = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        // Two float32 computations of x·Wᵀ + 1.5·(x·Aᵀ)·Bᵀ (+ the residual): within twice the chains' bounds,
        // plus the roundings of the scaling and the two additions.
        let dense = base.weight.to_dense(DType::F32).unwrap();
        let largest = |t: &Tensor| {
            f64(t)
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let bound = |out: &Tensor| {
            let chains = f32_chain_bound(&x, &[&dense]) + 1.5 * f32_chain_bound(&x, &[&a, &b]);
            2.0 * (chains + 3.0 * F32_UNIT_ROUNDOFF * largest(out))
        };
        let d = max_abs_diff(&f64(&plain), &f64(&decoded));
        assert!(d <= bound(&plain), "{d} beyond {}", bound(&plain));
        let d = max_abs_diff(&f64(&plain_plus), &f64(&decoded_plus));
        assert!(d <= bound(&plain_plus), "{d} beyond {}", bound(&plain_plus));
        assert_ne!(
            plain.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            decoded.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            "the decoding path ran (its summation order differs from the GEMM's)"
        );
    }
}
