//! The run's log file, `output_dir/log.jsonl`: one [`LogEntry`] per line, the entries of `log_history` in
//! `trainer_state.json`. A run starts it from the history it restored (a killed run may have logged past its
//! checkpoint), then appends each entry as it is logged.

use std::io::Write;
use std::path::Path;

use super::state::LogEntry;
use crate::error::{Error, Result};

/// The log's name in `output_dir`.
pub const LOG_FILE: &str = "log.jsonl";

/// Writes `history` as the whole log at `path`.
pub(crate) fn write_log(path: &Path, history: &[LogEntry]) -> Result<()> {
    let text: String = history
        .iter()
        .map(|e| serde_json::to_string(e).unwrap_or_default() + "\n")
        .collect();
    std::fs::write(path, text).map_err(|e| Error::io("cannot write", path, e))
}

/// Appends `entry` to the log at `path`.
pub(crate) fn append_to_log(path: &Path, entry: &LogEntry) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::io("cannot write", path, e))?;
    writeln!(f, "{}", serde_json::to_string(entry).unwrap_or_default())
        .map_err(|e| Error::io("cannot write", path, e))
}
