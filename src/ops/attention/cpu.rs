//! Causal attention on CPU slices (f32/f64).
//!
//! One task per (sequence, kv head) runs on its own thread: the query heads of the group, block by block of
//! queries, with single-threaded products — a block's matrices are too small to split further, and the tasks
//! already fill the cores. The mask is applied while taking the softmax (keys outside `start..=position` get
//! probability 0), so no mask tensor is built, and the backward recomputes each block's probabilities
//! (FlashAttention-2 style) using `D = rowsum(P ⊙ dP)`, which needs neither the output nor a stored softmax.

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

/// A call's sizes, its score scale and the queries per block.
#[derive(Clone, Copy)]
pub(super) struct Params {
    pub dims: Dims,
    pub scale: f64,
    pub query_block: usize,
}

/// Where key ranges start: nothing (plain causal) or, per sequence and position, the first token of its example.
#[derive(Clone, Copy)]
pub(super) struct KeyStarts<'a> {
    /// `[batch * len]` (packed rows), or `None`.
    pub starts: Option<&'a [u32]>,
    /// Positions per sequence in `starts`.
    pub len: usize,
}

impl KeyStarts<'_> {
    /// First key visible from absolute position `pos` of sequence `b`.
    fn first(&self, b: usize, pos: usize) -> usize {
        self.starts.map_or(0, |s| s[b * self.len + pos] as usize)
    }
}

/// Softmax probabilities of queries `qb` (`c × d`) against the first `keys` rows of `kh`, into `p` (`c × keys`).
/// Query `i` sits at absolute position `first_pos + i`.
#[allow(clippy::too_many_arguments)]
fn block_probs<T: CpuFloat>(
    p: &mut [T],
    qb: &[T],
    kh: &[T],
    (c, keys, d): (usize, usize, usize),
    first_pos: usize,
    scale: f64,
    starts: KeyStarts,
    b: usize,
) {
    matmul_into_serial(
        p,
        Mat::new(qb, c, d),
        Mat::new(&kh[..keys * d], keys, d).t(),
        scale,
        false,
    );
    simd(|| {
        for (i, row) in p.chunks_mut(keys).enumerate() {
            let last = first_pos + i;
            let first = starts.first(b, last);
            let visible = &mut row[first..=last];
            let max = vector::max(visible);
            visible.iter_mut().for_each(|v| *v = (*v - max).exp());
            let inv = T::one() / vector::sum(visible);
            visible.iter_mut().for_each(|v| *v *= inv);
            row[..first].fill(T::zero());
            row[last + 1..].fill(T::zero());
        }
    })
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
        dims: Dims {
            hkv, g, t, s, d, ..
        },
        scale,
        query_block,
    } = params;
    let mut out = vec![T::zero(); params.dims.b * hkv * g * t * d];
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
                for (i0, c) in query_blocks(t, query_block) {
                    let first_pos = s - t + i0;
                    let keys = first_pos + c;
                    let pb = &mut p[..c * keys];
                    let qb = &qh[i0 * d..(i0 + c) * d];
                    block_probs(pb, qb, kh, (c, keys, d), first_pos, scale, starts, b);
                    let ob = &mut out_head[i0 * d..(i0 + c) * d];
                    matmul_into_serial(
                        ob,
                        Mat::new(pb, c, keys),
                        Mat::new(&vh[..keys * d], keys, d),
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
        dims: Dims {
            hkv, g, t, s, d, ..
        },
        scale,
        query_block,
    } = params;
    let mut dq = vec![T::zero(); params.dims.b * hkv * g * t * d];
    let mut dk = vec![T::zero(); params.dims.b * hkv * s * d];
    let mut dv = vec![T::zero(); params.dims.b * hkv * s * d];
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
            for (h, dq_head) in dq_group.chunks_mut(t * d).enumerate() {
                let qh = &q[(bk * g + h) * t * d..][..t * d];
                let gh = &grad[(bk * g + h) * t * d..][..t * d];
                for (i0, c) in query_blocks(t, query_block) {
                    let first_pos = s - t + i0;
                    let keys = first_pos + c;
                    let (pb, dpb) = (&mut p[..c * keys], &mut dp[..c * keys]);
                    let qs = &qh[i0 * d..(i0 + c) * d];
                    let qb = Mat::new(qs, c, d);
                    let gb = Mat::new(&gh[i0 * d..(i0 + c) * d], c, d);
                    let (kb, vb) = (
                        Mat::new(&kh[..keys * d], keys, d),
                        Mat::new(&vh[..keys * d], keys, d),
                    );
                    block_probs(pb, qs, kh, (c, keys, d), first_pos, scale, starts, b);
                    // dV += Pᵀ·dO;  dP = dO·Vᵀ;  dS = P ⊙ (dP − rowsum(P ⊙ dP)).
                    matmul_into_serial(
                        &mut dvh[..keys * d],
                        Mat::new(pb, c, keys).t(),
                        gb,
                        1.0,
                        true,
                    );
                    matmul_into_serial(dpb, gb, vb.t(), 1.0, false);
                    simd(|| {
                        for (prow, dprow) in pb.chunks(keys).zip(dpb.chunks_mut(keys)) {
                            let dot = vector::dot(prow, dprow);
                            dprow
                                .iter_mut()
                                .zip(prow)
                                .for_each(|(ds, &x)| *ds = x * (*ds - dot));
                        }
                    });
                    let ds = Mat::new(&*dpb, c, keys);
                    // dQ = scale·dS·K;  dK += scale·dSᵀ·Q.
                    matmul_into_serial(&mut dq_head[i0 * d..(i0 + c) * d], ds, kb, scale, false);
                    matmul_into_serial(&mut dkh[..keys * d], ds.t(), qb, scale, true);
                }
            }
        });
    (dq, dk, dv)
}
