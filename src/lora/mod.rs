//! LoRA the PEFT way: configuration (PEFT's field names), the adapted linear layer, target matching, and merging.

pub mod config;
pub mod linear;
pub mod merge;
pub mod targets;

pub use config::{InitLoraWeights, LoraConfig, TargetModules};
pub use linear::{LoraAdapter, LoraLinear, LoraRuntime};
