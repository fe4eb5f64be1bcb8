//! Adapters on a model: add, switch, disable and remove named LoRA adapters ([`registry`]), and read/write them
//! in PEFT's file format ([`peft`]).

pub mod peft;
pub mod registry;

pub use peft::{load_adapter, save_adapter, ADAPTER_CONFIG, ADAPTER_WEIGHTS};
