//! Training: `TrainingArguments` (transformers' names and defaults), TOML run configs, and the `Trainer`.
//!
//! - [`args`]: `TrainingArguments`; [`config`]: TOML run configs; [`pipeline`]: a `Trainer` built from a run config
//!   (model, data, callbacks); `preflight`: the run's checks against its data and files before the weights load.
//! - [`run`]: the `Trainer` and its loop; `task`: what it optimizes (supervised or DPO); `window`: one
//!   accumulation window's forward and backward; [`dpo`]: DPO's settings, losses, reference and window; `sampler`:
//!   the data order and each rank's share; `ddp` (feature `nccl`): a rank of a distributed run (gradient
//!   all-reduce, agreement, adapter checks); [`mod@evaluate`]: the evaluation loss.
//! - [`checkpoint`]: checkpoint files and resume; [`state`]: the log and `trainer_state.json`; [`callbacks`]:
//!   hooks, early stopping, memory monitor; [`tensorboard`]: TensorBoard event files (`report_to`); `progress`: what
//!   the user sees; `oom`: the out-of-memory report;
//!   `neftune`: embedding noise; [`interrupt`]: a clean stop on Ctrl-C.

pub mod args;
pub mod callbacks;
pub mod checkpoint;
pub mod config;
#[cfg(feature = "nccl")]
mod ddp;
pub mod dpo;
pub mod evaluate;
pub mod interrupt;
mod neftune;
mod oom;
pub mod pipeline;
mod preflight;
mod progress;
pub mod run;
mod sampler;
pub mod state;
mod task;
pub mod tensorboard;
mod window;

pub use args::{IntervalStrategy, ReportTo, SamplingStrategy, TrainingArguments};
pub use callbacks::{
    EarlyStoppingCallback, MemoryMonitorCallback, TrainerCallback, TrainerControl,
};
pub use checkpoint::latest_checkpoint;
pub use config::RunConfig;
pub use dpo::{DpoConfig, LossType};
pub use evaluate::{evaluate, exact_match, EvalReport};
pub use run::Trainer;
pub use state::{LogEntry, TrainOutput, TrainerState};
