//! Training: `TrainingArguments` (transformers' names and defaults) and TOML configs.
//!
//! The training loop, checkpoints and resume are not written yet; this module provides the arguments and the
//! config file format they are read from.

pub mod args;
pub mod config;
pub mod trainer;

pub use args::{IntervalStrategy, TrainingArguments};
pub use config::RunConfig;
pub use trainer::{latest_checkpoint, LogEntry, Trainer};
