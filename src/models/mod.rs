//! The Llama-family model: configuration, tokenizer, decoder, and generation.

pub mod config;
pub mod generate;
pub mod llama;
pub mod tokenizer;

pub use config::{Architecture, ModelConfig};
pub use generate::{generate, GenerationConfig};
pub use llama::{Checkpointing, KvCache, LayerWeights, LlamaModel, Positions, SavedModules};
pub use tokenizer::{ChatMessage, TextTokenizer};
