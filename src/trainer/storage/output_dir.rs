//! The output folder of a run: claimed with its lock (one run per folder), an earlier run's adapter and checkpoints
//! refused unless resuming or `overwrite_output_dir` (then removed), and what a killed run left half-written swept.

use std::path::{Path, PathBuf};

use super::checkpoint::{latest_checkpoint, remove_partial_checkpoints};
use crate::distributed::WorldEnv;
use crate::error::{Error, Result};
use crate::files::lock::OutputLock;
use crate::files::sweep_abandoned;
use crate::trainer::settings::args::TrainingArguments;

/// Takes the output folder's lock (one run per folder), then refuses to reuse the output of an earlier run (an
/// adapter or checkpoints) unless resuming or `overwrite_output_dir`; with it, removes that run's adapter and
/// checkpoints (the user asked for it). A log without any checkpoint (a run killed early) holds nothing to keep
/// and is replaced. The other ranks of a distributed run leave the folder to rank 0 (`None`).
pub(crate) fn prepare_output_dir(
    args: &TrainingArguments,
    out: &Path,
    resuming: bool,
) -> Result<Option<OutputLock>> {
    if WorldEnv::from_env()?.is_some_and(|w| w.rank != 0) {
        return Ok(None); // rank 0 claims and writes the folder of a distributed run
    }
    std::fs::create_dir_all(out).map_err(|e| Error::io("cannot create", out, e))?;
    let lock = OutputLock::acquire(out)?;
    let earlier: Vec<PathBuf> = std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().unwrap_or_default().to_string_lossy();
            name.starts_with("checkpoint-")
                || ["adapter_config.json", "adapter_model.safetensors"].contains(&name.as_ref())
        })
        .collect();
    if !resuming && !earlier.is_empty() {
        if !args.overwrite_output_dir {
            // Resuming is a way out only where there is a checkpoint to resume from (a finished run without one
            // left its adapter alone).
            let resume = match latest_checkpoint(out) {
                Some(_) => "resume it (resume_from_checkpoint, or --resume), ",
                None => "",
            };
            return Err(Error::WouldOverwrite(format!(
                "`{}` holds the output of an earlier run ({}); {resume}set overwrite_output_dir = true to replace \
                 it, or pick another output_dir",
                out.display(),
                earlier[0].file_name().unwrap_or_default().to_string_lossy()
            )));
        }
        for p in &earlier {
            let removed = if p.is_dir() {
                std::fs::remove_dir_all(p)
            } else {
                std::fs::remove_file(p)
            };
            removed.map_err(|e| Error::io("cannot remove", p, e))?;
        }
    }
    remove_partial_checkpoints(out)?;
    // Files a killed run was writing (the folder is ours now: no one else writes into it).
    sweep_abandoned(out, None)?;
    Ok(Some(lock))
}
