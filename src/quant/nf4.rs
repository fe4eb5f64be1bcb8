//! NF4 (4-bit NormalFloat): bitsandbytes' 16 code values and its quantization tree.

/// The 16 NF4 values, index = 4-bit code (`functional.get_4bit_type("nf4")`, CUDA `nf4_dequantization_lut`).
pub const NF4_CODE: [f32; 16] = [
    -1.0,
    -0.696_192_8,
    -0.525_073_05,
    -0.394_917_5,
    -0.284_441_38,
    -0.184_773_43,
    -0.091_050_036,
    0.0,
    0.079_580_3,
    0.160_930_2,
    0.246_112_3,
    0.337_915_24,
    0.440_709_83,
    0.562_617,
    0.722_956_84,
    1.0,
];

/// The 15 pivots of [`quantize_nf4`] in increasing order (bitsandbytes' literals, parsed straight to float32).
#[allow(clippy::excessive_precision)]
pub const NF4_PIVOTS: [f32; 15] = [
    -0.8480964004993439,
    -0.6106329262256622,
    -0.4599952697753906,
    -0.33967943489551544,
    -0.23460740596055984,
    -0.13791173323988914,
    -0.045525018125772476,
    0.03979014977812767,
    0.1202552504837513,
    0.2035212516784668,
    0.2920137718319893,
    0.3893125355243683,
    0.5016634166240692,
    0.6427869200706482,
    0.8614784181118011,
];

/// Quantizes one value already scaled into [-1, 1] to its NF4 code.
///
/// This is bitsandbytes' `dQuantizeNF4` tree: strict `>` against the float32 midpoints of adjacent codes,
/// so a value exactly on a midpoint takes the lower code and NaN (every comparison false) takes code 0.
// The pivots are bitsandbytes' source literals, kept digit for digit.
#[allow(clippy::excessive_precision)]
#[inline]
pub fn quantize_nf4(x: f32) -> u8 {
    if x > 0.03979014977812767 {
        if x > 0.3893125355243683 {
            if x > 0.6427869200706482 {
                if x > 0.8614784181118011 {
                    15
                } else {
                    14
                }
            } else if x > 0.5016634166240692 {
                13
            } else {
                12
            }
        } else if x > 0.2035212516784668 {
            if x > 0.2920137718319893 {
                11
            } else {
                10
            }
        } else if x > 0.1202552504837513 {
            9
        } else {
            8
        }
    } else if x > -0.33967943489551544 {
        if x > -0.13791173323988914 {
            if x > -0.045525018125772476 {
                7
            } else {
                6
            }
        } else if x > -0.23460740596055984 {
            5
        } else {
            4
        }
    } else if x > -0.6106329262256622 {
        if x > -0.4599952697753906 {
            3
        } else {
            2
        }
    } else if x > -0.8480964004993439 {
        1
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The code values are the exact float32 bit patterns bitsandbytes uses.
    #[test]
    fn code_bits_match_bitsandbytes() {
        let bits: [u32; 16] = [
            0xbf800000, 0xbf3239b1, 0xbf066b30, 0xbeca32a0, 0xbe91a24d, 0xbe3d353f, 0xbdba7871,
            0x00000000, 0x3da2faff, 0x3e24cae3, 0x3e7c04dd, 0x3ead033a, 0x3ee1a4b8, 0x3f1007ab,
            0x3f3913b3, 0x3f800000,
        ];
        for (i, b) in bits.iter().enumerate() {
            assert_eq!(NF4_CODE[i].to_bits(), *b, "code {i}");
        }
    }

    fn next_up(x: f32) -> f32 {
        if x >= 0.0 {
            f32::from_bits(x.to_bits() + 1)
        } else {
            f32::from_bits(x.to_bits() - 1)
        }
    }

    /// Every pivot of the tree lies within one float32 ulp of the midpoint of its two codes (the pivots are
    /// decimal literals parsed straight to float32, as nvcc does), a value on the pivot takes the lower code, and
    /// NaN takes code 0.
    #[test]
    fn tree_is_nearest_code_with_ties_low() {
        for i in 0..15 {
            let mid = ((NF4_CODE[i] as f64 + NF4_CODE[i + 1] as f64) / 2.0) as f32;
            let mut x = f32::from_bits(if mid > 0.0 {
                mid.to_bits() - 2
            } else {
                mid.to_bits() + 2
            });
            assert_eq!(quantize_nf4(x) as usize, i, "below midpoint {i}");
            let mut steps = 0;
            while quantize_nf4(next_up(x)) as usize == i {
                x = next_up(x);
                steps += 1;
            }
            assert!(
                (1..=3).contains(&steps),
                "pivot {i} is {steps} ulps from the midpoint"
            );
            assert_eq!(quantize_nf4(next_up(x)) as usize, i + 1);
        }
        for (i, c) in NF4_CODE.iter().enumerate() {
            assert_eq!(quantize_nf4(*c) as usize, i);
        }
        assert_eq!(quantize_nf4(f32::NAN), 0);
        assert_eq!(quantize_nf4(2.0), 15);
        assert_eq!(quantize_nf4(-2.0), 0);
    }
}
