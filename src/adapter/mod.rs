//! Adapters on a model: add, switch, disable and remove named LoRA adapters ([`registry`]), read and write them in
//! PEFT's file format ([`peft`]), and merge one into its base ([`merge`]).

pub mod merge;
pub mod peft;
pub mod registry;

pub use merge::{effective_weight, merge_to_folder, merged_weight, MergeOptions, MergeReport};
pub use peft::{
    base_quantization, load_adapter, read_base_quantization, save_adapter, ADAPTER_CONFIG,
    ADAPTER_WEIGHTS, BASE_QUANTIZATION,
};
pub use registry::{peft_key, AdapterSlot, Adapters};
