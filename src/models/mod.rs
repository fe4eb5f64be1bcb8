//! The Llama-family models (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3): configuration, tokenizer, decoder, and
//! generation; and the mixture-of-experts block of Mixtral and Qwen2/3-MoE (`moe`).

pub mod config;
pub mod generate;
pub mod llama;
pub mod moe;
pub(crate) mod pyjson;
pub mod tokenizer;

pub use config::{Architecture, LayerAttention, ModelConfig};
pub use generate::{generate, GenerationConfig};
pub use llama::{
    Checkpointing, GateUpProjections, KvCache, LayerWeights, LlamaModel, Mlp, Positions,
    QkvProjections, SavedModules,
};
pub use moe::{load_balancing_loss, SharedExpert, SparseMoe};
pub use tokenizer::{ChatMessage, TextTokenizer};
