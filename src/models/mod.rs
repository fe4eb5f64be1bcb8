//! The Llama-family models (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3): configuration, tokenizer, decoder, and
//! generation.

pub mod config;
pub mod generate;
pub mod llama;
pub(crate) mod pyjson;
pub mod tokenizer;

pub use config::{Architecture, LayerAttention, ModelConfig};
pub use generate::{generate, GenerationConfig};
pub use llama::{
    Checkpointing, GateUpProjections, KvCache, LayerWeights, LlamaModel, Positions, QkvProjections,
    SavedModules,
};
pub use tokenizer::{ChatMessage, TextTokenizer};
