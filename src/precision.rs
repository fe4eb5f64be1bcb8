//! Floating-point types: their PyTorch names ([`TorchDtype`], as configs and checkpoints write them), and the
//! autocast policy — which dtype activations and matmuls run in, the way PEFT + transformers' autocast behave.
//!
//! - `bf16` / `fp16`: frozen base weights are dequantized to that dtype and matmuls run in it; RMSNorm, softmax
//!   and the loss are computed in float32 inside their ops; LoRA master weights and optimizer math stay float32.
//! - neither: everything in float32, the default on CPU, where Candle widens bf16 matmuls to f32 and gains no
//!   speed. Asking for bf16 on CPU works (and says so once).
//! - a model loaded with compute dtype float64 (`LoadOptions::compute_dtype`, CPU): everything in float64 — RoPE,
//!   norms, softmax, the loss, the LoRA masters and AdamW's state too, with none of the float32 steps transformers
//!   keeps. The tests compare it with PyTorch references run the same way, where float32 rounding (and the CPU's
//!   choice of matrix kernels) cannot decide a result.

use std::sync::Once;

use candle_core::{DType, Device};

use crate::error::{Error, Result};
use crate::names::named_enum;

named_enum! {
    /// A float dtype by PyTorch's name (`torch_dtype`, `bnb_4bit_compute_dtype`, bitsandbytes' quant state).
    pub enum TorchDtype ("dtype") {
        /// `torch.bfloat16`.
        BFloat16 = "bfloat16",
        /// `torch.float16`.
        Float16 = "float16",
        /// `torch.float32`.
        Float32 = "float32",
    }
}

impl TorchDtype {
    /// Candle's dtype.
    pub fn dtype(self) -> DType {
        match self {
            TorchDtype::BFloat16 => DType::BF16,
            TorchDtype::Float16 => DType::F16,
            TorchDtype::Float32 => DType::F32,
        }
    }

    /// The name of a Candle float dtype (anything else is written as float32, the dtype it is computed in).
    pub fn of(dtype: DType) -> Self {
        match dtype {
            DType::BF16 => TorchDtype::BFloat16,
            DType::F16 => TorchDtype::Float16,
            _ => TorchDtype::Float32,
        }
    }
}

/// The compute-dtype policy of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Precision {
    /// Dtype of activations and base matmuls.
    pub compute_dtype: DType,
}

/// The dtype of what is kept at float32 or better whatever the compute dtype — trainable (LoRA) master weights,
/// their gradients and optimizer state, logits and losses, the arithmetic of the ops' composed paths — for a model
/// computing in `compute_dtype`: float32, or float64 for a float64 model (the reference runs compared with
/// PyTorch's float64 results).
pub fn master_dtype(compute_dtype: DType) -> DType {
    if compute_dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

static CPU_BF16_NOTE: Once = Once::new();

impl Precision {
    /// Float32 everywhere.
    pub fn f32() -> Self {
        Precision {
            compute_dtype: DType::F32,
        }
    }

    /// The policy for `TrainingArguments`' `bf16`/`fp16` flags on `device`. Without either flag, a GPU computes
    /// in `quant_compute` (`bnb_4bit_compute_dtype` of a 4-bit model) when given, as bitsandbytes' 4-bit layers
    /// do; the CPU computes in float32.
    pub fn from_flags(
        bf16: bool,
        fp16: bool,
        quant_compute: Option<DType>,
        device: &Device,
    ) -> Result<Self> {
        let compute_dtype = match (bf16, fp16) {
            (true, true) => {
                return Err(Error::InvalidInput(
                    "bf16 and fp16 are both set: choose one (bf16 is the QLoRA default)".into(),
                ))
            }
            (true, false) => DType::BF16,
            (false, true) => DType::F16,
            (false, false) => match quant_compute {
                Some(dtype) if !device.is_cpu() => dtype,
                _ => DType::F32,
            },
        };
        #[cfg(feature = "cuda")]
        if let Device::Cuda(gpu) = device {
            check_gpu_dtype(gpu, compute_dtype)?;
        }
        if device.is_cpu() && compute_dtype != DType::F32 {
            // The flag that asked for it (on the CPU only the flags pick a half-precision dtype).
            let flag = if fp16 { "fp16" } else { "bf16" };
            CPU_BF16_NOTE.call_once(|| {
                eprintln!(
                    "note: {compute_dtype:?} compute on CPU is correct but not faster than f32 (Candle widens \
                     half-precision matmuls to f32 on CPU); set {flag} = false for the fastest CPU run"
                )
            });
        }
        Ok(Precision { compute_dtype })
    }
}

/// The device a command computes on: CUDA GPU `ordinal` when this build has the `cuda` feature, a GPU answers and
/// `use_cpu` is off; otherwise the CPU, with a note on stderr naming `what` ("training", "computing") when a GPU was
/// wanted but none answered. A GPU that answers but cannot run this build's kernels (too old a driver or compute
/// capability) is an error saying what to do.
pub fn select_device(use_cpu: bool, ordinal: usize, what: &str) -> Result<Device> {
    if use_cpu || !cfg!(feature = "cuda") {
        return Ok(Device::Cpu);
    }
    match Device::new_cuda(ordinal) {
        Ok(device) => {
            #[cfg(feature = "cuda")]
            {
                crate::cuda::check_device(device.as_cuda_device()?)?;
                check_gpu_capability(device.as_cuda_device()?)?;
            }
            Ok(device)
        }
        Err(e) => {
            eprintln!("note: no CUDA GPU answered ({e}); {what} on the CPU");
            Ok(Device::Cpu)
        }
    }
}

/// Why a GPU of compute capability `device` (major · 10 + minor) running kernels built for compute `build` cannot
/// compute in `dtype`, or `None` when it can: bfloat16 tensor cores start at 8.0 (A100, A10, L4, RTX 30xx), so a
/// T4 or V100 — and a build for one (`CUDA_COMPUTE_CAP=75`, which leaves the bf16 kernels out) — trains in float16
/// or float32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decision is unit-tested in every build
pub(crate) fn gpu_dtype_problem(dtype: DType, device: u32, build: u32) -> Option<String> {
    const FP16: &str =
        "train in float16 instead ([training] fp16 = true, bf16 = false; [model.quantization] \
                        bnb_4bit_compute_dtype = \"float16\")";
    if dtype != DType::BF16 {
        None
    } else if device < 80 {
        Some(format!(
            "compute capability {}.{}: bfloat16 needs 8.0 or later (A100, A10, L4, RTX 30xx and newer); {FP16}",
            device / 10,
            device % 10
        ))
    } else if build < 80 {
        Some(format!(
            "this build's kernels target compute {}.{} (CUDA_COMPUTE_CAP), which has no bfloat16 tensor cores, so it \
             has no bfloat16 attention: {FP16}, or use the default build",
            build / 10,
            build % 10
        ))
    } else {
        None
    }
}

/// Why a GPU of compute capability `device` (major · 10 + minor) cannot run kernels built for compute `build`, or
/// `None` when it can: PTX runs on its target generation and later ones, so a build for the GPU's own capability
/// runs there — from compute 7.0 on, as the attention kernels use tensor cores (WMMA), which older GPUs lack and
/// which no build for them compiles.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))] // the decision is unit-tested in every build
pub(crate) fn gpu_capability_problem(device: u32, build: u32) -> Option<String> {
    let (major, minor) = (device / 10, device % 10);
    if device >= build {
        None
    } else if device < 70 {
        Some(format!(
            "compute capability {major}.{minor}: this crate's GPU kernels need tensor cores, from compute 7.0 on \
             (V100, T4 and newer), and no build targets older GPUs; train on the CPU ([training] use_cpu = true) or \
             on a newer GPU"
        ))
    } else {
        Some(format!(
            "compute capability {major}.{minor}, but this build has kernels for compute {}.{} and later only: \
             rebuild with CUDA_COMPUTE_CAP={device} (scripts/build-cuda.sh; docs/gpu.md, \"GPU builds\")",
            build / 10,
            build % 10
        ))
    }
}

/// Whether `device` computes in bfloat16 with this build's kernels, as `torch.cuda.is_bf16_supported()` answers:
/// always on the CPU; on a GPU, from compute capability 8.0 in a build for it (not a `CUDA_COMPUTE_CAP=75` one).
/// A program picks `bf16` where this holds and `fp16` elsewhere (a T4).
pub fn is_bf16_supported(device: &Device) -> bool {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(gpu) => check_gpu_dtype(gpu, DType::BF16).is_ok(),
        _ => true,
    }
}

/// Whether `gpu` can compute in `dtype` with this build's kernels ([`gpu_dtype_problem`]); an error that says what
/// to use instead otherwise.
#[cfg(feature = "cuda")]
fn check_gpu_dtype(gpu: &candle_core::CudaDevice, dtype: DType) -> Result<()> {
    let context = gpu.cuda_stream().context().clone();
    let (major, minor) = context
        .compute_capability()
        .map_err(candle_core::Error::wrap)?;
    let build = crate::cuda::BUILD_COMPUTE_CAP.parse().unwrap_or(0);
    match gpu_dtype_problem(dtype, (major * 10 + minor) as u32, build) {
        Some(problem) => Err(Error::InvalidInput(format!(
            "GPU {} ({}): {problem}",
            context.ordinal(),
            context.name().unwrap_or_else(|_| "?".into())
        ))),
        None => Ok(()),
    }
}

/// Whether `gpu` runs this build's kernels ([`gpu_capability_problem`]); an error that says what to build or use
/// instead otherwise.
#[cfg(feature = "cuda")]
pub(crate) fn check_gpu_capability(gpu: &candle_core::CudaDevice) -> Result<()> {
    let context = gpu.cuda_stream().context().clone();
    let (major, minor) = context
        .compute_capability()
        .map_err(candle_core::Error::wrap)?;
    let build = crate::cuda::BUILD_COMPUTE_CAP.parse().unwrap_or(0);
    match gpu_capability_problem((major * 10 + minor) as u32, build) {
        Some(problem) => Err(Error::InvalidInput(format!(
            "GPU {} ({}): {problem}",
            context.ordinal(),
            context.name().unwrap_or_else(|_| "?".into())
        ))),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bfloat16_needs_compute_8_on_the_gpu_and_in_the_build() {
        assert_eq!(gpu_dtype_problem(DType::BF16, 80, 80), None);
        assert_eq!(gpu_dtype_problem(DType::BF16, 90, 80), None);
        assert_eq!(gpu_dtype_problem(DType::F16, 75, 75), None);
        assert_eq!(gpu_dtype_problem(DType::F32, 70, 70), None);
        let t4 = gpu_dtype_problem(DType::BF16, 75, 75).unwrap();
        assert!(t4.contains("7.5") && t4.contains("fp16 = true"), "{t4}");
        let t4_build = gpu_dtype_problem(DType::BF16, 86, 75).unwrap();
        assert!(
            t4_build.contains("compute 7.5") && t4_build.contains("fp16 = true"),
            "{t4_build}"
        );
    }

    #[test]
    fn a_gpu_older_than_the_build_is_told_a_build_that_compiles_for_it() {
        assert_eq!(gpu_capability_problem(80, 80), None);
        assert_eq!(gpu_capability_problem(90, 80), None);
        assert_eq!(gpu_capability_problem(75, 75), None);
        // A V100 under the default build: PTX for 7.0 runs there (7.5's, the T4 build's, does not).
        let v100 = gpu_capability_problem(70, 80).unwrap();
        assert!(v100.contains("rebuild with CUDA_COMPUTE_CAP=70"), "{v100}");
        // A P100: no CUDA_COMPUTE_CAP compiles the tensor-core kernels for compute 6.0, so no rebuild is advised.
        let p100 = gpu_capability_problem(60, 80).unwrap();
        assert!(
            !p100.contains("CUDA_COMPUTE_CAP") && p100.contains("use_cpu = true"),
            "{p100}"
        );
    }

    #[test]
    fn flags_map_to_compute_dtypes() {
        let cpu = Device::Cpu;
        assert_eq!(
            Precision::from_flags(false, false, None, &cpu)
                .unwrap()
                .compute_dtype,
            DType::F32
        );
        assert_eq!(
            Precision::from_flags(true, false, None, &cpu)
                .unwrap()
                .compute_dtype,
            DType::BF16
        );
        assert_eq!(
            Precision::from_flags(false, true, None, &cpu)
                .unwrap()
                .compute_dtype,
            DType::F16
        );
        // bnb_4bit_compute_dtype applies on a GPU only: the CPU stays in float32.
        assert_eq!(
            Precision::from_flags(false, false, Some(DType::BF16), &cpu)
                .unwrap()
                .compute_dtype,
            DType::F32
        );
        assert!(Precision::from_flags(true, true, None, &cpu)
            .unwrap_err()
            .to_string()
            .contains("choose one"));
    }
}
