//! Element-wise loops and reductions compiled for the CPU's widest vector instructions.
//!
//! The crate is built for x86-64-v3 (`.cargo/config.toml`), where a loop over `f32` runs eight lanes at a time.
//! [`simd`] compiles a closure again for AVX-512 (and AVX2+FMA, for builds without that file) and picks the version
//! the CPU has at run time, so the loops inlined into it run 16 lanes wide where they can. Floating-point sums and
//! maxima over a slice do not vectorize by themselves (the compiler may not reorder a sum), so [`sum`], [`dot`],
//! [`sum_zip`] and [`max`] keep one accumulator per lane. No multiply and add are fused into one rounding, so a
//! result does not depend on the instruction set.

use rayon::prelude::*;

use super::CpuFloat;

/// Accumulators of a reduction: one 512-bit register of `f32`.
const LANES: usize = 16;

/// Elements per parallel task of [`map2`] and [`map3`].
const CHUNK: usize = 1 << 14;

/// Runs `f` compiled for the widest vector instruction set the CPU has (chosen at run time). Mark the closure
/// `#[inline(always)]`: a closure the compiler does not inline into the dispatched versions is compiled once, for the
/// build's baseline (SSE2 without `.cargo/config.toml`, as in a dependent crate).
#[inline(always)]
pub fn simd<R>(f: impl FnOnce() -> R) -> R {
    pulp::Arch::new().dispatch(f)
}

/// `Σ xs` with one partial sum per lane, added up in a fixed order at the end.
#[inline(always)]
pub fn sum<T: CpuFloat>(xs: &[T]) -> T {
    sum_zip(xs, xs, |x, _| x)
}

/// `Σ a[i]·b[i]` (lengths must match) with one partial sum per lane.
#[inline(always)]
pub fn dot<T: CpuFloat>(a: &[T], b: &[T]) -> T {
    sum_zip(a, b, |x, y| x * y)
}

/// `Σ f(a[i], b[i])` (lengths must match) in `S`, with one partial sum per lane.
#[inline(always)]
pub fn sum_zip<T: Copy, S: CpuFloat>(a: &[T], b: &[T], f: impl Fn(T, T) -> S) -> S {
    assert_eq!(a.len(), b.len(), "sum over unequal lengths");
    let mut acc = [S::zero(); LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for ((s, &x), &y) in acc.iter_mut().zip(x).zip(y) {
            *s += f(x, y);
        }
    }
    let total = acc.into_iter().fold(S::zero(), |s, x| s + x);
    ra.iter().zip(rb).fold(total, |s, (&x, &y)| s + f(x, y))
}

/// The largest element of a non-empty slice, NaN only when `xs[0]` is (as a fold of `if x > m { x } else { m }`
/// from `xs[0]`). A maximum does not round, so the lanes give the same value as that fold.
#[inline(always)]
pub fn max<T: CpuFloat>(xs: &[T]) -> T {
    let pick = |m: T, x: T| if x > m { x } else { m };
    let mut acc = [xs[0]; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (m, &x) in acc.iter_mut().zip(chunk) {
            *m = pick(*m, x);
        }
    }
    rest.iter()
        .fold(acc.into_iter().fold(xs[0], pick), |m, &x| pick(m, x))
}

/// `f(a[i], b[i])` for every `i`, in parallel chunks compiled by [`simd`].
pub fn map2<T: CpuFloat>(a: &[T], b: &[T], f: impl Fn(T, T) -> T + Sync) -> Vec<T> {
    assert_eq!(a.len(), b.len(), "map2 over unequal lengths");
    let mut out = Vec::with_capacity(a.len());
    out.spare_capacity_mut()
        .par_chunks_mut(CHUNK)
        .zip(a.par_chunks(CHUNK).zip(b.par_chunks(CHUNK)))
        .for_each(|(out, (a, b))| {
            simd(
                #[inline(always)]
                || {
                    for (o, (&a, &b)) in out.iter_mut().zip(a.iter().zip(b)) {
                        o.write(f(a, b));
                    }
                },
            )
        });
    // SAFETY: the chunks of the spare capacity cover `a.len()` elements and every one was written above.
    unsafe { out.set_len(a.len()) };
    out
}

/// `f(a[i], b[i], c[i])` for every `i`, in parallel chunks compiled by [`simd`].
pub fn map3<T: CpuFloat>(a: &[T], b: &[T], c: &[T], f: impl Fn(T, T, T) -> T + Sync) -> Vec<T> {
    assert!(
        a.len() == b.len() && a.len() == c.len(),
        "map3 over unequal lengths"
    );
    let mut out = Vec::with_capacity(a.len());
    out.spare_capacity_mut()
        .par_chunks_mut(CHUNK)
        .zip(
            a.par_chunks(CHUNK)
                .zip(b.par_chunks(CHUNK).zip(c.par_chunks(CHUNK))),
        )
        .for_each(|(out, (a, (b, c)))| {
            simd(
                #[inline(always)]
                || {
                    for (o, (&a, (&b, &c))) in out.iter_mut().zip(a.iter().zip(b.iter().zip(c))) {
                        o.write(f(a, b, c));
                    }
                },
            )
        });
    // SAFETY: as in `map2`.
    unsafe { out.set_len(a.len()) };
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7919 % 1013) as f32 - 500.0) * 0.37)
            .collect()
    }

    #[test]
    fn reductions_equal_their_scalar_definitions() {
        for n in [1, 15, 16, 17, 100, 1000] {
            let (a, b) = (values(n), values(n + 3)[3..].to_vec());
            let close = |x: f32, y: f64| (x as f64 - y).abs() <= 1e-5 * y.abs().max(1.0);
            let want_sum: f64 = a.iter().map(|&x| x as f64).sum();
            assert!(close(sum(&a), want_sum), "sum of {n}");
            let want_dot: f64 = a.iter().zip(&b).map(|(&x, &y)| x as f64 * y as f64).sum();
            assert!(close(dot(&a, &b), want_dot), "dot of {n}");
            let want_max = a.iter().fold(a[0], |m, &x| if x > m { x } else { m });
            assert_eq!(max(&a), want_max);
        }
        let mut with_nan = values(40);
        with_nan[20] = f32::NAN;
        assert_eq!(
            max(&with_nan),
            values(40).iter().cloned().fold(f32::MIN, f32::max)
        );
        with_nan[0] = f32::NAN;
        assert!(max(&with_nan).is_nan());
    }

    #[test]
    fn maps_apply_their_function_to_every_element() {
        let n = CHUNK * 2 + 5;
        let (a, b, c) = (
            values(n),
            values(n + 1)[1..].to_vec(),
            values(n + 2)[2..].to_vec(),
        );
        let two = map2(&a, &b, |x, y| x * y + 1.0);
        let three = map3(&a, &b, &c, |x, y, z| x * y - z);
        for i in 0..n {
            assert_eq!(two[i], a[i] * b[i] + 1.0);
            assert_eq!(three[i], a[i] * b[i] - c[i]);
        }
    }
}
