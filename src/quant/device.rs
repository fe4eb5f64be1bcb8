//! [`DeviceNf4`]: a 4-bit weight whose codes and statistics live on a device (a CUDA GPU), dequantized there — by
//! one kernel (`kernels/dequant.cu`) on CUDA, by tensor ops elsewhere.
//!
//! The dequantization is the CPU kernel's arithmetic, step for step: `code[c] · absmax` in float32 (with a nested
//! absmax first rebuilt as `map[c8] · absmax₂ + offset`), then rounded to the compute dtype. Each step is one
//! float32 multiply or add, so the result is bit-identical to [`Nf4Tensor::dequantize`] on any device (the tensor-op
//! form is tested on the CPU, where both run; the kernel in the `cuda` tests).
//!
//! [`quantize_blocks_on`] goes the other way on a device: a run of blocks quantized by one kernel with the CPU
//! kernel's arithmetic (what a rank of a sharded load does with its part of a weight).

use candle_core::{DType, Device, Tensor};

use super::config::QuantConfig;
#[cfg(feature = "cuda")]
use super::cpu::CodeSelector;
use super::cpu::NestedAbsmax;
use super::tensor::{BlockScales, Nf4Tensor};
use crate::error::Result;

/// The per-block scales on the device.
#[derive(Clone, Debug)]
enum DeviceScales {
    /// One float32 absmax per block.
    Plain(Tensor),
    /// Double quantization: 8-bit codes per block, one float32 scale per `blocksize` codes, the 256-entry map and
    /// the offset.
    Nested {
        codes: Tensor,
        absmax: Tensor,
        map: Tensor,
        offset: f32,
        blocksize: usize,
    },
}

/// A 4-bit weight resident on a device: packed codes (one byte per two elements) and block statistics, the same
/// bytes as the [`Nf4Tensor`] it was made from.
#[derive(Clone, Debug)]
pub struct DeviceNf4 {
    /// Packed codes, u8 `[ceil(n / 2)]`.
    packed: Tensor,
    /// The 16 float32 code values (the dequantization kernel's table).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    code: Tensor,
    /// For every byte value, the two float32 values of its codes: `[256, 2]` (high nibble first).
    pairs: Tensor,
    scales: DeviceScales,
    shape: Vec<usize>,
    /// The dtype the weight was quantized from (bitsandbytes' `quant_state.dtype`).
    dtype: DType,
    bytes: usize,
    config: QuantConfig,
}

/// `values` (one per element, `[n]`) times `scale` (one per `block` elements, `[ceil(n / block)]`), as float32.
fn scale_blocks(values: &Tensor, scale: &Tensor, block: usize) -> Result<Tensor> {
    let n = values.dim(0)?;
    let blocks = scale.dim(0)?;
    let padded = blocks * block;
    let values = if padded > n {
        values.pad_with_zeros(0, 0, padded - n)?
    } else {
        values.clone()
    };
    let scaled = values
        .reshape((blocks, block))?
        .broadcast_mul(&scale.reshape((blocks, 1))?)?
        .flatten_all()?;
    Ok(if padded > n {
        scaled.narrow(0, 0, n)?
    } else {
        scaled
    })
}

/// Launches kernel `{base}_plain{suffix}` or `{base}_nested{suffix}` of `module` (as the weight's scales are) with
/// `lead` arguments, then the packed codes, the code book and the scales — the order every 4-bit kernel takes them
/// in — then `tail`. A macro rather than a function: the held views must outlive the launch arguments borrowing them.
#[cfg(feature = "cuda")]
macro_rules! launch_4bit {
    ($q:expr, $device:expr, $module:expr, $base:literal, $dtype:expr, $cfg:expr, [$($lead:expr),*], [$($tail:expr),*]) => {{
        use crate::cuda::{hold, kernel, run, suffix};
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        let q = $q;
        let (packed, code) = (hold(&q.packed)?, hold(&q.code)?);
        let (packed, code) = (packed.view::<u8>()?, code.view::<f32>()?);
        let blocksize = q.config.blocksize as u64;
        match &q.scales {
            DeviceScales::Plain(absmax) => {
                let absmax = hold(absmax)?;
                let absmax = absmax.view::<f32>()?;
                let name = format!(concat!($base, "_plain{}"), suffix($dtype)?);
                let func = kernel($device, $module, &name)?;
                let mut args = func.builder();
                $(args.arg($lead);)*
                args.arg(&packed).arg(&code).arg(&absmax).arg(&blocksize);
                $(args.arg($tail);)*
                run(&mut args, $cfg)?;
            }
            DeviceScales::Nested { codes, absmax, map, offset, blocksize: nested } => {
                let (codes, absmax, map) = (hold(codes)?, hold(absmax)?, hold(map)?);
                let (codes, absmax, map) = (codes.view::<u8>()?, absmax.view::<f32>()?, map.view::<f32>()?);
                let nested = *nested as u64;
                let name = format!(concat!($base, "_nested{}"), suffix($dtype)?);
                let func = kernel($device, $module, &name)?;
                let mut args = func.builder();
                $(args.arg($lead);)*
                args.arg(&packed).arg(&code).arg(&absmax).arg(&codes).arg(&map).arg(offset);
                args.arg(&blocksize).arg(&nested);
                $(args.arg($tail);)*
                run(&mut args, $cfg)?;
            }
        }
    }};
}

/// [`Nf4Tensor::quantize_blocks`] of `values` (1-D float32, bfloat16 or float16, not empty) on `device`: the packed
/// codes (u8) and the float32 absmax of each block, as 1-D tensors there. On a CUDA device one kernel
/// (`kernels/dequant.cu`) quantizes them with the CPU kernel's arithmetic, so they are its bytes; elsewhere the CPU
/// kernel does. `name` names the tensor in errors.
pub fn quantize_blocks_on(
    values: &Tensor,
    device: &Device,
    config: &QuantConfig,
    name: &str,
) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if device.is_cuda()
        && values.elem_count() > 0
        && matches!(values.dtype(), DType::F32 | DType::BF16 | DType::F16)
    {
        config.validate()?;
        let values = values.to_device(device)?.contiguous()?;
        return quantize_blocks_cuda(&values, config, name);
    }
    let (packed, absmax) = Nf4Tensor::quantize_blocks(values, config, name)?;
    let (bytes, blocks) = (packed.len(), absmax.len());
    Ok((
        Tensor::from_vec(packed, bytes, device)?,
        Tensor::from_vec(absmax, blocks, device)?,
    ))
}

/// [`quantize_blocks_on`] by the kernel, `values` on a CUDA device.
#[cfg(feature = "cuda")]
fn quantize_blocks_cuda(
    values: &Tensor,
    config: &QuantConfig,
    name: &str,
) -> Result<(Tensor, Tensor)> {
    use super::config::BnbKernels;
    use crate::cuda::{
        alloc, device_of, grid, hold, kernel, run, suffix, tensor, with_float_type, DEQUANT,
    };
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;

    let device = device_of(values)?;
    let n = values.elem_count();
    let blocks = n.div_ceil(config.blocksize);
    let selector = CodeSelector::new(config.quant_type, config.kernels);
    let thresholds = device.clone_htod(&selector.thresholds[..])?;
    let remap = device.clone_htod(&selector.remap[..])?;
    let mut first_bad = device.clone_htod(&[i64::MAX][..])?;
    let mut packed = alloc::<u8>(&device, n.div_ceil(2))?;
    let mut absmax = alloc::<f32>(&device, blocks)?;
    let n_thresholds = selector.thresholds.len() as i32;
    let sign_magnitude = i32::from(selector.sign_magnitude);
    let cpu_scaling = i32::from(config.kernels == BnbKernels::Cpu);
    let (blocksize, count) = (config.blocksize as u64, n as u64);
    let held = hold(values)?;
    let func = kernel(
        &device,
        &DEQUANT,
        &format!("quant_4bit{}", suffix(values.dtype())?),
    )?;
    let mut launch = || -> candle_core::Result<()> {
        with_float_type!(values.dtype(), T => {
            let x = held.view::<T>()?;
            let mut args = func.builder();
            args.arg(&x).arg(&thresholds).arg(&remap).arg(&n_thresholds);
            args.arg(&sign_magnitude).arg(&cpu_scaling).arg(&blocksize).arg(&count);
            args.arg(&mut packed).arg(&mut absmax).arg(&mut first_bad);
            run(&mut args, grid(blocks as u64))
        })
    };
    launch()?;
    let first_bad = device.clone_dtoh(&first_bad)?[0];
    if first_bad != i64::MAX {
        let at = first_bad as usize;
        let value = values
            .narrow(0, at, 1)?
            .to_dtype(DType::F32)?
            .to_vec1::<f32>()?[0];
        return Err(super::tensor::non_finite(name, at, value));
    }
    Ok((
        tensor(packed, &device, n.div_ceil(2)),
        tensor(absmax, &device, blocks),
    ))
}

impl DeviceNf4 {
    /// Rows of `x` the decoding product (`matvec`, with the `cuda` feature) takes at most: the kernel keeps one sum
    /// per row in registers.
    pub const MATVEC_MAX_ROWS: usize = 8;

    /// Copies `q`'s codes and statistics to `device`.
    pub fn new(q: &Nf4Tensor, device: &Device) -> Result<Self> {
        let code = q.code();
        let pairs: Vec<f32> = (0..256usize)
            .flat_map(|b| [code[b >> 4], code[b & 15]])
            .collect();
        let scales = match q.scales() {
            BlockScales::Plain(a) => DeviceScales::Plain(Tensor::from_slice(a, a.len(), device)?),
            BlockScales::Nested(n) => DeviceScales::Nested {
                codes: Tensor::from_slice(&n.codes, n.codes.len(), device)?,
                absmax: Tensor::from_slice(&n.absmax, n.absmax.len(), device)?,
                map: Tensor::from_slice(&n.code, n.code.len(), device)?,
                offset: n.offset,
                blocksize: n.blocksize,
            },
        };
        Ok(DeviceNf4 {
            packed: Tensor::from_slice(q.packed(), q.packed().len(), device)?,
            code: Tensor::from_slice(code, 16, device)?,
            pairs: Tensor::from_vec(pairs, (256, 2), device)?,
            scales,
            shape: q.shape().to_vec(),
            dtype: q.dtype(),
            bytes: q.size_in_bytes(),
            config: q.config(),
        })
    }

    /// The tensors whose size grows with the weight's — the packed codes, then the block scales (the float32
    /// absmax; or the 8-bit codes, then their float32 scales) — each 1-D, in the order [`DeviceNf4::with_storage`]
    /// takes them. The rest (code tables, the nested map and offset) is a few hundred bytes: a sharded weight keeps
    /// it whole, in its [`DeviceNf4::frame`].
    pub fn storage(&self) -> Vec<Tensor> {
        let mut parts = vec![self.packed.clone()];
        match &self.scales {
            DeviceScales::Plain(absmax) => parts.push(absmax.clone()),
            DeviceScales::Nested { codes, absmax, .. } => {
                parts.extend([codes.clone(), absmax.clone()])
            }
        }
        parts
    }

    /// This weight without its [`DeviceNf4::storage`] (left empty, on the host): what a rank keeps beside its share
    /// of the storage, to rebuild the weight from the gathered storage with [`DeviceNf4::with_storage`]. A frame
    /// only rebuilds: it computes nothing.
    pub fn frame(&self) -> Result<Self> {
        let empty = |t: &Tensor| Tensor::zeros(0, t.dtype(), &Device::Cpu);
        let scales = match &self.scales {
            DeviceScales::Plain(absmax) => DeviceScales::Plain(empty(absmax)?),
            DeviceScales::Nested {
                codes,
                absmax,
                map,
                offset,
                blocksize,
            } => DeviceScales::Nested {
                codes: empty(codes)?,
                absmax: empty(absmax)?,
                map: map.clone(),
                offset: *offset,
                blocksize: *blocksize,
            },
        };
        Ok(DeviceNf4 {
            packed: empty(&self.packed)?,
            scales,
            ..self.clone()
        })
    }

    /// The weight of this frame (see [`DeviceNf4::frame`]) with `parts` as its storage: as many tensors, of the
    /// lengths and dtypes [`DeviceNf4::storage`] gives, on the frame's device.
    pub fn with_storage(&self, parts: Vec<Tensor>) -> Result<Self> {
        let n: usize = self.shape.iter().product();
        let blocks = n.div_ceil(self.config.blocksize);
        let mut expected = vec![(n.div_ceil(2), DType::U8)];
        match &self.scales {
            DeviceScales::Plain(_) => expected.push((blocks, DType::F32)),
            DeviceScales::Nested { blocksize, .. } => expected.extend([
                (blocks, DType::U8),
                (blocks.div_ceil(*blocksize), DType::F32),
            ]),
        }
        let got: Vec<(usize, DType)> = parts.iter().map(|t| (t.elem_count(), t.dtype())).collect();
        if got != expected {
            return Err(crate::error::Error::InvalidQuantConfig(format!(
                "the storage of a {:?} 4-bit weight is {expected:?} (elements, dtype), not {got:?}",
                self.shape
            )));
        }
        let mut parts = parts.into_iter();
        let mut next = || parts.next().expect("checked above").flatten_all();
        let packed = next()?;
        let scales = match &self.scales {
            DeviceScales::Plain(_) => DeviceScales::Plain(next()?),
            DeviceScales::Nested {
                map,
                offset,
                blocksize,
                ..
            } => DeviceScales::Nested {
                codes: next()?,
                absmax: next()?,
                map: map.clone(),
                offset: *offset,
                blocksize: *blocksize,
            },
        };
        Ok(DeviceNf4 {
            packed,
            scales,
            ..self.clone()
        })
    }

    /// The weight as an [`Nf4Tensor`] on the host: the same bytes.
    pub fn to_host(&self) -> Result<Nf4Tensor> {
        let mut code = [0f32; 16];
        code.copy_from_slice(&self.code.to_vec1::<f32>()?);
        let scales = match &self.scales {
            DeviceScales::Plain(absmax) => BlockScales::Plain(absmax.to_vec1()?),
            DeviceScales::Nested {
                codes,
                absmax,
                map,
                offset,
                blocksize,
            } => BlockScales::Nested(NestedAbsmax {
                codes: codes.to_vec1()?,
                absmax: absmax.to_vec1()?,
                code: map.to_vec1()?,
                offset: *offset,
                blocksize: *blocksize,
            }),
        };
        Nf4Tensor::from_parts(
            self.packed.to_vec1()?,
            scales,
            code,
            self.shape.clone(),
            self.dtype,
            self.config.quant_type,
            self.config.blocksize,
        )
    }

    /// How the weight was quantized.
    pub fn config(&self) -> QuantConfig {
        self.config
    }

    /// The dense weight as `dtype` (f32, f16 or bf16) on the device, bit-identical to [`Nf4Tensor::dequantize`].
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.packed.device().is_cuda() && crate::cuda::fused_kernels() {
            return match dtype {
                DType::F32 => self.dequantize_cuda::<f32>(dtype),
                DType::BF16 => self.dequantize_cuda::<half::bf16>(dtype),
                DType::F16 => self.dequantize_cuda::<half::f16>(dtype),
                other => Ok(self.dequantize_cuda::<f32>(DType::F32)?.to_dtype(other)?),
            };
        }
        let n: usize = self.shape.iter().product();
        let absmax = match &self.scales {
            DeviceScales::Plain(a) => a.clone(),
            DeviceScales::Nested {
                codes,
                absmax,
                map,
                offset,
                blocksize,
            } => {
                let mapped = map.index_select(&codes.to_dtype(DType::U32)?, 0)?;
                (scale_blocks(&mapped, absmax, *blocksize)? + f64::from(*offset))?
            }
        };
        // u32 indices: Candle reads the largest value of an index type (255 for u8) as "no row" (zeros).
        let values = self
            .pairs
            .index_select(&self.packed.to_dtype(DType::U32)?, 0)?
            .flatten_all()?;
        let values = if values.dim(0)? > n {
            values.narrow(0, 0, n)?
        } else {
            values
        };
        let dense = scale_blocks(&values, &absmax, self.config.blocksize)?;
        Ok(dense.reshape(self.shape.as_slice())?.to_dtype(dtype)?)
    }

    /// [`DeviceNf4::dequantize`] by one kernel, into a new buffer of `T`.
    #[cfg(feature = "cuda")]
    fn dequantize_cuda<T>(&self, dtype: DType) -> Result<Tensor>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    {
        use crate::cuda::{alloc, device_of, grid, tensor, DEQUANT};

        let n: usize = self.shape.iter().product();
        let device = device_of(&self.packed)?;
        let mut out = alloc::<T>(&device, n)?;
        let count = n as u64;
        launch_4bit!(
            self,
            &device,
            &DEQUANT,
            "dequant_4bit",
            dtype,
            grid(count.div_ceil(2)),
            [],
            [&count, &mut out]
        );
        Ok(tensor(out, &device, self.shape.as_slice()))
    }

    /// `x·Wᵀ` for a few rows of `x` (`[rows, in_features]`, a decoding step) from the 4-bit codes on a CUDA device,
    /// without a dequantized copy of the weight: `[rows, out_features]` in `x`'s dtype (f32, bf16 or f16), each
    /// weight decoded as [`DeviceNf4::dequantize`] decodes it and the products summed in float32.
    #[cfg(feature = "cuda")]
    pub fn matvec(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        use crate::cuda::{alloc, device_of, tensor, with_float_type};
        let (rows, out) = (x.dim(0)?, self.shape[0]);
        let device = device_of(x)?;
        Ok(with_float_type!(x.dtype(), T => {
            let mut y = alloc::<T>(&device, rows * out)?;
            self.matvec_into(x, &mut y)?;
            tensor(y, &device, (rows, out))
        }))
    }

    /// [`DeviceNf4::matvec`] into `y` (`rows · out_features` elements of `x`'s dtype).
    #[cfg(feature = "cuda")]
    pub(crate) fn matvec_into<T>(
        &self,
        x: &Tensor,
        y: &mut candle_core::cuda_backend::cudarc::driver::CudaSlice<T>,
    ) -> candle_core::Result<()>
    where
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    {
        use crate::cuda::{device_of, hold, NF4_MATVEC};
        use candle_core::cuda_backend::cudarc::driver::LaunchConfig;
        let (rows, inp) = x.dims2()?;
        let out = self.shape[0];
        if self.shape.len() != 2
            || inp != self.shape[1]
            || rows > Self::MATVEC_MAX_ROWS
            || y.len() != rows * out
        {
            candle_core::bail!(
                "4-bit matrix-vector product: {rows} rows of {inp} features (at most {}) with a {:?} weight",
                Self::MATVEC_MAX_ROWS,
                self.shape
            );
        }
        let x = x.contiguous()?;
        let dtype = x.dtype();
        let device = device_of(&x)?;
        // One warp per output feature, 8 a block.
        let cfg = LaunchConfig {
            grid_dim: ((out as u64).div_ceil(8).clamp(1, 65_535 * 4) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let xh = hold(&x)?;
        let xv = xh.view::<T>()?;
        let sizes = [rows as u64, out as u64, inp as u64];
        launch_4bit!(
            self,
            &device,
            &NF4_MATVEC,
            "nf4_matvec",
            dtype,
            cfg,
            [&xv],
            [&sizes[0], &sizes[1], &sizes[2], y]
        );
        Ok(())
    }

    /// `[out_features, in_features]`.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The device the codes live on.
    pub fn device(&self) -> &Device {
        self.packed.device()
    }

    /// Bytes of codes and statistics (as [`Nf4Tensor::size_in_bytes`]).
    pub fn size_in_bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::config::{QuantConfig, QuantType};

    /// Both quant types, plain and nested scales, sizes that leave partial blocks: the tensor-op dequantization
    /// equals the CPU kernel bit for bit in every output dtype.
    #[test]
    fn equals_the_cpu_kernel_bit_for_bit() {
        for (quant_type, double_quant, n) in [
            (QuantType::Nf4, true, 64 * 300 + 37),
            (QuantType::Nf4, false, 128 * 5),
            (QuantType::Fp4, true, 64 * 513),
        ] {
            let w = Tensor::randn(0f32, 1.0, (1, n), &Device::Cpu).unwrap();
            let config = QuantConfig {
                quant_type,
                double_quant,
                ..QuantConfig::nf4()
            };
            let q = Nf4Tensor::quantize(&w, &config).unwrap();
            let on_device = DeviceNf4::new(&q, &Device::Cpu).unwrap();
            assert_eq!(on_device.size_in_bytes(), q.size_in_bytes());
            for dtype in [DType::F32, DType::BF16, DType::F16] {
                let want = q.dequantize(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let got = on_device
                    .dequantize(dtype)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                let (want, got) = (
                    want.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                    got.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                );
                assert!(
                    want.iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{quant_type:?} double={double_quant} n={n} {dtype:?}"
                );
            }
        }
    }
}
