//! Several processes training one model, as PyTorch's distributed data parallel does: where a process stands in
//! the job (torchrun's environment, [`WorldEnv`]), the rendezvous that gives every rank the NCCL unique id of rank 0
//! ([`share_from_rank0`], what torch's TCPStore does), and with the `nccl` feature the communicator that
//! all-reduces tensors on the GPUs (`Communicator`), under a watchdog that turns a dead or hung rank into an error
//! within `ddp_timeout`; [`launch_local`], which starts a node's ranks as `torchrun --nproc-per-node` does; and
//! [`check_ranks`], what the launcher and each rank check before a rank starts or a model loads.

mod env;
mod launch;
#[cfg(feature = "nccl")]
mod nccl;
mod ranks;
mod rendezvous;

pub use env::WorldEnv;
pub use launch::{launch_local, LAUNCH_GRACE};
#[cfg(feature = "nccl")]
pub use nccl::{Communicator, Reduce};
pub use ranks::{check_ranks, visible_gpus, RanksFrom};
pub use rendezvous::share_from_rank0;
