//! `y = x·Wᵀ` for a few float32 rows of `x` (decoding) with a bfloat16 `W` read in place — the output head of a
//! bf16 checkpoint, or layers kept unquantized in bf16. Converting `W` to float32 for every token would read two
//! bytes, write four and read four per weight; this reads the two.
//!
//! A bf16 value widens to float32 exactly (its 16 bits are the float's high half), so the result equals
//! convert-then-matmul up to the order of the float sums. Each output is one task's dot products with one partial
//! sum per lane ([`vector::simd`] picks AVX-512 or AVX2 at run time), added up in a fixed order: the result does not
//! depend on the number of threads.

use candle_core::Result;
use half::bf16;
use rayon::prelude::*;

use super::vector::simd;

/// Accumulators of a dot product: one 512-bit register of `f32`.
const LANES: usize = 16;

/// Weights per parallel task at least (a few microseconds of reading).
const MIN_TASK_WEIGHTS: usize = 1 << 16;

/// `Σ w[i]·x[i]` with `w` widened to float32, one partial sum per lane.
#[inline(always)]
fn dot(w: &[bf16], x: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let (cw, cx) = (w.chunks_exact(LANES), x.chunks_exact(LANES));
    let (rw, rx) = (cw.remainder(), cx.remainder());
    for (w, x) in cw.zip(cx) {
        for ((a, w), x) in acc.iter_mut().zip(w).zip(x) {
            *a += f32::from_bits((w.to_bits() as u32) << 16) * x;
        }
    }
    let total = acc.into_iter().fold(0.0, |s, a| s + a);
    rw.iter()
        .zip(rx)
        .fold(total, |s, (w, x)| s + w.to_f32() * x)
}

/// `x·Wᵀ` as a row-major `[rows, out_features]` buffer, for `x` a row-major `[rows, in_features]` float32 buffer and
/// `w` a row-major bf16 `[out_features, in_features]` matrix.
pub fn bf16_matvec(w: &[bf16], out_features: usize, x: &[f32], rows: usize) -> Result<Vec<f32>> {
    let inp = x.len().checked_div(rows).unwrap_or(0);
    if rows == 0 || x.len() != rows * inp || w.len() != out_features * inp {
        candle_core::bail!(
            "bf16 matrix-vector product: {} weights are not {out_features} rows of the {} input values' {inp} features",
            w.len(),
            x.len()
        );
    }
    // Feature-major first ([out, rows]): each task writes whole rows of it.
    let per_task = (MIN_TASK_WEIGHTS / inp.max(1)).max(1);
    let mut by_feature = vec![0f32; out_features * rows];
    by_feature
        .par_chunks_mut(per_task * rows)
        .zip(w.par_chunks(per_task * inp))
        .for_each(|(dst, w)| {
            simd(
                #[inline(always)]
                || {
                    for (dst, w) in dst.chunks_mut(rows).zip(w.chunks(inp)) {
                        for (d, x) in dst.iter_mut().zip(x.chunks(inp)) {
                            *d = dot(w, x);
                        }
                    }
                },
            )
        });
    let mut y = vec![0f32; rows * out_features];
    for (o, values) in by_feature.chunks(rows).enumerate() {
        for (r, v) in values.iter().enumerate() {
            y[r * out_features + o] = *v;
        }
    }
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Equal to widening `W` and a float64 product, to float32 rounding of the sums; odd sizes take the tails.
    #[test]
    fn equals_the_widened_product() {
        for (out, inp, rows) in [(37, 70, 1), (300, 2048, 3), (5, 16, 8)] {
            let w: Vec<bf16> = (0..out * inp)
                .map(|i| bf16::from_f32(((i * 7919) % 1000) as f32 / 500.0 - 1.0))
                .collect();
            let x: Vec<f32> = (0..rows * inp)
                .map(|i| ((i * 104_729) % 997) as f32 / 498.5 - 1.0)
                .collect();
            let y = bf16_matvec(&w, out, &x, rows).unwrap();
            for r in 0..rows {
                for o in 0..out {
                    let exact: f64 = (0..inp)
                        .map(|i| w[o * inp + i].to_f64() * x[r * inp + i] as f64)
                        .sum();
                    let got = y[r * out + o] as f64;
                    assert!(
                        (got - exact).abs() <= 1e-5 * (1.0 + exact.abs()) * (inp as f64).sqrt(),
                        "{out}×{inp}, row {r}, feature {o}: {got} vs {exact}"
                    );
                }
            }
        }
        assert!(bf16_matvec(&[bf16::ZERO; 6], 2, &[0.0; 4], 2).is_err());
    }
}
