//! `y = x·Wᵀ` for a few rows of `x` (decoding) straight from a 4-bit weight's packed codes: no dequantized copy of
//! `W` is made, so each product reads half a byte per weight instead of writing and reading four.
//!
//! Each output feature is one row of `W`. For every block of that row, the 16 weights a code can stand for
//! (`code[c] · absmax`, exactly the values dequantization gives) go into one table, each byte of codes picks two of
//! them, and their products with `x` accumulate in float32. The result therefore equals dequantize-then-matmul up to
//! the order of the float sums and fused multiply-adds (as a GEMM does). Output features are split over rayon's
//! threads where the product is large enough for its thread (smaller ones run on the calling thread); each output is
//! computed by one task either way, so the result does not depend on the number of threads.
//!
//! Where every row of `W` is whole blocks (`in_features` a multiple of the blocksize, as in every released model)
//! the loop takes 32 elements at a time with AVX-512 or AVX2+FMA, chosen at run time (pulp's detection, not the
//! build's target CPU), the table lookup being a register permute. All three paths — AVX-512, AVX2 and the
//! portable one — keep the same 64 partial sums per row with the same fused multiply-adds and add them up in the
//! same order, so the result is the same bits on every CPU. A weight whose blocks straddle its rows (any other
//! `in_features`) is read element by element.

use std::borrow::Cow;

use candle_core::Result;
use rayon::prelude::*;

use crate::quant::Nf4Tensor;

/// Rows of `x` this kernel is meant for: beyond that, dequantizing once and one GEMM is faster (and prefill is
/// rare), so callers switch to that.
pub const MAX_ROWS: usize = 8;

/// Elements per step of the vector paths: 16 bytes of codes.
const CHUNK: usize = 32;

/// Rows of `x` handled together: the codes are decoded once per group, and the accumulators of a group still fit
/// the registers.
const GROUP: usize = 4;

/// Weights per parallel task at least, on a rayon worker thread (32 KiB of codes, a few microseconds): another
/// worker takes a task from the pool at once, or the calling one runs it itself.
const MIN_TASK_WEIGHTS: usize = 1 << 16;

/// Weights per parallel task at least, off the pool (half a MiB of codes, tens of microseconds): handing work to
/// rayon from another thread wakes a worker and waits for it, which on a busy machine can be a scheduler slice, so
/// a smaller product (every one of a 135M model) runs on the calling thread alone.
const MIN_TASK_WEIGHTS_OFF_POOL: usize = 1 << 20;

/// `x·Wᵀ` as a row-major `[rows, out_features]` buffer, for `x` a row-major `[rows, in_features]` float32 buffer and
/// a 4-bit weight `[out_features, in_features]` (NF4 or FP4, double-quantized or not).
///
/// A double-quantized weight's block scales are dequantized once and kept with it ([`Nf4Tensor::block_absmax`]).
pub fn nf4_matvec(weight: &Nf4Tensor, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    let (out, inp) = match weight.shape() {
        [out, inp] => (*out, *inp),
        shape => {
            candle_core::bail!("4-bit matrix-vector product: weight must be 2-D, got {shape:?}")
        }
    };
    if Some(x.len()) != rows.checked_mul(inp) {
        candle_core::bail!(
            "4-bit matrix-vector product: {} input values are not {rows} rows of {inp} features",
            x.len()
        );
    }
    let codes = Codes {
        packed: weight.packed(),
        absmax: weight.block_absmax(),
        code: weight.code(),
        blocksize: weight.blocksize(),
        out,
        inp,
    };
    Ok(matvec(codes, x, rows, Isa::detect()))
}

/// The parts of a 4-bit weight `[out, inp]` the kernel reads.
#[derive(Clone, Copy)]
pub(crate) struct Codes<'a> {
    /// Two codes per byte, even element in the high nibble, over the row-major weight.
    pub packed: &'a [u8],
    /// One float32 absmax per block of the row-major weight.
    pub absmax: &'a [f32],
    /// The 16-entry codebook.
    pub code: &'a [f32; 16],
    /// Elements per block (even).
    pub blocksize: usize,
    /// Output features (rows of the weight).
    pub out: usize,
    /// Input features (columns of the weight).
    pub inp: usize,
}

/// The instruction set a product runs with: pulp's token that the CPU has it, for the vector paths.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Isa {
    /// 512-bit registers, a 16-entry table in one permute.
    #[cfg(target_arch = "x86_64")]
    Avx512(pulp::x86::V4),
    /// 256-bit registers with FMA, the table in two permutes and a blend.
    #[cfg(target_arch = "x86_64")]
    Avx2(pulp::x86::V3),
    /// Plain Rust, the same sums in the same order.
    Portable,
}

impl Isa {
    /// The widest set this CPU has (pulp detects it once).
    pub(crate) fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            if let Some(simd) = pulp::x86::V4::try_new() {
                return Isa::Avx512(simd);
            }
            if let Some(simd) = pulp::x86::V3::try_new() {
                return Isa::Avx2(simd);
            }
        }
        Isa::Portable
    }
}

/// [`nf4_matvec`] on a weight's parts with a chosen instruction set.
pub(crate) fn matvec(w: Codes, x: &[f32], rows: usize, isa: Isa) -> Vec<f32> {
    let min_task_weights = match rayon::current_thread_index() {
        Some(_) => MIN_TASK_WEIGHTS,
        None => MIN_TASK_WEIGHTS_OFF_POOL,
    };
    matvec_in_tasks(w, x, rows, isa, min_task_weights)
}

/// [`matvec`] with tasks of at least `min_task_weights` weights (whole output features).
fn matvec_in_tasks(
    w: Codes,
    x: &[f32],
    rows: usize,
    isa: Isa,
    min_task_weights: usize,
) -> Vec<f32> {
    let Codes {
        out,
        inp,
        blocksize: bs,
        ..
    } = w;
    let n = out * inp;
    // The vector paths read through pointers: these bounds make every read in range.
    assert!(
        x.len() == rows * inp
            && bs > 0
            && bs % 2 == 0
            && w.packed.len() >= n.div_ceil(2)
            && w.absmax.len() >= n.div_ceil(bs),
        "4-bit matrix-vector product: inconsistent shapes"
    );
    if rows == 0 || out == 0 {
        return vec![0.0; rows * out];
    }
    // The vector paths take chunk pairs within a block, or block pairs at blocksize 32 (`for_chunks!`); every
    // blocksize bitsandbytes allows is one of the two.
    let whole_blocks = inp % bs == 0 && (bs == CHUNK || bs % (2 * CHUNK) == 0);
    let xs: Cow<[f32]> = if whole_blocks {
        Cow::Owned(deinterleave(x))
    } else {
        Cow::Borrowed(x)
    };
    // Outputs feature-major (`[out, rows]`), so that each task owns one contiguous range.
    let mut yt = vec![0.0f32; out * rows];
    let per_task = out
        .div_ceil(4 * rayon::current_num_threads())
        .max(min_task_weights.div_ceil(inp.max(1)));
    let run = |t: usize, ys: &mut [f32]| {
        let first = t * per_task;
        for g in (0..rows).step_by(GROUP) {
            let group = GROUP.min(rows - g);
            let xg = &xs[g * inp..(g + group) * inp];
            let task = Task {
                w,
                first,
                ys: &mut *ys,
                stride: rows,
                g,
            };
            if whole_blocks {
                match group {
                    1 => task.whole_blocks::<1>(xg, isa),
                    2 => task.whole_blocks::<2>(xg, isa),
                    3 => task.whole_blocks::<3>(xg, isa),
                    _ => task.whole_blocks::<4>(xg, isa),
                }
            } else {
                task.straddling(xg, group);
            }
        }
    };
    // One task runs here: handing it to the pool would only add a thread's wake-up to it.
    if per_task >= out {
        run(0, &mut yt);
    } else {
        yt.par_chunks_mut(per_task * rows)
            .enumerate()
            .for_each(|(t, ys)| run(t, ys));
    }
    if rows == 1 {
        return yt;
    }
    let mut y = vec![0.0f32; rows * out];
    for (o, yo) in yt.chunks_exact(rows).enumerate() {
        for (r, v) in yo.iter().enumerate() {
            y[r * out + o] = *v;
        }
    }
    y
}

/// `x` with each 32-element chunk of a row reordered as its 16 even elements, then its 16 odd ones: the order in
/// which a chunk's 16 bytes give their high and low codes.
fn deinterleave(x: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for (o, i) in out.chunks_exact_mut(CHUNK).zip(x.chunks_exact(CHUNK)) {
        for j in 0..CHUNK / 2 {
            o[j] = i[2 * j];
            o[CHUNK / 2 + j] = i[2 * j + 1];
        }
    }
    out
}

/// One task: output features `first..` of a row group, written at `ys[k·stride + g + r]` (`ys` feature-major).
struct Task<'a, 'y> {
    w: Codes<'a>,
    first: usize,
    ys: &'y mut [f32],
    stride: usize,
    g: usize,
}

impl<'a> Task<'a, '_> {
    /// Rows of whole blocks, `R` rows of deinterleaved `x` (`xg`, `R · inp` values).
    fn whole_blocks<const R: usize>(self, xg: &[f32], isa: Isa) {
        let inp = self.w.inp;
        let xr: [&[f32]; R] = std::array::from_fn(|r| &xg[r * inp..(r + 1) * inp]);
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512(simd) => simd.vectorize(x86::Avx512Rows {
                simd,
                task: self,
                xr,
            }),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2(simd) => simd.vectorize(x86::Avx2Rows {
                simd,
                task: self,
                xr,
            }),
            Isa::Portable => rows_portable(self, xr),
        }
    }

    /// Output feature `k` of the task: its codes (`inp / 2` bytes) and block scales, for rows of whole blocks.
    #[inline(always)]
    fn row(&self, k: usize) -> (&'a [u8], &'a [f32]) {
        let w = self.w;
        let (inp, bs) = (w.inp, w.blocksize);
        let o = self.first + k;
        let blocks = inp / bs;
        (
            &w.packed[o * inp / 2..(o + 1) * inp / 2],
            &w.absmax[o * blocks..(o + 1) * blocks],
        )
    }

    /// Any shape, element by element (a block may start in one row and end in the next, a row on an odd nibble).
    fn straddling(self, xg: &[f32], group: usize) {
        let Codes {
            packed,
            absmax,
            code,
            blocksize: bs,
            inp,
            ..
        } = self.w;
        for (k, yo) in self.ys.chunks_exact_mut(self.stride).enumerate() {
            let start = (self.first + k) * inp;
            let mut acc = [0.0f32; GROUP];
            let mut i = 0;
            while i < inp {
                let block = (start + i) / bs;
                let end = ((block + 1) * bs - start).min(inp);
                let table = code.map(|c| c * absmax[block]);
                for i in i..end {
                    let e = start + i;
                    let byte = packed[e / 2];
                    let c = if e % 2 == 0 { byte >> 4 } else { byte & 0x0f };
                    let w = table[c as usize];
                    for (r, a) in acc[..group].iter_mut().enumerate() {
                        *a = w.mul_add(xg[r * inp + i], *a);
                    }
                }
                i = end;
            }
            yo[self.g..self.g + group].copy_from_slice(&acc[..group]);
        }
    }
}

/// The last step of every path's sum: 8 partial sums added pairwise in a fixed order.
#[inline(always)]
fn fold8(u: [f32; 8]) -> f32 {
    let v = [u[0] + u[4], u[1] + u[5], u[2] + u[6], u[3] + u[7]];
    (v[0] + v[2]) + (v[1] + v[3])
}

/// The portable path. A row's 64 partial sums: chunks alternate between two sets of 32 (`p` = the chunk's index
/// in the row, mod 2), so that the vector paths run four independent chains of fused multiply-adds; in a set, lane
/// `j < 16` takes the even element `2j` of a chunk, lane `16 + j` the odd one. The sets and lanes are added as the
/// vector paths add them.
fn rows_portable<const R: usize>(task: Task, xr: [&[f32]; R]) {
    let (code, bs) = (task.w.code, task.w.blocksize);
    for k in 0..task.ys.len() / task.stride {
        let (bytes, scales) = task.row(k);
        let mut acc = [[0.0f32; 2 * CHUNK]; R];
        for (b, scale) in scales.iter().enumerate() {
            let table = code.map(|c| c * scale);
            for e in (b * bs..(b + 1) * bs).step_by(CHUNK) {
                let set = (e / CHUNK % 2) * CHUNK;
                for (j, byte) in bytes[e / 2..e / 2 + CHUNK / 2].iter().enumerate() {
                    let (we, wo) = (table[(byte >> 4) as usize], table[(byte & 0x0f) as usize]);
                    for (a, x) in acc.iter_mut().zip(&xr) {
                        let (even, odd) = (set + j, set + 16 + j);
                        a[even] = we.mul_add(x[e + j], a[even]);
                        a[odd] = wo.mul_add(x[e + 16 + j], a[odd]);
                    }
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let set = |p: usize, j: usize| a[p * CHUNK + j] + a[p * CHUNK + 16 + j];
            let t: [f32; 16] = std::array::from_fn(|j| set(0, j) + set(1, j));
            task.ys[k * task.stride + task.g + r] = fold8(std::array::from_fn(|j| t[j] + t[j + 8]));
        }
    }
}

/// Runs `$chunk!(e, p, table)` over a row's chunks in order, `p` the chunk's parity as a literal (so that the
/// accumulators it picks stay in registers) and `table` its block's, made by `$table!(block)`: chunk pairs within a
/// block, or block pairs when a block is one chunk (blocksize 32), then the odd chunk left over.
#[cfg(target_arch = "x86_64")]
macro_rules! for_chunks {
    ($bs:expr, $blocks:expr, $table:ident, $chunk:ident) => {{
        let (bs, blocks): (usize, usize) = ($bs, $blocks);
        if bs >= 2 * CHUNK {
            for b in 0..blocks {
                let table = $table!(b);
                for e in (b * bs..(b + 1) * bs).step_by(2 * CHUNK) {
                    $chunk!(e, 0, table);
                    $chunk!(e + CHUNK, 1, table);
                }
            }
        } else {
            for b in (0..blocks - blocks % 2).step_by(2) {
                let (t0, t1) = ($table!(b), $table!(b + 1));
                $chunk!(b * CHUNK, 0, t0);
                $chunk!((b + 1) * CHUNK, 1, t1);
            }
            if blocks % 2 == 1 {
                let t = $table!(blocks - 1);
                $chunk!((blocks - 1) * CHUNK, 0, t);
            }
        }
    }};
}

/// The vector paths, each a pulp "nullary function" that pulp's token compiles and runs with its instruction set.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use pulp::x86::{V3, V4};
    use pulp::NullaryFnOnce;
    use std::arch::x86_64::__m128i;

    use super::{fold8, Task, CHUNK};

    /// The AVX-512 path: per chunk, 16 bytes widen to 16 lanes; the high nibbles (shifted down) and the low ones
    /// (a permute reads only an index's low 4 bits) each select 16 weights from the block's table in one permute.
    pub(super) struct Avx512Rows<'a, 'y, const R: usize> {
        pub simd: V4,
        pub task: Task<'a, 'y>,
        pub xr: [&'a [f32]; R],
    }

    impl<const R: usize> NullaryFnOnce for Avx512Rows<'_, '_, R> {
        type Output = ();

        #[inline(always)]
        fn call(self) {
            let Avx512Rows { simd, task, xr } = self;
            let (f, avx) = (simd.avx512f, simd.avx);
            let bs = task.w.blocksize;
            // SAFETY: the codebook has 16 entries.
            let code = unsafe { f._mm512_loadu_ps(task.w.code.as_ptr()) };
            for k in 0..task.ys.len() / task.stride {
                let (bytes, scales) = task.row(k);
                let mut even = [[f._mm512_setzero_ps(); R]; 2];
                let mut odd = [[f._mm512_setzero_ps(); R]; 2];
                macro_rules! table {
                    ($b:expr) => {
                        f._mm512_mul_ps(code, f._mm512_set1_ps(scales[$b]))
                    };
                }
                macro_rules! chunk {
                    ($e:expr, $p:literal, $table:expr) => {{
                        let e: usize = $e;
                        assert!(e + CHUNK <= xr[0].len(), "chunk out of the row");
                        // SAFETY: a row holds `inp / 2` bytes and each `xr[r]` `inp` values (`matvec` checked), and
                        // `e + 32 <= inp`.
                        let v = f._mm512_cvtepu8_epi32(unsafe {
                            simd.sse2._mm_loadu_si128(bytes.as_ptr().add(e / 2) as *const __m128i)
                        });
                        let we = f._mm512_permutexvar_ps(f._mm512_srli_epi32::<4>(v), $table);
                        let wo = f._mm512_permutexvar_ps(v, $table);
                        for r in 0..R {
                            let (xe, xo) = unsafe {
                                let x = xr[r].as_ptr().add(e);
                                (f._mm512_loadu_ps(x), f._mm512_loadu_ps(x.add(16)))
                            };
                            even[$p][r] = f._mm512_fmadd_ps(we, xe, even[$p][r]);
                            odd[$p][r] = f._mm512_fmadd_ps(wo, xo, odd[$p][r]);
                        }
                    }};
                }
                for_chunks!(bs, scales.len(), table, chunk);
                for r in 0..R {
                    let t = f._mm512_add_ps(
                        f._mm512_add_ps(even[0][r], odd[0][r]),
                        f._mm512_add_ps(even[1][r], odd[1][r]),
                    );
                    let lo = f._mm512_castps512_ps256(t);
                    let hi =
                        avx._mm256_castpd_ps(f._mm512_extractf64x4_pd::<1>(f._mm512_castps_pd(t)));
                    let mut u = [0.0f32; 8];
                    // SAFETY: `u` holds 8 floats.
                    unsafe { avx._mm256_storeu_ps(u.as_mut_ptr(), avx._mm256_add_ps(lo, hi)) };
                    task.ys[k * task.stride + task.g + r] = fold8(u);
                }
            }
        }
    }

    /// The AVX2 path: each chunk as two halves of 8 bytes, the 16-entry table as two 8-entry registers chosen by
    /// the index's bit 3 (moved to the sign bit for a blend). Lanes `0..8` / `8..16` of the AVX-512 sums.
    pub(super) struct Avx2Rows<'a, 'y, const R: usize> {
        pub simd: V3,
        pub task: Task<'a, 'y>,
        pub xr: [&'a [f32]; R],
    }

    impl<const R: usize> NullaryFnOnce for Avx2Rows<'_, '_, R> {
        type Output = ();

        #[inline(always)]
        fn call(self) {
            let Avx2Rows { simd, task, xr } = self;
            let (avx, avx2, fma) = (simd.avx, simd.avx2, simd.fma);
            let bs = task.w.blocksize;
            // SAFETY: the codebook has 16 entries.
            let code = unsafe {
                let c = task.w.code.as_ptr();
                [avx._mm256_loadu_ps(c), avx._mm256_loadu_ps(c.add(8))]
            };
            for k in 0..task.ys.len() / task.stride {
                let (bytes, scales) = task.row(k);
                // [parity][half][row]
                let mut even = [[[avx._mm256_setzero_ps(); R]; 2]; 2];
                let mut odd = [[[avx._mm256_setzero_ps(); R]; 2]; 2];
                macro_rules! table {
                    ($b:expr) => {{
                        let s = avx._mm256_set1_ps(scales[$b]);
                        (avx._mm256_mul_ps(code[0], s), avx._mm256_mul_ps(code[1], s))
                    }};
                }
                macro_rules! chunk {
                    ($e:expr, $p:literal, $table:expr) => {{
                        let e: usize = $e;
                        assert!(e + CHUNK <= xr[0].len(), "chunk out of the row");
                        let (t_lo, t_hi) = $table;
                        for h in 0..2 {
                            // SAFETY: as in the AVX-512 path.
                            let v = avx2._mm256_cvtepu8_epi32(unsafe {
                                simd.sse2._mm_loadl_epi64(bytes.as_ptr().add(e / 2 + 8 * h) as *const __m128i)
                            });
                            let hi = avx2._mm256_srli_epi32::<4>(v);
                            let we = avx._mm256_blendv_ps(
                                avx2._mm256_permutevar8x32_ps(t_lo, hi),
                                avx2._mm256_permutevar8x32_ps(t_hi, hi),
                                avx._mm256_castsi256_ps(avx2._mm256_slli_epi32::<24>(v)),
                            );
                            let wo = avx._mm256_blendv_ps(
                                avx2._mm256_permutevar8x32_ps(t_lo, v),
                                avx2._mm256_permutevar8x32_ps(t_hi, v),
                                avx._mm256_castsi256_ps(avx2._mm256_slli_epi32::<28>(v)),
                            );
                            for r in 0..R {
                                let (xe, xo) = unsafe {
                                    let x = xr[r].as_ptr().add(e + 8 * h);
                                    (avx._mm256_loadu_ps(x), avx._mm256_loadu_ps(x.add(16)))
                                };
                                even[$p][h][r] = fma._mm256_fmadd_ps(we, xe, even[$p][h][r]);
                                odd[$p][h][r] = fma._mm256_fmadd_ps(wo, xo, odd[$p][h][r]);
                            }
                        }
                    }};
                }
                for_chunks!(bs, scales.len(), table, chunk);
                for r in 0..R {
                    let t_lo = avx._mm256_add_ps(
                        avx._mm256_add_ps(even[0][0][r], odd[0][0][r]),
                        avx._mm256_add_ps(even[1][0][r], odd[1][0][r]),
                    );
                    let t_hi = avx._mm256_add_ps(
                        avx._mm256_add_ps(even[0][1][r], odd[0][1][r]),
                        avx._mm256_add_ps(even[1][1][r], odd[1][1][r]),
                    );
                    let mut u = [0.0f32; 8];
                    // SAFETY: `u` holds 8 floats.
                    unsafe { avx._mm256_storeu_ps(u.as_mut_ptr(), avx._mm256_add_ps(t_lo, t_hi)) };
                    task.ys[k * task.stride + task.g + r] = fold8(u);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{BnbKernels, QuantConfig, QuantType};
    use candle_core::DType;

    /// Deterministic values in about [-1, 1] with a few larger ones (so block scales differ).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = crate::rng::splitmix(seed ^ (i as u64).wrapping_mul(0x9e37_79b9));
                let u = (h >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                if h % 53 == 0 {
                    u * 4.0
                } else {
                    u
                }
            })
            .collect()
    }

    fn quantized(out: usize, inp: usize, cfg: &QuantConfig, seed: u64) -> Nf4Tensor {
        Nf4Tensor::quantize_values(&values(out * inp, seed), &[out, inp], DType::F32, cfg, "w")
            .unwrap()
    }

    /// `x·Wᵀ` in f64 from the dequantized weight, and `Σ|x·w|` per output (the scale of the rounding error).
    fn reference(w: &Nf4Tensor, x: &[f32], rows: usize) -> (Vec<f64>, Vec<f64>) {
        let (out, inp) = (w.shape()[0], w.shape()[1]);
        let dense = w
            .dequantize(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut y = vec![0.0f64; rows * out];
        let mut mag = vec![0.0f64; rows * out];
        for r in 0..rows {
            for o in 0..out {
                for i in 0..inp {
                    let p = x[r * inp + i] as f64 * dense[o * inp + i] as f64;
                    y[r * out + o] += p;
                    mag[r * out + o] += p.abs();
                }
            }
        }
        (y, mag)
    }

    /// Every instruction set this CPU has.
    fn isas() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut out = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            out.extend(pulp::x86::V4::try_new().map(Isa::Avx512));
            out.extend(pulp::x86::V3::try_new().map(Isa::Avx2));
        }
        out
    }

    fn codes(w: &Nf4Tensor) -> Codes<'_> {
        Codes {
            packed: w.packed(),
            absmax: w.block_absmax(),
            code: w.code(),
            blocksize: w.blocksize(),
            out: w.shape()[0],
            inp: w.shape()[1],
        }
    }

    #[test]
    fn equals_dequantize_then_matmul_for_every_format_and_shape() {
        // Whole-block rows (the vector paths) and rows that straddle blocks or end on an odd nibble.
        let shapes = [
            (7, 64),
            (5, 256),
            (3, 96),
            (9, 100),
            (4, 33),
            (6, 7),
            (1, 1),
            (2, 4096),
        ];
        for quant_type in [QuantType::Nf4, QuantType::Fp4] {
            for double_quant in [true, false] {
                for blocksize in [32, 64, 128, 256] {
                    let cfg = QuantConfig {
                        quant_type,
                        blocksize,
                        double_quant,
                        kernels: BnbKernels::Cuda,
                    };
                    for (s, &(out, inp)) in shapes.iter().enumerate() {
                        let w = quantized(out, inp, &cfg, s as u64);
                        for rows in 1..=MAX_ROWS {
                            let x = values(rows * inp, 100 + rows as u64);
                            let (want, mag) = reference(&w, &x, rows);
                            let got = nf4_matvec(&w, &x, rows).unwrap();
                            assert_eq!(got.len(), rows * out);
                            // Recursive summation's bound: (terms + 1) roundings of at most ε/2 each, on Σ|x·w|.
                            let bound = (inp + 1) as f64 * f32::EPSILON as f64 / 2.0;
                            for (i, ((g, r), m)) in got.iter().zip(&want).zip(&mag).enumerate() {
                                assert!(
                                    (*g as f64 - r).abs() <= bound * m,
                                    "{quant_type} dq={double_quant} bs={blocksize} {out}x{inp} rows={rows} \
                                     [{i}]: {g} vs {r}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn every_instruction_set_gives_the_same_bits() {
        // Blocks of one chunk (paired across blocks, an odd one left over) and of several chunks.
        let cases = [
            (37, 512, QuantConfig::nf4()),
            (
                11,
                96,
                QuantConfig {
                    blocksize: 32,
                    ..QuantConfig::fp4()
                },
            ),
            (
                5,
                192,
                QuantConfig {
                    double_quant: false,
                    ..QuantConfig::nf4()
                },
            ),
            (
                3,
                256,
                QuantConfig {
                    blocksize: 128,
                    ..QuantConfig::nf4()
                },
            ),
        ];
        for (s, (out, inp, cfg)) in cases.into_iter().enumerate() {
            let w = quantized(out, inp, &cfg, s as u64);
            for rows in 1..=MAX_ROWS {
                let x = values(rows * inp, rows as u64);
                let portable = matvec(codes(&w), &x, rows, Isa::Portable);
                for isa in isas() {
                    let got = matvec(codes(&w), &x, rows, isa);
                    let same = got
                        .iter()
                        .zip(&portable)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same,
                        "{isa:?} {out}x{inp} rows={rows}: {got:?} vs {portable:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn tasks_split_the_outputs_without_changing_a_bit() {
        let w = quantized(300, 4096, &QuantConfig::nf4(), 4);
        for rows in [1, 3, 8] {
            let x = values(rows * 4096, 7);
            let isa = Isa::detect();
            let one = matvec_in_tasks(codes(&w), &x, rows, isa, usize::MAX);
            for min in [1, 4096 * 7, MIN_TASK_WEIGHTS, MIN_TASK_WEIGHTS_OFF_POOL] {
                let split = matvec_in_tasks(codes(&w), &x, rows, isa, min);
                assert!(
                    one.iter()
                        .zip(&split)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "rows={rows} min={min}"
                );
            }
            let (want, mag) = reference(&w, &x, rows);
            let bound = 4097.0 * f32::EPSILON as f64 / 2.0;
            for (i, ((g, r), m)) in one.iter().zip(&want).zip(&mag).enumerate() {
                assert!((*g as f64 - r).abs() <= bound * m, "[{i}]: {g} vs {r}");
            }
        }
    }

    #[test]
    fn the_nested_absmax_is_dequantized_once_and_kept() {
        let w = quantized(4, 256, &QuantConfig::nf4(), 3);
        let first = w.block_absmax().as_ptr();
        assert_eq!(w.block_absmax(), &*w.scales().to_f32());
        assert_eq!(w.block_absmax().as_ptr(), first, "cached, not recomputed");
    }

    #[test]
    fn bad_shapes_are_errors() {
        let w = quantized(4, 64, &QuantConfig::nf4(), 1);
        let err = nf4_matvec(&w, &[0.0; 63], 1).unwrap_err();
        assert!(err.to_string().contains("not 1 rows of 64"), "{err}");
        let cube = Nf4Tensor::quantize_values(
            &values(128, 2),
            &[2, 2, 32],
            DType::F32,
            &QuantConfig::nf4(),
            "w",
        )
        .unwrap();
        let err = nf4_matvec(&cube, &[0.0; 32], 1).unwrap_err();
        assert!(err.to_string().contains("2-D"), "{err}");
        assert!(nf4_matvec(&w, &[], 0).unwrap().is_empty());
    }
}
