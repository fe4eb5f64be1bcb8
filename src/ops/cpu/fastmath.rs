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
}
