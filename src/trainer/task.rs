//! What a [`super::Trainer`] optimizes, with its data: the causal-LM loss on labelled tokens (supervised
//! fine-tuning), or DPO's preference loss on pairs.

use super::checkpoint::DataFingerprint;
use super::dpo::PreferenceTask;
use super::preflight::DataFacts;
use crate::data::Dataset;

/// The trainer's objective and data.
pub(super) enum Task {
    /// Supervised fine-tuning: the token-level loss of the labelled tokens.
    LanguageModeling {
        /// Training rows.
        train: Dataset,
        /// Evaluation rows (may be empty).
        eval: Dataset,
    },
    /// DPO on preference pairs.
    Preference(Box<PreferenceTask>),
}

impl Task {
    /// The length of each training item (a row, or a pair's longer sequence), for the sampler.
    pub(super) fn train_lengths(&self) -> Vec<usize> {
        match self {
            Task::LanguageModeling { train, .. } => {
                train.rows.iter().map(|r| r.input_ids.len()).collect()
            }
            Task::Preference(p) => p.train.pairs.iter().map(|p| p.longest()).collect(),
        }
    }

    /// The digests of the training items (a pair's chosen then rejected sequence), which a resumed run checks.
    pub(super) fn train_fingerprint(&self) -> DataFingerprint {
        match self {
            Task::LanguageModeling { train, .. } => DataFingerprint::of(&train.rows),
            Task::Preference(p) => {
                DataFingerprint::of(p.train.pairs.iter().flat_map(|p| [&p.chosen, &p.rejected]))
            }
        }
    }

    /// What the data checks need of the training and evaluation data.
    pub(super) fn facts(&self) -> DataFacts {
        match self {
            Task::LanguageModeling { train, eval } => DataFacts::supervised(train, eval),
            Task::Preference(p) => DataFacts::preference(&p.train, &p.eval),
        }
    }

    /// Whether there is anything to evaluate.
    pub(super) fn has_eval(&self) -> bool {
        match self {
            Task::LanguageModeling { eval, .. } => !eval.is_empty(),
            Task::Preference(p) => !p.eval.is_empty(),
        }
    }
}
