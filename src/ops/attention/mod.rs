//! Causal self-attention with grouped-query heads, memory-bounded: scores exist for one block of queries at a time,
//! in the forward and in the backward (which recomputes them, FlashAttention-2 style), and the causal mask is a
//! constant that gets no gradient.
//!
//! Besides the causal mask, an [`AttentionSpec`] may narrow what a query sees to a sliding window (Mistral, Gemma
//! 2/3, Phi-3), soft-cap the scores (Gemma 2) and add a per-head attention sink (gpt-oss: [`AttentionSinks`], a
//! learned logit that joins each row's softmax and carries no value); packed rows ([`Segments`]) keep each query
//! inside its example.

mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
mod spec;

use candle_core::{DType, Result, Shape, Tensor, D};

use super::autograd::op::{Apply, Op, Value};
use super::cpu::{gradient, slice_dtype, with_slices, CpuFloat};
use crate::precision::master_dtype;
use cpu::{Dims, KeyStarts};

pub use spec::{
    dq_kv_heads_per_launch, set_cuda_dq_bytes, AttentionSinks, AttentionSpec, Segments,
    CUDA_HEAD_DIMS, QUERY_BLOCK,
};

/// Additive mask `[1 or batch, 1, groups*rows, keys - lo]` over keys `lo..keys`: query `i` (at absolute position
/// `first_pos + i`) sees keys `first..=first_pos+i`, `first` from `starts` (example start and sliding window).
#[allow(clippy::too_many_arguments)]
fn attention_mask(
    rows: usize,
    first_pos: usize,
    (lo, keys): (usize, usize),
    groups: usize,
    starts: KeyStarts,
    batch: usize,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let mut m = Vec::with_capacity(batch * groups * rows * (keys - lo));
    for b in 0..batch {
        for _ in 0..groups {
            for i in 0..rows {
                let last = first_pos + i;
                let first = starts.first(b, last);
                m.extend((lo..keys).map(|j| {
                    if (first..=last).contains(&j) {
                        0f32
                    } else {
                        f32::NEG_INFINITY
                    }
                }));
            }
        }
    }
    Tensor::from_vec(m, (batch, 1, groups * rows, keys - lo), device)?.to_dtype(dtype)
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

/// The softmax probabilities of one query block of the composed path.
struct BlockProbs {
    /// `[b, hkv, g*c, keys - lo]` in the working dtype.
    p: Tensor,
    /// Under a soft cap, `1 − tanh²(score/cap)` of each score (same shape as `p`).
    dcap: Option<Tensor>,
    /// The block's keys are `lo..keys`.
    lo: usize,
    keys: usize,
}

/// Causal attention `softmax(q·kᵀ·scale + causal) · v` for `q: [b, hq, t, d]` and `k, v: [b, hkv, s, d]` with
/// `hq` a multiple of `hkv` (grouped-query attention) and `s ≥ t` (the queries are the last `t` positions, so a KV
/// cache works too). Softmax runs in float32 (f64 stays f64); the output has `q`'s dtype.
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    attention(q, k, v, &AttentionSpec::causal(scale), None)
}

/// [`causal_attention`] over packed rows: each query also stays inside its own example (`k` and `v` cover the
/// `[batch, len]` positions of `segments`, `q` the last `t ≤ len` of them).
pub fn packed_causal_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    segments: &Segments,
) -> Result<Tensor> {
    attention(q, k, v, &AttentionSpec::causal(scale), Some(segments))
}

/// Causal attention with `spec`; `segments` restricts packed rows to their example (see
/// [`packed_causal_attention`]).
///
/// The query at absolute position `p` (queries are the last `t` of the `s` keys) sees keys
/// `max(start, p + 1 − window)..=p`, `start` being 0 or the first token of its example; scores are
/// `scale·q·kᵀ`, soft-capped to `cap·tanh(score/cap)` before the mask where `spec.softcap` is set; with
/// `spec.sinks`, query head `h`'s softmax also counts `exp(sinks[h])` in its denominator. An error if the sinks are
/// not one finite value per query head.
///
/// On a CUDA device the tensor-core kernels run it (packed rows, windows, caps and sinks included) for bf16/f16
/// heads of [`CUDA_HEAD_DIMS`]; other calls run the composed path of Candle's ops there.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    spec: &AttentionSpec,
    segments: Option<&Segments>,
) -> Result<Tensor> {
    let dims = dims_of(q, k)?;
    spec.validate(dims.hkv * dims.g)?;
    if let Some(segments) = segments {
        if (dims.b, dims.s) != (segments.batch, segments.len) {
            candle_core::bail!(
                "packed attention: q {:?} / k {:?} do not cover the segments' [{}, {}]",
                q.dims(),
                k.dims(),
                segments.batch,
                segments.len
            );
        }
    }
    CausalAttention {
        dims,
        spec: spec.normalized(dims.s),
        segments: segments.cloned(),
        #[cfg(feature = "cuda")]
        lse: None,
    }
    .apply([q, k, v])
}

/// The attention op (inputs `[q, k, v]`).
struct CausalAttention {
    dims: Dims,
    /// Validated (sinks included); a window is shorter than the keys.
    spec: AttentionSpec,
    segments: Option<Segments>,
    /// Each query row's log-sum-exp, when the CUDA kernels ran the forward (their backward reads it).
    #[cfg(feature = "cuda")]
    lse: Option<Tensor>,
}

impl CausalAttention {
    /// The key ranges of the segments and the window for the slice kernels.
    fn key_starts(&self) -> KeyStarts<'_> {
        KeyStarts {
            starts: self.segments.as_ref().map(|s| s.starts.as_slice()),
            len: self.segments.as_ref().map_or(0, |s| s.len),
            window: self.spec.sliding_window,
        }
    }

    /// The slice kernels' parameters.
    fn params(&self) -> cpu::Params<'_> {
        cpu::Params {
            dims: self.dims,
            scale: self.spec.scale,
            softcap: self.spec.softcap,
            sinks: self.spec.sinks.as_ref().map(|s| s.values()),
            query_block: QUERY_BLOCK,
        }
    }

    /// Whether the CUDA kernels compute this op (windows, soft caps and sinks included).
    #[cfg(feature = "cuda")]
    fn on_cuda_kernels(&self, [q, k, v]: [&Tensor; 3]) -> bool {
        cuda::applies(q, k, v, self.dims)
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

    /// Softmax probabilities of query rows `i0..i0+c` (`qb`, grouped) against the keys the block sees, with
    /// `1 − tanh²` of the soft-capped scores when `with_dcap` (for the backward).
    fn block_probs(
        &self,
        qb: &Tensor,
        k: &Tensor,
        i0: usize,
        c: usize,
        with_dcap: bool,
    ) -> Result<BlockProbs> {
        let dims = self.dims;
        let starts = self.key_starts();
        let batch = self.segments.as_ref().map_or(1, |s| s.batch);
        let first_pos = dims.s - dims.t + i0;
        let keys = first_pos + c;
        let lo = (0..batch)
            .map(|b| starts.block_first(b, first_pos, c))
            .min()
            .unwrap_or(0);
        let kb = k.narrow(2, lo, keys - lo)?;
        let mut scores = (qb.matmul(&kb.t()?)? * self.spec.scale)?;
        let mut dcap = None;
        if let Some(cap) = self.spec.softcap {
            let th = (scores / cap)?.tanh()?;
            if with_dcap {
                dcap = Some(th.sqr()?.affine(-1.0, 1.0)?);
            }
            scores = (th * cap)?;
        }
        let mask = attention_mask(
            c,
            first_pos,
            (lo, keys),
            dims.g,
            starts,
            batch,
            scores.dtype(),
            scores.device(),
        )?;
        let scores = scores.broadcast_add(&mask)?;
        let mut max = scores.max_keepdim(D::Minus1)?;
        // A sink is one more column of the softmax (in the maximum and the sum) without a value: no column of `p`.
        let sink = match &self.spec.sinks {
            Some(sinks) => {
                let sink = sinks.block_column(dims, c, scores.dtype(), scores.device())?;
                max = max.broadcast_maximum(&sink)?;
                Some(sink)
            }
            None => None,
        };
        let e = scores.broadcast_sub(&max)?.exp()?;
        let mut sum = e.sum_keepdim(D::Minus1)?;
        if let Some(sink) = sink {
            sum = (sum + sink.broadcast_sub(&max)?.exp()?)?;
        }
        let p = e.broadcast_div(&sum)?;
        Ok(BlockProbs { p, dcap, lo, keys })
    }

    /// Candle's ops in f32 (f64 stays f64), query block by query block, with an additive mask.
    fn composed_fwd(&self, [q, k, v]: [&Tensor; 3]) -> Result<Value> {
        let dims = self.dims;
        // Candle's CUDA kernels count elements in 32 bits: a larger score block would run on a truncated grid.
        let scores = dims.b * dims.hkv * dims.g * QUERY_BLOCK.min(dims.t) * dims.s;
        if !q.device().is_cpu() && scores > u32::MAX as usize {
            candle_core::bail!(
                "attention scores of this micro-batch ({} × {} heads × {} queries × {} keys) exceed the 2³² elements \
                 a GPU kernel can address; lower per_device_train_batch_size (raise gradient_accumulation_steps), \
                 or per_device_eval_batch_size when evaluating (`--batch-size` for qlora eval)",
                dims.b,
                dims.hkv * dims.g,
                QUERY_BLOCK.min(dims.t),
                dims.s
            );
        }
        let dtype = q.dtype();
        let work = master_dtype(dtype);
        let (q, k, v) = (
            q.detach().to_dtype(work)?,
            k.detach().to_dtype(work)?,
            v.detach().to_dtype(work)?,
        );
        let mut blocks = Vec::new();
        for i0 in (0..dims.t).step_by(QUERY_BLOCK) {
            let c = QUERY_BLOCK.min(dims.t - i0);
            let qb = query_rows(dims, &q, i0, c)?;
            let BlockProbs { p, lo, keys, .. } = self.block_probs(&qb, &k, i0, c, false)?;
            let out = p.matmul(&v.narrow(2, lo, keys - lo)?)?;
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
        let (dims, scale) = (self.dims, self.spec.scale);
        let work = master_dtype(q.dtype());
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
            let BlockProbs { p, dcap, lo, keys } = self.block_probs(&qb, &k, i0, c, true)?;
            let kb = k.narrow(2, lo, keys - lo)?;
            let vb = v.narrow(2, lo, keys - lo)?;
            let pad = |x: Tensor| x.pad_with_zeros(2, lo, dims.s - keys);
            dv = (dv + pad(p.t()?.matmul(&gb)?)?)?;
            let dp = gb.matmul(&vb.t()?)?;
            // The sink's column is a constant with no value, so `D` sums over the real keys only.
            let row = (&p * &dp)?.sum_keepdim(D::Minus1)?;
            let mut ds = (p * dp.broadcast_sub(&row)?)?;
            if let Some(dcap) = dcap {
                ds = (ds * dcap)?;
            }
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
        if self.on_cuda_kernels(inputs) {
            let segments = self.segments.as_ref();
            let (value, lse) = cuda::forward(inputs, self.dims, &self.spec, segments)?;
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
        // Only a forward on the CUDA kernels saved a log-sum-exp.
        #[cfg(feature = "cuda")]
        if let Some(lse) = &self.lse {
            let segments = self.segments.as_ref();
            let spec = &self.spec;
            return cuda::backward(inputs, output, grad, lse, self.dims, spec, segments, needs);
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
        reference_with(q, k, v, &AttentionSpec::causal(scale), None)
    }

    /// [`reference`] with a spec and packed `positions` (`[b, s]`, restarting at 0 per example): the full score
    /// matrix, soft-capped, masked by `max(start, p + 1 − window) ≤ j ≤ p`, with the head's sink as one more column
    /// (transformers' gpt-oss), softmax, the sink's column dropped (all in `q`'s dtype).
    fn reference_with(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spec: &AttentionSpec,
        positions: Option<&[Vec<u32>]>,
    ) -> Result<Tensor> {
        let (b, hq, t, _) = q.dims4()?;
        let (_, hkv, s, _) = k.dims4()?;
        let g = hq / hkv;
        let k = candle_transformers_free_repeat_kv(k, g)?;
        let v = candle_transformers_free_repeat_kv(v, g)?;
        let mut scores = (q.matmul(&k.t()?)? * spec.scale)?;
        if let Some(cap) = spec.softcap {
            scores = ((scores / cap)?.tanh()? * cap)?;
        }
        let rows = positions.map_or(1, |p| p.len());
        let mut mask = Vec::with_capacity(rows * t * s);
        for r in 0..rows {
            for i in 0..t {
                let p = s - t + i;
                let start = positions.map_or(0, |ps| p - ps[r][p] as usize);
                for j in 0..s {
                    let in_window = spec.sliding_window.is_none_or(|w| j + w > p);
                    mask.push(if start <= j && j <= p && in_window {
                        0.0
                    } else {
                        f64::NEG_INFINITY
                    });
                }
            }
        }
        assert!(rows == 1 || rows == b);
        let mask = Tensor::from_vec(mask, (rows, 1, t, s), q.device())?.to_dtype(q.dtype())?;
        let scores = scores.broadcast_add(&mask)?;
        let probs = match &spec.sinks {
            None => candle_nn::ops::softmax(&scores, D::Minus1)?,
            Some(sinks) => {
                let column = Tensor::new(sinks.values(), q.device())?
                    .to_dtype(q.dtype())?
                    .reshape((1, hq, 1, 1))?
                    .broadcast_as((b, hq, t, 1))?;
                let with_sink = Tensor::cat(&[&scores, &column], 3)?;
                candle_nn::ops::softmax(&with_sink, D::Minus1)?.narrow(3, 0, s)?
            }
        };
        probs.matmul(&v)
    }

    fn candle_transformers_free_repeat_kv(x: &Tensor, g: usize) -> Result<Tensor> {
        let (b, h, s, d) = x.dims4()?;
        Tensor::cat(&vec![x; g], 2)?.reshape((b, h * g, s, d))
    }

    /// The attention op forced onto its composed path (Candle's ops), even for f64 on the CPU.
    struct Composed(CausalAttention);

    impl Op<3> for Composed {
        const NAME: &'static str = "composed-attention";
        fn fwd(&mut self, inputs: [&Tensor; 3]) -> Result<Value> {
            self.0.composed_fwd(inputs)
        }
        fn bwd(
            &self,
            inputs: [&Tensor; 3],
            grad: &Tensor,
            needs: [bool; 3],
        ) -> Result<[Option<Tensor>; 3]> {
            self.0.composed_bwd(inputs, grad, needs)
        }
    }

    /// [`attention`] on the composed path.
    fn composed(
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        spec: &AttentionSpec,
        segments: Option<&Segments>,
    ) -> Result<Tensor> {
        let dims = dims_of(q, k)?;
        spec.validate(dims.hkv * dims.g)?;
        Composed(CausalAttention {
            dims,
            spec: spec.normalized(dims.s),
            segments: segments.cloned(),
            #[cfg(feature = "cuda")]
            lse: None,
        })
        .apply([q, k, v])
    }

    /// Checks the slice kernel and the composed path against [`reference_with`] (forward, gradients) and finite
    /// differences, and against each other.
    fn check_spec(
        spec: AttentionSpec,
        positions: Option<&[Vec<u32>]>,
        inputs: &[Tensor; 3],
        samples: usize,
    ) {
        let segments = positions.map(|p| {
            let flat: Vec<u32> = p.concat();
            let t = Tensor::from_vec(flat, (p.len(), p[0].len()), &candle_core::Device::Cpu);
            Segments::from_positions(&t.unwrap()).unwrap()
        });
        let segments = segments.as_ref();
        let r = |xs: &[Tensor]| reference_with(&xs[0], &xs[1], &xs[2], &spec, positions);
        let sliced = |xs: &[Tensor]| attention(&xs[0], &xs[1], &xs[2], &spec, segments);
        let composite = |xs: &[Tensor]| composed(&xs[0], &xs[1], &xs[2], &spec, segments);
        let all = [true, true, true];
        check(&sliced, &r, inputs, &all, samples, 1e-6, 1e-12);
        check(&composite, &r, inputs, &all, samples, 1e-6, 1e-12);
        check(&sliced, &composite, inputs, &all, 0, 1e-6, 1e-12);
    }

    /// Packed positions: row 0 holds examples of 3 and `len - 3` tokens, row 1 one of `len`.
    fn two_rows(len: usize) -> Vec<Vec<u32>> {
        let row0 = (0..3u32).chain(0..(len as u32 - 3)).collect();
        vec![row0, (0..len as u32).collect()]
    }

    #[test]
    fn sliding_window_matches_reference_with_gqa() {
        let inputs = [
            rand_f64(&[2, 4, 9, 3], 21),
            rand_f64(&[2, 2, 9, 3], 22),
            rand_f64(&[2, 2, 9, 3], 23),
        ];
        for window in [1, 3, 8] {
            check_spec(
                AttentionSpec::causal(0.6).with_sliding_window(window),
                None,
                &inputs,
                20,
            );
        }
    }

    #[test]
    fn softcap_matches_reference_with_gqa() {
        // Scores reach ±3·1.5: a cap of 0.8 bends them well into tanh's curve.
        let inputs = [
            rand_f64(&[2, 4, 7, 3], 31),
            rand_f64(&[2, 2, 7, 3], 32),
            rand_f64(&[2, 2, 7, 3], 33),
        ];
        for cap in [0.8, 5.0] {
            check_spec(
                AttentionSpec::causal(1.5).with_softcap(cap),
                None,
                &inputs,
                20,
            );
        }
    }

    #[test]
    fn window_and_softcap_on_packed_rows() {
        let inputs = [
            rand_f64(&[2, 4, 9, 3], 41),
            rand_f64(&[2, 2, 9, 3], 42),
            rand_f64(&[2, 2, 9, 3], 43),
        ];
        let positions = two_rows(9);
        let spec = AttentionSpec::causal(1.2)
            .with_sliding_window(4)
            .with_softcap(0.9);
        check_spec(spec.clone(), Some(&positions), &inputs, 20);
        check_spec(
            AttentionSpec::causal(0.7).with_sliding_window(2),
            Some(&positions),
            &inputs,
            10,
        );
        check_spec(
            AttentionSpec::causal(1.2).with_softcap(0.7),
            Some(&positions),
            &inputs,
            10,
        );
    }

    #[test]
    fn window_softcap_and_sinks_with_cached_keys() {
        // 3 new queries over 10 keys (packed and not): equal to the reference and to the tail of the full call.
        let (q, k, v) = (
            rand_f64(&[2, 4, 10, 3], 51),
            rand_f64(&[2, 2, 10, 3], 52),
            rand_f64(&[2, 2, 10, 3], 53),
        );
        let tail = q.narrow(2, 7, 3).unwrap();
        let positions = two_rows(10);
        let flat = Tensor::from_vec(positions.concat(), (2, 10), &candle_core::Device::Cpu);
        let segments = Segments::from_positions(&flat.unwrap()).unwrap();
        let with_sinks = AttentionSpec::causal(1.1).with_sinks(sinks(4));
        let specs = [
            AttentionSpec::causal(1.3)
                .with_sliding_window(4)
                .with_softcap(0.8),
            with_sinks.clone(),
            with_sinks.with_sliding_window(4),
        ];
        for spec in specs {
            for (segs, pos) in [(None, None), (Some(&segments), Some(positions.as_slice()))] {
                let inputs = [tail.clone(), k.clone(), v.clone()];
                check_spec(spec.clone(), pos, &inputs, 15);
                let full = attention(&q, &k, &v, &spec, segs).unwrap();
                let part = attention(&tail, &k, &v, &spec, segs).unwrap();
                let d = max_abs_diff(&full.narrow(2, 7, 3).unwrap(), &part);
                assert!(d < 1e-14, "{d}");
            }
        }
    }

    #[test]
    fn window_softcap_and_sinks_across_query_blocks() {
        // 150 queries span two query blocks; the second block's keys start inside the first's queries.
        let inputs = [
            rand_f64(&[1, 2, 150, 2], 61),
            rand_f64(&[1, 1, 150, 2], 62),
            rand_f64(&[1, 1, 150, 2], 63),
        ];
        let spec = AttentionSpec::causal(1.5)
            .with_sliding_window(7)
            .with_softcap(1.1);
        check_spec(spec, None, &inputs, 8);
        check_spec(
            AttentionSpec::causal(0.5).with_sliding_window(140),
            None,
            &inputs,
            4,
        );
        // The composed path's sink column has `c` rows per head in each block.
        let with_sinks = AttentionSpec::causal(1.5)
            .with_sliding_window(7)
            .with_sinks(sinks(2));
        check_spec(with_sinks, None, &inputs, 6);
    }

    #[test]
    fn window_covering_the_keys_changes_nothing() {
        let (q, k, v) = (
            rand_f64(&[1, 4, 6, 3], 71),
            rand_f64(&[1, 2, 6, 3], 72),
            rand_f64(&[1, 2, 6, 3], 73),
        );
        let plain = causal_attention(&q, &k, &v, 0.5).unwrap();
        for window in [6, 7, 100] {
            let spec = AttentionSpec::causal(0.5).with_sliding_window(window);
            for y in [
                attention(&q, &k, &v, &spec, None).unwrap(),
                composed(&q, &k, &v, &spec, None).unwrap(),
            ] {
                let d = max_abs_diff(&plain, &y);
                assert!(d < 1e-14, "window {window}: {d}");
            }
        }
        // One key fewer does change the last query.
        let spec = AttentionSpec::causal(0.5).with_sliding_window(5);
        let y = attention(&q, &k, &v, &spec, None).unwrap();
        assert!(max_abs_diff(&plain, &y) > 1e-6);
    }

    #[test]
    fn window_of_one_sees_only_the_query_itself() {
        let (q, k, v) = (
            rand_f64(&[2, 4, 5, 3], 81),
            rand_f64(&[2, 2, 5, 3], 82),
            rand_f64(&[2, 2, 5, 3], 83),
        );
        let expected = candle_transformers_free_repeat_kv(&v, 2).unwrap();
        for cap in [None, Some(0.5)] {
            let spec = AttentionSpec {
                scale: 0.9,
                sliding_window: Some(1),
                softcap: cap,
                sinks: None,
            };
            for y in [
                attention(&q, &k, &v, &spec, None).unwrap(),
                composed(&q, &k, &v, &spec, None).unwrap(),
            ] {
                let d = max_abs_diff(&y, &expected);
                assert!(d < 1e-15, "{d}");
            }
        }
    }

    #[test]
    fn half_precision_composed_path_follows_f64() {
        // bf16 on the CPU runs the composed path (its soft cap; its sink column and denominator): forward and
        // gradients near the f64 slice kernel's.
        let window = AttentionSpec::causal(1.4).with_sliding_window(3);
        for spec in [
            window.clone().with_softcap(0.9),
            window.with_sinks(sinks(4)),
        ] {
            half_precision_follows_f64(&spec);
        }
    }

    /// `spec` in bf16 (the composed path) against f64 (the slice kernel): output and gradients.
    fn half_precision_follows_f64(spec: &AttentionSpec) {
        let xs = [
            rand_f64(&[1, 4, 8, 4], 91),
            rand_f64(&[1, 2, 8, 4], 92),
            rand_f64(&[1, 2, 8, 4], 93),
        ];
        let run = |dtype: DType| {
            let vars: Vec<_> = xs
                .iter()
                .map(|x| candle_core::Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap())
                .collect();
            let y = attention(&vars[0], &vars[1], &vars[2], spec, None).unwrap();
            let r = rand_f64(y.dims(), 5).to_dtype(dtype).unwrap();
            let grads = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
            let mut out = vec![y.to_dtype(DType::F64).unwrap()];
            for v in &vars {
                let g = grads.get(v).unwrap();
                assert_eq!(g.dtype(), dtype);
                out.push(g.to_dtype(DType::F64).unwrap());
            }
            out
        };
        for (a, b) in run(DType::F64).iter().zip(run(DType::BF16)) {
            let d = max_abs_diff(a, &b);
            assert!(d < 3e-2, "{d}");
        }
    }

    #[test]
    fn bad_specs_are_errors() {
        let x = rand_f64(&[1, 1, 3, 2], 1);
        let spec = AttentionSpec::causal(0.5);
        let bad = [
            spec.clone().with_sliding_window(0),
            spec.clone().with_softcap(0.0),
            spec.clone().with_softcap(-1.0),
            spec.clone().with_softcap(f64::NAN),
            spec.clone().with_softcap(f64::INFINITY),
            spec.clone()
                .with_sinks(AttentionSinks::new(vec![f32::NEG_INFINITY])),
            spec.clone().with_sinks(AttentionSinks::new(vec![f32::NAN])),
        ];
        for spec in bad {
            assert!(attention(&x, &x, &x, &spec, None).is_err(), "{spec:?}");
        }
        let good = spec
            .with_sliding_window(1)
            .with_softcap(1e-3)
            .with_sinks(AttentionSinks::new(vec![-3.0]));
        assert!(attention(&x, &x, &x, &good, None).is_ok());
    }

    /// Sinks for `heads` query heads: distinct, some above the scores of the test inputs, some far below.
    fn sinks(heads: usize) -> AttentionSinks {
        AttentionSinks::new((0..heads).map(|h| [0.7, -1.3, 2.2, -8.0][h % 4]).collect())
    }

    #[test]
    fn sinks_match_reference_with_gqa() {
        // 4 query heads over 2 kv heads: each head's own sink (a wrong head index shows in the reference check).
        let inputs = [
            rand_f64(&[2, 4, 9, 3], 101),
            rand_f64(&[2, 2, 9, 3], 102),
            rand_f64(&[2, 2, 9, 3], 103),
        ];
        let causal = AttentionSpec::causal(0.8).with_sinks(sinks(4));
        for spec in [
            causal.clone(),
            causal.clone().with_sliding_window(3),
            causal.clone().with_softcap(0.9),
            causal.with_sliding_window(1),
        ] {
            check_spec(spec, None, &inputs, 20);
        }
    }

    #[test]
    fn sinks_take_probability_away_from_the_keys() {
        // With one key seen, p = 1/(1 + exp(sink − s)): a sink far below the score leaves the output at v, a sink
        // equal to it halves it, one far above empties it.
        let (q, k, v) = (
            rand_f64(&[1, 2, 4, 3], 131),
            rand_f64(&[1, 1, 4, 3], 132),
            rand_f64(&[1, 1, 4, 3], 133),
        );
        let window = AttentionSpec::causal(1.0).with_sliding_window(1);
        let plain = candle_transformers_free_repeat_kv(&v, 2).unwrap();
        let run = |values: Vec<f32>| {
            let spec = window.clone().with_sinks(AttentionSinks::new(values));
            let sliced = attention(&q, &k, &v, &spec, None).unwrap();
            let composite = composed(&q, &k, &v, &spec, None).unwrap();
            assert!(max_abs_diff(&sliced, &composite) < 1e-15);
            sliced
        };
        assert!(max_abs_diff(&run(vec![-60.0, -60.0]), &plain) < 1e-15);
        assert!(
            run(vec![60.0, 60.0])
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
                < 1e-20
        );
        // Each head's own sink: head 0 keeps v, head 1 (sink = its score) gets p = ½.
        let scores = (q.narrow(1, 1, 1).unwrap() * k.clone())
            .unwrap()
            .sum(D::Minus1)
            .unwrap();
        let y = run(vec![-60.0, 0.0]);
        assert!(max_abs_diff(&y.narrow(1, 0, 1).unwrap(), &v) < 1e-15);
        let half = y.narrow(1, 1, 1).unwrap();
        let expected = v
            .broadcast_mul(
                &(scores.neg().unwrap().exp().unwrap() + 1.0)
                    .unwrap()
                    .recip()
                    .unwrap()
                    .unsqueeze(3)
                    .unwrap(),
            )
            .unwrap();
        assert!(max_abs_diff(&half, &expected) < 1e-14);
    }

    #[test]
    fn sinks_must_match_the_query_heads() {
        let (q, k) = (rand_f64(&[1, 4, 3, 2], 1), rand_f64(&[1, 2, 3, 2], 2));
        let spec = AttentionSpec::causal(0.5).with_sinks(sinks(3));
        let err = attention(&q, &k, &k, &spec, None).unwrap_err().to_string();
        assert!(err.contains("3 sinks for 4 query heads"), "{err}");
        assert_eq!(
            AttentionSpec::causal(0.5).with_sinks(sinks(4)),
            AttentionSpec::causal(0.5).with_sinks(AttentionSinks::new(vec![0.7, -1.3, 2.2, -8.0]))
        );
        assert_eq!(sinks(2).values(), &[0.7, -1.3]);
    }

    #[test]
    fn segments_must_cover_the_keys() {
        let positions = Tensor::from_vec(vec![0u32, 1, 2, 0], (1, 4), &candle_core::Device::Cpu);
        let segments = Segments::from_positions(&positions.unwrap()).unwrap();
        let (q, k) = (rand_f64(&[1, 1, 3, 2], 1), rand_f64(&[1, 1, 3, 2], 2));
        assert!(packed_causal_attention(&q, &k, &k, 0.5, &segments).is_err());
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
