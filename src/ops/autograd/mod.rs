//! The plumbing every op shares: an `Op` computes its forward without a graph and brings its own backward; its
//! `Apply::apply` turns the two into one node of Candle's graph.
//!
//! The forward runs once, on the inputs' values; the graph node only hands that value over (a CPU buffer is moved
//! into the graph without a copy). When no input needs a gradient the value is returned as is, with no graph.
//! [`checkpoint()`] recomputes a block in the backward instead of keeping its graph ([`checkpoint_chain()`] a chain
//! of them, their inputs in host memory with [`ActivationOffload`]); [`tiled_rows()`] runs a
//! row-wise block (an MLP) slice by slice in the forward and the backward; `gradcheck` (tests only)
//! checks an op's gradients against finite differences and a composite reference.

pub mod checkpoint;
#[cfg(test)]
pub(crate) mod gradcheck;
pub mod offload;
#[cfg(feature = "cuda")]
mod offload_cuda;
pub(crate) mod op;
pub mod tiled;

pub use checkpoint::{checkpoint, checkpoint_chain, Block, GradSink, LabeledBlock, Pass};
pub use offload::ActivationOffload;
pub use tiled::{tiled_rows, RowBlock};
