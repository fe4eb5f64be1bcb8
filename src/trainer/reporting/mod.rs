//! What a run tells its user and its callbacks: the progress line and summary (`progress`), the callbacks
//! ([`callbacks`]: transformers' hooks, early stopping, the memory monitor) and TensorBoard's event files
//! ([`tensorboard`]), the evaluation report they see (`eval_report`), the memory timeline of each step and the
//! out-of-memory report (`memory`, `oom`), and the files a finished run writes besides the adapter (`results`).
//! Above the settings and storage; below the window mechanics, the methods and the loop, which report through it.

pub mod callbacks;
pub(crate) mod eval_report;
pub(crate) mod memory;
pub(crate) mod oom;
pub(crate) mod progress;
pub(crate) mod results;
pub mod tensorboard;
