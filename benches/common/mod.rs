//! Timing shared by the benchmarks.

/// Pairs timed by [`interleaved`].
pub const PAIRS: usize = 9;

/// `a` and `b` timed alternately `PAIRS` times: the medians of `a`'s and `b`'s seconds and of the pairs' ratios
/// `a / b`. On a shared machine a slow minute then slows both halves of a pair instead of one side of the ratio.
pub fn interleaved(a: &dyn Fn(), b: &dyn Fn()) -> (f64, f64, f64) {
    let time = |f: &dyn Fn()| {
        let start = std::time::Instant::now();
        f();
        start.elapsed().as_secs_f64()
    };
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let pairs: Vec<(f64, f64)> = (0..PAIRS).map(|_| (time(a), time(b))).collect();
    (
        median(pairs.iter().map(|p| p.0).collect()),
        median(pairs.iter().map(|p| p.1).collect()),
        median(pairs.iter().map(|p| p.0 / p.1).collect()),
    )
}
