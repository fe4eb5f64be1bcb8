//! Training and evaluation data: JSONL formats and their tokenization ([`formats`]), preference pairs for DPO
//! ([`preference_json`], [`preference`]), prompts and rollouts for GRPO ([`prompts`]), data sets built from files or
//! from examples in memory ([`dataset`]), packing ([`packing`]) and batches for the model ([`batch`]).

pub mod batch;
pub mod dataset;
pub mod formats;
pub mod packing;
pub mod preference;
pub mod preference_json;
pub mod prompts;

pub use batch::{collate, Batch};
pub use dataset::{DataConfig, Dataset};
pub use formats::{read_json_lines, read_jsonl, DataFormat, Example, ReadReport, TokenizedExample};
pub use packing::{pack, row_positions};
pub use preference::{chosen_then_rejected, PreferenceDataset, PreferencePair, TruncationMode};
pub use preference_json::{PreferenceExample, Turns};
pub use prompts::{Prompt, PromptDataset, Rollout};
