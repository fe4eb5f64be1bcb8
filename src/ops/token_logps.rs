//! Per-token log-probabilities and entropies of chosen tokens under the output head, for GRPO (TRL's
//! `selective_log_softmax` and `entropy_from_logits` on `logits / temperature`), computed block by block of
//! [`TOKEN_BLOCK`] tokens so that at most one block of logits exists at a time, never `[tokens, vocab]`.
//!
//! The forward and the backward are composed of Candle's ops in the master dtype (float32, float64 for float64
//! inputs), so they run on any device with no kernel of their own; the backward recomputes each block's logits.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor, D};

use super::autograd::op::{Apply, Op, Value};
use super::cross_entropy::{capped_logits, check_cap, head_backward, log_sum_exp, TOKEN_BLOCK};
use crate::precision::master_dtype;

/// Per-token log-probabilities of `labels` under `softmax(cap(hidden·weightᵀ) / temperature)`, and each token's
/// entropy `−Σ p·log p` of that distribution.
///
/// `hidden: [n, d]` (any float dtype), the output head `weight: [vocab, d]` and `n` labels, each `< vocab`. With
/// `softcap`, the raw logits are soft-capped first, `z → cap·tanh(z/cap)` (Gemma 2's `final_logit_softcapping`),
/// then divided by `temperature` (finite and positive), as TRL's GRPO does.
///
/// Returns the `[n]` log-probabilities in [`master_dtype`] of `hidden`'s dtype, differentiable with respect to
/// `hidden` and to `weight` when it is tracked (a trainable head), and the entropies as plain values (a metric and
/// a mask: no gradient).
pub fn token_logps(
    hidden: &Tensor,
    weight: &Tensor,
    labels: &[u32],
    temperature: f64,
    softcap: Option<f64>,
) -> Result<(Tensor, Vec<f64>)> {
    if !(temperature.is_finite() && temperature > 0.0) {
        candle_core::bail!("the temperature must be finite and positive, got {temperature}");
    }
    if let Some(cap) = softcap {
        check_cap(cap)?;
    }
    let (n, d) = hidden.dims2()?;
    let (vocab, wd) = weight.dims2()?;
    if wd != d {
        candle_core::bail!("hidden states of size {d} for an output head of rows of size {wd}");
    }
    if labels.len() != n {
        candle_core::bail!("{} labels for {n} hidden states", labels.len());
    }
    if let Some((i, bad)) = labels
        .iter()
        .enumerate()
        .find(|(_, l)| **l as usize >= vocab)
    {
        candle_core::bail!("label {bad} of token {i} is out of range for a vocabulary of {vocab}");
    }
    let entropies = Arc::new(Mutex::new(Vec::new()));
    let op = TokenLogps {
        labels: labels.to_vec(),
        temperature,
        softcap,
        entropies: entropies.clone(),
    };
    let logps = op.apply([hidden, weight])?;
    let entropies = std::mem::take(
        &mut *entropies
            .lock()
            .map_err(|_| candle_core::Error::Msg("token-logps: poisoned entropies".into()))?,
    );
    Ok((logps, entropies))
}

/// The op (inputs `[hidden, weight]`, output the `[n]` log-probabilities).
struct TokenLogps {
    labels: Vec<u32>,
    temperature: f64,
    /// `cap` of `z → cap·tanh(z/cap)` on the raw logits, if they are capped.
    softcap: Option<f64>,
    /// Where the forward leaves the entropies for [`token_logps`] (the op itself moves into the graph).
    entropies: Arc<Mutex<Vec<f64>>>,
}

/// One block's scaled logits `cap(z)/temperature` and their log-sum-exp `[len, 1]`, and with a cap the
/// `tanh(z/cap)` of the raw logits `z` (for the gradient).
struct BlockLogits {
    scaled: Tensor,
    lse: Tensor,
    tanh: Option<Tensor>,
}

impl TokenLogps {
    /// The logits of rows `h` (in the master dtype) against the head `w`.
    fn block(&self, h: &Tensor, w: &Tensor) -> Result<BlockLogits> {
        let (capped, tanh) = capped_logits(h, w, self.softcap)?;
        // The cap first, then the temperature (TRL divides the model's capped logits).
        let scaled = (capped / self.temperature)?;
        let lse = log_sum_exp(&scaled)?;
        Ok(BlockLogits { scaled, lse, tanh })
    }

    /// The labels of tokens `start..start+len` as a `[len, 1]` index on `like`'s device.
    fn block_labels(&self, start: usize, len: usize, like: &Tensor) -> Result<Tensor> {
        Tensor::from_slice(&self.labels[start..start + len], (len, 1), like.device())
    }
}

impl Op<2> for TokenLogps {
    const NAME: &'static str = "token-logps";

    fn fwd(&mut self, [hidden, weight]: [&Tensor; 2]) -> Result<Value> {
        let work = master_dtype(hidden.dtype());
        let n = hidden.dim(0)?;
        let h = hidden.detach().to_dtype(work)?;
        let w = weight.detach().to_dtype(work)?;
        let (mut logps, mut entropies) = (Vec::new(), Vec::new());
        for start in (0..n).step_by(TOKEN_BLOCK) {
            let len = TOKEN_BLOCK.min(n - start);
            let b = self.block(&h.narrow(0, start, len)?, &w)?;
            let idx = self.block_labels(start, len, &h)?;
            logps.push((b.scaled.gather(&idx, 1)? - &b.lse)?.squeeze(1)?);
            // −Σ p·log p as Σ p·(lse − y): every term is non-negative, so a near-zero entropy loses no digits.
            let neg_log_p = b.lse.broadcast_sub(&b.scaled)?;
            let p = neg_log_p.neg()?.exp()?;
            entropies.push((p * neg_log_p)?.sum(D::Minus1)?);
        }
        if n == 0 {
            return Ok(Value::Tensor(Tensor::zeros(0, work, hidden.device())?));
        }
        // One transfer of the entropies at the end, not one per block.
        let values = Tensor::cat(&entropies, 0)?
            .to_dtype(DType::F64)?
            .to_vec1()?;
        *self
            .entropies
            .lock()
            .map_err(|_| candle_core::Error::Msg("token-logps: poisoned entropies".into()))? =
            values;
        Ok(Value::Tensor(Tensor::cat(&logps, 0)?))
    }

    fn bwd(
        &self,
        [hidden, weight]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let work = master_dtype(hidden.dtype());
        let (n, vocab) = (hidden.dim(0)?, weight.dim(0)?);
        let h = hidden.to_dtype(work)?;
        let w = weight.to_dtype(work)?;
        let g = grad.to_dtype(work)?;
        let ids = Tensor::arange(0u32, vocab as u32, hidden.device())?.unsqueeze(0)?;
        let mut dh_blocks = Vec::new();
        let mut dw: Option<Tensor> = None;
        for start in (0..n).step_by(TOKEN_BLOCK) {
            let len = TOKEN_BLOCK.min(n - start);
            let hb = h.narrow(0, start, len)?;
            let b = self.block(&hb, &w)?;
            let idx = self.block_labels(start, len, &h)?;
            // d logp / d capped logits = (onehot − p) / temperature; the one-hot built on the device.
            let p = b.scaled.broadcast_sub(&b.lse)?.exp()?;
            let onehot = ids.broadcast_eq(&idx)?.to_dtype(work)?;
            let gb = (g.narrow(0, start, len)?.unsqueeze(1)? / self.temperature)?;
            let dz = (onehot - p)?.broadcast_mul(&gb)?;
            head_backward(
                dz,
                b.tanh.as_ref(),
                (&hb, &w),
                needs,
                &mut dh_blocks,
                &mut dw,
            )?;
        }
        let dh = match needs[0] {
            true if n == 0 => Some(hidden.zeros_like()?),
            true => Some(Tensor::cat(&dh_blocks, 0)?.to_dtype(hidden.dtype())?),
            false => None,
        };
        let dw = match (needs[1], dw) {
            (true, Some(dw)) => Some(dw.to_dtype(weight.dtype())?),
            (true, None) => Some(weight.zeros_like()?),
            (false, _) => None,
        };
        Ok([dh, dw])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{
        check, f32_chain_bound, max_abs_diff, rand_f64, F32_UNIT_ROUNDOFF,
    };
    use candle_core::Var;

    /// Labels `0..vocab` in a fixed scramble.
    fn labels(n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|i| ((i * 7 + 3) % vocab) as u32).collect()
    }

    /// `cap·tanh(x/cap)` through `exp` (independent of the op's `tanh`).
    fn softcap_via_exp(x: &Tensor, cap: f64) -> Result<Tensor> {
        let e = (x * (-2.0 / cap))?.exp()?;
        ((1.0 - &e)? / (e + 1.0)?)? * cap
    }

    /// The composite reference on the full logits: Candle's `log_softmax(cap(h·Wᵀ) / T)` gathered at the labels,
    /// and the entropies `−Σ p·log p` from the same.
    fn composite(
        xs: &[Tensor],
        labels: &[u32],
        temperature: f64,
        cap: Option<f64>,
    ) -> Result<(Tensor, Tensor)> {
        let logits = xs[0].matmul(&xs[1].t()?)?;
        let logits = match cap {
            Some(c) => softcap_via_exp(&logits, c)?,
            None => logits,
        };
        let lsm = candle_nn::ops::log_softmax(&(logits / temperature)?, 1)?;
        let idx = Tensor::from_slice(labels, (labels.len(), 1), xs[0].device())?;
        let logps = lsm.gather(&idx, 1)?.squeeze(1)?;
        let entropies = (lsm.exp()? * &lsm)?.sum(1)?.neg()?;
        Ok((logps, entropies))
    }

    #[test]
    fn values_match_composite_over_many_blocks() {
        let (n, d, vocab) = (TOKEN_BLOCK + 44, 6, 11);
        assert!(n % TOKEN_BLOCK != 0 && n > TOKEN_BLOCK);
        // Logits of a few units: a cap of 2 bends them a lot.
        let h = (rand_f64(&[n, d], 1) * 2.0).unwrap();
        let w = (rand_f64(&[vocab, d], 2) * 2.0).unwrap();
        let labels = labels(n, vocab);
        for cap in [None, Some(2.0)] {
            for temperature in [1.0, 0.7] {
                let (logps, entropies) = token_logps(&h, &w, &labels, temperature, cap).unwrap();
                let (want, want_entropies) =
                    composite(&[h.clone(), w.clone()], &labels, temperature, cap).unwrap();
                assert_eq!(logps.dims(), &[n]);
                assert_eq!(logps.dtype(), DType::F64);
                let diff = max_abs_diff(&logps, &want);
                assert!(
                    diff < 1e-12,
                    "cap {cap:?} T {temperature}: logps differ by {diff}"
                );
                let want_entropies: Vec<f64> = want_entropies.to_vec1().unwrap();
                assert_eq!(entropies.len(), n);
                for (i, (e, r)) in entropies.iter().zip(&want_entropies).enumerate() {
                    assert!(
                        (e - r).abs() < 1e-12,
                        "cap {cap:?} T {temperature} row {i}: {e} vs {r}"
                    );
                    assert!(*e >= 0.0 && *e <= (vocab as f64).ln() + 1e-12);
                }
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences_and_composite() {
        let (n, d, vocab) = (TOKEN_BLOCK + 9, 5, 7);
        let inputs = [
            (rand_f64(&[n, d], 3) * 2.0).unwrap(),
            (rand_f64(&[vocab, d], 4) * 2.0).unwrap(),
        ];
        let labels = labels(n, vocab);
        for (temperature, cap) in [(0.7, Some(2.0)), (1.3, None)] {
            let l = labels.clone();
            let f = move |xs: &[Tensor]| Ok(token_logps(&xs[0], &xs[1], &l, temperature, cap)?.0);
            let l = labels.clone();
            let r = move |xs: &[Tensor]| Ok(composite(xs, &l, temperature, cap)?.0);
            // A frozen head (no gradient for it) and a trainable one.
            check(&f, &r, &inputs, &[true, false], 30, 1e-6, 1e-10);
            check(&f, &r, &inputs, &[true, true], 30, 1e-6, 1e-10);
        }
    }

    #[test]
    fn empty_input_gives_empty_outputs_and_gradients() {
        let h = Var::from_tensor(&rand_f64(&[0, 4], 5)).unwrap();
        let w = Var::from_tensor(&rand_f64(&[6, 4], 6)).unwrap();
        let (logps, entropies) =
            token_logps(h.as_tensor(), w.as_tensor(), &[], 0.9, Some(3.0)).unwrap();
        assert_eq!(logps.dims(), &[0]);
        assert!(entropies.is_empty());
        let grads = logps.sum_all().unwrap().backward().unwrap();
        assert_eq!(grads.get(&h).unwrap().dims(), &[0, 4]);
        assert_eq!(grads.get(&w).unwrap().dims(), &[6, 4]);
    }

    #[test]
    fn rejects_bad_inputs() {
        let h = rand_f64(&[2, 3], 7);
        let w = rand_f64(&[4, 3], 8);
        let err = |r: Result<(Tensor, Vec<f64>)>| r.unwrap_err().to_string();
        let e = err(token_logps(&h, &w, &[1, 4], 1.0, None));
        assert!(e.contains("label 4 of token 1 is out of range"), "{e}");
        for t in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = err(token_logps(&h, &w, &[1, 2], t, None));
            assert!(e.contains("temperature"), "{e}");
        }
        let e = err(token_logps(&h, &w, &[1, 2], 1.0, Some(0.0)));
        assert!(e.contains("soft-cap"), "{e}");
        let e = err(token_logps(&h, &w, &[1], 1.0, None));
        assert!(e.contains("1 labels for 2"), "{e}");
        let e = err(token_logps(&h, &rand_f64(&[4, 5], 9), &[1, 2], 1.0, None));
        assert!(e.contains("size 3"), "{e}");
        assert!(token_logps(&rand_f64(&[2, 3, 1], 10), &w, &[1, 2], 1.0, None).is_err());
    }

    #[test]
    fn float32_matches_float64() {
        let (n, d, vocab) = (TOKEN_BLOCK + 44, 8, 13);
        let h = (rand_f64(&[n, d], 11) * 2.0).unwrap();
        let w = (rand_f64(&[vocab, d], 12) * 2.0).unwrap();
        let labels = labels(n, vocab);
        let (h32, w32) = (
            h.to_dtype(DType::F32).unwrap(),
            w.to_dtype(DType::F32).unwrap(),
        );
        let u = F32_UNIT_ROUNDOFF;
        // The largest |z| any logit can reach, max of |h|·|W|ᵀ.
        let largest_logit = h
            .abs()
            .unwrap()
            .matmul(&w.abs().unwrap().t().unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        for (temperature, cap) in [(0.7, Some(2.0)), (1.0, None)] {
            let (want, want_entropies) = token_logps(&h, &w, &labels, temperature, cap).unwrap();
            let (got, entropies) = token_logps(&h32, &w32, &labels, temperature, cap).unwrap();
            assert_eq!(got.dtype(), DType::F32);
            // The raw logits' float32 error (the product and the inputs' rounding) passes through the cap (slope
            // ≤ 1) and the division by T; the cap, the division, exp and the vocabulary's sum add a few roundings
            // each, relative to the scaled logits' magnitude `y`.
            let y = (largest_logit + 1.0) / temperature;
            let logit_err = 2.0 * f32_chain_bound(&h, &[&w]) / temperature + 16.0 * u * y;
            // logp = y[label] − lse: both move by at most the logits' error, plus the sum's roundings.
            let tol = 2.0 * (2.0 * logit_err + (vocab as f64 + 8.0) * u * (1.0 + y));
            let diff = max_abs_diff(&got.to_dtype(DType::F64).unwrap(), &want);
            assert!(diff <= tol, "T {temperature} cap {cap:?}: {diff} > {tol}");
            // The entropy's slope in each logit is p·|y − E[y]| ≤ 2y in total.
            let tol_h = 2.0 * (2.0 * y * logit_err + (vocab as f64 + 8.0) * u * (1.0 + y));
            for (e, r) in entropies.iter().zip(&want_entropies) {
                assert!((e - r).abs() <= tol_h, "{e} vs {r} (tolerance {tol_h})");
            }
        }
        // Half-precision inputs: float32 log-probabilities, gradients in the inputs' dtype.
        let hb = Var::from_tensor(&h.to_dtype(DType::BF16).unwrap()).unwrap();
        let wb = Var::from_tensor(&w.to_dtype(DType::BF16).unwrap()).unwrap();
        let (logps, _) =
            token_logps(hb.as_tensor(), wb.as_tensor(), &labels, 0.7, Some(2.0)).unwrap();
        assert_eq!(logps.dtype(), DType::F32);
        let grads = logps.sum_all().unwrap().backward().unwrap();
        assert_eq!(grads.get(&hb).unwrap().dtype(), DType::BF16);
        assert_eq!(grads.get(&wb).unwrap().dtype(), DType::BF16);
    }
}
