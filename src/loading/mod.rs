//! Reading and writing model files.
//!
//! - [`model`]: [`load_model`] — a model and its tokenizer from a folder, a `.gguf` file or a Hub id, quantized on
//!   load; [`load_model_config`] reads only the configuration. `in_file`: linear weights left in their files, read
//!   whole at use or in parts by a sharded load's ranks.
//! - [`source`]: what a `--model` argument names; [`hub`]: Hub downloads and the offline cache.
//! - [`safetensors`]: a model folder's (sharded) safetensors weights; [`gguf`]: GGUF weights and metadata;
//!   [`read_names`]: which of their tensors a model has read.
//! - [`bnb`]: bitsandbytes' 4-bit checkpoint layout (`*-bnb-4bit` models) and quantizing files and model folders.

pub mod bnb;
pub mod gguf;
pub mod hub;
mod in_file;
pub mod model;
pub mod read_names;
pub mod safetensors;
pub mod source;

pub use model::{load_model, load_model_config, load_tokenizer, LoadOptions, LoadedModel};
pub use source::{cached_test_model, ModelSource, TEST_MODEL_FILE};
