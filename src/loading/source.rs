//! Where a model comes from: a Hugging Face folder, a `.gguf` file or a Hub id — and the test model the repository's
//! scripts cache.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Where a model is read from.
#[derive(Clone, Debug, PartialEq)]
pub enum ModelSource {
    /// A Hugging Face model folder (`config.json`, `*.safetensors`, tokenizer files), possibly bitsandbytes 4-bit.
    Folder(PathBuf),
    /// A `.gguf` file (weights, config and tokenizer in one).
    Gguf(PathBuf),
    /// A Hugging Face Hub repository id (`org/name`).
    Hub {
        /// `org/name`.
        id: String,
        /// Branch, tag or commit.
        revision: String,
    },
}

impl ModelSource {
    /// Interprets a `--model` argument: an existing folder, a `.gguf` file, or else a Hub id.
    pub fn parse(spec: &str, revision: Option<&str>) -> Result<Self> {
        let path = PathBuf::from(spec);
        if path.is_dir() {
            return Ok(ModelSource::Folder(path));
        }
        if path.extension().is_some_and(|e| e == "gguf") {
            if !path.is_file() {
                return Err(Error::io(
                    "cannot open",
                    &path,
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                ));
            }
            return Ok(ModelSource::Gguf(path));
        }
        let looks_like_id =
            spec.split('/').count() == 2 && !spec.starts_with('.') && !spec.starts_with('/');
        if looks_like_id {
            return Ok(ModelSource::Hub {
                id: spec.to_string(),
                revision: revision.unwrap_or("main").to_string(),
            });
        }
        Err(Error::Model(format!(
            "`{spec}` is neither a model folder, a .gguf file nor a Hub id (org/name)"
        )))
    }
}

#[doc(hidden)]
/// File name of the test model `scripts/fetch-test-model.sh` caches (SmolLM2-135M-Instruct, Q4_1 GGUF).
pub const TEST_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

#[doc(hidden)]
/// The real test model if `scripts/fetch-test-model.sh` has cached it: `$QLORA_TEST_MODEL` if set, else
/// `$QLORA_TEST_MODEL_DIR`, `$XDG_CACHE_HOME/candle-qlora` or `~/.cache/candle-qlora`, + [`TEST_MODEL_FILE`].
pub fn cached_test_model() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("QLORA_TEST_MODEL") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    let dir = std::env::var_os("QLORA_TEST_MODEL_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("candle-qlora"))
        })
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("candle-qlora"))
        })?;
    Some(dir.join(TEST_MODEL_FILE)).filter(|p| p.is_file())
}
