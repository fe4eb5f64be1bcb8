//! What resuming reads: the checkpoint `resume_from_checkpoint` names ([`TrainingArguments::resume_checkpoint`],
//! checked before anything loads), and the run's state saved in it ([`Saved`]: `trainer_state.json`, the data
//! position, the schedule).

use std::path::{Path, PathBuf};

use super::checkpoint::{latest_checkpoint, read_json};
use super::position::{DataPosition, SchedulerState, RNG_STATE, SCHEDULER};
use super::state::{TrainerState, TRAINER_STATE};
use crate::error::{Error, Result};
use crate::trainer::settings::args::TrainingArguments;

impl TrainingArguments {
    /// The checkpoint `resume_from_checkpoint` names: a folder, or the latest in `output_dir` for `"true"` or
    /// `"latest"`; `None` when it is unset.
    pub fn resume_checkpoint(&self) -> Result<Option<PathBuf>> {
        let out = Path::new(&self.output_dir);
        match self.resume_from_checkpoint.as_deref() {
            None | Some("false") => Ok(None),
            Some("true") | Some("latest") => latest_checkpoint(out).map(Some).ok_or_else(|| {
                Error::InvalidInput(format!(
                    "no checkpoint-N folder with trainer_state.json in {} to resume from",
                    out.display()
                ))
            }),
            Some(dir) => check_resume_folder(Path::new(dir)).map(Some),
        }
    }
}

/// What a resumed run reads of its checkpoint besides the adapter, the optimizer and the method's own files.
pub(crate) struct Saved {
    /// `trainer_state.json`.
    pub state: TrainerState,
    /// Where the data stream stood (`rng_state.json`).
    pub position: DataPosition,
    /// The learning-rate schedule (`scheduler.json`).
    pub scheduler: SchedulerState,
}

impl Saved {
    /// Reads the state saved in checkpoint `ckpt`.
    pub(crate) fn read(ckpt: &Path) -> Result<Self> {
        Ok(Saved {
            state: read_json(ckpt, TRAINER_STATE)?,
            position: read_json(ckpt, RNG_STATE)?,
            scheduler: read_json(ckpt, SCHEDULER)?,
        })
    }
}

/// `dir`, named by `resume_from_checkpoint` (or `--resume`), if it is a checkpoint folder (it has
/// `trainer_state.json`); otherwise an error naming it and what to resume from instead — checked before anything
/// loads.
fn check_resume_folder(dir: &Path) -> Result<PathBuf> {
    let shown = dir.display();
    let problem = if !dir.exists() {
        "does not exist".to_string()
    } else if !dir.is_dir() {
        "is a file, not a checkpoint folder".to_string()
    } else if !dir.join(TRAINER_STATE).is_file() {
        match latest_checkpoint(dir) {
            Some(latest) => format!(
                "is not a checkpoint (no {TRAINER_STATE}) but holds checkpoints: resume from the latest, {}",
                latest.display()
            ),
            None => format!("is not a checkpoint (no {TRAINER_STATE})"),
        }
    } else {
        return Ok(dir.to_path_buf());
    };
    Err(Error::InvalidInput(format!(
        "resume_from_checkpoint (--resume) `{shown}` {problem}; name a checkpoint-N folder, or give --resume \
         without a value to resume from the latest checkpoint in output_dir"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resume_folder_that_is_no_checkpoint_is_named_before_anything_loads() {
        let dir = tempfile::tempdir().unwrap();
        let args = |resume: &Path| TrainingArguments {
            resume_from_checkpoint: Some(resume.display().to_string()),
            ..Default::default()
        };
        let err = |resume: &Path| args(resume).resume_checkpoint().unwrap_err().to_string();
        let missing = dir.path().join("checkpoint-9");
        assert!(err(&missing).contains("checkpoint-9` does not exist"));
        assert!(err(dir.path()).contains("is not a checkpoint (no trainer_state.json)"));
        let file = dir.path().join("notes.txt");
        std::fs::write(&file, "x").unwrap();
        assert!(err(&file).contains("is a file, not a checkpoint folder"));
        // An output folder holding checkpoints: the latest is named.
        let ckpt = dir.path().join("checkpoint-4");
        std::fs::create_dir(&ckpt).unwrap();
        std::fs::write(ckpt.join(TRAINER_STATE), "{}").unwrap();
        let e = err(dir.path());
        assert!(
            e.contains("resume from the latest") && e.contains("checkpoint-4"),
            "{e}"
        );
        assert_eq!(args(&ckpt).resume_checkpoint().unwrap(), Some(ckpt));
    }
}
