//! # candle-qlora
//!
//! QLoRA fine-tuning of Llama-family models on [Candle](https://github.com/huggingface/candle), interchangeable
//! with the Python stack people use today (transformers + PEFT + bitsandbytes).
//!
//! What is here today:
//!
//! - [`quant`]: NF4/FP4 quantization bit-identical to bitsandbytes (and its checkpoint layout in
//!   [`loading::bnb`]).
//! - [`ops`]: differentiable ops with hand-written backward passes (frozen 4-bit linear, RMSNorm, RoPE,
//!   grouped-query attention, SwiGLU, fused linear cross-entropy) and gradient checkpointing.
//! - [`models`] + [`loading`]: one Llama-family model (Llama, Mistral, Qwen2, SmolLM2) from HF folders, GGUF files,
//!   bitsandbytes folders or the Hub, with generation.
//! - [`lora`] + [`adapter`]: LoRA/DoRA adapters that are PEFT adapters, several per model, and merging.
//! - [`optim`]: AdamW (torch and bitsandbytes 8-bit/32-bit semantics), SGD, transformers' schedules, clipping.
//!
//! Quantizing a weight:
//!
//! ```
//! use candle_core::{Device, DType, Tensor};
//! use candle_qlora::quant::{Nf4Tensor, QuantConfig};
//!
//! let w = Tensor::randn(0f32, 0.02, (2048, 2048), &Device::Cpu)?;
//! let q = Nf4Tensor::quantize(&w, &QuantConfig::nf4())?;      // NF4, double quant, blocksize 64
//! assert!((q.bits_per_parameter() - 4.127).abs() < 0.01);
//! let back = q.dequantize(DType::F32)?;                        // same values bitsandbytes' dequantize_4bit gives
//! assert_eq!(back.dims(), &[2048, 2048]);
//! # Ok::<(), candle_qlora::Error>(())
//! ```
//!
//! One training step of a QLoRA adapter (NF4 base, LoRA on every linear, checkpointed layers, 8-bit AdamW):
//!
//! ```no_run
//! use candle_core::{DType, Tensor};
//! use candle_qlora::prelude::*;
//!
//! let opts = LoadOptions { quantization: Some(QuantConfig::nf4()), compute_dtype: DType::F32 };
//! let mut model = load_model("SmolLM2-135M-Instruct.Q4_1.gguf", None, &opts)?.model;
//! let lora = LoraConfig { r: 16, lora_alpha: 32.0, target_modules: Some(TargetModules::AllLinear), ..Default::default() };
//! model.add_adapter("default", &lora, 42)?;
//! let params = model.adapter_parameters("default")?;
//! let vars: Vec<_> = params.iter().map(|(_, v)| v.clone()).collect();
//! let mut opt = Optimizer::new(params, OptimizerConfig { name: OptimizerName::AdamW8bit, ..Default::default() })?;
//! let ids = Tensor::new(&[[1u32, 2, 3, 4]], &candle_core::Device::Cpu)?;
//! let ck = Checkpointing { enabled: true, params: vars.clone(), ..Default::default() };
//! let (sum, n) = model.loss_sum(&ids, &ids.to_dtype(DType::I64)?, &Positions::Range(0), &ck)?;
//! let mut grads = (sum / n as f64)?.backward()?;
//! ck.sink.merge_into(&mut grads)?;
//! clip_grad_norm(&vars, &mut grads, 1.0)?;
//! opt.step(&grads, 2e-4)?;
//! # Ok::<(), candle_qlora::Error>(())
//! ```
//!
pub mod adapter;
pub mod data;
pub mod error;
pub mod files;
pub mod loading;
pub mod lora;
pub mod memory;
pub mod models;
mod names;
pub mod ops;
pub mod optim;
pub mod plot;
pub mod precision;
pub mod quant;
mod rng;
pub mod trainer;

pub use error::{Error, Result};

/// Unit tests count heap bytes, so memory accounting is tested exactly.
#[cfg(test)]
#[global_allocator]
static TEST_ALLOCATOR: memory::TrackingAllocator = memory::TrackingAllocator;

/// The types most programs need.
pub mod prelude {
    pub use crate::adapter::{load_adapter, save_adapter, Adapters};
    pub use crate::error::{Error, Result};
    pub use crate::loading::{load_model, LoadOptions, LoadedModel};
    pub use crate::lora::{InitLoraWeights, LoraConfig, TargetModules};
    pub use crate::models::{generate, Checkpointing, GenerationConfig, LlamaModel, Positions};
    pub use crate::optim::{
        clip_grad_norm, Optimizer, OptimizerConfig, OptimizerName, Schedule, SchedulerType,
    };
    pub use crate::quant::{BnbKernels, Nf4Tensor, QuantConfig, QuantType};
}
