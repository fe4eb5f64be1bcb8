//! Training: `TrainingArguments` (transformers' names and defaults) and TOML configs.
//!
//! - [`args`]: `TrainingArguments`; [`config`]: TOML run configs; [`run`]: the loop, checkpoints and resume.

pub mod args;
pub mod config;
pub mod run;

pub use args::{IntervalStrategy, TrainingArguments};
pub use config::RunConfig;
pub use run::{latest_checkpoint, LogEntry, Trainer};
