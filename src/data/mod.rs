//! Training and evaluation data: JSONL formats and their tokenization ([`formats`]), data sets built from files or
//! from examples in memory ([`dataset`]), packing ([`packing`]) and batches for the model ([`batch`]).

pub mod batch;
pub mod dataset;
pub mod formats;
pub mod packing;

pub use batch::{collate, Batch};
pub use dataset::{DataConfig, Dataset};
pub use formats::{read_jsonl, DataFormat, Example, ReadReport, TokenizedExample};
pub use packing::{pack, row_positions};
