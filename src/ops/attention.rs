//! Causal self-attention with grouped-query heads, memory-bounded: scores exist for one block of queries at a time,
//! in the forward and in the backward (which recomputes them, FlashAttention-2 style), and the causal mask is a
//! constant that gets no gradient.

use candle_core::{DType, Result, Tensor, D};

use super::autograd::attach3;

/// Query rows per block: the score tensor is `[batch, heads, QUERY_BLOCK, keys]`.
pub const QUERY_BLOCK: usize = 128;

/// Additive causal mask `[rows, keys]`: query `i` (at absolute position `offset + i`) sees keys `0..=offset+i`.
fn causal_mask(
    rows: usize,
    first_pos: usize,
    keys: usize,
    groups: usize,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let mut m = Vec::with_capacity(groups * rows * keys);
    for _ in 0..groups {
        for i in 0..rows {
            let last = first_pos + i;
            m.extend((0..keys).map(|j| if j <= last { 0f32 } else { f32::NEG_INFINITY }));
        }
    }
    Tensor::from_vec(m, (1, 1, groups * rows, keys), device)?.to_dtype(dtype)
}

/// Shapes of one call: batch, kv heads, query heads per kv head, query length, key length, head dim.
#[derive(Clone, Copy)]
struct Dims {
    b: usize,
    hkv: usize,
    g: usize,
    t: usize,
    s: usize,
    d: usize,
}

impl Dims {
    fn of(q: &Tensor, k: &Tensor) -> Result<Self> {
        let (b, hq, t, d) = q.dims4()?;
        let (bk, hkv, s, dk) = k.dims4()?;
        if bk != b || dk != d || hkv == 0 || hq % hkv != 0 || s < t {
            candle_core::bail!(
                "attention shapes do not fit: q {:?}, k {:?}",
                q.dims(),
                k.dims()
            );
        }
        Ok(Dims {
            b,
            hkv,
            g: hq / hkv,
            t,
            s,
            d,
        })
    }

    /// Query rows `i0..i0+c` of `q` as `[b, hkv, g*c, d]` (grouped under their kv head).
    fn query_block(&self, q: &Tensor, i0: usize, c: usize) -> Result<Tensor> {
        q.reshape((self.b, self.hkv, self.g, self.t, self.d))?
            .narrow(3, i0, c)?
            .contiguous()?
            .reshape((self.b, self.hkv, self.g * c, self.d))
    }

    /// `[b, hkv, g*c, d]` back to `[b, hkv, g, c, d]`.
    fn ungroup(&self, x: &Tensor, c: usize) -> Result<Tensor> {
        x.reshape((self.b, self.hkv, self.g, c, self.d))
    }
}

/// Softmax probabilities of one query block: `[b, hkv, g*c, keys]` in the working dtype.
fn block_probs(
    qb: &Tensor,
    k: &Tensor,
    dims: Dims,
    i0: usize,
    c: usize,
    scale: f64,
) -> Result<(Tensor, usize)> {
    let first_pos = dims.s - dims.t + i0;
    let keys = first_pos + c;
    let kb = k.narrow(2, 0, keys)?;
    let scores = (qb.matmul(&kb.t()?)? * scale)?;
    let mask = causal_mask(c, first_pos, keys, dims.g, scores.dtype(), scores.device())?;
    let scores = scores.broadcast_add(&mask)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    Ok((p, keys))
}

fn work_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Causal attention `softmax(q·kᵀ·scale + causal) · v` for `q: [b, hq, t, d]` and `k, v: [b, hkv, s, d]` with
/// `hq` a multiple of `hkv` (grouped-query attention) and `s ≥ t` (the queries are the last `t` positions, so a KV
/// cache works too). Softmax runs in float32 (f64 stays f64); the output has `q`'s dtype.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let dims = Dims::of(q, k)?;
    let dtype = q.dtype();
    let work = work_dtype(dtype);
    let value = {
        let (q, k, v) = (
            q.detach().to_dtype(work)?,
            k.detach().to_dtype(work)?,
            v.detach().to_dtype(work)?,
        );
        let mut blocks = Vec::new();
        for i0 in (0..dims.t).step_by(QUERY_BLOCK) {
            let c = QUERY_BLOCK.min(dims.t - i0);
            let qb = dims.query_block(&q, i0, c)?;
            let (p, keys) = block_probs(&qb, &k, dims, i0, c, scale)?;
            let out = p.matmul(&v.narrow(2, 0, keys)?)?;
            blocks.push(dims.ungroup(&out, c)?);
        }
        Tensor::cat(&blocks, 3)?
            .reshape((dims.b, dims.hkv * dims.g, dims.t, dims.d))?
            .to_dtype(dtype)?
    };
    attach3(
        "causal-attention",
        q,
        k,
        v,
        value,
        Box::new(move |q, k, v, grad, needs| {
            let dtypes = [q.dtype(), k.dtype(), v.dtype()];
            let (q, k, v, grad) = (
                q.to_dtype(work)?,
                k.to_dtype(work)?,
                v.to_dtype(work)?,
                grad.to_dtype(work)?,
            );
            let mut dq_blocks = Vec::new();
            let mut dk = Tensor::zeros((dims.b, dims.hkv, dims.s, dims.d), work, q.device())?;
            let mut dv = dk.clone();
            for i0 in (0..dims.t).step_by(QUERY_BLOCK) {
                let c = QUERY_BLOCK.min(dims.t - i0);
                let qb = dims.query_block(&q, i0, c)?;
                let gb = dims.query_block(&grad, i0, c)?;
                let (p, keys) = block_probs(&qb, &k, dims, i0, c, scale)?;
                let kb = k.narrow(2, 0, keys)?;
                let vb = v.narrow(2, 0, keys)?;
                let pad = |x: Tensor| x.pad_with_zeros(2, 0, dims.s - keys);
                dv = (dv + pad(p.t()?.matmul(&gb)?)?)?;
                let dp = gb.matmul(&vb.t()?)?;
                let row = (&p * &dp)?.sum_keepdim(D::Minus1)?;
                let ds = (p * dp.broadcast_sub(&row)?)?;
                dq_blocks.push(dims.ungroup(&(ds.matmul(&kb)? * scale)?, c)?);
                dk = (dk + pad((ds.t()?.matmul(&qb)? * scale)?)?)?;
            }
            let dq =
                Tensor::cat(&dq_blocks, 3)?.reshape((dims.b, dims.hkv * dims.g, dims.t, dims.d))?;
            let out = |x: Tensor, i: usize| -> Result<Option<Tensor>> {
                if needs[i] {
                    Ok(Some(x.to_dtype(dtypes[i])?))
                } else {
                    Ok(None)
                }
            };
            Ok((out(dq, 0)?, out(dk, 1)?, out(dv, 2)?))
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check, max_abs_diff, rand_f64};

    /// Composite attention from Candle primitives: repeat kv heads, full scores, masked softmax.
    fn reference(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        let (_, hq, t, _) = q.dims4()?;
        let (_, hkv, s, _) = k.dims4()?;
        let g = hq / hkv;
        let k = candle_transformers_free_repeat_kv(k, g)?;
        let v = candle_transformers_free_repeat_kv(v, g)?;
        let scores = (q.matmul(&k.t()?)? * scale)?;
        let mask: Vec<f64> = (0..t)
            .flat_map(|i| {
                (0..s).map(move |j| {
                    if j <= s - t + i {
                        0.0
                    } else {
                        f64::NEG_INFINITY
                    }
                })
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, s), q.device())?.to_dtype(q.dtype())?;
        candle_nn::ops::softmax(&scores.broadcast_add(&mask)?, D::Minus1)?.matmul(&v)
    }

    fn candle_transformers_free_repeat_kv(x: &Tensor, g: usize) -> Result<Tensor> {
        let (b, h, s, d) = x.dims4()?;
        Tensor::cat(&vec![x; g], 2)?.reshape((b, h * g, s, d))
    }

    #[test]
    fn gqa_gradients_match_finite_differences_and_composite() {
        let f = |xs: &[Tensor]| causal_attention(&xs[0], &xs[1], &xs[2], 0.4);
        let r = |xs: &[Tensor]| reference(&xs[0], &xs[1], &xs[2], 0.4);
        let inputs = [
            rand_f64(&[2, 4, 5, 3], 1),
            rand_f64(&[2, 2, 5, 3], 2),
            rand_f64(&[2, 2, 5, 3], 3),
        ];
        check(&f, &r, &inputs, &[true, true, true], 30, 1e-6, 1e-12);
    }

    #[test]
    fn multi_block_sequences_and_frozen_inputs() {
        // 130 queries span two query blocks; v frozen.
        let f = |xs: &[Tensor]| causal_attention(&xs[0], &xs[1], &xs[2], 0.3);
        let r = |xs: &[Tensor]| reference(&xs[0], &xs[1], &xs[2], 0.3);
        let inputs = [
            rand_f64(&[1, 3, 130, 2], 4),
            rand_f64(&[1, 1, 130, 2], 5),
            rand_f64(&[1, 1, 130, 2], 6),
        ];
        check(&f, &r, &inputs, &[true, true, false], 12, 1e-6, 1e-12);
    }

    #[test]
    fn cached_keys_offset_the_queries() {
        // 2 new queries over 6 keys equal the last 2 rows of the full computation.
        let (q, k, v) = (
            rand_f64(&[1, 2, 6, 4], 7),
            rand_f64(&[1, 1, 6, 4], 8),
            rand_f64(&[1, 1, 6, 4], 9),
        );
        let full = causal_attention(&q, &k, &v, 0.5)
            .unwrap()
            .narrow(2, 4, 2)
            .unwrap();
        let tail = causal_attention(&q.narrow(2, 4, 2).unwrap(), &k, &v, 0.5).unwrap();
        let d = max_abs_diff(&full, &tail);
        assert!(d < 1e-14, "{d}");
    }
}

#[cfg(test)]
mod bf16_tests {
    use super::*;
    use crate::ops::gradcheck::rand_f64;

    #[test]
    fn half_precision_inputs_get_half_precision_gradients() {
        let mk = |s: u64, h: usize| {
            candle_core::Var::from_tensor(
                &rand_f64(&[1, h, 5, 4], s).to_dtype(DType::BF16).unwrap(),
            )
            .unwrap()
        };
        let (q, k, v) = (mk(1, 2), mk(2, 1), mk(3, 1));
        let y = causal_attention(&q, &k, &v, 0.5).unwrap();
        assert_eq!(y.dtype(), DType::BF16);
        let g = y.sum_all().unwrap().backward().unwrap();
        for t in [&q, &k, &v] {
            assert_eq!(g.get(t).unwrap().dtype(), DType::BF16);
        }
    }
}
