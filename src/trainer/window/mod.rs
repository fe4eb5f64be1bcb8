//! One accumulation window's mechanics, which every training method builds its forward and backward from: the
//! window's micro-batches and outcome (`batches`), a micro-batch's seeded forward and its backward into the window's
//! gradients (`micro_batch`), NEFTune noise (`neftune`), and this process's share of a distributed run (`shard`).
//! Above the settings, storage and reporting (the memory timeline of each phase); below the methods and the loop.

pub(crate) mod batches;
pub(crate) mod micro_batch;
mod neftune;
pub(crate) mod shard;
