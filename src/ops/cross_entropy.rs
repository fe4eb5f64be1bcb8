//! Causal-LM cross-entropy fused with the output projection: `Σ NLL(h·Wᵀ, labels)` computed over blocks of tokens,
//! so at most one block of float32 logits (and of their gradient) exists at a time, never `[tokens, vocab]`.
//!
//! Labels equal to [`IGNORE_INDEX`] (−100) are skipped. The result is the *sum* of the token losses in float32; the
//! caller divides by the number of label tokens of the whole accumulation window (transformers' `num_items_in_batch`).

use std::sync::Arc;

use candle_core::{DType, Result, Tensor, D};

use super::autograd::attach1;
use super::frozen_linear::FrozenLinear;

/// The label of tokens that do not count in the loss.
pub const IGNORE_INDEX: i64 = -100;

/// Tokens per block of logits.
pub const TOKEN_BLOCK: usize = 256;

/// For the tokens of one block: logits (work dtype), log-sum-exp, and the one-hot-safe label indices.
fn block_logits(h: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
    let logits = h.matmul(&w.t()?)?;
    let max = logits.max_keepdim(D::Minus1)?;
    let lse = (logits
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(D::Minus1)?
        .log()?
        + max)?;
    Ok((logits, lse))
}

/// Sum over tokens of `−log softmax(h·Wᵀ)[label]` for `hidden: [tokens, h]`, `labels: [tokens]` (i64, −100 to
/// ignore), with the frozen output projection `lm_head`. Differentiable with respect to `hidden`.
/// Also returns the number of tokens that counted.
pub fn linear_cross_entropy(
    hidden: &Tensor,
    lm_head: &Arc<FrozenLinear>,
    labels: &Tensor,
) -> Result<(Tensor, usize)> {
    let (n, _) = hidden.dims2()?;
    let labels_vec: Vec<i64> = labels.to_dtype(DType::I64)?.to_vec1()?;
    if labels_vec.len() != n {
        candle_core::bail!("{} labels for {n} hidden states", labels_vec.len());
    }
    let work = if hidden.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let vocab = lm_head.weight.dims2()?.0;
    if let Some(bad) = labels_vec
        .iter()
        .find(|l| **l != IGNORE_INDEX && (**l < 0 || **l as usize >= vocab))
    {
        candle_core::bail!(
            "label {bad} is out of range for a vocabulary of {vocab} (use -100 to ignore a token)"
        );
    }
    let counted = labels_vec.iter().filter(|l| **l != IGNORE_INDEX).count();
    let device = hidden.device().clone();
    // Label index per token (ignored → 0) and a 0/1 weight, as tensors per block.
    let block_targets = move |start: usize, len: usize| -> Result<(Tensor, Tensor)> {
        let slice = &labels_vec[start..start + len];
        let idx: Vec<u32> = slice
            .iter()
            .map(|l| if *l == IGNORE_INDEX { 0 } else { *l as u32 })
            .collect();
        let keep: Vec<f32> = slice
            .iter()
            .map(|l| if *l == IGNORE_INDEX { 0.0 } else { 1.0 })
            .collect();
        Ok((
            Tensor::from_vec(idx, (len, 1), &device)?,
            Tensor::from_vec(keep, (len, 1), &device)?.to_dtype(work)?,
        ))
    };
    let value = {
        let w = lm_head.weight.to_dense(work)?;
        let h = hidden.detach().to_dtype(work)?;
        let mut total = Tensor::zeros((), work, hidden.device())?;
        for start in (0..n).step_by(TOKEN_BLOCK) {
            let len = TOKEN_BLOCK.min(n - start);
            let (logits, lse) = block_logits(&h.narrow(0, start, len)?, &w)?;
            let logits = match &lm_head.bias {
                Some(b) => logits.broadcast_add(&b.to_dtype(work)?)?,
                None => logits,
            };
            let (idx, keep) = block_targets(start, len)?;
            let picked = logits.gather(&idx, 1)?;
            total = (total + ((lse - picked)? * keep)?.sum_all()?)?;
        }
        total
    };
    let head = lm_head.clone();
    let block_targets = Arc::new(block_targets);
    let loss = attach1(
        "linear-cross-entropy",
        hidden,
        value,
        Box::new(move |hidden, grad| {
            let w = head.weight.to_dense(work)?;
            let h = hidden.to_dtype(work)?;
            let g = grad.to_dtype(work)?;
            let vocab = w.dim(0)?;
            let mut blocks = Vec::new();
            for start in (0..n).step_by(TOKEN_BLOCK) {
                let len = TOKEN_BLOCK.min(n - start);
                let (logits, lse) = block_logits(&h.narrow(0, start, len)?, &w)?;
                let logits = match &head.bias {
                    Some(b) => logits.broadcast_add(&b.to_dtype(work)?)?,
                    None => logits,
                };
                let (idx, keep) = block_targets(start, len)?;
                // d/dlogits = (softmax − onehot) · keep · grad
                let probs = logits.broadcast_sub(&lse)?.exp()?;
                let onehot = candle_nn::encoding::one_hot(idx.squeeze(1)?, vocab, 1f32, 0f32)?
                    .to_dtype(work)?;
                let dlogits = (probs - onehot)?.broadcast_mul(&keep)?.broadcast_mul(&g)?;
                blocks.push(dlogits.matmul(&w)?);
            }
            Ok(Some(Tensor::cat(&blocks, 0)?.to_dtype(hidden.dtype())?))
        }),
    )?;
    Ok((loss, counted))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::frozen_linear::FrozenWeight;
    use crate::ops::gradcheck::{check, rand_f64};

    #[test]
    fn gradient_matches_finite_differences_and_candle_cross_entropy() {
        let w = (rand_f64(&[11, 6], 1) * 2.0).unwrap();
        let head = Arc::new(FrozenLinear::new(FrozenWeight::Dense(w.clone()), None));
        let labels = Tensor::new(&[3i64, -100, 10, 0, 7], &candle_core::Device::Cpu).unwrap();
        let (l1, l2) = (labels.clone(), labels.clone());
        let f = move |xs: &[Tensor]| Ok(linear_cross_entropy(&xs[0], &head, &l1)?.0);
        let r = move |xs: &[Tensor]| {
            // Candle's composite cross-entropy (mean) on the kept rows, times their count.
            let keep = Tensor::new(&[0u32, 2, 3, 4], xs[0].device())?;
            let logits = xs[0].matmul(&w.t()?)?.index_select(&keep, 0)?;
            let targets = l2.index_select(&keep, 0)?.to_dtype(DType::U32)?;
            candle_nn::loss::cross_entropy(&logits, &targets)? * 4.0
        };
        check(&f, &r, &[rand_f64(&[5, 6], 2)], &[true], 30, 1e-6, 1e-12);
    }

    #[test]
    fn counts_tokens_and_rejects_bad_labels() {
        let head = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(rand_f64(&[4, 3], 3)),
            None,
        ));
        let h = rand_f64(&[3, 3], 4);
        let (_, n) = linear_cross_entropy(
            &h,
            &head,
            &Tensor::new(&[1i64, -100, 2], h.device()).unwrap(),
        )
        .unwrap();
        assert_eq!(n, 2);
        let err = linear_cross_entropy(&h, &head, &Tensor::new(&[1i64, 9, 2], h.device()).unwrap())
            .unwrap_err();
        assert!(err.to_string().contains("label 9 is out of range"), "{err}");
    }

    #[test]
    fn many_blocks_match_one_block() {
        let head = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(rand_f64(&[7, 4], 5)),
            None,
        ));
        let n = TOKEN_BLOCK * 2 + 3;
        let h = rand_f64(&[n, 4], 6);
        let labels = Tensor::from_vec(
            (0..n as i64).map(|i| i % 7).collect::<Vec<_>>(),
            n,
            h.device(),
        )
        .unwrap();
        let (loss, _) = linear_cross_entropy(&h, &head, &labels).unwrap();
        let logits = h
            .matmul(&head.weight.to_dense(DType::F64).unwrap().t().unwrap())
            .unwrap();
        let lsm = candle_nn::ops::log_softmax(&logits, 1).unwrap();
        let expected = lsm
            .gather(
                &labels.to_dtype(DType::U32).unwrap().unsqueeze(1).unwrap(),
                1,
            )
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
}
