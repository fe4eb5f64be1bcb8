#![warn(missing_docs)]
//! # candle-qlora
//!
//! QLoRA fine-tuning of Llama-family models on [Candle](https://github.com/huggingface/candle), interchangeable
//! with the Python stack people use today (transformers + PEFT + bitsandbytes): NF4 weights bit-identical to
//! bitsandbytes, adapters PEFT loads, the optimizers, schedules and `TrainingArguments` of transformers.
//!
//! ## Modules, bottom to top
//!
//! Each module imports only from those above it in this list (a test checks it; `ARCHITECTURE.md` explains the
//! layers).
//!
//! - [`error`]: the crate's one error type; [`files`]: safetensors and atomic writes; [`plot`]: SVG charts;
//!   [`precision`]: float dtypes by PyTorch's names and the autocast policy.
//! - [`quant`]: NF4/FP4 quantization and double quantization, bit-identical to bitsandbytes.
//! - [`ops`]: differentiable ops with hand-written backward passes, and gradient checkpointing.
//! - [`lora`]: `LoraConfig` (PEFT's fields), target matching, and the LoRA linear layer.
//! - [`models`]: the Llama-family model, its configuration, tokenizer and generation.
//! - [`loading`]: models from HF folders, GGUF files, bitsandbytes folders and the Hub; quantizing files.
//! - [`adapter`]: named adapters on a model, PEFT's adapter files, merging.
//! - [`export`]: a model with its adapter merged in, written as GGUF for llama.cpp.
//! - [`optim`]: AdamW (PyTorch and bitsandbytes 8-bit semantics), SGD, transformers' schedules, clipping;
//!   [`data`]: JSONL formats, tokenization and labels, data sets, packing, batches.
//! - [`memory`]: heap accounting, memory statistics and timeline, memory estimates.
//! - [`distributed`]: torchrun's environment, the rendezvous, and (feature `nccl`) the NCCL communicator.
//! - [`trainer`]: `TrainingArguments`, TOML run configs, and the `Trainer`.
//!
//! ## Train an adapter
//!
//! A `Trainer` from code, on examples in memory (a run config and `Trainer::from_run_config` do the same from a
//! TOML file, as `qlora train --config` does). Here on the tiny random Llama the tests use:
//!
//! ```
//! use candle_qlora::prelude::*;
//!
//! let folder = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/models/tiny-llama");
//! let nf4 = LoadOptions { quantization: Some(QuantConfig::nf4()), ..Default::default() };
//! let loaded = load_model(folder, None, &nf4)?;
//! let examples = (0..8).map(|i| Example::Instruction {
//!     prompt: format!("t{i} t{}", i + 1),
//!     response: format!("t{}", i + 2),
//! });
//! let data = DataConfig { max_length: 32, ..Default::default() };
//! let train = Dataset::tokenize(examples, loaded.tokenizer()?, &data)?;
//! let lora = LoraConfig { r: 4, lora_alpha: 8.0, target_modules: Some(TargetModules::AllLinear), ..Default::default() };
//! let out = std::env::temp_dir().join(format!("candle-qlora-doc-train-{}", std::process::id()));
//! let args = TrainingArguments {
//!     output_dir: out.display().to_string(),
//!     overwrite_output_dir: true,
//!     per_device_train_batch_size: 4,
//!     learning_rate: 1e-2,
//!     max_steps: 2,
//!     optim: OptimizerName::PagedAdamW8bit,
//!     gradient_checkpointing: true,
//!     save_strategy: IntervalStrategy::No,
//!     disable_tqdm: true,
//!     ..Default::default()
//! };
//! let mut trainer = Trainer::new(loaded.model, args, &lora, train, Dataset::default())?;
//! let result = trainer.train(None)?; // the PEFT adapter is now in `out`
//! assert_eq!(result.global_step, 2);
//! assert!(out.join("adapter_model.safetensors").exists());
//! # std::fs::remove_dir_all(&out).ok();
//! # Ok::<(), candle_qlora::Error>(())
//! ```
//!
//! ## Use the pieces in your own training code
//!
//! `candle-qlora = "0.1"` in `Cargo.toml`; then quantize, add adapters, and write the loop yourself — here one step
//! with checkpointed layers and bitsandbytes' 8-bit AdamW:
//!
//! ```
//! use candle_core::{DType, Tensor};
//! use candle_qlora::prelude::*;
//!
//! let folder = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/models/tiny-llama");
//! let nf4 = LoadOptions { quantization: Some(QuantConfig::nf4()), ..Default::default() };
//! let mut model = load_model(folder, None, &nf4)?.model;
//! let lora = LoraConfig { r: 4, target_modules: Some(TargetModules::AllLinear), ..Default::default() };
//! model.add_adapter("default", &lora, 42)?;
//! let params = model.adapter_parameters("default")?;
//! let vars: Vec<_> = params.iter().map(|(_, v)| v.clone()).collect();
//! let mut opt = Optimizer::new(params, OptimizerConfig { name: OptimizerName::AdamW8bit, ..Default::default() })?;
//! let ids = Tensor::new(&[[1u32, 5, 9, 13, 17]], model.device())?;
//! let ck = Checkpointing { enabled: true, params: vars.clone(), ..Default::default() };
//! let (sum, n) = model.loss_sum(&ids, &ids.to_dtype(DType::I64)?, &Positions::Range(0), &ck)?;
//! let mut grads = (sum / n as f64)?.backward()?;
//! ck.sink.merge_into(&mut grads)?;
//! clip_grad_norm(&vars, &mut grads, 1.0)?;
//! opt.step(&grads, 2e-4)?;
//! # Ok::<(), candle_qlora::Error>(())
//! ```
//!
//! ## Load an adapter for inference
//!
//! A PEFT adapter (trained here or by PEFT) on its NF4 base, then greedy generation:
//!
//! ```
//! use candle_qlora::prelude::*;
//!
//! let dir = env!("CARGO_MANIFEST_DIR");
//! let nf4 = LoadOptions { quantization: Some(QuantConfig::nf4()), ..Default::default() };
//! let loaded = load_model(&format!("{dir}/tests/data/models/tiny-llama"), None, &nf4)?;
//! let mut model = loaded.model;
//! load_adapter(&mut model, format!("{dir}/tests/data/peft/lora_all_linear").as_ref(), "default")?;
//! let tokenizer = loaded.tokenizer.expect("the folder has tokenizer.json");
//! let prompt = tokenizer.encode("t1 t2 t3", true)?;
//! let tokens = generate(&model, &prompt, &GenerationConfig::greedy(8), |_| Ok(()))?;
//! println!("{}", tokenizer.decode(&tokens, true)?);
//! # Ok::<(), candle_qlora::Error>(())
//! ```
//!
//! Quantizing a weight on its own:
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

pub mod adapter;
#[cfg(feature = "cuda")]
pub(crate) mod cuda;
pub mod data;
pub mod distributed;
pub mod error;
pub mod export;
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
pub mod profile;
pub mod quant;
mod rng;
pub mod trainer;

pub use error::{Error, Result};

/// The README and the pages of `docs/`, compiled under `cargo test --doc` so that every Rust example in them builds
/// (and runs, unless marked `no_run`) against the crate as it is.
#[cfg(doctest)]
mod doc_pages {
    #[doc = include_str!("../README.md")]
    pub struct Readme;
    #[doc = include_str!("../docs/README.md")]
    pub struct DocsIndex;
    #[doc = include_str!("../docs/training.md")]
    pub struct Training;
    #[doc = include_str!("../docs/data.md")]
    pub struct Data;
    #[doc = include_str!("../docs/adapters.md")]
    pub struct Adapters;
    #[doc = include_str!("../docs/models.md")]
    pub struct Models;
    #[doc = include_str!("../docs/quantization.md")]
    pub struct Quantization;
    #[doc = include_str!("../docs/memory.md")]
    pub struct Memory;
    #[doc = include_str!("../docs/gpu.md")]
    pub struct Gpu;
    #[doc = include_str!("../docs/multi-gpu.md")]
    pub struct MultiGpu;
    #[doc = include_str!("../docs/moe.md")]
    pub struct Moe;
    #[doc = include_str!("../docs/dpo.md")]
    pub struct Dpo;
    #[doc = include_str!("../docs/grpo.md")]
    pub struct Grpo;
    #[doc = include_str!("../docs/reliability.md")]
    pub struct Reliability;
    #[doc = include_str!("../docs/cli.md")]
    pub struct Cli;
    #[doc = include_str!("../docs/correctness.md")]
    pub struct Correctness;
    #[doc = include_str!("../docs/benchmarks.md")]
    pub struct Benchmarks;
}

/// Unit tests count heap bytes, so memory accounting is tested exactly.
#[cfg(test)]
#[global_allocator]
static TEST_ALLOCATOR: memory::TrackingAllocator = memory::TrackingAllocator;

/// The types most programs need: loading a model, adapters, data, the trainer, and the pieces of a custom loop.
pub mod prelude {
    pub use crate::adapter::{load_adapter, merge_to_folder, save_adapter, Adapters, MergeOptions};
    pub use crate::data::{DataConfig, DataFormat, Dataset, Example, TokenizedExample};
    pub use crate::error::{Error, Result};
    pub use crate::loading::{load_model, LoadOptions, LoadedModel};
    pub use crate::lora::{InitLoraWeights, LoraConfig, TargetModules};
    pub use crate::models::{
        generate, ChatMessage, Checkpointing, GenerationConfig, LlamaModel, Positions,
        TextTokenizer,
    };
    pub use crate::optim::{
        clip_grad_norm, Optimizer, OptimizerConfig, OptimizerName, Schedule, SchedulerType,
    };
    pub use crate::quant::{BnbKernels, Nf4Tensor, QuantConfig, QuantType};
    pub use crate::trainer::{
        evaluate, EvalReport, IntervalStrategy, RunConfig, Trainer, TrainerCallback,
        TrainingArguments,
    };
}
