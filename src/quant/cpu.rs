//! CPU kernels for blockwise 4-bit quantization and double quantization, parallel over blocks (rayon).
//!
//! Every kernel works on whole blocks, and a block's bytes never straddle another block's (blocksizes are even),
//! so blocks are independent and the results do not depend on the number of threads.

use rayon::prelude::*;

use super::config::{BnbKernels, QuantType, NESTED_BLOCKSIZE};
use super::dynamic_map::{quantize_dynamic, signed_map, CpuLutQuantizer};
use super::fp4::{quantize_fp4, FP4_CODE, FP4_CPU_ORDER};
use super::nf4::{quantize_nf4, NF4_CODE};
use super::reduce::torch_mean_f32;

/// bitsandbytes' CPU backend clamps absmax to this before taking its reciprocal.
const CPU_MIN_ABSMAX: f32 = 1e-38;

/// bitsandbytes' CPU ("default" backend) 4-bit code choice: `bucketize` on the midpoints of the sorted code
/// values (computed in float32 arithmetic, which differs from the CUDA tree's pivots by an ulp at one NF4 pivot),
/// then the code of that bucket.
struct CpuBuckets {
    bounds: [f32; 15],
    order: [u8; 16],
}

impl CpuBuckets {
    fn new(code: &[f32; 16], order: [u8; 16]) -> Self {
        let bounds =
            std::array::from_fn(|k| (code[order[k] as usize] + code[order[k + 1] as usize]) / 2.0);
        CpuBuckets { bounds, order }
    }

    /// Bucket = number of bounds strictly below `x` (`right=False`).
    #[inline]
    fn code(&self, x: f32) -> u8 {
        self.order[self.bounds.partition_point(|b| *b < x)]
    }
}

/// Picks the 4-bit code of a scaled value.
enum CodeSelector {
    Nf4Cuda,
    Fp4Cuda,
    Cpu(CpuBuckets),
}

impl CodeSelector {
    fn new(quant_type: QuantType, kernels: BnbKernels) -> Self {
        match (quant_type, kernels) {
            (QuantType::Nf4, BnbKernels::Cuda) => CodeSelector::Nf4Cuda,
            (QuantType::Fp4, BnbKernels::Cuda) => CodeSelector::Fp4Cuda,
            (QuantType::Nf4, BnbKernels::Cpu) => {
                CodeSelector::Cpu(CpuBuckets::new(&NF4_CODE, std::array::from_fn(|i| i as u8)))
            }
            (QuantType::Fp4, BnbKernels::Cpu) => {
                CodeSelector::Cpu(CpuBuckets::new(&FP4_CODE, FP4_CPU_ORDER))
            }
        }
    }

    #[inline]
    fn code(&self, x: f32) -> u8 {
        match self {
            CodeSelector::Nf4Cuda => quantize_nf4(x),
            CodeSelector::Fp4Cuda => quantize_fp4(x),
            CodeSelector::Cpu(b) => b.code(x),
        }
    }
}

/// Max |x| of a block (exact in any order).
fn block_absmax(block: &[f32]) -> f32 {
    block.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// Quantizes `values` (flattened, row-major) to packed 4-bit codes (even element in the high nibble, an odd count
/// padded with the code of 0.0) and one float32 absmax per block.
pub(crate) fn quantize_4bit(
    values: &[f32],
    blocksize: usize,
    quant_type: QuantType,
    kernels: BnbKernels,
) -> (Vec<u8>, Vec<f32>) {
    let n = values.len();
    let n_blocks = n.div_ceil(blocksize);
    let mut packed = vec![0u8; n.div_ceil(2)];
    let mut absmax = vec![0.0f32; n_blocks];
    let selector = CodeSelector::new(quant_type, kernels);
    packed
        .par_chunks_mut(blocksize / 2)
        .zip(values.par_chunks(blocksize))
        .zip(absmax.par_iter_mut())
        .for_each(|((bytes, block), amax)| {
            *amax = block_absmax(block);
            let partial = block.len() < blocksize;
            let scale = |x: f32| -> f32 {
                match kernels {
                    BnbKernels::Cuda => x * (1.0 / *amax),
                    // The CPU backend scales full blocks by the reciprocal, the partial last block by division.
                    BnbKernels::Cpu if partial => x / amax.max(CPU_MIN_ABSMAX),
                    BnbKernels::Cpu => x * (1.0 / amax.max(CPU_MIN_ABSMAX)),
                }
            };
            // The padding element: the CUDA kernel loads 0 and scales it, the CPU backend pads after scaling.
            let pad_code = match kernels {
                BnbKernels::Cuda => selector.code(scale(0.0)),
                BnbKernels::Cpu => selector.code(0.0),
            };
            for (byte, pair) in bytes.iter_mut().zip(block.chunks(2)) {
                let hi = selector.code(scale(pair[0]));
                let lo = match pair.get(1) {
                    Some(x) => selector.code(scale(*x)),
                    None => pad_code,
                };
                *byte = (hi << 4) | lo;
            }
        });
    (packed, absmax)
}

/// Dequantizes `n` elements of packed 4-bit codes into `out` (`code[c] * absmax` in float32, then `convert`).
pub(crate) fn dequantize_4bit<T: Send>(
    packed: &[u8],
    absmax: &[f32],
    code: &[f32; 16],
    blocksize: usize,
    out: &mut [T],
    convert: impl Fn(f32) -> T + Sync,
) {
    out.par_chunks_mut(blocksize)
        .zip(packed.par_chunks(blocksize / 2))
        .zip(absmax.par_iter())
        .for_each(|((out_block, bytes), scale)| {
            let lut: [f32; 16] = std::array::from_fn(|i| code[i] * scale);
            let mut pairs = out_block.chunks_mut(2);
            for byte in bytes {
                let Some(pair) = pairs.next() else { break };
                pair[0] = convert(lut[(byte >> 4) as usize]);
                if let Some(second) = pair.get_mut(1) {
                    *second = convert(lut[(byte & 0x0f) as usize]);
                }
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
    /// The float32 block absmax values: `code[q] * nested_absmax + offset`, rounded after each step as bitsandbytes.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.codes.len()];
        out.par_chunks_mut(self.blocksize)
            .zip(self.codes.par_chunks(self.blocksize))
            .zip(self.absmax.par_iter())
            .for_each(|((o, q), scale)| {
                for (v, c) in o.iter_mut().zip(q) {
                    let scaled = self.code[*c as usize] * scale;
                    *v = scaled + self.offset;
                }
            });
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::nf4::NF4_CODE;

    #[test]
    fn cpu_buckets_agree_with_the_cuda_trees_off_the_pivots() {
        for (quant_type, tree) in [
            (QuantType::Nf4, quantize_nf4 as fn(f32) -> u8),
            (QuantType::Fp4, quantize_fp4),
        ] {
            let cpu = CodeSelector::new(quant_type, BnbKernels::Cpu);
            for i in -1000..=1000 {
                let x = i as f32 * 0.000_999_7;
                // FP4 differs on the sign of zero for tiny values (documented in the golden script).
                if quant_type == QuantType::Fp4 && x.abs() < 0.0027 {
                    continue;
                }
                assert_eq!(cpu.code(x), tree(x), "{quant_type} x={x}");
            }
        }
    }

    #[test]
    fn packs_even_high_odd_low_and_pads_odd_counts() {
        let values = [1.0f32, -1.0, 0.0];
        let (packed, absmax) = quantize_4bit(&values, 64, QuantType::Nf4, BnbKernels::Cuda);
        assert_eq!(absmax, vec![1.0]);
        assert_eq!(packed, vec![0xf0, 0x77]);
        let mut out = vec![0.0f32; 3];
        dequantize_4bit(&packed, &absmax, &NF4_CODE, 64, &mut out, |x| x);
        assert_eq!(out, vec![1.0, -1.0, 0.0]);
    }

    #[test]
    fn all_zero_block_codes_follow_the_chosen_kernels() {
        let zeros = [0.0f32; 64];
        let (cuda, _) = quantize_4bit(&zeros, 64, QuantType::Nf4, BnbKernels::Cuda);
        let (cpu, absmax) = quantize_4bit(&zeros, 64, QuantType::Nf4, BnbKernels::Cpu);
        assert!(cuda.iter().all(|b| *b == 0x00));
        assert!(cpu.iter().all(|b| *b == 0x77));
        assert_eq!(absmax, vec![0.0]);
        for packed in [cuda, cpu] {
            let mut out = vec![1.0f32; 64];
            dequantize_4bit(&packed, &absmax, &NF4_CODE, 64, &mut out, |x| x);
            assert!(out.iter().all(|x| *x == 0.0));
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
