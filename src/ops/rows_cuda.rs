//! Attention rows on a CUDA device (`kernels/rope.cu`): moved between the token-major layout of a projection
//! (`[b, t, h·d]`) and the head-major layout of attention (`[b, h, t, d]`), or kept in one, and rotated by RoPE
//! when tables are given — `split_heads`, `merge_heads`, `rope` and `rope_split_heads` as one op each way (the
//! backward moves back and rotates by `−sin`).

use candle_core::{DType, Result, Tensor};

use super::autograd::op::{Apply, Op, Value};
use super::head_layout::HeadDims;
use crate::cuda::{
    alloc, device_of, grid, hold, kernel, run, storage, suffix, with_float_type, ROPE,
};
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

/// Where the rows are: token-major `[b, t, h, d]` or head-major `[b, h, t, d]`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowLayout {
    /// `[b, t, h·d]`, as a projection writes it.
    TokenMajor,
    /// `[b, h, t, d]`, as attention reads it.
    HeadMajor,
}

/// The op (input `x` in `from`; the output in `to`); also run without a graph inside other ops.
pub(crate) struct MoveRows {
    dims: HeadDims,
    /// cos and sin, float32 `[1 or b, 1, t, d]`, contiguous.
    tables: Option<(Tensor, Tensor)>,
    per_sequence: bool,
    from: RowLayout,
    to: RowLayout,
}

/// Whether the kernel takes `x`: a float tensor on a CUDA device.
pub(crate) fn applies(x: &Tensor) -> bool {
    x.device().is_cuda()
        && crate::cuda::fused_kernels()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
}

/// `x` (in `from`, of `dims`) moved to `to` and rotated by `tables` (cos, sin of `[1 or b, 1, t, d]`) when given.
pub(crate) fn move_rows(
    x: &Tensor,
    dims: HeadDims,
    tables: Option<(&Tensor, &Tensor)>,
    from: RowLayout,
    to: RowLayout,
) -> Result<Tensor> {
    MoveRows::new(dims, tables, from, to)?.apply([x])
}

impl MoveRows {
    /// The move of rows of `dims` from `from` to `to`, rotated by `tables` (cos, sin of `[1 or b, 1, t, d]`) when
    /// given.
    pub(crate) fn new(
        dims: HeadDims,
        tables: Option<(&Tensor, &Tensor)>,
        from: RowLayout,
        to: RowLayout,
    ) -> Result<Self> {
        let HeadDims { b, t, d, .. } = dims;
        let mut per_sequence = false;
        let tables = match tables {
            None => None,
            Some((cos, sin)) => {
                let (cb, one, ct, cd) = cos.dims4()?;
                if sin.dims() != cos.dims()
                    || !(cb == 1 || cb == b)
                    || (one, ct, cd) != (1, t, d)
                    || d % 2 != 0
                {
                    candle_core::bail!(
                        "rope: tables of shape {:?} do not fit heads of {d} over {t} positions",
                        cos.dims()
                    );
                }
                per_sequence = cb > 1;
                let table = |x: &Tensor| x.to_dtype(DType::F32)?.contiguous();
                Some((table(cos)?, table(sin)?))
            }
        };
        Ok(MoveRows {
            dims,
            tables,
            per_sequence,
            from,
            to,
        })
    }

    /// `x` moved and rotated, without a graph.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Value> {
        if x.dims() != self.shape(self.from).as_slice() {
            candle_core::bail!(
                "heads: input of shape {:?}, expected {:?}",
                x.dims(),
                self.shape(self.from)
            );
        }
        self.launch(x, self.from, self.to, false)
    }

    /// The gradient of the input for the output's `grad`: moved back and rotated by `−sin`.
    pub(crate) fn backward(&self, grad: &Tensor) -> Result<Tensor> {
        self.launch(grad, self.to, self.from, true)?.into_tensor()
    }

    /// The dims of a tensor in `layout`.
    fn shape(&self, layout: RowLayout) -> Vec<usize> {
        let HeadDims { b, t, h, d } = self.dims;
        match layout {
            RowLayout::TokenMajor => vec![b, t, h * d],
            RowLayout::HeadMajor => vec![b, h, t, d],
        }
    }

    /// One launch: `x` from `from` to `to`, rotated forward or (`transposed`) backward.
    fn launch(
        &self,
        x: &Tensor,
        from: RowLayout,
        to: RowLayout,
        transposed: bool,
    ) -> Result<Value> {
        let x = x.contiguous()?;
        let device = device_of(&x)?;
        let HeadDims { b, t, h, d } = self.dims;
        let (b, h, t, d) = (b as u64, h as u64, t as u64, d as u64);
        let flags = [
            self.tables.is_some() as i32,
            self.per_sequence as i32,
            (from == RowLayout::TokenMajor) as i32,
            (to == RowLayout::TokenMajor) as i32,
            transposed as i32,
        ];
        // Without tables the kernel reads none: any float32 buffer stands in.
        let placeholder = Tensor::zeros(1, DType::F32, x.device())?;
        let (cos, sin) = match &self.tables {
            Some((c, s)) => (c, s),
            None => (&placeholder, &placeholder),
        };
        let func = kernel(&device, &ROPE, &format!("rope_move{}", suffix(x.dtype())?))?;
        with_float_type!(x.dtype(), T => {
            let mut out = alloc::<T>(&device, x.elem_count())?;
            let (xh, ch, sh) = (hold(&x)?, hold(cos)?, hold(sin)?);
            let (xv, cv, sv) = (xh.view::<T>()?, ch.view::<f32>()?, sh.view::<f32>()?);
            let mut args = func.builder();
            args.arg(&xv).arg(&cv).arg(&sv);
            for flag in &flags {
                args.arg(flag);
            }
            args.arg(&b).arg(&h).arg(&t).arg(&d).arg(&mut out);
            run(&mut args, grid(b * h * t * (d / 2)))?;
            Ok(Value::Cuda(storage(out, &device), self.shape(to).into()))
        })
    }
}

impl Op<1> for MoveRows {
    const NAME: &'static str = "move-rows";

    fn fwd(&mut self, [x]: [&Tensor; 1]) -> Result<Value> {
        self.forward(x)
    }

    fn bwd(&self, _: [&Tensor; 1], grad: &Tensor, _: [bool; 1]) -> Result<[Option<Tensor>; 1]> {
        Ok([Some(self.backward(grad)?)])
    }
}
