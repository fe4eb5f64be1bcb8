//! Integration tests, in one binary so the Candle stack is linked once.

mod bad_inputs;
mod bad_settings;
mod bnb_layout;
mod chat_templates;
mod cli;
mod common;
#[cfg(feature = "cuda")]
mod cuda;
mod dpo;
mod export;
mod families;
mod fsdp;
mod fuzz;
mod grpo;
mod layering;
mod memory;
mod model_cli;
mod model_parity;
mod moe;
mod optim_golden;
mod packing;
mod peft_parity;
mod quant_golden;
mod smollm2_training;
mod trainer;

/// Counts heap bytes so memory statistics and the timeline are exact.
#[global_allocator]
static ALLOCATOR: candle_qlora::memory::TrackingAllocator = candle_qlora::memory::TrackingAllocator;
