//! The op off the CPU slice path, composed of Candle's ops (any dtype and device); on a GPU the CUDA path
//! (`cuda.rs`) takes its place where it applies.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use super::branch::{dropout_mask, BranchDropout, CallShapes};
use crate::ops::autograd::op::Value;
use crate::ops::frozen_linear::FrozenLinear;

/// The op off the CPU slice path (inputs `[x, A, B]`): the CUDA kernels and cuBLAS on a GPU where they apply
/// (`cuda.rs`), else composed of Candle's ops (any dtype and device).
pub(super) struct LowRankComposed {
    pub(super) base: Arc<FrozenLinear>,
    pub(super) scaling: f64,
    pub(super) dropout: Option<BranchDropout>,
    pub(super) shapes: CallShapes,
}

impl LowRankComposed {
    /// The branch's input `[rows, in]` in the masters' dtype, dropped out when training.
    fn branch_input(&self, x2: &Tensor, master: DType) -> Result<Tensor> {
        let xm = x2.to_dtype(master)?;
        match self.dropout {
            Some(d) => xm * self.mask(d, master, x2.device())?,
            None => Ok(xm),
        }
    }

    /// The dropout mask of the branch's input `[rows, in]`.
    fn mask(&self, d: BranchDropout, dtype: DType, device: &Device) -> Result<Tensor> {
        let CallShapes { rows, inp, .. } = self.shapes;
        dropout_mask(d.seed, d.p, &[rows, inp], dtype, device)
    }

    /// The forward composed of Candle's ops.
    pub(super) fn composed_fwd(&self, [x, a, b]: [&Tensor; 3]) -> Result<Value> {
        let CallShapes {
            inp,
            rows,
            ref out_dims,
            ..
        } = self.shapes;
        let dtype = x.dtype();
        let x2 = x.detach().contiguous()?.reshape((rows, inp))?;
        let w = self.base.weight.to_dense(dtype)?;
        let mut y = x2.matmul(&w.t()?)?;
        if let Some(bias) = &self.base.bias {
            y = y.broadcast_add(&bias.to_dtype(dtype)?)?;
        }
        let h = self
            .branch_input(&x2, a.dtype())?
            .matmul(&a.detach().t()?)?;
        let delta = (h.matmul(&b.detach().t()?)? * self.scaling)?.to_dtype(dtype)?;
        Ok(Value::Tensor((y + delta)?.reshape(out_dims.as_slice())?))
    }

    /// The backward composed of Candle's ops.
    pub(super) fn composed_bwd(
        &self,
        [x, a, b]: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let CallShapes {
            ref dims,
            inp,
            rows,
            out,
            ..
        } = self.shapes;
        let (dtype, master) = (x.dtype(), a.dtype());
        let x2 = x.contiguous()?.reshape((rows, inp))?;
        let g2 = grad.contiguous()?.reshape((rows, out))?;
        let gm = g2.to_dtype(master)?;
        let xm = self.branch_input(&x2, master)?;
        // dL/dh for h = xm·Aᵀ.
        let gh = (gm.matmul(b)? * self.scaling)?;
        let ga = needs[1].then(|| gh.t()?.matmul(&xm)).transpose()?;
        let gb = if needs[2] {
            let h = xm.matmul(&a.t()?)?;
            Some((gm.t()?.matmul(&h)? * self.scaling)?)
        } else {
            None
        };
        let gx = if needs[0] {
            let w = self.base.weight.to_dense(dtype)?;
            let mut branch = gh.matmul(a)?;
            if let Some(d) = self.dropout {
                branch = (branch * self.mask(d, master, x.device())?)?;
            }
            let gx = (g2.matmul(&w)? + branch.to_dtype(dtype)?)?;
            Some(gx.reshape(dims.as_slice())?)
        } else {
            None
        };
        Ok([gx, ga, gb])
    }
}
