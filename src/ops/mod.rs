//! Differentiable ops for training on Candle 0.11, each with a forward and a hand-written backward.
//!
//! Candle's fused norm/softmax/rope ops drop gradients silently and its matmul backward computes gradients for
//! frozen weights too (see `candle-0.11-training-notes.md` §0). Every op here computes its forward *without* a graph
//! (on detached tensors, with Candle's fast kernels) and attaches a backward written for it ([`autograd`]), so the
//! graph keeps only each op's inputs, frozen weights never get gradients, and constants never get dead gradients.
//!
//! Every backward is checked against central finite differences (f64) and against a composite of Candle primitives.

pub mod attention;
mod attention_cpu;
pub mod autograd;
pub mod checkpoint;
pub mod cross_entropy;
pub mod embedding;
pub mod fastmath;
pub mod frozen_linear;
pub mod gemm;
pub mod heads;
pub mod lora_linear;
pub mod rms_norm;
pub mod rope;
pub mod swiglu;
pub mod vector;

#[cfg(test)]
pub(crate) mod gradcheck;

pub use attention::{causal_attention, packed_causal_attention, Segments};
pub use checkpoint::{checkpoint, GradSink, Pass};
pub use cross_entropy::{linear_cross_entropy, IGNORE_INDEX};
pub use embedding::embedding;
pub use frozen_linear::{frozen_linear, FrozenLinear, FrozenWeight};
pub use heads::{merge_heads, split_heads};
pub use rms_norm::rms_norm;
pub use rope::{rope, rope_split_heads, RopeTables};
pub use swiglu::swiglu;
