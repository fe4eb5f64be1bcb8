//! LoRA the PEFT way: configuration (PEFT's field names), which modules it targets, and the adapted linear layer.
//! Managing adapters on a model, their files and merging are [`crate::adapter`]'s.

pub mod config;
pub mod linear;
pub mod targets;

pub use config::{InitLoraWeights, LoraConfig, TargetModules};
pub use linear::{LoraAdapter, LoraLinear, LoraRuntime};
