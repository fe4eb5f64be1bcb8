//! Training: `TrainingArguments` (transformers' names and defaults), TOML run configs, and the `Trainer` with its
//! training methods (supervised fine-tuning, DPO, GRPO).
//!
//! The trainer is layers, each importing only from those below it (`tests/integration/layering.rs` enforces it):
//!
//! - [`settings`]: what a run asks for — [`TrainingArguments`], the TOML [`RunConfig`] and its `--set` overrides,
//!   the methods' own sections ([`DpoConfig`]), and the checks of the settings against the data before the weights
//!   load. It imports nothing else of the trainer.
//! - [`storage`]: what a run keeps on disk — checkpoints (written atomically, rotated, verified by their manifest),
//!   the data position and schedule, [`TrainerState`] and the log, the output folder, and what a resume reads.
//! - [`reporting`]: what a run tells — the progress line, [`TrainerCallback`]s (early stopping, the memory monitor,
//!   TensorBoard), the [`EvalReport`], the memory timeline and the out-of-memory report, the files of a finished run.
//! - `window`: one accumulation window's mechanics that every method builds on — a micro-batch's seeded forward
//!   and its backward into the window's gradients, NEFTune noise, a rank's share.
//! - `methods`: each training method behind one interface (`Method`) — its data, its forward, loss and backward of
//!   a window, its metrics and evaluation, its checkpoint files and setup; supervised fine-tuning and [`dpo`], and
//!   the one place a run config's method is chosen.
//! - [`run`]: the loop and the [`Trainer`] — setup, steps (the method's window, the ranks, clipping, the
//!   optimizer), evaluation and checkpoints on schedule, resume, `load_best_model_at_end`, a clean stop on Ctrl-C
//!   ([`interrupt`]), and the pipeline from a run config.

pub(crate) mod methods;
pub mod reporting;
pub mod run;
pub mod settings;
pub mod storage;
pub(crate) mod window;

// The module paths programs already use (`trainer::dpo::METRICS`, `trainer::interrupt::stop_on_ctrl_c`,
// `trainer::config::RunConfig`, `trainer::checkpoint::checkpoints`, `trainer::tensorboard::scalars`).
pub use methods::dpo;
pub use methods::grpo;
pub use reporting::tensorboard;
pub use run::interrupt;
pub use settings::config;
pub use storage::checkpoint;

pub use methods::supervised::evaluate::{evaluate, exact_match};
pub use reporting::callbacks::{
    EarlyStoppingCallback, MemoryMonitorCallback, TrainerCallback, TrainerControl,
};
pub use reporting::eval_report::EvalReport;
pub use run::trainer::Trainer;
pub use settings::args::{IntervalStrategy, ReportTo, SamplingStrategy, TrainingArguments};
pub use settings::config::RunConfig;
pub use settings::dpo::{DpoConfig, LossType};
pub use settings::fsdp::{FsdpConfig, FsdpPlan};
pub use settings::grpo::GrpoConfig;
pub use storage::checkpoint::latest_checkpoint;
pub use storage::state::{LogEntry, TrainOutput, TrainerState};
