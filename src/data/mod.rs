//! Training and evaluation data: JSONL formats, chat rendering and label masking.

pub mod formats;

pub use formats::{read_jsonl, DataFormat, Example, TokenizedExample};
