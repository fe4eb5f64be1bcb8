//! Differentiable ops for training on Candle, each with a forward and a hand-written backward.
//!
//! Candle's fused norm/softmax/rope ops drop gradients silently and its matmul backward computes gradients for
//! frozen weights too. Every op here computes its forward without a graph and attaches a backward written for it
//! ([`autograd`]), so the graph keeps only each op's inputs, frozen weights never get gradients, and constants never
//! get dead gradients.
//!
//! Each op is one type implementing `autograd::op::Op`: where it has a CPU path on slices (f32 in training, f64 in
//! gradient checks; the kernels in `cpu`), that runs on the CPU and a path composed of Candle's ops runs for every
//! other dtype and device, the backward following the forward's choice. Every backward is checked against central
//! finite differences (f64) and a composite of Candle primitives.
//!
//! | op | computes |
//! |---|---|
//! | [`frozen_linear()`] | `x·Wᵀ (+ b)`, `W` dense or 4-bit, gradient for `x` only |
//! | [`low_rank_linear()`] (and `_plus`, `_to_heads`, `_from_heads`) | frozen linear + `s·B·A·dropout(x)` |
//! | [`rms_norm()`] | RMSNorm in f32 |
//! | [`rope()`], [`rope_split_heads`] | rotary embeddings (Llama-3 scaling) |
//! | [`split_heads`], [`merge_heads`] | `[b, t, h·d] ↔ [b, h, t, d]` |
//! | [`causal_attention`], [`packed_causal_attention`] | grouped-query causal attention, query block by block |
//! | [`attention()`] with an [`AttentionSpec`] | the same with a sliding window, logit soft-capping and sinks |
//! | [`swiglu()`], [`geglu_tanh()`] ([`gated_activation()`]) | `silu(gate)·up`, `gelu_tanh(gate)·up` |
//! | [`clamped_swiglu()`] | gpt-oss's `(clamp(up) + 1)·g·σ(α·g)` on interleaved gate/up, `g = min(gate, limit)` |
//! | [`linear_cross_entropy`] | output head + cross-entropy, token block by block |
//! | [`linear_cross_entropy_capped`], [`softcap()`] | the same with the logits soft-capped, `cap·tanh(z/cap)` |
//! | [`token_logps()`] | output head + per-token log-probabilities and entropies (GRPO), token block by block |
//! | [`embedding()`] | row lookup |
//! | [`checkpoint()`] | a block recomputed in the backward |
//! | [`checkpoint_chain()`] | a chain of blocks (the layers) recomputed in turn, inputs offloaded with [`ActivationOffload`] |
//! | [`tiled_rows()`] | a row-wise block (the MLP) run slice by slice of its rows, forward and backward |

pub mod attention;
pub mod autograd;
pub mod clamped_swiglu;
pub(crate) mod cpu;
pub mod cross_entropy;
pub mod embedding;
pub mod frozen_linear;
pub(crate) mod head_layout;
pub mod heads;
pub mod low_rank_linear;
pub mod rms_norm;
pub mod rope;
#[cfg(feature = "cuda")]
mod rows_cuda;
pub mod swiglu;
pub mod token_logps;

pub use attention::{
    attention, causal_attention, packed_causal_attention, AttentionSinks, AttentionSpec, Segments,
};
pub use autograd::{
    checkpoint, checkpoint_chain, tiled_rows, ActivationOffload, Block, GradSink, LabeledBlock,
    Pass, RowBlock,
};
pub use clamped_swiglu::{clamped_swiglu, ClampedSwiglu};
pub use cross_entropy::{linear_cross_entropy, linear_cross_entropy_capped, softcap, IGNORE_INDEX};
pub use embedding::embedding;
pub use frozen_linear::{frozen_linear, FrozenLinear, FrozenWeight, WeightFrame};
pub use heads::{merge_heads, split_heads};
pub use low_rank_linear::{
    low_rank_linear, low_rank_linear_from_heads, low_rank_linear_plus, low_rank_linear_to_heads,
    BranchDropout, LowRank, OutputValue,
};
pub use rms_norm::rms_norm;
pub use rope::{rope, rope_split_heads, RopeTables};
pub use swiglu::{gated_activation, geglu_tanh, swiglu, GateActivation};
pub use token_logps::token_logps;

/// With the `cuda` feature: whether the ops run the crate's own CUDA kernels (the default) or Candle's composed ops
/// on a GPU, for the whole process (`TrainingArguments::use_liger_kernel` sets it for a training run).
#[cfg(feature = "cuda")]
pub use crate::cuda::set_fused_kernels;
