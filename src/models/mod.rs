//! The Llama-family models (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3): configuration, tokenizer, decoder, and
//! generation; and the mixture-of-experts block of Mixtral and Qwen2/3-MoE (`moe`).

pub mod config;
pub mod generate;
pub mod llama;
pub mod mlp;
pub mod moe;
pub(crate) mod pyjson;
pub mod tokenizer;

pub use config::{Architecture, LayerAttention, ModelConfig, MoeConfig};
pub use generate::{generate, GenerationConfig};
pub use llama::{
    Checkpointing, FeedForward, KvCache, LayerWeights, LlamaModel, Positions, QkvProjections,
    SavedModules,
};
pub use mlp::{GateUpProjections, Mlp};
pub use moe::{load_balancing_loss, RouterLogits, SharedExpert, SparseMoe};
pub use tokenizer::{ChatMessage, TextTokenizer};
