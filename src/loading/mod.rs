//! Reading and writing model files.
//!
//! - [`safetensors`]: memory-mapped safetensors files, raw tensors for writing, atomic file output.
//! - [`source`]: where a model comes from (the cached test model for now).
//! - [`bnb`]: bitsandbytes' 4-bit checkpoint layout (`*-bnb-4bit` models) and quantizing files and model folders.

pub mod bnb;
pub mod gguf;
pub mod safetensors;
pub mod source;
