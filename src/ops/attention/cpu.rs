//! Causal attention on CPU slices (f32/f64).
//!
//! One task per (sequence, kv head) runs on its own thread: the query heads of the group, block by block of
//! queries, with single-threaded products — a block's matrices are too small to split further, and the tasks
//! already fill the cores. The mask is applied while taking the softmax (keys outside `first..=position` get
//! probability 0, `first` being the latest of the example's start and the sliding window's first key), so no mask
//! tensor is built, and a block's products skip the keys before the first one its earliest query sees. The backward
//! recomputes each block's probabilities (FlashAttention-2 style, soft-capping included) using
//! `D = rowsum(P ⊙ dP)`, which needs neither the output nor a stored softmax. An attention sink (gpt-oss) only adds
//! a term to each row's softmax denominator: `dS = P ⊙ (dP − D)` keeps its form, `D` summing over the real keys.

use rayon::prelude::*;

use crate::ops::cpu::gemm::{matmul_into_serial, Mat};
use crate::ops::cpu::vector::{self, simd};
use crate::ops::cpu::CpuFloat;

/// The sizes of a call: batch, kv heads, query heads per kv head, query length, key length, head dim.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub b: usize,
    pub hkv: usize,
    pub g: usize,
    pub t: usize,
    pub s: usize,
    pub d: usize,
}

/// A call's sizes, its score scale, soft cap and sinks, and the queries per block.
#[derive(Clone, Copy)]
pub(super) struct Params<'a> {
    pub dims: Dims,
    pub scale: f64,
    /// Scores become `cap·tanh(score/cap)` before the mask.
    pub softcap: Option<f64>,
    /// Per query head (`[hq]`), one more logit in each row's softmax, without a value.
    pub sinks: Option<&'a [f32]>,
    pub query_block: usize,
}

/// Where key ranges start: 0 (plain causal), per sequence and position the first token of its example (packed
/// rows), and no earlier than `window - 1` positions before the query (sliding window).
#[derive(Clone, Copy)]
pub(super) struct KeyStarts<'a> {
    /// `[batch * len]` (packed rows), or `None`.
    pub starts: Option<&'a [u32]>,
    /// Positions per sequence in `starts`.
    pub len: usize,
    /// The sliding window (at least 1), or `None`.
    pub window: Option<usize>,
}

impl KeyStarts<'_> {
    /// First key visible from absolute position `pos` of sequence `b`.
    pub(super) fn first(&self, b: usize, pos: usize) -> usize {
        let start = self.starts.map_or(0, |s| s[b * self.len + pos] as usize);
        self.window
            .map_or(start, |w| start.max((pos + 1).saturating_sub(w)))
    }

    /// The first key any of the queries at positions `first_pos..first_pos + rows` of sequence `b` sees.
    pub(super) fn block_first(&self, b: usize, first_pos: usize, rows: usize) -> usize {
        (first_pos..first_pos + rows)
            .map(|pos| self.first(b, pos))
            .min()
            .unwrap_or(first_pos)
    }
}

/// One block of `c` queries, query `i` at absolute position `first_pos + i`, against keys `lo..keys`.
#[derive(Clone, Copy)]
struct Block {
    c: usize,
    first_pos: usize,
    lo: usize,
    keys: usize,
}

impl Block {
    fn new(b: usize, i0: usize, c: usize, dims: Dims, starts: KeyStarts) -> Self {
        let first_pos = dims.s - dims.t + i0;
        Block {
            c,
            first_pos,
            lo: starts.block_first(b, first_pos, c),
            keys: first_pos + c,
        }
    }

    /// Keys of the block.
    fn width(&self) -> usize {
        self.keys - self.lo
    }

    /// The block's rows `lo..keys` of a `[s, d]` matrix.
    fn rows<'a, T>(&self, x: &'a [T], d: usize) -> &'a [T] {
        &x[self.lo * d..self.keys * d]
    }
}

/// Softmax probabilities of queries `qb` (`c × d`, of query head `head`) against keys `lo..keys` of `kh`, into `p`
/// (`c × (keys − lo)`); with a soft cap and `dcap`, also each score's `1 − tanh²(score/cap)` (0 outside the mask)
/// into `dcap`.
#[allow(clippy::too_many_arguments)]
fn block_probs<T: CpuFloat>(
    p: &mut [T],
    dcap: Option<&mut [T]>,
    qb: &[T],
    kh: &[T],
    blk: Block,
    params: Params,
    starts: KeyStarts,
    (b, head): (usize, usize),
) {
    let (d, w) = (params.dims.d, blk.width());
    matmul_into_serial(
        p,
        Mat::new(qb, blk.c, d),
        Mat::new(blk.rows(kh, d), w, d).t(),
        params.scale,
        false,
    );
    // The visible keys of row `i`, relative to `lo`.
    let visible = |i: usize| {
        let last = blk.first_pos + i;
        starts.first(b, last) - blk.lo..last + 1 - blk.lo
    };
    if let Some(cap) = params.softcap {
        let cap = T::from_f64(cap);
        let mut dcap = dcap;
        simd(
            #[inline(always)]
            || {
                for (i, row) in p.chunks_mut(w).enumerate() {
                    let range = visible(i);
                    let mut drow = dcap.as_deref_mut().map(|x| &mut x[i * w..(i + 1) * w]);
                    if let Some(drow) = drow.as_deref_mut() {
                        drow[..range.start].fill(T::zero());
                        drow[range.end..].fill(T::zero());
                    }
                    for j in range {
                        let th = (row[j] / cap).tanh();
                        row[j] = cap * th;
                        if let Some(drow) = drow.as_deref_mut() {
                            drow[j] = T::one() - th * th;
                        }
                    }
                }
            },
        );
    }
    // The head's sink is one more softmax column, in the maximum and the sum, whose probability is dropped.
    let sink = params.sinks.map(|s| T::from_f64(s[head] as f64));
    simd(
        #[inline(always)]
        || {
            for (i, row) in p.chunks_mut(w).enumerate() {
                let range = visible(i);
                let (first, end) = (range.start, range.end);
                let seen = &mut row[range];
                let mut max = vector::max(seen);
                if let Some(sink) = sink.filter(|&x| x > max) {
                    max = sink;
                }
                seen.iter_mut().for_each(|v| *v = (*v - max).exp());
                let mut sum = vector::sum(seen);
                if let Some(sink) = sink {
                    sum += (sink - max).exp();
                }
                let inv = T::one() / sum;
                seen.iter_mut().for_each(|v| *v *= inv);
                row[..first].fill(T::zero());
                row[end..].fill(T::zero());
            }
        },
    )
}

/// The blocks of queries of a sequence of `t` queries: `(start, rows)`.
fn query_blocks(t: usize, block: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t).step_by(block).map(move |i0| (i0, block.min(t - i0)))
}

/// The attention output `[b, hq, t, d]` for `q: [b, hq, t, d]`, `k, v: [b, hkv, s, d]` (row-major).
pub(super) fn forward<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    params: Params,
    starts: KeyStarts,
) -> Vec<T> {
    let Params {
        dims, query_block, ..
    } = params;
    let Dims {
        hkv, g, t, s, d, ..
    } = dims;
    let mut out = vec![T::zero(); dims.b * hkv * g * t * d];
    out.par_chunks_mut(g * t * d)
        .enumerate()
        .for_each(|(bk, out_group)| {
            let (b, kh, vh) = (
                bk / hkv,
                &k[bk * s * d..][..s * d],
                &v[bk * s * d..][..s * d],
            );
            let mut p = vec![T::zero(); query_block.min(t) * s];
            for (h, out_head) in out_group.chunks_mut(t * d).enumerate() {
                let qh = &q[(bk * g + h) * t * d..][..t * d];
                // The query head within the sequence (`bk` counts kv heads across the batch), for its sink.
                let head = bk % hkv * g + h;
                for (i0, c) in query_blocks(t, query_block) {
                    let blk = Block::new(b, i0, c, dims, starts);
                    let w = blk.width();
                    let pb = &mut p[..c * w];
                    let qb = &qh[i0 * d..(i0 + c) * d];
                    block_probs(pb, None, qb, kh, blk, params, starts, (b, head));
                    let ob = &mut out_head[i0 * d..(i0 + c) * d];
                    matmul_into_serial(
                        ob,
                        Mat::new(pb, c, w),
                        Mat::new(blk.rows(vh, d), w, d),
                        1.0,
                        false,
                    );
                }
            }
        });
    out
}

/// Gradients `(dq, dk, dv)` of [`forward`] for the output gradient `grad: [b, hq, t, d]`.
pub(super) fn backward<T: CpuFloat>(
    q: &[T],
    k: &[T],
    v: &[T],
    grad: &[T],
    params: Params,
    starts: KeyStarts,
) -> (Vec<T>, Vec<T>, Vec<T>) {
    let Params {
        dims,
        scale,
        softcap,
        query_block,
        ..
    } = params;
    let Dims {
        hkv, g, t, s, d, ..
    } = dims;
    let mut dq = vec![T::zero(); dims.b * hkv * g * t * d];
    let mut dk = vec![T::zero(); dims.b * hkv * s * d];
    let mut dv = vec![T::zero(); dims.b * hkv * s * d];
    dq.par_chunks_mut(g * t * d)
        .zip(dk.par_chunks_mut(s * d))
        .zip(dv.par_chunks_mut(s * d))
        .enumerate()
        .for_each(|(bk, ((dq_group, dkh), dvh))| {
            let (b, kh, vh) = (
                bk / hkv,
                &k[bk * s * d..][..s * d],
                &v[bk * s * d..][..s * d],
            );
            let mut p = vec![T::zero(); query_block.min(t) * s];
            let mut dp = p.clone();
            // `1 − tanh²` of the soft-capped scores, only with a soft cap.
            let mut dcap = if softcap.is_some() {
                p.clone()
            } else {
                Vec::new()
            };
            for (h, dq_head) in dq_group.chunks_mut(t * d).enumerate() {
                let qh = &q[(bk * g + h) * t * d..][..t * d];
                let gh = &grad[(bk * g + h) * t * d..][..t * d];
                let head = bk % hkv * g + h;
                for (i0, c) in query_blocks(t, query_block) {
                    let blk = Block::new(b, i0, c, dims, starts);
                    let w = blk.width();
                    let (pb, dpb) = (&mut p[..c * w], &mut dp[..c * w]);
                    let dcapb = softcap.map(|_| &mut dcap[..c * w]);
                    let qs = &qh[i0 * d..(i0 + c) * d];
                    let qb = Mat::new(qs, c, d);
                    let gb = Mat::new(&gh[i0 * d..(i0 + c) * d], c, d);
                    let (kb, vb) = (
                        Mat::new(blk.rows(kh, d), w, d),
                        Mat::new(blk.rows(vh, d), w, d),
                    );
                    block_probs(pb, dcapb, qs, kh, blk, params, starts, (b, head));
                    // dV += Pᵀ·dO;  dP = dO·Vᵀ;  dS = P ⊙ (dP − rowsum(P ⊙ dP)) (⊙ (1 − tanh²) under a soft cap).
                    matmul_into_serial(
                        &mut dvh[blk.lo * d..blk.keys * d],
                        Mat::new(pb, c, w).t(),
                        gb,
                        1.0,
                        true,
                    );
                    matmul_into_serial(dpb, gb, vb.t(), 1.0, false);
                    simd(
                        #[inline(always)]
                        || {
                            for (prow, dprow) in pb.chunks(w).zip(dpb.chunks_mut(w)) {
                                let dot = vector::dot(prow, dprow);
                                dprow
                                    .iter_mut()
                                    .zip(prow)
                                    .for_each(|(ds, &x)| *ds = x * (*ds - dot));
                            }
                            if softcap.is_some() {
                                dpb.iter_mut()
                                    .zip(&dcap[..c * w])
                                    .for_each(|(ds, &f)| *ds *= f);
                            }
                        },
                    );
                    let ds = Mat::new(&*dpb, c, w);
                    // dQ = scale·dS·K;  dK += scale·dSᵀ·Q.
                    matmul_into_serial(&mut dq_head[i0 * d..(i0 + c) * d], ds, kb, scale, false);
                    matmul_into_serial(&mut dkh[blk.lo * d..blk.keys * d], ds.t(), qb, scale, true);
                }
            }
        });
    (dq, dk, dv)
}
