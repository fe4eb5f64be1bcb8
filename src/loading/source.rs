//! Where models come from.

use std::path::PathBuf;

/// File name of the test model `scripts/fetch-test-model.sh` caches (SmolLM2-135M-Instruct, Q4_1 GGUF).
pub const TEST_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

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
