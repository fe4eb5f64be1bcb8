//! The low-rank linear op on a CUDA device: the frozen weight dequantized by one kernel, every product a cuBLAS GEMM
//! in the activations' dtype with float32 accumulation, the low-rank update added into the base output
//! (`beta = 1`), and the dropout masks made on the device (`kernels/dropout.cu`). The branch runs in the
//! activations' dtype, as PEFT's under autocast; the gradients of `A` and `B` come out in float32.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{DType, Result, Tensor};

use super::branch::CallShapes;
use super::composed::LowRankComposed;
use crate::cuda::{
    alloc, device_of, grid, hold, kernel, product, run, storage, suffix, tensor, with_float_type,
    GemmShape, DROPOUT,
};
use crate::ops::autograd::op::{Op, Value};
use crate::ops::frozen_linear::decoding_device_codes;
use crate::ops::rows_cuda::MoveRows;

/// Whether the CUDA path takes these inputs: float activations on a GPU, float32 masters.
pub(super) fn applies(x: &Tensor, a: &Tensor, b: &Tensor) -> bool {
    x.device().is_cuda()
        && crate::cuda::fused_kernels()
        && matches!(x.dtype(), DType::F32 | DType::BF16 | DType::F16)
        && a.dtype() == DType::F32
        && b.dtype() == DType::F32
}

impl LowRankComposed {
    /// `x ⊙ mask` (a new buffer) with this step's dropout, or `x` itself without dropout.
    fn dropped_out(&self, x: &Tensor) -> Result<Tensor> {
        let Some(d) = self.dropout else {
            return Ok(x.clone());
        };
        let device = device_of(x)?;
        let (keep, n) = (1.0 - d.p, x.elem_count() as u64);
        let func = kernel(
            &device,
            &DROPOUT,
            &format!("dropout_apply{}", suffix(x.dtype())?),
        )?;
        with_float_type!(x.dtype(), T => {
            let mut out = alloc::<T>(&device, x.elem_count())?;
            let xh = hold(x)?;
            let xv = xh.view::<T>()?;
            let mut args = func.builder();
            args.arg(&d.seed).arg(&keep).arg(&n).arg(&xv).arg(&mut out);
            run(&mut args, grid(n))?;
            Ok(tensor(out, &device, x.shape().clone()))
        })
    }

    /// The forward on the device; with `start` (a residual of the output's shape) the products accumulate onto a
    /// copy of it, so no separate projection output exists.
    pub(super) fn cuda_fwd(
        &self,
        [x, a, b]: [&Tensor; 3],
        start: Option<&Tensor>,
    ) -> Result<Value> {
        let CallShapes {
            inp,
            rows,
            out,
            ref out_dims,
            ..
        } = self.shapes;
        let dtype = x.dtype();
        let r = a.dim(0)?;
        let x = x.contiguous()?;
        // A decoding step multiplies by the 4-bit codes in place; otherwise the weight is dequantized for cuBLAS.
        let codes = match start {
            Some(_) => None,
            None => decoding_device_codes(&self.base.weight, &x, rows),
        };
        let start = start.map(|s| s.to_dtype(dtype)?.contiguous()).transpose()?;
        let xd = self.dropped_out(&x)?;
        let (a, b) = (
            a.to_dtype(dtype)?.contiguous()?,
            b.to_dtype(dtype)?.contiguous()?,
        );
        let device = device_of(&x)?;
        let y = with_float_type!(dtype, T => {
            let mut y = alloc::<T>(&device, rows * out)?;
            let base_beta = match &start {
                Some(start) => {
                    let held = hold(start)?;
                    device
                        .cuda_stream()
                        .memcpy_dtod(&held.view::<T>()?, &mut y)
                        .map_err(candle_core::Error::wrap)?;
                    1.0
                }
                None => 0.0,
            };
            let mut h = alloc::<T>(&device, rows * r)?;
            let held = [hold(&x)?, hold(&xd)?, hold(&a)?, hold(&b)?];
            let [xv, xdv, av, bv] = [0, 1, 2, 3].map(|i| held[i].view::<T>());
            let (xv, xdv, av, bv) = (xv?, xdv?, av?, bv?);
            // y = x·Wᵀ;  h = dropout(x)·Aᵀ;  y += s·h·Bᵀ.
            match codes {
                Some(q) => q.matvec_into(&x.reshape((rows, inp))?, &mut y)?,
                None => {
                    let w = self.base.weight.to_dense(dtype)?.contiguous()?;
                    let wh = hold(&w)?;
                    let base = GemmShape { m: rows, n: out, k: inp, a_t: false, b_t: true, alpha: 1.0, beta: base_beta };
                    product(&device, base, (&xv, dtype), (&wh.view::<T>()?, dtype), (&mut y, dtype))?;
                }
            }
            let down = GemmShape { m: rows, n: r, k: inp, a_t: false, b_t: true, alpha: 1.0, beta: 0.0 };
            product(&device, down, (&xdv, dtype), (&av, dtype), (&mut h, dtype))?;
            let hv = h.slice(0..rows * r);
            let up = GemmShape { m: rows, n: out, k: r, a_t: false, b_t: true, alpha: self.scaling as f32, beta: 1.0 };
            product(&device, up, (&hv, dtype), (&bv, dtype), (&mut y, dtype))?;
            storage(y, &device)
        });
        let shape: candle_core::Shape = out_dims.as_slice().into();
        Ok(match &self.base.bias {
            None => Value::Cuda(y, shape),
            Some(bias) => {
                let y = Value::Cuda(y, shape).into_tensor()?;
                Value::Tensor(y.broadcast_add(&bias.to_dtype(dtype)?)?)
            }
        })
    }

    /// The backward on the device.
    pub(super) fn cuda_bwd(
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
        let dtype = x.dtype();
        let r = a.dim(0)?;
        let s = self.scaling as f32;
        let (x, g) = (x.contiguous()?, grad.contiguous()?);
        let xd = self.dropped_out(&x)?;
        let (a, b) = (
            a.to_dtype(dtype)?.contiguous()?,
            b.to_dtype(dtype)?.contiguous()?,
        );
        let device = device_of(&x)?;
        let w = if needs[0] {
            self.base.weight.to_dense(dtype)?.contiguous()?
        } else {
            g.clone()
        };
        with_float_type!(dtype, T => {
            let held = [hold(&g)?, hold(&xd)?, hold(&a)?, hold(&b)?, hold(&w)?];
            let [gv, xdv, av, bv, wv] = [0, 1, 2, 3, 4].map(|i| held[i].view::<T>());
            let (gv, xdv, av, bv, wv) = (gv?, xdv?, av?, bv?, wv?);
            // dL/dh = s·g·B.
            let mut gh = alloc::<T>(&device, rows * r)?;
            let shape = GemmShape { m: rows, n: r, k: out, a_t: false, b_t: false, alpha: s, beta: 0.0 };
            product(&device, shape, (&gv, dtype), (&bv, dtype), (&mut gh, dtype))?;
            let ghv = gh.slice(0..rows * r);
            let ga = if needs[1] {
                // dA = (dL/dh)ᵀ·dropout(x), float32.
                let mut ga = alloc::<f32>(&device, r * inp)?;
                let shape = GemmShape { m: r, n: inp, k: rows, a_t: true, b_t: false, alpha: 1.0, beta: 0.0 };
                product(&device, shape, (&ghv, dtype), (&xdv, dtype), (&mut ga, DType::F32))?;
                Some(tensor(ga, &device, (r, inp)))
            } else {
                None
            };
            let gb = if needs[2] {
                // h = dropout(x)·Aᵀ again; dB = s·gᵀ·h, float32.
                let mut h = alloc::<T>(&device, rows * r)?;
                let shape = GemmShape { m: rows, n: r, k: inp, a_t: false, b_t: true, alpha: 1.0, beta: 0.0 };
                product(&device, shape, (&xdv, dtype), (&av, dtype), (&mut h, dtype))?;
                let hv = h.slice(0..rows * r);
                let mut gb = alloc::<f32>(&device, out * r)?;
                let shape = GemmShape { m: out, n: r, k: rows, a_t: true, b_t: false, alpha: s, beta: 0.0 };
                product(&device, shape, (&gv, dtype), (&hv, dtype), (&mut gb, DType::F32))?;
                Some(tensor(gb, &device, (out, r)))
            } else {
                None
            };
            let gx = if needs[0] {
                // dx = g·W + dropout'((dL/dh)·A): the branch accumulated into the base (masked first with dropout).
                let mut gx = alloc::<T>(&device, rows * inp)?;
                let shape = GemmShape { m: rows, n: inp, k: out, a_t: false, b_t: false, alpha: 1.0, beta: 0.0 };
                product(&device, shape, (&gv, dtype), (&wv, dtype), (&mut gx, dtype))?;
                let branch = GemmShape { m: rows, n: inp, k: r, a_t: false, b_t: false, alpha: 1.0, beta: 1.0 };
                match self.dropout {
                    None => product(&device, branch, (&ghv, dtype), (&av, dtype), (&mut gx, dtype))?,
                    Some(d) => {
                        let mut part = alloc::<T>(&device, rows * inp)?;
                        let shape = GemmShape { beta: 0.0, ..branch };
                        product(&device, shape, (&ghv, dtype), (&av, dtype), (&mut part, dtype))?;
                        let (keep, n) = (1.0 - d.p, (rows * inp) as u64);
                        let name = format!("dropout_accumulate{}", suffix(dtype)?);
                        let func = kernel(&device, &DROPOUT, &name)?;
                        let mut args = func.builder();
                        args.arg(&d.seed).arg(&keep).arg(&n).arg(&part).arg(&mut gx);
                        run(&mut args, grid(n))?;
                    }
                }
                Some(tensor(gx, &device, dims.as_slice()))
            } else {
                None
            };
            Ok([gx, ga, gb])
        })
    }
}

/// [`LowRankComposed`] with its output moved into attention heads (`[b, t, h·d]` → `[b, h, t, d]`, rotated when
/// the mover has RoPE tables) as one op: inputs `[x, A, B]`. The graph keeps neither the token-major projection
/// nor a copy of it; the backward moves the heads' gradient back (rotated by `−sin`) and differentiates the
/// projection.
pub(super) struct ToHeads {
    pub(super) linear: LowRankComposed,
    pub(super) rows: MoveRows,
}

impl Op<3> for ToHeads {
    const NAME: &'static str = "low-rank-linear";

    fn fwd(&mut self, inputs: [&Tensor; 3]) -> Result<Value> {
        let y = self.linear.cuda_fwd(inputs, None)?.into_tensor()?;
        self.rows.forward(&y)
    }

    fn bwd(
        &self,
        inputs: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let token_major = self.rows.backward(grad)?;
        self.linear.cuda_bwd(inputs, &token_major, needs)
    }
}

/// `residual + LowRankComposed(x)` as one op: inputs `[x, A‖B, residual]` (`A` and `B` flattened and
/// concatenated: Candle's ops take three inputs). The products accumulate onto a copy of the residual, so the graph
/// keeps no projection output apart from the sum. With `heads`, `x` is attention heads `[b, h, t, d]` merged into
/// `[b, t, h·d]` first; the merged copy exists only while a product reads it.
pub(super) struct PlusResidual {
    pub(super) linear: LowRankComposed,
    /// Moves attention heads to token-major rows, when the input is heads.
    pub(super) heads: Option<MoveRows>,
    /// `A`'s shape `[r, in]` and `B`'s `[out, r]`.
    pub(super) factors: ((usize, usize), (usize, usize)),
}

impl PlusResidual {
    /// `A` and `B` out of their concatenation.
    fn factors(&self, ab: &Tensor) -> Result<(Tensor, Tensor)> {
        let ((r, inp), (out, r2)) = self.factors;
        let a = ab.narrow(0, 0, r * inp)?.reshape((r, inp))?;
        let b = ab.narrow(0, r * inp, out * r2)?.reshape((out, r2))?;
        Ok((a, b))
    }

    /// The projection's token-major input.
    fn rows(&self, x: &Tensor) -> Result<Tensor> {
        match &self.heads {
            Some(mover) => mover.forward(x)?.into_tensor(),
            None => Ok(x.clone()),
        }
    }
}

impl Op<3> for PlusResidual {
    const NAME: &'static str = "low-rank-linear";

    fn fwd(&mut self, [x, ab, residual]: [&Tensor; 3]) -> Result<Value> {
        let rows = self.rows(x)?;
        let (a, b) = self.factors(ab)?;
        self.linear.cuda_fwd([&rows, &a, &b], Some(residual))
    }

    fn bwd(
        &self,
        [x, ab, _]: [&Tensor; 3],
        grad: &Tensor,
        [needs_x, needs_ab, needs_residual]: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let rows = self.rows(x)?;
        let (a, b) = self.factors(ab)?;
        let needs = [needs_x, needs_ab, needs_ab];
        let [gx, ga, gb] = self.linear.cuda_bwd([&rows, &a, &b], grad, needs)?;
        drop(rows);
        let gx = match (&self.heads, gx) {
            (Some(mover), Some(g)) => Some(mover.backward(&g)?),
            (_, gx) => gx,
        };
        let g_ab = match (ga, gb) {
            (Some(ga), Some(gb)) => Some(Tensor::cat(&[ga.flatten_all()?, gb.flatten_all()?], 0)?),
            _ => None,
        };
        Ok([gx, g_ab, needs_residual.then(|| grad.clone())])
    }
}
