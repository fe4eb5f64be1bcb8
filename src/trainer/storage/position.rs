//! Where a run stands, as a checkpoint records it for an exact resume: the data position and seeds
//! (`rng_state.json`: [`DataPosition`], with the training items' [`DataFingerprint`]) and the learning-rate schedule
//! (`scheduler.json`: [`SchedulerState`]).

use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::manifest::hex;
use crate::data::TokenizedExample;
use crate::error::{Error, Result};
use crate::optim::SchedulerType;
use crate::trainer::settings::args::SamplingStrategy;

/// The data position and seeds.
pub const RNG_STATE: &str = "rng_state.json";
/// The learning-rate schedule.
pub const SCHEDULER: &str = "scheduler.json";

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
