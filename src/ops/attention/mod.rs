//! Causal self-attention with grouped-query heads, memory-bounded: scores exist for one block of queries at a time,
//! in the forward and in the backward (which recomputes them, FlashAttention-2 style), and the causal mask is a
//! constant that gets no gradient.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;

use std::sync::Arc;

use candle_core::{DType, Result, Shape, Tensor, D};

use super::autograd::{Apply, Op, Value};
use super::cpu::{gradient, slice_dtype, with_slices, CpuFloat};
use super::work_dtype;
use cpu::{Dims, KeyStarts};

/// Query rows per block: the score tensor is `[batch, heads, QUERY_BLOCK, keys]`.
pub const QUERY_BLOCK: usize = 128;

/// Head dimensions the CUDA attention kernels take (in bf16 or f16); others run the composed path.
pub const CUDA_HEAD_DIMS: [usize; 2] = [64, 128];

/// Where each example of packed rows begins: queries attend only to keys of their own example.
///
/// Built from positions that restart at 0 at every example (`start = index − position`), so the same tensor that
/// drives RoPE defines the mask and the two cannot disagree.
#[derive(Clone, Debug)]
pub struct Segments {
    /// `[batch * len]`: the index of the first token of each token's example.
    starts: Arc<Vec<u32>>,
    batch: usize,
    len: usize,
    /// `starts` on the GPU, uploaded by the first kernel that reads them and shared by every clone (each layer's
    /// forward, recompute and backward of one batch).
    #[cfg(feature = "cuda")]
    on_device: Arc<std::sync::OnceLock<Tensor>>,
}

impl PartialEq for Segments {
    fn eq(&self, other: &Self) -> bool {
        (&self.starts, self.batch, self.len) == (&other.starts, other.batch, other.len)
    }
}

impl Segments {
    /// Segments of `positions` (`[batch, len]`): each row must count up by one from 0 and may restart at 0.
    pub fn from_positions(positions: &Tensor) -> Result<Self> {
        let rows = positions.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let (batch, len) = (rows.len(), rows.first().map_or(0, |r| r.len()));
        let mut starts = Vec::with_capacity(batch * len);
        for (r, row) in rows.iter().enumerate() {
            for (i, &p) in row.iter().enumerate() {
                let restarts = p == 0;
                let continues = i > 0 && p == row[i - 1] + 1;
                if !(restarts || continues) {
                    candle_core::bail!(
                        "packed positions must restart at 0 or count up by one: row {r}, index {i} has {p}"
                    );
                }
                starts.push((i as u32) - p);
            }
        }
        Ok(Segments {
            starts: Arc::new(starts),
            batch,
            len,
            #[cfg(feature = "cuda")]
            on_device: Default::default(),
        })
    }
}

/// Additive mask `[1 or batch, 1, groups*rows, keys]`: query `i` (at absolute position `first_pos + i`) sees keys
/// `start..=first_pos+i`, where `start` is 0, or the beginning of its example in packed rows.
fn attention_mask(
    rows: usize,
    first_pos: usize,
    keys: usize,
    groups: usize,
    segments: Option<&Segments>,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let batch = segments.map_or(1, |s| s.batch);
    let mut m = Vec::with_capacity(batch * groups * rows * keys);
    for b in 0..batch {
        for _ in 0..groups {
            for i in 0..rows {
                let last = first_pos + i;
                let first = segments.map_or(0, |s| s.starts[b * s.len + last] as usize);
                m.extend((0..keys).map(|j| {
                    if (first..=last).contains(&j) {
                        0f32
                    } else {
                        f32::NEG_INFINITY
                    }
                }));
            }
        }
    }
    Tensor::from_vec(m, (batch, 1, groups * rows, keys), device)?.to_dtype(dtype)
}

/// The sizes of a call on `q: [b, hq, t, d]` and `k: [b, hkv, s, d]`, checked.
fn dims_of(q: &Tensor, k: &Tensor) -> Result<Dims> {
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
fn query_rows(dims: Dims, q: &Tensor, i0: usize, c: usize) -> Result<Tensor> {
    q.reshape((dims.b, dims.hkv, dims.g, dims.t, dims.d))?
        .narrow(3, i0, c)?
        .contiguous()?
        .reshape((dims.b, dims.hkv, dims.g * c, dims.d))
}

/// `[b, hkv, g*c, d]` back to `[b, hkv, g, c, d]`.
fn ungroup(dims: Dims, x: &Tensor, c: usize) -> Result<Tensor> {
    x.reshape((dims.b, dims.hkv, dims.g, c, dims.d))
}

/// Softmax probabilities of one query block: `[b, hkv, g*c, keys]` in the working dtype.
fn block_probs(
    qb: &Tensor,
    k: &Tensor,
    dims: Dims,
    i0: usize,
    c: usize,
    scale: f64,
    segments: Option<&Segments>,
) -> Result<(Tensor, usize)> {
    let first_pos = dims.s - dims.t + i0;
    let keys = first_pos + c;
    let kb = k.narrow(2, 0, keys)?;
    let scores = (qb.matmul(&kb.t()?)? * scale)?;
    let mask = attention_mask(
        c,
        first_pos,
        keys,
        dims.g,
        segments,
        scores.dtype(),
        scores.device(),
    )?;
    let scores = scores.broadcast_add(&mask)?;
    let max = scores.max_keepdim(D::Minus1)?;
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    Ok((p, keys))
}

/// Causal attention `softmax(q·kᵀ·scale + causal) · v` for `q: [b, hq, t, d]` and `k, v: [b, hkv, s, d]` with
/// `hq` a multiple of `hkv` (grouped-query attention) and `s ≥ t` (the queries are the last `t` positions, so a KV
/// cache works too). Softmax runs in float32 (f64 stays f64); the output has `q`'s dtype.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    attention(q, k, v, scale, None)
}

/// [`causal_attention`] over packed rows: each query also stays inside its own example (`q`, `k`, `v` cover the
/// same `[batch, len]` positions as `segments`).
pub fn packed_causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    segments: &Segments,
) -> Result<Tensor> {
    let dims = dims_of(q, k)?;
    if (dims.b, dims.t, dims.s) != (segments.batch, segments.len, segments.len) {
        candle_core::bail!(
            "packed attention: q {:?} / k {:?} do not cover the segments' [{}, {}]",
            q.dims(),
            k.dims(),
            segments.batch,
            segments.len
        );
    }
    attention(q, k, v, scale, Some(segments.clone()))
}

fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    segments: Option<Segments>,
) -> Result<Tensor> {
    let dims = dims_of(q, k)?;
    CausalAttention {
        dims,
        scale,
        segments,
        #[cfg(feature = "cuda")]
        lse: None,
    }
    .apply([q, k, v])
}

/// The attention op (inputs `[q, k, v]`).
struct CausalAttention {
    dims: Dims,
    scale: f64,
    segments: Option<Segments>,
    /// Each query row's log-sum-exp, when the CUDA kernels ran the forward (their backward reads it).
    #[cfg(feature = "cuda")]
    lse: Option<Tensor>,
}

impl CausalAttention {
    /// The key ranges of the segments for the slice kernels.
    fn key_starts(&self) -> KeyStarts<'_> {
        KeyStarts {
            starts: self.segments.as_ref().map(|s| s.starts.as_slice()),
            len: self.segments.as_ref().map_or(0, |s| s.len),
        }
    }

    /// The slice kernels' parameters.
    fn params(&self) -> cpu::Params {
        cpu::Params {
            dims: self.dims,
            scale: self.scale,
            query_block: QUERY_BLOCK,
        }
    }

    fn cpu_fwd<T: CpuFloat>(&self, [q, k, v]: [&Tensor; 3]) -> Result<Value> {
        let out = with_slices([q, k, v], |[qs, ks, vs]| {
            Ok(cpu::forward::<T>(
                qs,
                ks,
                vs,
                self.params(),
                self.key_starts(),
            ))
        })?;
        Ok(Value::cpu(out, q.shape()))
    }

    fn cpu_bwd<T: CpuFloat>(
        &self,
        [q, k, v]: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let (dq, dk, dv) = with_slices([q, k, v, grad], |[qs, ks, vs, gs]| {
            Ok(cpu::backward::<T>(
                qs,
                ks,
                vs,
                gs,
                self.params(),
                self.key_starts(),
            ))
        })?;
        let keep = |x: Vec<T>, i: usize, shape: &Shape| gradient(needs[i].then_some(x), shape);
        Ok([
            keep(dq, 0, q.shape())?,
            keep(dk, 1, k.shape())?,
            keep(dv, 2, v.shape())?,
        ])
    }

    /// Candle's ops in f32 (f64 stays f64), query block by query block, with an additive mask.
    fn composed_fwd(&self, [q, k, v]: [&Tensor; 3]) -> Result<Value> {
        let dims = self.dims;
        // Candle's CUDA kernels count elements in 32 bits: a larger score block would run on a truncated grid.
        let scores = dims.b * dims.hkv * dims.g * QUERY_BLOCK.min(dims.t) * dims.t;
        if !q.device().is_cpu() && scores > u32::MAX as usize {
            candle_core::bail!(
                "attention scores of this micro-batch ({} × {} heads × {} queries × {} keys) exceed the 2³² elements \
                 a GPU kernel can address; lower per_device_train_batch_size (raise gradient_accumulation_steps)",
                dims.b,
                dims.hkv * dims.g,
                QUERY_BLOCK.min(dims.t),
                dims.t
            );
        }
        let dtype = q.dtype();
        let work = work_dtype(dtype);
        let (q, k, v) = (
            q.detach().to_dtype(work)?,
            k.detach().to_dtype(work)?,
            v.detach().to_dtype(work)?,
        );
        let mut blocks = Vec::new();
        for i0 in (0..dims.t).step_by(QUERY_BLOCK) {
            let c = QUERY_BLOCK.min(dims.t - i0);
            let qb = query_rows(dims, &q, i0, c)?;
            let (p, keys) = block_probs(&qb, &k, dims, i0, c, self.scale, self.segments.as_ref())?;
            let out = p.matmul(&v.narrow(2, 0, keys)?)?;
            blocks.push(ungroup(dims, &out, c)?);
        }
        let value = Tensor::cat(&blocks, 3)?
            .reshape((dims.b, dims.hkv * dims.g, dims.t, dims.d))?
            .to_dtype(dtype)?;
        Ok(Value::Tensor(value))
    }

    /// The backward recomputes each block's probabilities (FlashAttention-2 style).
    fn composed_bwd(
        &self,
        [q, k, v]: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let (dims, scale) = (self.dims, self.scale);
        let work = work_dtype(q.dtype());
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
            let qb = query_rows(dims, &q, i0, c)?;
            let gb = query_rows(dims, &grad, i0, c)?;
            let (p, keys) = block_probs(&qb, &k, dims, i0, c, scale, self.segments.as_ref())?;
            let kb = k.narrow(2, 0, keys)?;
            let vb = v.narrow(2, 0, keys)?;
            let pad = |x: Tensor| x.pad_with_zeros(2, 0, dims.s - keys);
            dv = (dv + pad(p.t()?.matmul(&gb)?)?)?;
            let dp = gb.matmul(&vb.t()?)?;
            let row = (&p * &dp)?.sum_keepdim(D::Minus1)?;
            let ds = (p * dp.broadcast_sub(&row)?)?;
            dq_blocks.push(ungroup(dims, &(ds.matmul(&kb)? * scale)?, c)?);
            dk = (dk + pad((ds.t()?.matmul(&qb)? * scale)?)?)?;
        }
        let dq =
            Tensor::cat(&dq_blocks, 3)?.reshape((dims.b, dims.hkv * dims.g, dims.t, dims.d))?;
        let out = |x: Tensor, i: usize| -> Result<Option<Tensor>> {
            needs[i].then(|| x.to_dtype(dtypes[i])).transpose()
        };
        Ok([out(dq, 0)?, out(dk, 1)?, out(dv, 2)?])
    }
}

impl Op<3> for CausalAttention {
    const NAME: &'static str = "causal-attention";

    fn fwd(&mut self, inputs: [&Tensor; 3]) -> Result<Value> {
        #[cfg(feature = "cuda")]
        if cuda::applies(inputs[0], inputs[1], inputs[2], self.dims) {
            let (value, lse) =
                cuda::forward(inputs, self.dims, self.scale, self.segments.as_ref())?;
            self.lse = Some(lse);
            return Ok(value);
        }
        match slice_dtype(&inputs) {
            Some(DType::F32) => self.cpu_fwd::<f32>(inputs),
            Some(DType::F64) => self.cpu_fwd::<f64>(inputs),
            _ => self.composed_fwd(inputs),
        }
    }

    fn bwd(
        &self,
        inputs: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        match slice_dtype(&inputs) {
            Some(DType::F32) => self.cpu_bwd::<f32>(inputs, grad, needs),
            Some(DType::F64) => self.cpu_bwd::<f64>(inputs, grad, needs),
            _ => self.composed_bwd(inputs, grad, needs),
        }
    }

    fn bwd_with_output(
        &self,
        inputs: [&Tensor; 3],
        output: &Tensor,
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        #[cfg(feature = "cuda")]
        if let Some(lse) = &self.lse {
            let segments = self.segments.as_ref();
            return cuda::backward(
                inputs, output, grad, lse, self.dims, self.scale, segments, needs,
            );
        }
        let _ = output;
        self.bwd(inputs, grad, needs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, max_abs_diff, rand_f64};

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
    fn packed_rows_equal_separate_examples() {
        // Row 0 packs examples of 3 and 4 tokens; row 1 holds one of 7. The reference runs each example alone.
        let positions = Tensor::from_vec(
            vec![0u32, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6],
            (2, 7),
            &candle_core::Device::Cpu,
        )
        .unwrap();
        let segments = Segments::from_positions(&positions).unwrap();
        let f = |xs: &[Tensor]| packed_causal_attention(&xs[0], &xs[1], &xs[2], 0.4, &segments);
        let r = |xs: &[Tensor]| {
            let piece = |row: usize, start: usize, len: usize| -> Result<Tensor> {
                let cut = |x: &Tensor| x.narrow(0, row, 1)?.narrow(2, start, len);
                reference(&cut(&xs[0])?, &cut(&xs[1])?, &cut(&xs[2])?, 0.4)
            };
            let row0 = Tensor::cat(&[piece(0, 0, 3)?, piece(0, 3, 4)?], 2)?;
            Tensor::cat(&[row0, piece(1, 0, 7)?], 0)
        };
        let inputs = [
            rand_f64(&[2, 4, 7, 3], 11),
            rand_f64(&[2, 2, 7, 3], 12),
            rand_f64(&[2, 2, 7, 3], 13),
        ];
        check(&f, &r, &inputs, &[true, true, true], 30, 1e-6, 1e-12);
    }

    #[test]
    fn packed_positions_must_restart_or_count_up() {
        let dev = candle_core::Device::Cpu;
        let bad = Tensor::from_vec(vec![0u32, 1, 3], (1, 3), &dev).unwrap();
        let err = Segments::from_positions(&bad).unwrap_err().to_string();
        assert!(err.contains("row 0, index 2"), "{err}");
        let starts_late = Tensor::from_vec(vec![1u32, 2], (1, 2), &dev).unwrap();
        assert!(Segments::from_positions(&starts_late).is_err());
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
    use crate::ops::autograd::gradcheck::rand_f64;

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
