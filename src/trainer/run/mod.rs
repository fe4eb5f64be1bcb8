//! The training loop and the [`trainer::Trainer`] that runs it: built in code or from a run config (`pipeline`),
//! a run is its `setup`, the epoch loop (`train`) of optimizer steps (`step`: the method's window, the ranks'
//! sums, clipping, the update) and what follows each on schedule (`after_step`: log, evaluate, callbacks,
//! checkpoint), checkpoints written (`save`) and read back (`restore`: resume, `load_best_model_at_end`), the data
//! order (`sampler`), whether a run fits its device's memory before it loads (`fits`), the other ranks of a
//! distributed run (`ddp`, feature `nccl`) and a clean stop on Ctrl-C ([`interrupt`]). The top layer of the trainer: it drives a method (`methods`) and uses every layer below.

mod after_step;
#[cfg(feature = "nccl")]
mod ddp;
mod fits;
pub mod interrupt;
mod pipeline;
mod restore;
mod sampler;
mod save;
mod setup;
mod step;
mod train;
pub mod trainer;
