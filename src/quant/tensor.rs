//! [`Nf4Tensor`]: a weight quantized to 4 bits exactly as bitsandbytes does (NF4 or FP4, optional double
//! quantization), with its statistics, and the way back to a dense tensor.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use candle_core::{CpuStorage, DType, Device, Storage, Tensor};

use super::config::{QuantConfig, QuantType, ALLOWED_BLOCKSIZES, NESTED_BLOCKSIZE};
use super::cpu::{self, NestedAbsmax};
use crate::error::{Error, Result};

/// The per-block scales of a 4-bit tensor.
#[derive(Clone, Debug, PartialEq)]
pub enum BlockScales {
    /// One float32 absmax per block.
    Plain(Vec<f32>),
    /// Double quantization: 8-bit codes per block with their own scales and offset.
    Nested(NestedAbsmax),
}

impl BlockScales {
    /// Number of 4-bit blocks these scales cover.
    pub fn len(&self) -> usize {
        match self {
            BlockScales::Plain(a) => a.len(),
            BlockScales::Nested(n) => n.codes.len(),
        }
    }

    /// True when there are no blocks (never for a valid tensor).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The float32 absmax of every block (dequantizing the nested codes if double-quantized).
    pub fn to_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match self {
            BlockScales::Plain(a) => std::borrow::Cow::Borrowed(a),
            BlockScales::Nested(n) => std::borrow::Cow::Owned(n.dequantize()),
        }
    }

    /// Bytes these statistics take in a checkpoint (codes, scales, map and offset).
    pub fn size_in_bytes(&self) -> usize {
        match self {
            BlockScales::Plain(a) => a.len() * 4,
            BlockScales::Nested(n) => n.codes.len() + n.absmax.len() * 4 + n.code.len() * 4 + 4,
        }
    }
}

/// The float32 absmax of every block of a double-quantized tensor, dequantized on first use and kept (see
/// [`Nf4Tensor::block_absmax`]). A cache, so it never makes two tensors unequal.
#[derive(Clone, Debug, Default)]
struct AbsmaxCache(OnceLock<Vec<f32>>);

impl PartialEq for AbsmaxCache {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

/// A weight stored in 4 bits, bit-compatible with bitsandbytes' `Params4bit` + `QuantState`.
///
/// The elements of the row-major weight are split into blocks of `blocksize`; each element is the code of
/// `w / absmax(block)` in a 16-value codebook, two codes per byte (even element in the high nibble).
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4Tensor {
    packed: Vec<u8>,
    scales: BlockScales,
    code: [f32; 16],
    shape: Vec<usize>,
    dtype: DType,
    quant_type: QuantType,
    blocksize: usize,
    absmax_cache: AbsmaxCache,
}

impl Nf4Tensor {
    /// Quantizes a float tensor (f32, f16 or bf16, any device) with `config`.
    ///
    /// Non-finite values are an error: bitsandbytes would silently turn their whole block into garbage codes.
    pub fn quantize(tensor: &Tensor, config: &QuantConfig) -> Result<Self> {
        Self::quantize_named(tensor, config, "<tensor>")
    }

    /// [`Nf4Tensor::quantize`] with the tensor's name for error messages.
    pub fn quantize_named(tensor: &Tensor, config: &QuantConfig, name: &str) -> Result<Self> {
        let (packed, absmax) = Self::quantize_blocks(tensor, config, name)?;
        Self::from_codes_and_absmax(packed, absmax, tensor.dims(), tensor.dtype(), config)
    }

    /// The packed codes and the float32 absmax of every block of `tensor` (f32, f16 or bf16, any device, taken
    /// flat), without the double quantization: what [`Nf4Tensor::quantize_named`] computes first. Blocks are
    /// independent, so a run of whole blocks of a larger tensor quantizes here to the same bytes it has in the
    /// whole (a rank of a sharded load quantizes its part so, see [`Nf4Tensor::from_codes_and_absmax`]).
    pub fn quantize_blocks(
        tensor: &Tensor,
        config: &QuantConfig,
        name: &str,
    ) -> Result<(Vec<u8>, Vec<f32>)> {
        config.validate()?;
        let dtype = tensor.dtype();
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return Err(Error::Quantize {
                name: name.into(),
                reason: format!(
                    "dtype {dtype:?} is not supported: 4-bit quantization takes f32, f16 or bf16"
                ),
            });
        }
        if tensor.elem_count() == 0 {
            return Err(Error::Quantize {
                name: name.into(),
                reason: "the tensor has no elements".into(),
            });
        }
        // Read the storage in place (no f32 copy of the whole weight): each block is widened as it is quantized.
        let t = tensor.to_device(&Device::Cpu)?.contiguous()?;
        let (storage, layout) = t.storage_and_layout();
        let (start, end) = layout.contiguous_offsets().ok_or_else(|| Error::Quantize {
            name: name.into(),
            reason: "non-contiguous tensor".into(),
        })?;
        match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => {
                Self::quantize_slice(&v[start..end], |x| x, config, name)
            }
            Storage::Cpu(CpuStorage::BF16(v)) => {
                Self::quantize_slice(&v[start..end], half::bf16::to_f32, config, name)
            }
            Storage::Cpu(CpuStorage::F16(v)) => {
                Self::quantize_slice(&v[start..end], half::f16::to_f32, config, name)
            }
            _ => Err(Error::Quantize {
                name: name.into(),
                reason: format!("unsupported storage for {dtype:?}"),
            }),
        }
    }

    /// Quantizes already-flattened float32 `values` of a tensor whose shape is `shape` and original dtype `dtype`
    /// (the dtype dequantization returns by default and the checkpoint records).
    pub fn quantize_values(
        values: &[f32],
        shape: &[usize],
        dtype: DType,
        config: &QuantConfig,
        name: &str,
    ) -> Result<Self> {
        config.validate()?;
        if shape.iter().product::<usize>() != values.len() {
            return Err(Error::Quantize {
                name: name.into(),
                reason: format!("shape {shape:?} does not hold {} values", values.len()),
            });
        }
        let (packed, absmax) = Self::quantize_slice(values, |x| x, config, name)?;
        Self::from_codes_and_absmax(packed, absmax, shape, dtype, config)
    }

    /// The packed codes and block absmax of `values` of any element type that `to_f32` widens exactly.
    fn quantize_slice<T: Copy + Sync>(
        values: &[T],
        to_f32: impl Fn(T) -> f32 + Sync + Copy,
        config: &QuantConfig,
        name: &str,
    ) -> Result<(Vec<u8>, Vec<f32>)> {
        cpu::quantize_4bit(
            values,
            to_f32,
            config.blocksize,
            config.quant_type,
            config.kernels,
        )
        .map_err(|i| non_finite(name, i, to_f32(values[i])))
    }

    /// The tensor of `shape` and original dtype `dtype` whose packed codes and float32 block absmax
    /// [`Nf4Tensor::quantize_blocks`] gave (or several runs of its blocks, joined in order), double-quantized as
    /// `config` says: the same tensor [`Nf4Tensor::quantize_named`] makes of the whole, bit for bit.
    pub fn from_codes_and_absmax(
        packed: Vec<u8>,
        absmax: Vec<f32>,
        shape: &[usize],
        dtype: DType,
        config: &QuantConfig,
    ) -> Result<Self> {
        config.validate()?;
        let scales = if config.double_quant {
            BlockScales::Nested(cpu::quantize_nested(&absmax, config.kernels))
        } else {
            BlockScales::Plain(absmax)
        };
        Self::from_parts(
            packed,
            scales,
            *config.quant_type.code(),
            shape.to_vec(),
            dtype,
            config.quant_type,
            config.blocksize,
        )
    }

    /// Builds a tensor from stored parts (a checkpoint), checking that they fit together.
    pub fn from_parts(
        packed: Vec<u8>,
        scales: BlockScales,
        code: [f32; 16],
        shape: Vec<usize>,
        dtype: DType,
        quant_type: QuantType,
        blocksize: usize,
    ) -> Result<Self> {
        let bad = |reason: String| Err(Error::InvalidQuantConfig(reason));
        if !ALLOWED_BLOCKSIZES.contains(&blocksize) {
            return bad(format!(
                "blocksize {blocksize} is not one of {ALLOWED_BLOCKSIZES:?}"
            ));
        }
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
            return bad(format!(
                "dtype {dtype:?} is not a float dtype bitsandbytes quantizes"
            ));
        }
        // The shape comes from a file (a bitsandbytes quant state): its product may overflow.
        let Some(n) = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d)) else {
            return bad(format!("shape {shape:?} has more elements than any tensor"));
        };
        if n == 0 {
            return bad(format!("shape {shape:?} has no elements"));
        }
        if packed.len() != n.div_ceil(2) {
            return bad(format!(
                "{} packed bytes for shape {shape:?}: expected {} (two 4-bit codes per byte)",
                packed.len(),
                n.div_ceil(2)
            ));
        }
        let n_blocks = n.div_ceil(blocksize);
        if scales.len() != n_blocks {
            return bad(format!(
                "{} absmax values for {n} elements at blocksize {blocksize}: expected {n_blocks}",
                scales.len()
            ));
        }
        if let BlockScales::Nested(nested) = &scales {
            if nested.blocksize == 0
                || nested.absmax.len() != nested.codes.len().div_ceil(nested.blocksize)
            {
                return bad(format!(
                    "{} nested absmax values for {} codes at nested blocksize {}",
                    nested.absmax.len(),
                    nested.codes.len(),
                    nested.blocksize
                ));
            }
            if nested.code.len() != 256 {
                return bad(format!(
                    "nested quant map has {} entries, expected 256",
                    nested.code.len()
                ));
            }
        }
        Ok(Nf4Tensor {
            packed,
            scales,
            code,
            shape,
            dtype,
            quant_type,
            blocksize,
            absmax_cache: AbsmaxCache::default(),
        })
    }

    /// Dequantizes to a dense CPU tensor of `dtype` (f32, f16 or bf16): `code[c] * absmax` in float32, then
    /// rounded to `dtype` (round to nearest even), bit-identical to bitsandbytes' `dequantize_4bit`.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        match dtype {
            DType::F32 => self.dequantize_as(|x| x),
            DType::BF16 => self.dequantize_as(half::bf16::from_f32),
            DType::F16 => self.dequantize_as(half::f16::from_f32),
            other => Err(Error::InvalidQuantConfig(format!(
                "cannot dequantize to {other:?}: use f32, f16 or bf16"
            ))),
        }
    }

    /// Dequantizes to a CPU tensor of element type `T`, converting each block's 16 values with `convert`.
    fn dequantize_as<T: candle_core::WithDType>(
        &self,
        convert: impl Fn(f32) -> T + Sync,
    ) -> Result<Tensor> {
        let n = self.elem_count();
        let mut out = Vec::with_capacity(n);
        self.dequantize_to(&mut out.spare_capacity_mut()[..n], convert);
        // SAFETY: `dequantize_to` wrote all `n` elements.
        unsafe { out.set_len(n) };
        Ok(Tensor::from_vec(out, self.shape.as_slice(), &Device::Cpu)?)
    }

    /// Dequantizes into a float32 buffer of [`Nf4Tensor::elem_count`] elements (no allocation for the output).
    pub fn dequantize_into(&self, out: &mut [f32]) -> Result<()> {
        if out.len() != self.elem_count() {
            return Err(Error::InvalidQuantConfig(format!(
                "output buffer holds {} values, the tensor has {}",
                out.len(),
                self.elem_count()
            )));
        }
        // SAFETY: `MaybeUninit<f32>` has `f32`'s layout, and only initialized values are written through it.
        let out = unsafe { &mut *(out as *mut [f32] as *mut [MaybeUninit<f32>]) };
        self.dequantize_to(out, |x| x);
        Ok(())
    }

    /// Writes every element of `out` (`elem_count` long): the codes through the block scales, then `convert`.
    fn dequantize_to<T: Copy + Send>(
        &self,
        out: &mut [MaybeUninit<T>],
        convert: impl Fn(f32) -> T + Sync,
    ) {
        let absmax = self.scales.to_f32();
        cpu::dequantize_4bit(
            &self.packed,
            &absmax,
            &self.code,
            self.blocksize,
            out,
            convert,
        );
    }

    /// The packed codes, `(n + 1) / 2` bytes.
    pub fn packed(&self) -> &[u8] {
        &self.packed
    }

    /// The float32 absmax of every block, as [`BlockScales::to_f32`] gives it, without a copy per call: plain
    /// scales as stored; double-quantized ones dequantized on the first call and kept with the tensor (4 bytes per
    /// block from then on, about 0.5 bit per parameter at blocksize 64). For kernels that read the scales on every
    /// call (decoding); dequantization keeps computing them per call, so training holds no extra memory.
    pub fn block_absmax(&self) -> &[f32] {
        match &self.scales {
            BlockScales::Plain(a) => a,
            BlockScales::Nested(n) => self.absmax_cache.0.get_or_init(|| n.dequantize()),
        }
    }

    /// The block scales.
    pub fn scales(&self) -> &BlockScales {
        &self.scales
    }

    /// The 16-entry codebook the codes index (`quant_map`).
    pub fn code(&self) -> &[f32; 16] {
        &self.code
    }

    /// The original shape, e.g. `[out_features, in_features]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn elem_count(&self) -> usize {
        self.shape.iter().product()
    }

    /// The original dtype (what [`Nf4Tensor::dequantize`] is usually asked for).
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// NF4 or FP4.
    pub fn quant_type(&self) -> QuantType {
        self.quant_type
    }

    /// Elements per block.
    pub fn blocksize(&self) -> usize {
        self.blocksize
    }

    /// True when the absmax values are double-quantized.
    pub fn is_double_quantized(&self) -> bool {
        matches!(self.scales, BlockScales::Nested(_))
    }

    /// How the tensor was quantized (the kernels it reproduces are not recorded: bitsandbytes' CUDA ones).
    pub fn config(&self) -> QuantConfig {
        QuantConfig {
            quant_type: self.quant_type,
            blocksize: self.blocksize,
            double_quant: self.is_double_quantized(),
            ..QuantConfig::nf4()
        }
    }

    /// Exact bytes of the quantized form as stored: packed codes, block statistics, the nested map and offset,
    /// and the 16-entry codebook.
    pub fn size_in_bytes(&self) -> usize {
        self.packed.len() + self.scales.size_in_bytes() + self.code.len() * 4
    }

    /// Storage cost in bits per parameter (≈4.127 for NF4 with double quantization at blocksize 64).
    pub fn bits_per_parameter(&self) -> f64 {
        self.size_in_bytes() as f64 * 8.0 / self.elem_count() as f64
    }
}

/// The nested blocksize bitsandbytes supports for double quantization.
pub(crate) fn check_nested_blocksize(blocksize: usize) -> std::result::Result<(), String> {
    if blocksize == NESTED_BLOCKSIZE {
        Ok(())
    } else {
        Err(format!("nested_blocksize {blocksize} is not supported: bitsandbytes always uses {NESTED_BLOCKSIZE}"))
    }
}

/// The error for tensor `name`, whose element `index` is `value`, NaN or infinite.
pub(crate) fn non_finite(name: &str, index: usize, value: f32) -> Error {
    Error::Quantize {
        name: name.into(),
        reason: format!(
            "element {index} is {value}; 4-bit blocks cannot represent NaN or infinity (fix or clip the weights first)"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::config::BnbKernels;

    fn sample(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i as f32 * 0.7318).sin() * 0.05) + if i % 97 == 0 { 0.3 } else { 0.0 })
            .collect()
    }

    #[test]
    fn nf4_double_quant_costs_4_127_bits_per_parameter() {
        let n = 4096 * 4096;
        let values = sample(n);
        let t = Nf4Tensor::quantize_values(
            &values,
            &[4096, 4096],
            DType::BF16,
            &QuantConfig::nf4(),
            "w",
        )
        .unwrap();
        // Codes, one u8 per 64-block, one f32 per 256 of those, the 256-entry nested map, offset, 16-entry codebook.
        assert_eq!(
            t.size_in_bytes(),
            n / 2 + n / 64 + 4 * n / 64 / 256 + 256 * 4 + 4 + 16 * 4
        );
        let bits = t.bits_per_parameter();
        assert!((4.127..4.128).contains(&bits), "{bits}");
        let plain = QuantConfig {
            double_quant: false,
            ..QuantConfig::nf4()
        };
        let t =
            Nf4Tensor::quantize_values(&values[..4096 * 64], &[64, 4096], DType::BF16, &plain, "w")
                .unwrap();
        assert_eq!(
            t.size_in_bytes(),
            4096 * 64 / 2 + 4096 * 64 / 64 * 4 + 16 * 4
        );
    }

    #[test]
    fn dequantized_error_is_bounded_by_half_the_widest_code_gap() {
        let values = sample(1000);
        for quant_type in [QuantType::Nf4, QuantType::Fp4] {
            for kernels in [BnbKernels::Cuda, BnbKernels::Cpu] {
                let cfg = QuantConfig {
                    quant_type,
                    blocksize: 64,
                    double_quant: false,
                    kernels,
                };
                let t =
                    Nf4Tensor::quantize_values(&values, &[10, 100], DType::F32, &cfg, "w").unwrap();
                let back = t
                    .dequantize(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap();
                let absmax = t.scales().to_f32();
                for (i, (a, b)) in values.iter().zip(&back).enumerate() {
                    // Widest gap: NF4 0.28 (0.72..1.0), FP4 0.333 (0.667..1.0).
                    assert!(
                        (a - b).abs() <= 0.17 * absmax[i / 64] + 1e-7,
                        "{quant_type} {i}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn rejects_bad_input_with_clear_errors() {
        let cfg = QuantConfig {
            blocksize: 48,
            ..QuantConfig::nf4()
        };
        let err = Nf4Tensor::quantize_values(&[1.0; 4], &[4], DType::F32, &cfg, "w").unwrap_err();
        assert!(
            err.to_string().contains("blocksize 48 is not allowed"),
            "{err}"
        );
        let err = Nf4Tensor::quantize_values(
            &[1.0, f32::NAN],
            &[2],
            DType::F32,
            &QuantConfig::nf4(),
            "layer.weight",
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("layer.weight") && err.to_string().contains("NaN"),
            "{err}"
        );
        let err = Nf4Tensor::quantize_values(
            &[1.0, f32::INFINITY],
            &[2],
            DType::F32,
            &QuantConfig::nf4(),
            "w",
        )
        .unwrap_err();
        assert!(err.to_string().contains("inf"), "{err}");
        let err =
            Nf4Tensor::quantize_values(&[1.0; 3], &[2, 2], DType::F32, &QuantConfig::nf4(), "w")
                .unwrap_err();
        assert!(err.to_string().contains("does not hold"), "{err}");
        let int = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        assert!(Nf4Tensor::quantize(&int, &QuantConfig::nf4()).is_err());
    }

    #[test]
    fn from_parts_checks_consistency() {
        let t = Nf4Tensor::quantize_values(
            &sample(128),
            &[2, 64],
            DType::F32,
            &QuantConfig::nf4(),
            "w",
        )
        .unwrap();
        let err = Nf4Tensor::from_parts(
            t.packed()[1..].to_vec(),
            t.scales().clone(),
            *t.code(),
            vec![2, 64],
            DType::F32,
            QuantType::Nf4,
            64,
        )
        .unwrap_err();
        assert!(err.to_string().contains("packed bytes"), "{err}");
        let rebuilt = Nf4Tensor::from_parts(
            t.packed().to_vec(),
            t.scales().clone(),
            *t.code(),
            vec![2, 64],
            DType::F32,
            QuantType::Nf4,
            64,
        )
        .unwrap();
        assert_eq!(rebuilt, t);
    }
}
