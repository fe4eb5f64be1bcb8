//! What a run keeps on disk, and what a resume reads back: checkpoint folders ([`checkpoint`]: written atomically,
//! listed, rotated), their [`manifest`] (the base model, every file's SHA-256), the data position and schedule
//! ([`position`]), the run's [`state`] (`trainer_state.json`, log entries, the result), the log file (`log`:
//! `log.jsonl`), the output folder (`output_dir`: its lock, an earlier run's output) and `resume` (the checkpoint
//! to resume from, the state saved in it). Above the settings, below everything else of the trainer.

pub mod checkpoint;
pub(crate) mod log;
pub mod manifest;
pub(crate) mod output_dir;
pub mod position;
pub(crate) mod resume;
pub mod state;
