//! Training: `TrainingArguments` (transformers' names and defaults), TOML configs, and the `Trainer`.
//!
//! - [`args`]: `TrainingArguments`; [`config`]: TOML run configs; [`run`]: the loop; [`checkpoint`]: checkpoint
//!   files and resume; [`callbacks`]: hooks, early stopping, memory monitor; [`state`]: the log and
//!   `trainer_state.json`; [`progress`]: what the user sees; [`neftune`]: embedding noise.

pub mod args;
pub mod callbacks;
pub mod checkpoint;
pub mod config;
pub mod neftune;
pub mod progress;
pub mod run;
pub mod state;

pub use args::{IntervalStrategy, TrainingArguments};
pub use callbacks::{
    EarlyStoppingCallback, MemoryMonitorCallback, TrainerCallback, TrainerControl,
};
pub use checkpoint::latest_checkpoint;
pub use config::RunConfig;
pub use run::Trainer;
pub use state::{LogEntry, TrainOutput, TrainerState};
