//! Checkpoints: `output_dir/checkpoint-N/` holds everything a resumed run needs to continue exactly as the
//! uninterrupted one would — the adapter (PEFT format), the optimizer state, the schedule, the data position and
//! seeds, `trainer_state.json`, the training arguments and the resolved run config. A checkpoint is written into
//! a hidden `.checkpoint-N.partial` folder and renamed when complete, so a crash at any moment leaves either the
//! whole checkpoint or none that [`latest_checkpoint`] would pick. Its [`Manifest`] records the base model and
//! every file's SHA-256, so resuming refuses a damaged file or another base model instead of diverging silently.

use std::path::{Path, PathBuf};

use serde::Serialize;

pub use super::manifest::MANIFEST;
use super::manifest::{BaseModelId, Manifest};
use super::position::{DataPosition, SchedulerState};
pub use super::position::{RNG_STATE, SCHEDULER};
use super::state::TrainerState;
pub use super::state::TRAINER_STATE;
use crate::error::{Error, Result};
use crate::trainer::settings::args::TrainingArguments;

/// The training arguments.
pub const TRAINING_ARGS: &str = "training_args.json";
/// The resolved run config (when trained from one).
pub const RUN_CONFIG: &str = "run_config.toml";

/// Everything a checkpoint holds besides the adapter and optimizer files.
pub struct CheckpointFiles<'a> {
    /// `trainer_state.json`.
    pub state: &'a TrainerState,
    /// `rng_state.json`.
    pub data: &'a DataPosition,
    /// `scheduler.json`.
    pub scheduler: &'a SchedulerState,
    /// `training_args.json`.
    pub args: &'a TrainingArguments,
    /// `run_config.toml`, when known.
    pub run_config: Option<&'a str>,
    /// The base model, for the manifest.
    pub base_model: &'a BaseModelId,
}

fn write_json(dir: &Path, name: &str, value: &impl Serialize) -> Result<()> {
    let path = dir.join(name);
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::invalid_file(&path, e.to_string()))?;
    std::fs::write(&path, text + "\n").map_err(|e| Error::io("cannot write", &path, e))
}

/// Reads JSON file `name` of checkpoint `dir`.
pub fn read_json<T: serde::de::DeserializeOwned>(dir: &Path, name: &str) -> Result<T> {
    crate::files::read_json(&dir.join(name))
}

/// Writes checkpoint `output_dir/checkpoint-{step}` atomically: `write_weights` fills a temporary folder (adapter,
/// optimizer), the JSON files follow, and the folder is renamed into place only when complete.
pub fn write_checkpoint(
    output_dir: &Path,
    step: usize,
    files: &CheckpointFiles,
    write_weights: impl FnOnce(&Path) -> Result<()>,
) -> Result<PathBuf> {
    let final_dir = output_dir.join(format!("checkpoint-{step}"));
    let tmp = output_dir.join(format!(".checkpoint-{step}.partial"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io("cannot remove", &tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io("cannot create", &tmp, e))?;
    write_weights(&tmp)?;
    write_json(&tmp, RNG_STATE, files.data)?;
    write_json(&tmp, SCHEDULER, files.scheduler)?;
    write_json(&tmp, TRAINING_ARGS, files.args)?;
    if let Some(config) = files.run_config {
        let path = tmp.join(RUN_CONFIG);
        std::fs::write(&path, config).map_err(|e| Error::io("cannot write", &path, e))?;
    }
    write_json(&tmp, TRAINER_STATE, files.state)?;
    write_json(
        &tmp,
        MANIFEST,
        &Manifest::of_folder(&tmp, files.base_model)?,
    )?;
    if final_dir.exists() {
        remove_checkpoint(&final_dir)?;
    }
    std::fs::rename(&tmp, &final_dir)
        .map_err(|e| Error::io("cannot move into place", &final_dir, e))?;
    Ok(final_dir)
}

/// Complete `checkpoint-N` folders of `dir` (those with `trainer_state.json`), oldest first.
pub fn checkpoints(dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut found: Vec<(usize, PathBuf)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n: usize = name.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path()
                .join(TRAINER_STATE)
                .exists()
                .then_some((n, e.path()))
        })
        .collect();
    found.sort();
    found
}

/// The newest complete `checkpoint-N` folder in `dir`.
pub fn latest_checkpoint(dir: &Path) -> Option<PathBuf> {
    checkpoints(dir).pop().map(|(_, p)| p)
}

/// Applies `save_total_limit` to the checkpoints of `dir` as transformers' `rotate_checkpoints` does: `None`, 0
/// or less keeps every one; otherwise the oldest are removed until `limit` remain, never the newest (to resume
/// from) nor `best` (the best model's checkpoint, with `metric_for_best_model`) — so a limit of 1 keeps two when
/// the best is not the newest.
pub fn rotate_checkpoints(dir: &Path, limit: Option<i64>, best: Option<&Path>) -> Result<()> {
    for p in checkpoints_to_rotate(&checkpoints(dir), limit, best) {
        remove_checkpoint(&p)?;
    }
    Ok(())
}

/// At the end of training, as transformers: with `save_total_limit = 1` and a best checkpoint, only the best one
/// stays (the newest, kept until then to resume from, is no longer needed).
pub fn rotate_checkpoints_at_end(
    dir: &Path,
    limit: Option<i64>,
    best: Option<&Path>,
) -> Result<()> {
    for p in checkpoints_to_remove_at_end(&checkpoints(dir), limit, best) {
        remove_checkpoint(&p)?;
    }
    Ok(())
}

/// The checkpoints of `all` that [`rotate_checkpoints_at_end`] removes: every one but `best`, when `limit` is 1
/// and `best` is among them.
fn checkpoints_to_remove_at_end(
    all: &[(usize, PathBuf)],
    limit: Option<i64>,
    best: Option<&Path>,
) -> Vec<PathBuf> {
    let best = best.and_then(Path::file_name);
    let is_best = |p: &Path| best.is_some() && p.file_name() == best;
    if limit != Some(1) || !all.iter().any(|(_, p)| is_best(p)) {
        return Vec::new();
    }
    all.iter()
        .filter(|(_, p)| !is_best(p))
        .map(|(_, p)| p.clone())
        .collect()
}

/// The checkpoints of `all` (oldest first) that `save_total_limit = limit` removes, `best` protected (see
/// [`rotate_checkpoints`]).
fn checkpoints_to_rotate(
    all: &[(usize, PathBuf)],
    limit: Option<i64>,
    best: Option<&Path>,
) -> Vec<PathBuf> {
    let Some(limit) = limit.filter(|&l| l > 0) else {
        return Vec::new();
    };
    let limit = usize::try_from(limit).unwrap_or(usize::MAX);
    let newest = all.last().map(|(_, p)| p.as_path());
    // The best is named by its folder's name: all are in one folder, which a resumed run may spell differently.
    let best = best.and_then(Path::file_name);
    let protected = |p: &Path| Some(p) == newest || (best.is_some() && p.file_name() == best);
    let kept_anyway = all.iter().filter(|(_, p)| protected(p)).count();
    let mut remaining = all.len();
    let mut doomed = Vec::new();
    for (_, p) in all {
        if remaining <= limit.max(kept_anyway) {
            break;
        }
        if !protected(p) {
            doomed.push(p.clone());
            remaining -= 1;
        }
    }
    doomed
}

/// Removes checkpoint folder `dir` without ever leaving a part of it that looks complete: it is first renamed to a
/// hidden `.checkpoint-N.removed.partial` (one atomic step), which a kill mid-removal leaves for
/// [`remove_partial_checkpoints`].
fn remove_checkpoint(dir: &Path) -> Result<()> {
    let name = dir.file_name().unwrap_or_default().to_string_lossy();
    let doomed = dir.with_file_name(format!(".{name}.removed.partial"));
    if doomed.exists() {
        std::fs::remove_dir_all(&doomed).map_err(|e| Error::io("cannot remove", &doomed, e))?;
    }
    std::fs::rename(dir, &doomed).map_err(|e| Error::io("cannot remove", dir, e))?;
    std::fs::remove_dir_all(&doomed).map_err(|e| Error::io("cannot remove", &doomed, e))
}

/// Removes `.checkpoint-N.partial` folders a killed run left behind.
pub fn remove_partial_checkpoints(dir: &Path) -> Result<()> {
    for e in std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
    {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with(".checkpoint-") && name.ends_with(".partial") {
            let p = e.path();
            std::fs::remove_dir_all(&p).map_err(|e| Error::io("cannot remove", &p, e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::SchedulerType;
    use crate::trainer::settings::args::SamplingStrategy;
    use crate::trainer::storage::manifest::{check_base_model, verify_checkpoint_files};

    fn position() -> DataPosition {
        DataPosition {
            seed: 1,
            data_seed: 1,
            sampling: SamplingStrategy::Random,
            per_device_train_batch_size: 2,
            gradient_accumulation_steps: 1,
            train_rows: 10,
            world_size: 1,
            micro_batches_done: 4,
            epoch: 0,
            data: None,
        }
    }

    #[test]
    fn incomplete_and_partial_folders_are_never_picked() {
        let dir = tempfile::tempdir().unwrap();
        let state = TrainerState::default();
        let scheduler = SchedulerState {
            lr_scheduler_type: SchedulerType::Linear,
            learning_rate: 1e-3,
            warmup_steps: 0,
            total_steps: 10,
            last_step: 2,
            last_lr: 1e-3,
        };
        let args = TrainingArguments::default();
        let files = CheckpointFiles {
            state: &state,
            data: &position(),
            scheduler: &scheduler,
            args: &args,
            run_config: Some("[model]\n"),
            base_model: &BaseModelId {
                name: None,
                fingerprint: "0".repeat(64),
            },
        };
        let written = write_checkpoint(dir.path(), 2, &files, |_| Ok(())).unwrap();
        assert_eq!(written, dir.path().join("checkpoint-2"));
        // A folder without trainer_state.json (as a crash mid-write outside our rename would leave) and a partial one.
        std::fs::create_dir(dir.path().join("checkpoint-9")).unwrap();
        std::fs::create_dir(dir.path().join(".checkpoint-4.partial")).unwrap();
        assert_eq!(latest_checkpoint(dir.path()), Some(written.clone()));
        // A failed weight write leaves no checkpoint-5.
        let err = write_checkpoint(dir.path(), 5, &files, |_| {
            Err(Error::InvalidInput("disk full".into()))
        });
        assert!(err.is_err() && !dir.path().join("checkpoint-5").exists());
        remove_partial_checkpoints(dir.path()).unwrap();
        assert!(!dir.path().join(".checkpoint-4.partial").exists());
        let read: DataPosition = read_json(&written, RNG_STATE).unwrap();
        assert_eq!(read, position());
        assert!(written.join(RUN_CONFIG).exists() && written.join(TRAINING_ARGS).exists());
        // The manifest lists every other file, and verification passes on the untouched folder.
        let manifest: Manifest = read_json(&written, MANIFEST).unwrap();
        assert_eq!(
            manifest.files.keys().collect::<Vec<_>>(),
            [
                RNG_STATE,
                RUN_CONFIG,
                SCHEDULER,
                TRAINER_STATE,
                TRAINING_ARGS
            ]
        );
        let manifest = verify_checkpoint_files(&written).unwrap().unwrap();
        check_base_model(&written, &manifest, files.base_model, false).unwrap();
    }

    /// transformers 5's `rotate_checkpoints` (`trainer_utils.py`) on the names of `steps`: `None` or ≤ 0 keeps
    /// all; else the oldest go until `limit` remain, never the newest nor the best. Returns the steps kept.
    fn transformers_rotation(
        steps: &[usize],
        limit: Option<i64>,
        best: Option<usize>,
    ) -> Vec<usize> {
        let Some(limit) = limit.filter(|&l| l > 0) else {
            return steps.to_vec();
        };
        let mut protected = vec![*steps.last().unwrap()];
        protected.extend(best);
        protected.dedup();
        let keep = (limit as usize).max(protected.len());
        let mut remaining = steps.len();
        let mut kept = vec![];
        for &s in steps {
            if remaining > keep && !protected.contains(&s) {
                remaining -= 1;
            } else {
                kept.push(s);
            }
        }
        kept
    }

    #[test]
    fn save_total_limit_rotates_as_transformers() {
        let dir = Path::new("out");
        let steps = [2, 4, 6, 8, 10];
        let all: Vec<(usize, PathBuf)> = steps
            .iter()
            .map(|&s| (s, dir.join(format!("checkpoint-{s}"))))
            .collect();
        let kept = |limit: Option<i64>, best: Option<usize>| -> Vec<usize> {
            let best = best.map(|b| PathBuf::from(format!("elsewhere/checkpoint-{b}")));
            let doomed = checkpoints_to_rotate(&all, limit, best.as_deref());
            all.iter()
                .filter(|(_, p)| !doomed.contains(p))
                .map(|(s, _)| *s)
                .collect()
        };
        // Every value of the limit, with and without a best checkpoint anywhere in the list.
        for limit in [
            None,
            Some(-1),
            Some(0),
            Some(1),
            Some(2),
            Some(3),
            Some(5),
            Some(9),
        ] {
            for best in [None, Some(2), Some(6), Some(10)] {
                assert_eq!(
                    kept(limit, best),
                    transformers_rotation(&steps, limit, best),
                    "save_total_limit = {limit:?}, best = {best:?}"
                );
            }
        }
        // The rules themselves: 0 and unset keep all (0 kept one before), 1 keeps the best and the newest.
        assert_eq!(kept(Some(0), None), steps);
        assert_eq!(kept(None, None), steps);
        assert_eq!(kept(Some(1), None), [10]);
        assert_eq!(kept(Some(1), Some(4)), [4, 10]);
        assert_eq!(kept(Some(2), Some(2)), [2, 10]);
        assert_eq!(kept(Some(3), Some(2)), [2, 8, 10]);
        // At the end, a limit of 1 leaves only the best.
        let best = PathBuf::from("out/checkpoint-4");
        let doomed = checkpoints_to_remove_at_end(&all, Some(1), Some(&best));
        assert_eq!(doomed.len(), 4);
        assert!(!doomed.contains(&best));
        assert!(checkpoints_to_remove_at_end(&all, Some(2), Some(&best)).is_empty());
        assert!(checkpoints_to_remove_at_end(&all, Some(1), None).is_empty());
    }

    #[test]
    fn a_different_data_seed_is_refused_by_name() {
        let mut now = position();
        now.data_seed = 2;
        let err = position()
            .check_compatible(&now, Path::new("ck"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("data_seed = 1") && err.contains("this run has 2"),
            "{err}"
        );
    }
}
