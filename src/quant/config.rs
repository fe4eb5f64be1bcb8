//! What to quantize to: 4-bit type, blocksize, double quantization, and which bitsandbytes kernels to reproduce.

use crate::error::{Error, Result};
use crate::names::named_enum;

named_enum! {
    /// The 4-bit data type (`bnb_4bit_quant_type`).
    pub enum QuantType ("bnb_4bit_quant_type") {
        /// 4-bit NormalFloat, the QLoRA data type.
        Nf4 = "nf4",
        /// 4-bit float (1 sign, 2 exponent, 1 mantissa bit).
        Fp4 = "fp4",
    }
}

impl QuantType {
    /// The 16 code values of this type, index = 4-bit code.
    pub fn code(self) -> &'static [f32; 16] {
        match self {
            QuantType::Nf4 => &super::nf4::NF4_CODE,
            QuantType::Fp4 => &super::fp4::FP4_CODE,
        }
    }
}

/// Which bitsandbytes implementation the quantized bytes reproduce. Both dequantize to the same values from the
/// same bytes; they differ only in edge cases of *choosing* codes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BnbKernels {
    /// The CUDA kernels (which produced the `*-bnb-4bit` checkpoints on the Hub): `x * (1/absmax)` for every block,
    /// an all-zero block takes code 0 (NaN path), nested absmax by the 8-bit binary search.
    #[default]
    Cuda,
    /// bitsandbytes' CPU backend: absmax clamped to 1e-38 for scaling (an all-zero block takes the code of 0.0), the
    /// last partial block divided instead of multiplied, FP4 by `bucketize`, nested absmax by the 65536-bin table.
    Cpu,
}

/// The blocksizes bitsandbytes accepts for 4-bit quantization.
pub const ALLOWED_BLOCKSIZES: [usize; 8] = [32, 64, 128, 256, 512, 1024, 2048, 4096];

/// The blocksize of double quantization (the nested absmax), fixed at 256 as in bitsandbytes.
pub const NESTED_BLOCKSIZE: usize = 256;

/// How to quantize a weight (the 4-bit part of transformers' `BitsAndBytesConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantConfig {
    /// NF4 or FP4.
    pub quant_type: QuantType,
    /// Elements per absmax block: one of [`ALLOWED_BLOCKSIZES`]; 64 by default.
    pub blocksize: usize,
    /// Quantize the absmax values too (`bnb_4bit_use_double_quant`, bitsandbytes' `compress_statistics`).
    pub double_quant: bool,
    /// Which bitsandbytes kernels to reproduce bit for bit.
    pub kernels: BnbKernels,
}

impl QuantConfig {
    /// NF4 with double quantization at blocksize 64: the QLoRA recipe.
    pub fn nf4() -> Self {
        QuantConfig {
            quant_type: QuantType::Nf4,
            blocksize: 64,
            double_quant: true,
            kernels: BnbKernels::Cuda,
        }
    }

    /// FP4 with double quantization at blocksize 64.
    pub fn fp4() -> Self {
        QuantConfig {
            quant_type: QuantType::Fp4,
            ..Self::nf4()
        }
    }

    /// Checks the blocksize.
    pub fn validate(&self) -> Result<()> {
        if !ALLOWED_BLOCKSIZES.contains(&self.blocksize) {
            return Err(Error::InvalidQuantConfig(format!(
                "blocksize {} is not allowed: use one of {:?} (bitsandbytes' set; 64 is the default)",
                self.blocksize, ALLOWED_BLOCKSIZES
            )));
        }
        Ok(())
    }
}

impl Default for QuantConfig {
    fn default() -> Self {
        Self::nf4()
    }
}
