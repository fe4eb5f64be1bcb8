//! FP4 (1 sign, 2 exponent, 1 mantissa bit, exponent bias 2): bitsandbytes' code values and quantization tree.

/// The 16 FP4 values as bitsandbytes' `get_4bit_type("fp4")` builds them (`data / 12` in float32), index = code.
/// Bit 3 is the sign. Code 8 ("negative zero") is `+0.0` here, as in the `quant_map` bitsandbytes stores (its
/// Python table is built from the integer `-0`); its C++/CUDA lookup tables use `-0.0`, so dequantized zeros of
/// code 8 differ from those kernels in the sign bit only.
pub const FP4_CODE: [f32; 16] = {
    let raw: [f32; 16] = [
        0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0,
        -3.0,
    ];
    let mut out = [0.0f32; 16];
    let mut i = 0;
    while i < 16 {
        out[i] = raw[i] / 12.0;
        i += 1;
    }
    out
};

/// Quantizes one value already scaled into [-1, 1] to its FP4 code, as bitsandbytes' CUDA `dQuantizeFP4`:
/// the sign bit is set for `x < 0` (so `-0.0` and NaN get sign 0), then a strict-`>` tree on `|x|`.
// The pivots are bitsandbytes' source literals (`dQuantizeFP4`), kept digit for digit.
#[allow(clippy::excessive_precision)]
#[inline]
pub fn quantize_fp4(x: f32) -> u8 {
    let sign = if x < 0.0 { 0b1000 } else { 0 };
    let a = x.abs();
    let magnitude = if a > 0.29166667 {
        if a > 0.583333 {
            if a > 0.8333333 {
                0b011
            } else {
                0b010
            }
        } else if a > 0.4166667 {
            0b101
        } else {
            0b100
        }
    } else if a > 0.0859375 {
        if a > 0.20833333 {
            0b111
        } else {
            0b110
        }
    } else if a > 0.00260417 {
        0b001
    } else {
        0b000
    };
    sign | magnitude
}

/// The sorted order torch's `argsort` gives for [`FP4_CODE`]: `+0.0` (code 0) sorts before `-0.0` (code 8).
pub(crate) const FP4_CPU_ORDER: [u8; 16] = [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_the_normalized_fp4_values() {
        assert_eq!(FP4_CODE[3], 1.0);
        assert_eq!(FP4_CODE[11], -1.0);
        assert_eq!(FP4_CODE[8].to_bits(), 0, "+0.0 as bitsandbytes stores it");
        assert_eq!(FP4_CODE[1], 0.0625f32 / 12.0);
    }

    #[test]
    fn tree_round_trips_every_code_and_ties_low() {
        for (c, v) in FP4_CODE.iter().enumerate() {
            if c == 8 {
                // Zero is not "< 0", so it gets code 0.
                assert_eq!(quantize_fp4(*v), 0);
            } else {
                assert_eq!(quantize_fp4(*v) as usize, c, "value {v}");
            }
        }
        assert_eq!(quantize_fp4(f32::NAN), 0);
        assert_eq!(quantize_fp4(-1e-6), 0b1000);
    }

    #[test]
    fn cpu_order_sorts_the_codes() {
        for k in 0..15 {
            assert!(FP4_CODE[FP4_CPU_ORDER[k] as usize] <= FP4_CODE[FP4_CPU_ORDER[k + 1] as usize]);
        }
    }
}
