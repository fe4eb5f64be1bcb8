//! # candle-qlora
//!
//! QLoRA fine-tuning of Llama-family models on [Candle](https://github.com/huggingface/candle), interchangeable
//! with the Python stack people use today (transformers + PEFT + bitsandbytes).
//!
//! This release provides the foundation: 4-bit quantization that is bitsandbytes' bit for bit.
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
//! Checkpoints in bitsandbytes' safetensors layout (`*-bnb-4bit` models on the Hub) are read and written by
//! [`loading::bnb`]; `qlora quantize` turns a model folder into one that transformers loads with bitsandbytes.

pub mod adapter;
pub mod data;
pub mod error;
pub mod eval;
pub mod loading;
pub mod lora;
pub mod models;
pub mod ops;
pub mod optim;
pub mod precision;
pub mod quant;

pub use error::{Error, Result};

/// The types most programs need.
pub mod prelude {
    pub use crate::error::{Error, Result};
    pub use crate::quant::{BnbKernels, Nf4Tensor, QuantConfig, QuantType};
}
