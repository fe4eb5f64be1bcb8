//! Training and evaluation data: JSONL formats, chat rendering, label masking and packing.

pub mod formats;
pub mod packing;

pub use formats::{read_jsonl, DataFormat, Example, TokenizedExample};
pub use packing::{pack, row_positions};
