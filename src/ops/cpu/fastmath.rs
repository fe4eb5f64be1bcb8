//! `exp` for float32 loops that the compiler can vectorize.
//!
//! `f32::exp` calls libm once per element, which made softmax-style loops (cross-entropy over a 49k
//! vocabulary, attention, SiLU) cost more than their matrix products. This is Cephes' `expf`: `2ⁿ·e^r` with
//! `|r| ≤ ln2/2` and a degree-6 polynomial for `e^r` — within 2 ulp of the exact value over the float32 range,
//! built only from float and integer arithmetic and selects (no float-to-int conversion, which Rust saturates), so a
//! loop over a slice becomes SIMD code of any width.

const LOG2_E: f32 = std::f32::consts::LOG2_E;
// ln 2 split in a part exact in float32 and the rest (Cody–Waite reduction).
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
// Adding and subtracting 1.5·2²³ rounds a float32 of magnitude < 2²² to the nearest integer.
const ROUND: f32 = 12_582_912.0;

/// `e^x` in float32 (see the module doc); `0` below −87.3, `+∞` above 88.7, NaN for NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    let clamped = x.clamp(-87.336_54, 88.722_84);
    let shifted = clamped * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = clamped - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5e-1;
    let er = p * r * r + r + 1.0;
    // The integer n sits in the low mantissa bits of `shifted`: reading it there (instead of a float-to-int
    // conversion, which saturates in Rust) keeps the loop vectorizable.
    let n = shifted.to_bits() as i32 - ROUND.to_bits() as i32;
    // 2ⁿ as two factors, so n = 128 (x near the top of the range) does not overflow the exponent field.
    let half = n >> 1;
    let pow2 = |e: i32| f32::from_bits(((e + 127) << 23) as u32);
    let y = er * pow2(half) * pow2(n - half);
    let y = if x < -87.336_54 { 0.0 } else { y };
    let y = if x > 88.722_84 { f32::INFINITY } else { y };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// `tanh(x)` in float32 for loops that the compiler can vectorize: the rational approximation of Eigen (also in
/// XLA and ONNX Runtime's MLAS) — odd degree 13 over even degree 6, within 3·ε of `tanh(x)` (relative and
/// absolute) over the float32 range and never beyond ±1, `x` itself below `4·10⁻⁴`; NaN for NaN.
#[inline(always)]
#[allow(clippy::excessive_precision)]
pub fn tanh_f32(x: f32) -> f32 {
    let c = x.clamp(-7.905_311_107_635_498_05, 7.905_311_107_635_498_05);
    let c2 = c * c;
    let mut p = -2.760_768_477_423_55e-16f32;
    p = p * c2 + 2.000_187_904_824_77e-13;
    p = p * c2 - 8.604_671_522_137_35e-11;
    p = p * c2 + 5.122_297_090_371_14e-8;
    p = p * c2 + 1.485_722_357_179_79e-5;
    p = p * c2 + 6.372_619_288_754_36e-4;
    p = p * c2 + 4.893_524_558_917_86e-3;
    let mut q = 1.198_258_394_667_02e-6f32;
    q = q * c2 + 1.185_347_056_866_54e-4;
    q = q * c2 + 2.268_434_632_439_00e-3;
    q = q * c2 + 4.893_525_185_543_85e-3;
    let y = c * p / q;
    if x.abs() < 4e-4 {
        x
    } else {
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_libm_within_two_ulp_over_the_range() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.5 {
            let (got, want) = (exp_f32(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_731;
        }
        assert!(worst < 2.5 * f32::EPSILON as f64, "relative error {worst}");
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_matches_libm_within_three_epsilon() {
        let (mut worst_rel, mut worst_abs) = (0.0f64, 0.0f64);
        let mut x = -10.0f32;
        while x < 10.0 {
            let (got, want) = (tanh_f32(x) as f64, (x as f64).tanh());
            assert!(got.abs() <= 1.0, "tanh({x}) = {got}");
            worst_abs = worst_abs.max((got - want).abs());
            worst_rel = worst_rel.max(((got - want) / want).abs());
            x += 0.000_731;
        }
        // About 3·ε at worst (near x = 5.9, where tanh is within 10⁻⁵ of 1).
        assert!(
            worst_rel < 3.5 * f32::EPSILON as f64,
            "relative error {worst_rel}"
        );
        assert!(
            worst_abs < 3.5 * f32::EPSILON as f64,
            "absolute error {worst_abs}"
        );
        for tiny in [1e-30f32, -3e-4, 1e-7] {
            assert_eq!(tanh_f32(tiny), tiny);
        }
        assert_eq!(tanh_f32(0.0), 0.0);
        assert_eq!(tanh_f32(100.0), 1.0);
        assert_eq!(tanh_f32(-1e30), -1.0);
        assert_eq!(tanh_f32(f32::INFINITY), 1.0);
        assert!(tanh_f32(f32::NAN).is_nan());
    }
}
