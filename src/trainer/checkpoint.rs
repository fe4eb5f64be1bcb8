//! Checkpoints: `output_dir/checkpoint-N/` holds everything a resumed run needs to continue exactly as the
//! uninterrupted one would — the adapter (PEFT format), the optimizer state, the schedule, the data position and
//! seeds, `trainer_state.json`, the training arguments and the resolved run config. A checkpoint is written into
//! a hidden `.checkpoint-N.partial` folder and renamed when complete, so a crash at any moment leaves either the
//! whole checkpoint or none that [`latest_checkpoint`] would pick. Its [`Manifest`] records the base model and
//! every file's SHA-256, so resuming refuses a damaged file or another base model instead of diverging silently.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use candle_core::DType;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::args::{SamplingStrategy, TrainingArguments};
use super::state::TrainerState;
use crate::adapter::{read_base_quantization, ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_QUANTIZATION};
use crate::data::TokenizedExample;
use crate::error::{Error, Result};
use crate::models::LlamaModel;
use crate::optim::SchedulerType;
use crate::quant::QuantConfig;

/// File names inside a checkpoint folder.
pub const TRAINER_STATE: &str = "trainer_state.json";
/// The data position and seeds.
pub const RNG_STATE: &str = "rng_state.json";
/// The learning-rate schedule.
pub const SCHEDULER: &str = "scheduler.json";
/// The training arguments.
pub const TRAINING_ARGS: &str = "training_args.json";
/// The resolved run config (when trained from one).
pub const RUN_CONFIG: &str = "run_config.toml";
/// The base model and every other file's size and SHA-256.
pub const MANIFEST: &str = "checkpoint_manifest.json";

/// Which base model a checkpoint's adapter was trained on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseModelId {
    /// `base_model_name_or_path`, when known.
    pub name: Option<String>,
    /// SHA-256 of the architecture's shape and of the embedding's first rows and the final norm (rounded to bf16,
    /// so the same model gives the same value on every device and precision): cheap, and different for two models
    /// of the same shape.
    pub fingerprint: String,
}

impl BaseModelId {
    /// The identity of `model`, loaded from `name`.
    pub fn of(model: &LlamaModel, name: Option<&str>) -> Result<Self> {
        const ROWS: usize = 64;
        let c = model.config();
        let mut hash = Sha256::new();
        let shape = format!(
            "{:?} vocab {} hidden {} intermediate {} layers {} heads {}/{} head_dim {}",
            c.architecture,
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim
        );
        hash.update(shape.as_bytes());
        let rows = model.embed_tokens.dim(0)?.min(ROWS);
        for t in [&model.embed_tokens.narrow(0, 0, rows)?, &model.norm] {
            let values: Vec<f32> = t
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            for v in values {
                hash.update(v.to_le_bytes());
            }
        }
        Ok(BaseModelId {
            name: name.map(str::to_string),
            fingerprint: hex(&hash.finalize()),
        })
    }
}

/// Size and SHA-256 of one checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Length in bytes.
    pub bytes: u64,
    /// SHA-256, lowercase hex.
    pub sha256: String,
}

impl FileDigest {
    /// Reads `path` through once.
    pub fn of(path: &Path) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| Error::io("cannot read", path, e))?;
        let (mut hash, mut bytes, mut buf) = (Sha256::new(), 0u64, vec![0u8; 1 << 20]);
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| Error::io("cannot read", path, e))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok(FileDigest {
            bytes,
            sha256: hex(&hash.finalize()),
        })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `checkpoint_manifest.json`: the base model and the digest of every other file in the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The base model the adapter was trained on.
    pub base_model: BaseModelId,
    /// File name → size and SHA-256.
    pub files: BTreeMap<String, FileDigest>,
}

impl Manifest {
    /// Digests every file of folder `dir` (but the manifest).
    fn of_folder(dir: &Path, base_model: &BaseModelId) -> Result<Self> {
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(|e| Error::io("cannot list", dir, e))? {
            let entry = entry.map_err(|e| Error::io("cannot list", dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != MANIFEST && entry.path().is_file() {
                files.insert(name, FileDigest::of(&entry.path())?);
            }
        }
        Ok(Manifest {
            base_model: base_model.clone(),
            files,
        })
    }
}

/// Checks that every file the manifest of checkpoint `ckpt` lists is there with the recorded size and SHA-256,
/// and returns the manifest (`None`, with a warning, for a checkpoint written before manifests existed).
pub fn verify_checkpoint_files(ckpt: &Path) -> Result<Option<Manifest>> {
    verify_files(
        ckpt,
        |_| true,
        "resume from another checkpoint",
        "resume from another checkpoint or start a new run",
    )
}

/// Checks the adapter files of checkpoint `ckpt` (`adapter_config.json`, `adapter_model.safetensors`) against its
/// manifest, as [`verify_checkpoint_files`] checks them all: what `load_best_model_at_end` reads back.
pub fn verify_adapter_files(ckpt: &Path) -> Result<()> {
    const REMEDY: &str =
        "the best model cannot be loaded; set load_best_model_at_end = false to keep the last \
                          step's adapter (the newest checkpoint holds it too)";
    let adapter = |name: &str| name == ADAPTER_CONFIG || name == ADAPTER_WEIGHTS;
    verify_files(ckpt, adapter, REMEDY, REMEDY).map(|_| ())
}

/// The files of checkpoint `ckpt`'s manifest that `checked` selects, each there with its recorded size and
/// SHA-256; an error names the file with `if_missing` or `if_damaged` as what to do.
fn verify_files(
    ckpt: &Path,
    checked: impl Fn(&str) -> bool,
    if_missing: &str,
    if_damaged: &str,
) -> Result<Option<Manifest>> {
    let path = ckpt.join(MANIFEST);
    if !path.exists() {
        eprintln!(
            "warning: {} has no {MANIFEST} (written by an older version): its files are not verified",
            ckpt.display()
        );
        return Ok(None);
    }
    let manifest: Manifest = crate::files::read_json(&path)?;
    for (name, recorded) in manifest.files.iter().filter(|(n, _)| checked(n)) {
        let file = ckpt.join(name);
        if !file.exists() {
            return Err(Error::invalid_file(
                &file,
                format!("missing from the checkpoint ({MANIFEST} lists it): {if_missing}"),
            ));
        }
        let found = FileDigest::of(&file)?;
        if &found != recorded {
            return Err(Error::invalid_file(
                &file,
                format!(
                    "damaged: {} bytes with SHA-256 {}, but the checkpoint wrote {} bytes with SHA-256 {}; \
                     {if_damaged}",
                    found.bytes, found.sha256, recorded.bytes, recorded.sha256
                ),
            ));
        }
    }
    Ok(Some(manifest))
}

/// An error unless checkpoint `ckpt` (with `manifest`, checked by [`verify_checkpoint_files`]) was trained on `base`
/// (or `ignore_base_mismatch`).
pub fn check_base_model(
    ckpt: &Path,
    manifest: &Manifest,
    base: &BaseModelId,
    ignore_base_mismatch: bool,
) -> Result<()> {
    let path = ckpt.join(MANIFEST);
    let then = &manifest.base_model;
    if then.fingerprint != base.fingerprint && !ignore_base_mismatch {
        let named = |id: &BaseModelId| id.name.clone().unwrap_or_else(|| "an unnamed model".into());
        return Err(Error::invalid_file(
            &path,
            format!(
                "the checkpoint was trained on {} (fingerprint {}), this run loads {} (fingerprint {}): the \
                 adapter belongs to another base model; load that model, or set ignore_base_model_mismatch = true \
                 to resume anyway",
                named(then),
                &then.fingerprint[..12.min(then.fingerprint.len())],
                named(base),
                &base.fingerprint[..12.min(base.fingerprint.len())],
            ),
        ));
    }
    Ok(())
}

/// An error when the checkpoint in `ckpt` was trained on a base stored another way than this run's (`now`: its
/// 4-bit format, or `None` for a dense base): the adapter learned against other weights. Checkpoints that do not
/// record it, and `ignore_base_mismatch`, pass.
pub fn check_base_quantization(
    ckpt: &Path,
    now: Option<QuantConfig>,
    ignore_base_mismatch: bool,
) -> Result<()> {
    let Some(then) = read_base_quantization(ckpt)? else {
        return Ok(());
    };
    let format = |q: Option<QuantConfig>| q.map(|q| (q.quant_type, q.blocksize, q.double_quant));
    if ignore_base_mismatch || format(then) == format(now) {
        return Ok(());
    }
    let words = |q: Option<QuantConfig>| match q {
        None => "a dense base (not quantized)".to_string(),
        Some(q) => format!(
            "a {} base (bnb_4bit_blocksize = {}, bnb_4bit_use_double_quant = {})",
            q.quant_type, q.blocksize, q.double_quant
        ),
    };
    Err(Error::invalid_file(
        ckpt.join(BASE_QUANTIZATION),
        format!(
            "the checkpoint was trained on {}, this run loads {}: the adapter learned against other base weights; \
             set [model.quantization] as the checkpoint's, set ignore_base_model_mismatch = true to resume anyway, \
             or start a new run",
            words(then),
            words(now)
        ),
    ))
}

/// Where the data stream stands and what it depends on. Data order is a pure function of these seeds and the
/// epoch, and dropout/NEFTune noise of (seed, micro-batch index), so this is the whole random state of a run.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataPosition {
    /// `seed` (initialization, dropout, NEFTune noise).
    pub seed: u64,
    /// Seed of the data order.
    pub data_seed: u64,
    /// The order of the micro-batches.
    pub sampling: SamplingStrategy,
    /// Micro-batch size.
    pub per_device_train_batch_size: usize,
    /// Micro-batches per step.
    pub gradient_accumulation_steps: usize,
    /// Training rows (examples, or packed rows).
    pub train_rows: usize,
    /// Micro-batches consumed so far (all epochs).
    pub micro_batches_done: usize,
    /// Epoch the next micro-batch belongs to.
    pub epoch: usize,
    /// Processes of the run (`WORLD_SIZE`; 1 when not distributed). Each rank's RNG is a function of the seed and
    /// the global micro-batch index, so this one file is every rank's random state (HF's `rng_state_{rank}`).
    #[serde(default = "single_process")]
    pub world_size: usize,
    /// What the training items hold (absent in checkpoints written before it was recorded).
    #[serde(default, flatten)]
    pub data: Option<DataFingerprint>,
}

/// SHA-256 digests of the training items, after tokenization, truncation, label masking and packing: a resumed run
/// must replay the same tokens with the same labels.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DataFingerprint {
    /// Of every item's token ids (and a packed row's example boundaries), in order.
    pub inputs_sha256: String,
    /// Of every item's labels, in order.
    pub labels_sha256: String,
}

impl DataFingerprint {
    /// The digests of `items`.
    pub fn of<'a>(items: impl IntoIterator<Item = &'a TokenizedExample>) -> Self {
        let (mut inputs, mut labels) = (Sha256::new(), Sha256::new());
        for item in items {
            inputs.update((item.input_ids.len() as u64).to_le_bytes());
            for id in &item.input_ids {
                inputs.update(id.to_le_bytes());
            }
            inputs.update((item.segments.len() as u64).to_le_bytes());
            for segment in &item.segments {
                inputs.update((*segment as u64).to_le_bytes());
            }
            for label in &item.labels {
                labels.update(label.to_le_bytes());
            }
        }
        DataFingerprint {
            inputs_sha256: hex(&inputs.finalize()),
            labels_sha256: hex(&labels.finalize()),
        }
    }

    /// Why `self` (a checkpoint's) and `now` would not train on the same data, if they would not.
    fn difference(&self, now: &DataFingerprint) -> Option<&'static str> {
        if self.inputs_sha256 != now.inputs_sha256 {
            Some(
                "the checkpoint was trained on other tokens (the data files, max_length, packing, the chat template or \
                 the tokenizer changed)",
            )
        } else if self.labels_sha256 != now.labels_sha256 {
            Some(
                "the checkpoint was trained on the same tokens with other labels (the label masking changed: \
                 completion_only_loss, assistant_only_loss, or the data's prompt/completion split)",
            )
        } else {
            None
        }
    }
}

fn single_process() -> usize {
    1
}

impl DataPosition {
    /// An error if `self` (from a checkpoint) and `now` would not replay the same data.
    pub fn check_compatible(&self, now: &DataPosition, ckpt: &Path) -> Result<()> {
        let pairs = [
            ("seed", self.seed.to_string(), now.seed.to_string()),
            (
                "data_seed",
                self.data_seed.to_string(),
                now.data_seed.to_string(),
            ),
            (
                "train_sampling_strategy",
                self.sampling.to_string(),
                now.sampling.to_string(),
            ),
            (
                "per_device_train_batch_size",
                self.per_device_train_batch_size.to_string(),
                now.per_device_train_batch_size.to_string(),
            ),
            (
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps.to_string(),
                now.gradient_accumulation_steps.to_string(),
            ),
            (
                "training rows",
                self.train_rows.to_string(),
                now.train_rows.to_string(),
            ),
        ];
        if self.world_size != now.world_size {
            eprintln!(
                "note: {} was written by {} process(es), this run has {}: training goes on from its step with \
                 this world size's sharding of the data, so the order differs from the uninterrupted run's",
                ckpt.display(),
                self.world_size,
                now.world_size
            );
        }
        let changed = pairs
            .into_iter()
            .find(|(_, then, now)| then != now)
            .map(|(name, then, now)| {
                format!("the checkpoint was written with {name} = {then}, this run has {now}")
            })
            .or_else(|| match (&self.data, &now.data) {
                (Some(then), Some(now)) => then.difference(now).map(str::to_string),
                _ => None,
            });
        match changed {
            Some(why) => Err(Error::invalid_file(
                ckpt.join(RNG_STATE),
                format!(
                    "{why}: resuming would not replay the same data; use the checkpoint's settings and data, or \
                     start a new run"
                ),
            )),
            None => Ok(()),
        }
    }
}

/// The learning-rate schedule as saved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SchedulerState {
    /// `lr_scheduler_type`.
    pub lr_scheduler_type: SchedulerType,
    /// Peak learning rate.
    pub learning_rate: f64,
    /// Warmup steps.
    pub warmup_steps: usize,
    /// Total steps.
    pub total_steps: usize,
    /// Steps done.
    pub last_step: usize,
    /// Learning rate of the last step.
    pub last_lr: f64,
}

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
