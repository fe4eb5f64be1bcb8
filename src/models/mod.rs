//! The Llama-family models (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, and the mixtures of experts Mixtral,
//! Qwen2/3-MoE, gpt-oss): configuration, each family's differences in a file of its own (`config::family`),
//! tokenizer, decoder, generation, and GRPO's sampling (`sampling`); and the mixture-of-experts block (`moe`).

pub mod config;
pub mod generate;
pub mod llama;
pub mod mlp;
pub mod moe;
pub(crate) mod pyjson;
pub mod sampling;
pub mod shard;
mod shared_read;
pub mod tokenizer;

pub use config::{Architecture, Family, LayerAttention, ModelConfig, MoeConfig};
pub use generate::{generate, generate_group, GenerationConfig, GroupCompletion};
pub use llama::{
    Checkpointing, FeedForward, KvCache, LayerWeights, LlamaModel, Positions, QkvProjections,
    SavedModules,
};
pub use mlp::{mlp_slice_rows, GateUpProjections, Mlp, MlpTiling};
pub use moe::{load_balancing_loss, RouterLogits, SharedExpert, SparseMoe};
pub use sampling::{draw, draw_index, SamplingConfig};
#[cfg(feature = "cuda")]
pub use shard::PinnedShard;
pub use shard::{
    FlatShards, Gathering, LocalRank, LocalRanks, ShardExchange, ShardSource, Sharding,
};
pub use tokenizer::{ChatMessage, TextTokenizer};
