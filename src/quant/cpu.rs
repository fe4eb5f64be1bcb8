//! CPU kernels for blockwise 4-bit quantization and double quantization, parallel over blocks (rayon).
//!
//! Every kernel works on whole blocks, and a block's bytes never straddle another block's (blocksizes are even),
//! so blocks are independent and the results do not depend on the number of threads.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::config::{BnbKernels, QuantType, NESTED_BLOCKSIZE};
use super::dynamic_map::{quantize_dynamic, signed_map, CpuLutQuantizer};
use super::fp4::{FP4_CODE, FP4_CPU_ORDER};
use super::nf4::{NF4_CODE, NF4_PIVOTS};
use super::reduce::torch_mean_f32;

/// bitsandbytes' CPU backend clamps absmax to this before taking its reciprocal.
const CPU_MIN_ABSMAX: f32 = 1e-38;

/// Chooses 4-bit codes for whole blocks of scaled values as "code = remap[number of thresholds below x]", which
/// the compiler vectorizes across elements. This is the same function as bitsandbytes' comparison trees (a binary
/// search over the same sorted thresholds with strict `>`; NaN counts 0) and as its CPU backend's `bucketize`.
pub(crate) struct CodeSelector {
    /// Sorted thresholds (15, or 7 for the CUDA FP4 magnitude).
    pub(crate) thresholds: Vec<f32>,
    /// Code of each bucket.
    pub(crate) remap: [u8; 16],
    /// CUDA FP4: the sign bit comes from `x < 0` and the buckets are counted on `|x|`.
    pub(crate) sign_magnitude: bool,
}

/// The CUDA `dQuantizeFP4` magnitude pivots in increasing order, and the 3-bit code of each bucket.
const FP4_CUDA_PIVOTS: [f32; 7] = [
    0.00260417, 0.0859375, 0.20833333, 0.29166667, 0.4166667, 0.583333, 0.8333333,
];
const FP4_CUDA_MAGNITUDE_CODES: [u8; 8] = [0b000, 0b001, 0b110, 0b111, 0b100, 0b101, 0b010, 0b011];

impl CodeSelector {
    /// The selection of `quant_type`'s codes with `kernels`' thresholds.
    pub(crate) fn new(quant_type: QuantType, kernels: BnbKernels) -> Self {
        let identity: [u8; 16] = std::array::from_fn(|i| i as u8);
        // bitsandbytes' CPU backend: midpoints of the sorted codes in float32 arithmetic (one NF4 midpoint is an
        // ulp away from the CUDA literal), codes by torch's argsort order.
        let cpu = |code: &[f32; 16], order: [u8; 16]| CodeSelector {
            thresholds: (0..15)
                .map(|k| (code[order[k] as usize] + code[order[k + 1] as usize]) / 2.0)
                .collect(),
            remap: order,
            sign_magnitude: false,
        };
        match (quant_type, kernels) {
            (QuantType::Nf4, BnbKernels::Cuda) => CodeSelector {
                thresholds: NF4_PIVOTS.to_vec(),
                remap: identity,
                sign_magnitude: false,
            },
            (QuantType::Fp4, BnbKernels::Cuda) => {
                let mut remap = [0u8; 16];
                remap[..8].copy_from_slice(&FP4_CUDA_MAGNITUDE_CODES);
                CodeSelector {
                    thresholds: FP4_CUDA_PIVOTS.to_vec(),
                    remap,
                    sign_magnitude: true,
                }
            }
            (QuantType::Nf4, BnbKernels::Cpu) => cpu(&NF4_CODE, identity),
            (QuantType::Fp4, BnbKernels::Cpu) => cpu(&FP4_CODE, FP4_CPU_ORDER),
        }
    }

    /// Codes of `scaled` into `codes` (same length).
    fn codes(&self, scaled: &[f32], codes: &mut [u8]) {
        let mut counts = [0u8; MAX_BLOCK];
        let counts = &mut counts[..scaled.len()];
        if self.sign_magnitude {
            for t in &self.thresholds {
                for (c, x) in counts.iter_mut().zip(scaled) {
                    *c += (x.abs() > *t) as u8;
                }
            }
            for ((out, c), x) in codes.iter_mut().zip(counts.iter()).zip(scaled) {
                *out = self.remap[*c as usize] | if *x < 0.0 { 0b1000 } else { 0 };
            }
        } else {
            for t in &self.thresholds {
                for (c, x) in counts.iter_mut().zip(scaled) {
                    *c += (*x > *t) as u8;
                }
            }
            for (out, c) in codes.iter_mut().zip(counts.iter()) {
                *out = self.remap[*c as usize];
            }
        }
    }
}

/// The largest blocksize (stack buffers are sized for it).
const MAX_BLOCK: usize = 4096;

/// Max |x| of a block (exact in any order).
fn block_absmax(block: &[f32]) -> f32 {
    block.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Quantizes `values` (flattened, row-major, converted to f32 by `to_f32`) to packed 4-bit codes (even element in
/// the high nibble, an odd count padded with the code of 0.0) and one float32 absmax per block. Fails with the
/// index of the first non-finite value.
pub(crate) fn quantize_4bit<T: Copy + Sync>(
    values: &[T],
    to_f32: impl Fn(T) -> f32 + Sync,
    blocksize: usize,
    quant_type: QuantType,
    kernels: BnbKernels,
) -> std::result::Result<(Vec<u8>, Vec<f32>), usize> {
    assert!(
        blocksize <= MAX_BLOCK && blocksize % 2 == 0,
        "blocksize is validated by QuantConfig"
    );
    let n = values.len();
    let n_blocks = n.div_ceil(blocksize);
    let mut packed = vec![0u8; n.div_ceil(2)];
    let mut absmax = vec![0.0f32; n_blocks];
    let selector = CodeSelector::new(quant_type, kernels);
    let bad = std::sync::atomic::AtomicUsize::new(usize::MAX);
    packed
        .par_chunks_mut(blocksize / 2)
        .zip(values.par_chunks(blocksize))
        .zip(absmax.par_iter_mut())
        .enumerate()
        .for_each(|(b, ((bytes, block), amax))| {
            let mut buf = [0f32; MAX_BLOCK];
            let len = block.len();
            let x = &mut buf[..len + len % 2];
            for (o, v) in x.iter_mut().zip(block) {
                *o = to_f32(*v);
            }
            if let Some(i) = x[..len].iter().position(|v| !v.is_finite()) {
                bad.fetch_min(b * blocksize + i, std::sync::atomic::Ordering::Relaxed);
                return;
            }
            *amax = block_absmax(&x[..len]);
            match kernels {
                // CUDA scales every element (and the zero padding) by the reciprocal; 0 * inf = NaN takes code 0.
                BnbKernels::Cuda => {
                    let inv = 1.0 / *amax;
                    x.iter_mut().for_each(|v| *v *= inv);
                }
                // The CPU backend clamps absmax, divides the partial last block, and pads after scaling.
                BnbKernels::Cpu => {
                    let denom = amax.max(CPU_MIN_ABSMAX);
                    if len < blocksize {
                        x[..len].iter_mut().for_each(|v| *v /= denom);
                    } else {
                        let inv = 1.0 / denom;
                        x.iter_mut().for_each(|v| *v *= inv);
                    }
                }
            }
            let mut codes = [0u8; MAX_BLOCK];
            let codes = &mut codes[..x.len()];
            selector.codes(x, codes);
            for (byte, pair) in bytes.iter_mut().zip(codes.chunks_exact(2)) {
                *byte = (pair[0] << 4) | pair[1];
            }
        });
    match bad.into_inner() {
        usize::MAX => Ok((packed, absmax)),
        i => Err(i),
    }
}

/// Dequantizes `n` elements of packed 4-bit codes into `out` (`code[c] * absmax` in float32, then `convert`),
/// writing every element of `out`.
pub(crate) fn dequantize_4bit<T: Copy + Send>(
    packed: &[u8],
    absmax: &[f32],
    code: &[f32; 16],
    blocksize: usize,
    out: &mut [MaybeUninit<T>],
    convert: impl Fn(f32) -> T + Sync,
) {
    // Callers rely on every element being written: the codes and scales must cover `out`.
    assert!(
        packed.len() >= out.len().div_ceil(2) && absmax.len() >= out.len().div_ceil(blocksize),
        "4-bit codes or scales shorter than the output"
    );
    out.par_chunks_mut(blocksize)
        .zip(packed.par_chunks(blocksize / 2))
        .zip(absmax.par_iter())
        .for_each(|((out_block, bytes), scale)| {
            // The 16 possible outputs of this block, converted once: every element is then a table lookup.
            let lut: [T; 16] = std::array::from_fn(|i| convert(code[i] * scale));
            let half = out_block.len() / 2;
            let mut pairs = out_block.chunks_exact_mut(2);
            for (pair, byte) in pairs.by_ref().zip(bytes) {
                pair[0].write(lut[(byte >> 4) as usize]);
                pair[1].write(lut[(byte & 0x0f) as usize]);
            }
            // An odd element count ends in a half-used byte.
            if let ([last], Some(byte)) = (pairs.into_remainder(), bytes.get(half)) {
                last.write(lut[(byte >> 4) as usize]);
            }
        });
}

/// The double-quantized form of a block-absmax vector: bitsandbytes' `quantize_blockwise(absmax - mean, 256)`.
#[derive(Clone, Debug, PartialEq)]
pub struct NestedAbsmax {
    /// One 8-bit code per 4-bit block.
    pub codes: Vec<u8>,
    /// One float32 scale per 256 codes.
    pub absmax: Vec<f32>,
    /// The 256-entry signed dynamic map the codes index.
    pub code: Vec<f32>,
    /// The mean of the original absmax values, subtracted before quantizing.
    pub offset: f32,
    /// Codes per nested block (256).
    pub blocksize: usize,
}

/// Double-quantizes block absmax values.
pub(crate) fn quantize_nested(absmax: &[f32], kernels: BnbKernels) -> NestedAbsmax {
    let offset = torch_mean_f32(absmax);
    let centered: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let code = signed_map();
    let lut = match kernels {
        BnbKernels::Cpu => Some(CpuLutQuantizer::new(&code)),
        BnbKernels::Cuda => None,
    };
    let n_blocks = centered.len().div_ceil(NESTED_BLOCKSIZE);
    let mut codes = vec![0u8; centered.len()];
    let mut scales = vec![0.0f32; n_blocks];
    codes
        .par_chunks_mut(NESTED_BLOCKSIZE)
        .zip(centered.par_chunks(NESTED_BLOCKSIZE))
        .zip(scales.par_iter_mut())
        .for_each(|((out, block), amax)| {
            *amax = block_absmax(block);
            let inv = 1.0 / *amax;
            match &lut {
                // CUDA: an all-zero block scales 0 by inf = NaN, which the search sends to code 0.
                None => out
                    .iter_mut()
                    .zip(block)
                    .for_each(|(o, x)| *o = quantize_dynamic(&code, x * inv)),
                // CPU: an all-zero block is written as code 0 without scaling.
                Some(_) if *amax == 0.0 => out.fill(0),
                Some(lut) => out
                    .iter_mut()
                    .zip(block)
                    .for_each(|(o, x)| *o = lut.quantize(x * inv)),
            }
        });
    NestedAbsmax {
        codes,
        absmax: scales,
        code: code.to_vec(),
        offset,
        blocksize: NESTED_BLOCKSIZE,
    }
}

impl NestedAbsmax {
    /// A block's absmax from its 8-bit code under `map`, its group's nested absmax and the offset: `map[code] ·
    /// nested_absmax + offset`, rounded after each step as bitsandbytes.
    pub fn block_scale(map: &[f32], code: u8, nested_absmax: f32, offset: f32) -> f32 {
        let scaled = map[code as usize] * nested_absmax;
        scaled + offset
    }

    /// The float32 block absmax values: `code[q] * nested_absmax + offset`, rounded after each step as bitsandbytes.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.codes.len()];
        out.par_chunks_mut(self.blocksize)
            .zip(self.codes.par_chunks(self.blocksize))
            .zip(self.absmax.par_iter())
            .for_each(|((o, q), scale)| {
                for (v, c) in o.iter_mut().zip(q) {
                    *v = NestedAbsmax::block_scale(&self.code, *c, *scale, self.offset);
                }
            });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::nf4::NF4_CODE;

    fn one(s: &CodeSelector, x: f32) -> u8 {
        let mut c = [0u8; 1];
        s.codes(&[x], &mut c);
        c[0]
    }

    /// The vectorized selectors are exactly bitsandbytes' trees (CUDA), also on and next to every pivot.
    #[test]
    fn cuda_selectors_equal_the_trees() {
        use crate::quant::{fp4::quantize_fp4, nf4::quantize_nf4};
        let nf4 = CodeSelector::new(QuantType::Nf4, BnbKernels::Cuda);
        let fp4 = CodeSelector::new(QuantType::Fp4, BnbKernels::Cuda);
        let mut xs: Vec<f32> = (-3000..=3000).map(|i| i as f32 * 0.000_377).collect();
        for p in NF4_PIVOTS
            .iter()
            .chain(FP4_CUDA_PIVOTS.iter())
            .flat_map(|p| [*p, -*p])
        {
            xs.extend([
                p,
                f32::from_bits(p.to_bits() - 1),
                f32::from_bits(p.to_bits() + 1),
            ]);
        }
        xs.extend([f32::NAN, 0.0, -0.0, 2.0, -2.0]);
        for x in xs {
            assert_eq!(one(&nf4, x), quantize_nf4(x), "nf4 x={x}");
            assert_eq!(one(&fp4, x), quantize_fp4(x), "fp4 x={x}");
        }
    }

    #[test]
    fn cpu_buckets_agree_with_the_cuda_trees_off_the_pivots() {
        for quant_type in [QuantType::Nf4, QuantType::Fp4] {
            let cpu = CodeSelector::new(quant_type, BnbKernels::Cpu);
            let cuda = CodeSelector::new(quant_type, BnbKernels::Cuda);
            for i in -1000..=1000 {
                let x = i as f32 * 0.000_999_7;
                // FP4 differs on the sign of zero for tiny values (documented in the golden script).
                if quant_type == QuantType::Fp4 && x.abs() < 0.0027 {
                    continue;
                }
                assert_eq!(one(&cpu, x), one(&cuda, x), "{quant_type} x={x}");
            }
        }
    }

    /// `n` NF4 values dequantized with blocksize 64.
    fn dequantized(packed: &[u8], absmax: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![MaybeUninit::new(f32::NAN); n];
        dequantize_4bit(packed, absmax, &NF4_CODE, 64, &mut out, |x| x);
        // SAFETY: initialized above (and overwritten by the call).
        out.into_iter()
            .map(|x| unsafe { x.assume_init() })
            .collect()
    }

    #[test]
    fn packs_even_high_odd_low_and_pads_odd_counts() {
        let values = [1.0f32, -1.0, 0.0];
        let (packed, absmax) =
            quantize_4bit(&values, |x| x, 64, QuantType::Nf4, BnbKernels::Cuda).unwrap();
        assert_eq!(absmax, vec![1.0]);
        assert_eq!(packed, vec![0xf0, 0x77]);
        assert_eq!(dequantized(&packed, &absmax, 3), vec![1.0, -1.0, 0.0]);
    }

    #[test]
    fn all_zero_block_codes_follow_the_chosen_kernels() {
        let zeros = [0.0f32; 64];
        let (cuda, _) = quantize_4bit(&zeros, |x| x, 64, QuantType::Nf4, BnbKernels::Cuda).unwrap();
        let (cpu, absmax) =
            quantize_4bit(&zeros, |x| x, 64, QuantType::Nf4, BnbKernels::Cpu).unwrap();
        assert!(cuda.iter().all(|b| *b == 0x00));
        assert!(cpu.iter().all(|b| *b == 0x77));
        assert_eq!(absmax, vec![0.0]);
        for packed in [cuda, cpu] {
            assert!(dequantized(&packed, &absmax, 64).iter().all(|x| *x == 0.0));
        }
    }

    #[test]
    fn nested_absmax_round_trips_closely() {
        let absmax: Vec<f32> = (0..1000)
            .map(|i| 0.01 + (i as f32 * 0.37).sin().abs() * 0.1)
            .collect();
        for kernels in [BnbKernels::Cuda, BnbKernels::Cpu] {
            let nested = quantize_nested(&absmax, kernels);
            assert_eq!(nested.absmax.len(), 4);
            let back = nested.dequantize();
            for (a, b) in absmax.iter().zip(&back) {
                assert!((a - b).abs() < 2e-3, "{a} vs {b}");
            }
        }
    }
}
