//! Causal-LM cross-entropy fused with the output projection: `Σ NLL(h·Wᵀ, labels)` computed over blocks of tokens,
//! so at most one block of float32 logits (and of their gradient) exists at a time, never `[tokens, vocab]`.
//!
//! Labels equal to [`IGNORE_INDEX`] (−100) are skipped. The result is the *sum* of the token losses in float32; the
//! caller divides by the number of label tokens of the whole accumulation window (transformers' `num_items_in_batch`).
//!
//! On the CPU in f32/f64 with a frozen head, the gradient with respect to the hidden states is computed in the
//! forward, block by block, while the block's logits are at hand (`(softmax − onehot)·W`): the backward only scales
//! it by the upstream gradient, so the logits are never recomputed and each block costs its two matrix products
//! and one pass of `exp`. Otherwise (trainable head, other dtypes or devices) the backward recomputes each block.
//!
//! [`linear_cross_entropy_capped`] soft-caps the logits first, `z → cap·tanh(z/cap)` (Gemma 2's
//! `final_logit_softcapping`), the gradient through it `1 − tanh²(z/cap)`; [`softcap`] is the same map on a logits
//! tensor (evaluation, generation). On CUDA a capped loss runs the composed path (the kernels do not cap).

use std::sync::Mutex;

use candle_core::{DType, Result, Tensor, D};
use rayon::prelude::*;

use super::autograd::op::{Apply, Op, Value};
use super::cpu::gemm::{matmul_into, Mat};
use super::cpu::vector::{self, simd};
use super::cpu::{slice_dtype, with_slices, CpuFloat};
use crate::precision::master_dtype;

/// The label of tokens that do not count in the loss.
pub const IGNORE_INDEX: i64 = -100;

/// Tokens per block of logits.
pub const TOKEN_BLOCK: usize = 256;

/// Sum over tokens of `−log softmax(h·Wᵀ)[label]` for `hidden: [tokens, h]`, `labels: [tokens]` (i64, −100 to
/// ignore) and the output head `weight: [vocab, h]`. Differentiable with respect to `hidden`, and to `weight` when
/// it is trainable (e.g. `modules_to_save = ["lm_head"]`); a frozen head gets no gradient. Also returns the number
/// of tokens that counted.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
) -> Result<(Tensor, usize)> {
    linear_cross_entropy_capped(hidden, weight, labels, None)
}

/// [`linear_cross_entropy`] with the logits soft-capped first when `softcap` is set: `z → cap·tanh(z/cap)` before
/// the softmax (Gemma 2's `final_logit_softcapping`). The cap must be finite and positive.
pub fn linear_cross_entropy_capped(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &Tensor,
    softcap: Option<f64>,
) -> Result<(Tensor, usize)> {
    if let Some(cap) = softcap {
        check_cap(cap)?;
    }
    let (n, _) = hidden.dims2()?;
    let labels: Vec<i64> = labels.to_dtype(DType::I64)?.to_vec1()?;
    if labels.len() != n {
        candle_core::bail!("{} labels for {n} hidden states", labels.len());
    }
    let vocab = weight.dim(0)?;
    if let Some(bad) = labels
        .iter()
        .find(|l| **l != IGNORE_INDEX && (**l < 0 || **l as usize >= vocab))
    {
        candle_core::bail!(
            "label {bad} is out of range for a vocabulary of {vocab} (use -100 to ignore a token)"
        );
    }
    let counted = labels.iter().filter(|l| **l != IGNORE_INDEX).count();
    let op = LinearCrossEntropy {
        labels,
        softcap,
        hidden_gradient: Mutex::new(None),
    };
    Ok((op.apply([hidden, weight])?, counted))
}

/// `cap·tanh(x/cap)`, element-wise and differentiable: the soft-capping of [`linear_cross_entropy_capped`] for
/// logits computed apart (evaluation, generation). The cap must be finite and positive.
pub fn softcap(x: &Tensor, cap: f64) -> Result<Tensor> {
    check_cap(cap)?;
    (x / cap)?.tanh()? * cap
}

/// A soft-cap is finite and positive.
pub(super) fn check_cap(cap: f64) -> Result<()> {
    if !(cap.is_finite() && cap > 0.0) {
        candle_core::bail!("the logit soft-cap must be finite and positive, got {cap}");
    }
    Ok(())
}

/// The fused head + cross-entropy op (inputs `[hidden, weight]`).
struct LinearCrossEntropy {
    labels: Vec<i64>,
    /// `cap` of `z → cap·tanh(z/cap)` on the logits, if they are capped.
    softcap: Option<f64>,
    /// `d loss / d hidden`, computed in the forward by the slice path (see the module doc); the backward takes it,
    /// so that it is not held through the rest of the step's backward (a second backward recomputes it).
    hidden_gradient: Mutex<Option<Tensor>>,
}

/// Logits of one block of tokens (soft-capped with `softcap`) and their log-sum-exp, and with a cap the
/// `tanh(z/cap)` of the raw logits `z` (for the gradient).
fn block_logits(
    h: &Tensor,
    w: &Tensor,
    softcap: Option<f64>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let (logits, tanh) = capped_logits(h, w, softcap)?;
    let lse = log_sum_exp(&logits)?;
    Ok((logits, lse, tanh))
}

/// The logits `h·wᵀ` of a block of rows (soft-capped with `softcap`), and with a cap the `tanh(z/cap)` of the raw
/// logits `z` (for the gradient).
pub(super) fn capped_logits(
    h: &Tensor,
    w: &Tensor,
    softcap: Option<f64>,
) -> Result<(Tensor, Option<Tensor>)> {
    let raw = h.matmul(&w.t()?)?;
    Ok(match softcap {
        Some(cap) => {
            let t = (raw / cap)?.tanh()?;
            ((&t * cap)?, Some(t))
        }
        None => (raw, None),
    })
}

/// `log Σ exp` over the last dimension, kept (`[rows, 1]`), the maximum subtracted first.
pub(super) fn log_sum_exp(x: &Tensor) -> Result<Tensor> {
    let max = x.max_keepdim(D::Minus1)?;
    x.broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max
}

/// A block's share of the head's backward: `dlogits`, the gradient with respect to its (capped) logits, taken
/// through the cap (`1 − tanh²(z/cap)`, with `tanh` from [`capped_logits`]) to the block's rows `hb` — pushed onto
/// `dh_blocks` — and to the head `w` — added to `dw` —, each where `needs` asks.
pub(super) fn head_backward(
    dlogits: Tensor,
    tanh: Option<&Tensor>,
    (hb, w): (&Tensor, &Tensor),
    needs: [bool; 2],
    dh_blocks: &mut Vec<Tensor>,
    dw: &mut Option<Tensor>,
) -> Result<()> {
    let dlogits = match tanh {
        Some(t) => (dlogits * (1.0 - t.sqr()?)?)?,
        None => dlogits,
    };
    if needs[0] {
        dh_blocks.push(dlogits.matmul(w)?);
    }
    if needs[1] {
        let part = dlogits.t()?.matmul(hb)?;
        *dw = Some(match dw.take() {
            Some(acc) => (acc + part)?,
            None => part,
        });
    }
    Ok(())
}

impl LinearCrossEntropy {
    /// The gradient slot the forward fills (`&mut self`: no other borrow exists).
    fn stored_gradient(&mut self) -> &mut Option<Tensor> {
        match self.hidden_gradient.get_mut() {
            Ok(slot) => slot,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The loss, and the hidden states' gradient when `hidden` needs one, block by block on CPU slices.
    fn cpu_fwd<T: CpuFloat>(&mut self, hidden: &Tensor, weight: &Tensor) -> Result<Value> {
        let (n, d) = hidden.dims2()?;
        let vocab = weight.dim(0)?;
        let with_grad = hidden.track_op();
        let labels = &self.labels;
        let cap = self.softcap.map(T::from_f64);
        let (total, dh) = with_slices([hidden, weight], |[h, w]| {
            let w = Mat::new(w, vocab, d);
            let mut logits = vec![T::zero(); TOKEN_BLOCK.min(n) * vocab];
            let mut dh = vec![T::zero(); if with_grad { n * d } else { 0 }];
            let mut total = 0f64;
            for start in (0..n).step_by(TOKEN_BLOCK) {
                let len = TOKEN_BLOCK.min(n - start);
                let block = &mut logits[..len * vocab];
                let rows = Mat::new(&h[start * d..(start + len) * d], len, d);
                matmul_into(block, rows, w.t(), 1.0, false);
                total += block
                    .par_chunks_mut(vocab)
                    .zip(labels[start..start + len].par_iter())
                    .map_init(Vec::new, |scratch, (row, &label)| {
                        token_loss(row, label, with_grad, cap, scratch)
                    })
                    .sum::<f64>();
                if with_grad {
                    let dlogits = Mat::new(&*block, len, vocab);
                    matmul_into(
                        &mut dh[start * d..(start + len) * d],
                        dlogits,
                        w,
                        1.0,
                        false,
                    );
                }
            }
            Ok((total, dh))
        })?;
        if with_grad {
            *self.stored_gradient() = Some(Tensor::from_vec(dh, (n, d), hidden.device())?);
        }
        Ok(Value::Tensor(Tensor::new(
            T::from_f64(total),
            hidden.device(),
        )?))
    }

    /// Label index per token (ignored → 0) and a 0/1 weight, for tokens `start..start+len`.
    fn block_targets(&self, start: usize, len: usize, like: &Tensor) -> Result<(Tensor, Tensor)> {
        let slice = &self.labels[start..start + len];
        let idx: Vec<u32> = slice
            .iter()
            .map(|l| if *l == IGNORE_INDEX { 0 } else { *l as u32 })
            .collect();
        let keep: Vec<f32> = slice
            .iter()
            .map(|l| if *l == IGNORE_INDEX { 0.0 } else { 1.0 })
            .collect();
        Ok((
            Tensor::from_vec(idx, (len, 1), like.device())?,
            Tensor::from_vec(keep, (len, 1), like.device())?.to_dtype(like.dtype())?,
        ))
    }

    /// Any dtype and device: Candle's ops, block by block (the backward recomputes each block).
    fn composed_fwd(&self, hidden: &Tensor, weight: &Tensor) -> Result<Value> {
        let work = master_dtype(hidden.dtype());
        let n = hidden.dim(0)?;
        let w = weight.detach().to_dtype(work)?;
        let h = hidden.detach().to_dtype(work)?;
        let mut total = Tensor::zeros((), work, hidden.device())?;
        for start in (0..n).step_by(TOKEN_BLOCK) {
            let len = TOKEN_BLOCK.min(n - start);
            let (logits, lse, _) = block_logits(&h.narrow(0, start, len)?, &w, self.softcap)?;
            let (idx, keep) = self.block_targets(start, len, &h)?;
            let picked = logits.gather(&idx, 1)?;
            total = (total + ((lse - picked)? * keep)?.sum_all()?)?;
        }
        Ok(Value::Tensor(total))
    }

    fn composed_bwd(
        &self,
        [hidden, weight]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let work = master_dtype(hidden.dtype());
        let (n, vocab) = (hidden.dim(0)?, weight.dim(0)?);
        let w = weight.to_dtype(work)?;
        let h = hidden.to_dtype(work)?;
        let g = grad.to_dtype(work)?;
        let mut dh_blocks = Vec::new();
        let mut dw: Option<Tensor> = None;
        for start in (0..n).step_by(TOKEN_BLOCK) {
            let len = TOKEN_BLOCK.min(n - start);
            let hb = h.narrow(0, start, len)?;
            let (logits, lse, tanh) = block_logits(&hb, &w, self.softcap)?;
            let (idx, keep) = self.block_targets(start, len, &h)?;
            // d/dlogits = (softmax − onehot) · keep · grad
            let probs = logits.broadcast_sub(&lse)?.exp()?;
            let onehot =
                candle_nn::encoding::one_hot(idx.squeeze(1)?, vocab, 1f32, 0f32)?.to_dtype(work)?;
            let dlogits = (probs - onehot)?.broadcast_mul(&keep)?.broadcast_mul(&g)?;
            head_backward(
                dlogits,
                tanh.as_ref(),
                (&hb, &w),
                needs,
                &mut dh_blocks,
                &mut dw,
            )?;
        }
        let dh = if needs[0] {
            Some(Tensor::cat(&dh_blocks, 0)?.to_dtype(hidden.dtype())?)
        } else {
            None
        };
        Ok([dh, dw.map(|d| d.to_dtype(weight.dtype())).transpose()?])
    }
}

/// Bytes of float32 logits per block of tokens on CUDA (the block's token count follows from the vocabulary).
pub const CUDA_LOGITS_BYTES: usize = 256 << 20;

#[cfg(feature = "cuda")]
impl LinearCrossEntropy {
    /// Whether the CUDA path takes these inputs: a frozen head in the hidden states' float dtype, on a GPU.
    fn cuda_applies(hidden: &Tensor, weight: &Tensor) -> bool {
        hidden.device().is_cuda()
            && crate::cuda::fused_kernels()
            && !weight.track_op()
            && hidden.dtype() == weight.dtype()
            && matches!(hidden.dtype(), DType::F32 | DType::BF16 | DType::F16)
    }

    /// `dh · grad` in `dtype` by one kernel (the upstream gradient read on the device: a broadcast product would
    /// upload its layout).
    fn cuda_scale(dh: &Tensor, grad: &Tensor, dtype: DType) -> Result<Tensor> {
        use crate::cuda::{
            alloc, device_of, grid, hold, kernel, run, suffix, tensor, with_float_type,
            CROSS_ENTROPY,
        };
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        let grad = grad.to_dtype(DType::F32)?.contiguous()?;
        let device = device_of(dh)?;
        let n = dh.elem_count() as u64;
        let func = kernel(
            &device,
            &CROSS_ENTROPY,
            &format!("ce_scale{}", suffix(dtype)?),
        )?;
        let (dhh, gh) = (hold(dh)?, hold(&grad)?);
        let (dhv, gv) = (dhh.view::<f32>()?, gh.view::<f32>()?);
        Ok(with_float_type!(dtype, T => {
            let mut out = alloc::<T>(&device, dh.elem_count())?;
            let mut args = func.builder();
            args.arg(&dhv).arg(&gv).arg(&n).arg(&mut out);
            run(&mut args, grid(n))?;
            tensor(out, &device, dh.shape().clone())
        }))
    }

    /// Block by block of tokens: float32 logits from the head in its own dtype (cuBLAS, no float32 copy of the
    /// head), the token losses and, when `hidden` needs it, the logits' gradient in the storage dtype
    /// (`kernels/cross_entropy.cu`), then the hidden states' gradient `dlogits · W` in float32 — all on the device.
    fn cuda_fwd(&mut self, hidden: &Tensor, weight: &Tensor) -> Result<Value> {
        use crate::cuda::{
            alloc, device_of, gemm, hold, kernel, product, rows_grid, run, suffix, tensor,
            with_float_type, GemmShape, Matrix, CROSS_ENTROPY,
        };
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

        let (n, h) = hidden.dims2()?;
        let vocab = weight.dim(0)?;
        let with_grad = hidden.track_op();
        if n == 0 {
            return Ok(Value::Tensor(Tensor::zeros(
                (),
                DType::F32,
                hidden.device(),
            )?));
        }
        let (hidden, weight) = (hidden.contiguous()?, weight.contiguous()?);
        let dtype = hidden.dtype();
        let device = device_of(&hidden)?;
        let stream = device.cuda_stream();
        let labels = Tensor::new(self.labels.as_slice(), hidden.device())?;
        let chunk = (CUDA_LOGITS_BYTES / (vocab * 4).max(1)).clamp(1, n);
        let func = kernel(
            &device,
            &CROSS_ENTROPY,
            &format!("ce_rows{}", suffix(dtype)?),
        )?;
        let mut logits = alloc::<f32>(&device, chunk * vocab)?;
        let mut losses = alloc::<f32>(&device, n)?;
        let (vocab_u, grad_flag) = (vocab as u64, with_grad as i32);
        with_float_type!(dtype, T => {
            let mut dlogits = alloc::<T>(&device, if with_grad { chunk * vocab } else { 1 })?;
            // The hidden states' gradient in float32: the backward scales it by the upstream gradient before the one
            // rounding to the activations' dtype, as the CPU path does.
            let mut dh = alloc::<f32>(&device, if with_grad { n * h } else { 1 })?;
            let (hh, wh, lh) = (hold(&hidden)?, hold(&weight)?, hold(&labels)?);
            let (hv, wv, lv) = (hh.view::<T>()?, wh.view::<T>()?, lh.view::<i64>()?);
            for start in (0..n).step_by(chunk) {
                let len = chunk.min(n - start);
                let rows = hv.slice(start * h..(start + len) * h);
                let shape = GemmShape { m: len, n: vocab, k: h, a_t: false, b_t: true, alpha: 1.0, beta: 0.0 };
                product(&device, shape, (&rows, dtype), (&wv, dtype), (&mut logits, DType::F32))?;
                {
                    let len_u = len as u64;
                    let labels_block = lv.slice(start..start + len);
                    let mut losses_block = losses.slice_mut(start..start + len);
                    let mut args = func.builder();
                    args.arg(&logits)
                        .arg(&labels_block)
                        .arg(&len_u)
                        .arg(&vocab_u)
                        .arg(&grad_flag)
                        .arg(&mut losses_block)
                        .arg(&mut dlogits);
                    run(&mut args, rows_grid(len_u))?;
                }
                if with_grad {
                    let dl = dlogits.slice(0..len * vocab);
                    let (a, _a) = Matrix::of(&dl, &stream, dtype);
                    let (b, _b) = Matrix::of(&wv, &stream, dtype);
                    let (c, _c) = Matrix::of_mut(&mut dh, &stream, DType::F32);
                    let shape = GemmShape { m: len, n: h, k: vocab, a_t: false, b_t: false, alpha: 1.0, beta: 0.0 };
                    gemm(&device, shape, a, b, c.offset(start * h))?;
                }
            }
            if with_grad {
                *self.stored_gradient() = Some(tensor(dh, &device, (n, h)));
            }
        });
        // Summed by a kernel of ours: Candle's reduction would upload the layout, a copy per micro-batch.
        let mut total = alloc::<f32>(&device, 1)?;
        let sum = kernel(&device, &CROSS_ENTROPY, "ce_sum")?;
        let mut args = sum.builder();
        let n_u = n as u64;
        args.arg(&losses).arg(&n_u).arg(&mut total);
        run(&mut args, rows_grid(1))?;
        Ok(Value::Tensor(tensor(total, &device, ())))
    }
}

impl Op<2> for LinearCrossEntropy {
    const NAME: &'static str = "linear-cross-entropy";

    fn fwd(&mut self, [hidden, weight]: [&Tensor; 2]) -> Result<Value> {
        #[cfg(feature = "cuda")]
        if self.softcap.is_none() && Self::cuda_applies(hidden, weight) {
            return self.cuda_fwd(hidden, weight);
        }
        // The slice path computes the gradient in the forward, which needs a frozen head.
        match slice_dtype(&[hidden, weight]).filter(|_| !weight.track_op()) {
            Some(DType::F32) => self.cpu_fwd::<f32>(hidden, weight),
            Some(DType::F64) => self.cpu_fwd::<f64>(hidden, weight),
            _ => self.composed_fwd(hidden, weight),
        }
    }

    fn bwd(
        &self,
        inputs: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let stored = self
            .hidden_gradient
            .lock()
            .map_err(|_| candle_core::Error::Msg("cross-entropy: poisoned gradient".into()))?
            .take();
        match stored {
            Some(dh) => {
                #[cfg(feature = "cuda")]
                if dh.device().is_cuda() {
                    return Ok([Some(Self::cuda_scale(&dh, grad, inputs[0].dtype())?), None]);
                }
                let scaled = dh.broadcast_mul(&grad.to_dtype(dh.dtype())?)?;
                Ok([Some(scaled.to_dtype(inputs[0].dtype())?), None])
            }
            None => self.composed_bwd(inputs, grad, needs),
        }
    }
}

/// The loss of one token from its logits `row`, soft-capped first with `cap`; with `with_grad`, `row` becomes
/// `d loss / d logits` (`softmax − onehot`, times `1 − tanh²(z/cap)` with a cap, which `scratch` holds meanwhile;
/// zero for an ignored token).
fn token_loss<T: CpuFloat>(
    row: &mut [T],
    label: i64,
    with_grad: bool,
    cap: Option<T>,
    scratch: &mut Vec<T>,
) -> f64 {
    if label == IGNORE_INDEX {
        if with_grad {
            row.fill(T::zero());
        }
        return 0.0;
    }
    let Some(cap) = cap else {
        return uncapped_token_loss(row, label, with_grad);
    };
    if with_grad {
        scratch.resize(row.len(), T::zero());
    }
    simd(
        #[inline(always)]
        || {
            if with_grad {
                for (z, d) in row.iter_mut().zip(scratch.iter_mut()) {
                    let t = (*z / cap).tanh();
                    *z = cap * t;
                    *d = T::one() - t * t;
                }
            } else {
                row.iter_mut().for_each(|z| *z = cap * (*z / cap).tanh());
            }
        },
    );
    let loss = uncapped_token_loss(row, label, with_grad);
    if with_grad {
        simd(
            #[inline(always)]
            || {
                row.iter_mut()
                    .zip(scratch.iter())
                    .for_each(|(v, &d)| *v *= d)
            },
        );
    }
    loss
}

/// [`token_loss`] without a cap, for a counted token.
fn uncapped_token_loss<T: CpuFloat>(row: &mut [T], label: i64, with_grad: bool) -> f64 {
    let label = label as usize;
    let picked = row[label].to_f64();
    simd(
        #[inline(always)]
        || {
            let max = vector::max(row);
            row.iter_mut().for_each(|v| *v = (*v - max).exp());
            // Partial sums in T, their total in f64.
            let sum: f64 = row.chunks(512).map(|c| vector::sum(c).to_f64()).sum();
            if with_grad {
                let inv = T::from_f64(1.0 / sum);
                row.iter_mut().for_each(|v| *v *= inv);
                row[label] -= T::one();
            }
            max.to_f64() + sum.ln() - picked
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, max_abs_diff, rand_f64};

    #[test]
    fn gradients_match_finite_differences_and_candle_cross_entropy() {
        let labels = Tensor::new(&[3i64, -100, 10, 0, 7], &candle_core::Device::Cpu).unwrap();
        let (l1, l2) = (labels.clone(), labels.clone());
        let f = move |xs: &[Tensor]| Ok(linear_cross_entropy(&xs[0], &xs[1], &l1)?.0);
        let r = move |xs: &[Tensor]| {
            // Candle's composite cross-entropy (mean) on the kept rows, times their count.
            let keep = Tensor::new(&[0u32, 2, 3, 4], xs[0].device())?;
            let logits = xs[0].matmul(&xs[1].t()?)?.index_select(&keep, 0)?;
            let targets = l2.index_select(&keep, 0)?.to_dtype(DType::U32)?;
            candle_nn::loss::cross_entropy(&logits, &targets)? * 4.0
        };
        let inputs = [rand_f64(&[5, 6], 2), (rand_f64(&[11, 6], 1) * 2.0).unwrap()];
        // Frozen head (the usual case) and a trainable one (modules_to_save = ["lm_head"]).
        check(&f, &r, &inputs, &[true, false], 30, 1e-6, 1e-12);
        check(&f, &r, &inputs, &[true, true], 30, 1e-6, 1e-12);
    }

    #[test]
    fn counts_tokens_and_rejects_bad_labels() {
        let w = rand_f64(&[4, 3], 3);
        let h = rand_f64(&[3, 3], 4);
        let (_, n) =
            linear_cross_entropy(&h, &w, &Tensor::new(&[1i64, -100, 2], h.device()).unwrap())
                .unwrap();
        assert_eq!(n, 2);
        let err = linear_cross_entropy(&h, &w, &Tensor::new(&[1i64, 9, 2], h.device()).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("label 9 is out of range"), "{err}");
    }

    #[test]
    fn many_blocks_match_one_block() {
        let w = rand_f64(&[7, 4], 5);
        let n = TOKEN_BLOCK * 2 + 3;
        let h = rand_f64(&[n, 4], 6);
        let labels = Tensor::from_vec(
            (0..n as i64).map(|i| i % 7).collect::<Vec<_>>(),
            n,
            h.device(),
        )
        .unwrap();
        let (loss, _) = linear_cross_entropy(&h, &w, &labels).unwrap();
        let lsm = candle_nn::ops::log_softmax(&h.matmul(&w.t().unwrap()).unwrap(), 1).unwrap();
        let idx = labels.to_dtype(DType::U32).unwrap().unsqueeze(1).unwrap();
        let expected = lsm
            .gather(&idx, 1)
            .unwrap()
            .sum_all()
            .unwrap()
            .neg()
            .unwrap();
        let d = (loss - expected)
            .unwrap()
            .abs()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert!(d < 1e-10, "{d}");
    }

    /// The loss from the full logits in plain f64: `Σ −log_softmax(cap·tanh(z/cap))[label]` over counted tokens.
    fn naive_loss(h: &Tensor, w: &Tensor, labels: &[i64], cap: Option<f64>) -> f64 {
        let z: Vec<Vec<f64>> = h
            .to_dtype(DType::F64)
            .unwrap()
            .matmul(&w.to_dtype(DType::F64).unwrap().t().unwrap())
            .unwrap()
            .to_vec2()
            .unwrap();
        z.iter()
            .zip(labels)
            .filter(|(_, &l)| l != IGNORE_INDEX)
            .map(|(row, &l)| {
                let row: Vec<f64> = row
                    .iter()
                    .map(|&v| cap.map_or(v, |c| c * (v / c).tanh()))
                    .collect();
                let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let lse = max + row.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
                lse - row[l as usize]
            })
            .sum()
    }

    /// `cap·tanh(x/cap)` through `exp` (a composite independent of [`softcap`]).
    fn softcap_via_exp(x: &Tensor, cap: f64) -> Result<Tensor> {
        let e = (x * (-2.0 / cap))?.exp()?;
        ((1.0 - &e)? / (e + 1.0)?)? * cap
    }

    /// Candle's composite cross-entropy over the kept rows of soft-capped logits, times their count.
    fn composite_capped(xs: &[Tensor], labels: &[i64], cap: Option<f64>) -> Result<Tensor> {
        let kept: Vec<u32> = (0..labels.len() as u32)
            .filter(|&i| labels[i as usize] != IGNORE_INDEX)
            .collect();
        let targets: Vec<u32> = kept.iter().map(|&i| labels[i as usize] as u32).collect();
        let keep = Tensor::new(kept.as_slice(), xs[0].device())?;
        let logits = xs[0].matmul(&xs[1].t()?)?.index_select(&keep, 0)?;
        let logits = match cap {
            Some(c) => softcap_via_exp(&logits, c)?,
            None => logits,
        };
        let targets = Tensor::new(targets.as_slice(), xs[0].device())?;
        candle_nn::loss::cross_entropy(&logits, &targets)? * kept.len() as f64
    }

    #[test]
    fn capped_loss_equals_naive_reference() {
        let labels = [3i64, -100, 10, 0, 7, 10, -100, 1];
        let label_t = Tensor::new(&labels, &candle_core::Device::Cpu).unwrap();
        // Logits of a few units: a cap of 2 bends them a lot, a cap of 30 a little.
        let h = (rand_f64(&[8, 6], 12) * 2.0).unwrap();
        let w = (rand_f64(&[11, 6], 13) * 2.0).unwrap();
        for cap in [Some(2.0), Some(30.0), None] {
            let want = naive_loss(&h, &w, &labels, cap);
            // The slice path (frozen head) and the composed path (trainable head), in f64 and f32.
            let w_var = candle_core::Var::from_tensor(&w).unwrap();
            for (w, dtype, tol) in [
                (w.clone(), DType::F64, 1e-12),
                (w_var.as_tensor().clone(), DType::F64, 1e-12),
                (w.clone(), DType::F32, 1e-5),
                (
                    w_var.as_tensor().to_dtype(DType::F32).unwrap(),
                    DType::F32,
                    1e-5,
                ),
            ] {
                let h = h.to_dtype(dtype).unwrap();
                let w = w.to_dtype(dtype).unwrap();
                let (loss, n) = linear_cross_entropy_capped(&h, &w, &label_t, cap).unwrap();
                assert_eq!(n, 6);
                let got = loss
                    .to_dtype(DType::F64)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap();
                assert!(
                    (got - want).abs() <= tol * want.abs(),
                    "cap {cap:?} {dtype:?} trainable {}: {got} vs {want}",
                    w.track_op()
                );
            }
        }
        // A cap bounds the logits: with a cap of 2 no token loses more than ln(vocab) + 4.
        let (loss, _) = linear_cross_entropy_capped(
            &(&h * 100.0).unwrap(),
            &w,
            &Tensor::new(&[0i64; 8], h.device()).unwrap(),
            Some(2.0),
        )
        .unwrap();
        assert!(loss.to_scalar::<f64>().unwrap() <= 8.0 * (11f64.ln() + 4.0));
    }

    #[test]
    fn capped_gradients_match_finite_differences_and_composite() {
        let labels = [3i64, -100, 10, 0, 7];
        let label_t = Tensor::new(&labels, &candle_core::Device::Cpu).unwrap();
        let inputs = [
            (rand_f64(&[5, 6], 14) * 2.0).unwrap(),
            (rand_f64(&[11, 6], 15) * 2.0).unwrap(),
        ];
        for cap in [2.0, 30.0] {
            let l = label_t.clone();
            let f = move |xs: &[Tensor]| {
                Ok(linear_cross_entropy_capped(&xs[0], &xs[1], &l, Some(cap))?.0)
            };
            let r = move |xs: &[Tensor]| composite_capped(xs, &labels, Some(cap));
            check(&f, &r, &inputs, &[true, false], 30, 1e-6, 1e-12);
            check(&f, &r, &inputs, &[true, true], 30, 1e-6, 1e-12);
        }
    }

    #[test]
    fn capped_blocks_match_one_block_and_float32_matches_float64() {
        let n = TOKEN_BLOCK * 2 + 3;
        let w = (rand_f64(&[7, 4], 16) * 3.0).unwrap();
        let h = (rand_f64(&[n, 4], 17) * 3.0).unwrap();
        let labels: Vec<i64> = (0..n as i64)
            .map(|i| if i % 5 == 2 { IGNORE_INDEX } else { i % 7 })
            .collect();
        let label_t = Tensor::new(labels.as_slice(), h.device()).unwrap();
        let want = naive_loss(&h, &w, &labels, Some(2.0));
        // The hidden states' gradient from the slice path (computed in the forward) and the composed path.
        let grad_of = |h: &Tensor, w: &Tensor| {
            let h = candle_core::Var::from_tensor(h).unwrap();
            let (loss, _) =
                linear_cross_entropy_capped(h.as_tensor(), w, &label_t, Some(2.0)).unwrap();
            let grads = loss.backward().unwrap();
            let value = loss
                .to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap();
            (value, grads.get(&h).unwrap().to_dtype(DType::F64).unwrap())
        };
        let (slice, dh) = grad_of(&h, &w);
        assert!((slice - want).abs() <= 1e-12 * want, "{slice} vs {want}");
        let w_var = candle_core::Var::from_tensor(&w).unwrap();
        let (composed, dh_composed) = grad_of(&h, w_var.as_tensor());
        assert!(
            (composed - want).abs() <= 1e-12 * want,
            "{composed} vs {want}"
        );
        assert!(max_abs_diff(&dh, &dh_composed) < 1e-12);
        // The gradient equals the composite's on all rows.
        let hv = candle_core::Var::from_tensor(&h).unwrap();
        let reference =
            composite_capped(&[hv.as_tensor().clone(), w.clone()], &labels, Some(2.0)).unwrap();
        let dh_ref = reference.backward().unwrap().get(&hv).unwrap().clone();
        assert!(max_abs_diff(&dh, &dh_ref) < 1e-12);
        // Float32 (fast tanh and exp) against float64.
        let (h32, w32) = (
            h.to_dtype(DType::F32).unwrap(),
            w.to_dtype(DType::F32).unwrap(),
        );
        let (loss32, dh32) = grad_of(&h32, &w32);
        assert!((loss32 - want).abs() <= 1e-5 * want, "{loss32} vs {want}");
        assert!(max_abs_diff(&dh32, &dh) < 1e-5);
    }

    #[test]
    fn softcap_bounds_values_and_has_a_gradient() {
        let f = |xs: &[Tensor]| softcap(&xs[0], 2.5);
        let r = |xs: &[Tensor]| softcap_via_exp(&xs[0], 2.5);
        let inputs = [(rand_f64(&[4, 5], 18) * 6.0).unwrap()];
        check(&f, &r, &inputs, &[true], 20, 1e-6, 1e-12);
        let big = Tensor::new(&[-1e4f32, -3.0, 0.0, 3.0, 1e4], &candle_core::Device::Cpu).unwrap();
        let capped: Vec<f32> = softcap(&big, 2.0).unwrap().to_vec1().unwrap();
        assert_eq!(capped[2], 0.0);
        assert!(capped.iter().all(|v| v.abs() <= 2.0));
        assert!((capped[3] - 2.0 * (1.5f32).tanh()).abs() < 1e-6);
    }

    #[test]
    fn rejects_bad_caps() {
        let w = rand_f64(&[4, 3], 19);
        let h = rand_f64(&[2, 3], 20);
        let labels = Tensor::new(&[1i64, 2], h.device()).unwrap();
        for cap in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let err = linear_cross_entropy_capped(&h, &w, &labels, Some(cap)).unwrap_err();
            assert!(err.to_string().contains("soft-cap"), "{err}");
            assert!(softcap(&h, cap).is_err());
        }
    }
}
