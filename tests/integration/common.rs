//! Helpers shared by the integration tests.

use std::path::PathBuf;

use candle_core::DType;
use candle_qlora::files::MappedSafetensors;
use safetensors::tensor::TensorView;

/// The repository: where it was built, else the working directory (a test binary carried to another machine runs
/// from the repository's copy there).
pub fn repo_root() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    if built.join("Cargo.toml").exists() {
        built
    } else {
        std::env::current_dir().expect("a working directory")
    }
}

/// The tiny golden models under `tests/data/models`, one per family (and Mistral with a sliding window shorter
/// than the golden inputs), written by `scripts/golden_model.py`.
pub const TINY_MODELS: [&str; 7] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-mistral-sw",
];

/// `tests/data/<rel>`.
pub fn data_path(rel: &str) -> PathBuf {
    repo_root().join("tests").join("data").join(rel)
}

/// A tensor's raw bytes by name, panicking with the file name when missing.
pub fn bytes<'a>(
    file: &'a MappedSafetensors,
    st: &safetensors::SafeTensors<'a>,
    name: &str,
) -> Vec<u8> {
    let view: TensorView<'_> = st
        .tensor(name)
        .unwrap_or_else(|_| panic!("`{name}` missing in {}", file.path().display()));
    view.data().to_vec()
}

/// The raw little-endian bytes of a CPU tensor.
pub fn tensor_bytes(t: &candle_core::Tensor) -> Vec<u8> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        DType::U8 => t.to_vec1::<u8>().unwrap(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

/// Little-endian f32 values.
pub fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// Index of the first difference and the number of differing elements, for readable failures.
pub fn diff_summary<T: PartialEq>(a: &[T], b: &[T]) -> Option<(usize, usize)> {
    if a.len() != b.len() {
        return Some((a.len().min(b.len()), a.len().abs_diff(b.len())));
    }
    let first = a.iter().zip(b).position(|(x, y)| x != y)?;
    Some((first, a.iter().zip(b).filter(|(x, y)| x != y).count()))
}

/// The real test model (SmolLM2-135M GGUF). Fetches it with `scripts/fetch-test-model.sh` when it is not cached;
/// with `CI` set, a missing model is a failure, otherwise the calling test is skipped with a message.
pub fn test_model() -> Option<PathBuf> {
    if let Some(p) = candle_qlora::loading::cached_test_model() {
        return Some(p);
    }
    let script = repo_root().join("scripts/fetch-test-model.sh");
    let fetched = std::process::Command::new(&script)
        .output()
        .ok()
        .filter(|o| o.status.success());
    if let Some(out) = fetched {
        let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if path.is_file() {
            return Some(path);
        }
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the test model is missing: run scripts/fetch-test-model.sh"
    );
    eprintln!("skipped: the SmolLM2 test model is not available (run scripts/fetch-test-model.sh)");
    None
}

/// Largest absolute difference between two tensors (as f64).
pub fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// `(sum of token losses, counted tokens)` of `ids` (`[batch, seq]`, u32) with `labels = ids`, no checkpointing.
pub fn text_loss(
    model: &candle_qlora::models::LlamaModel,
    ids: &candle_core::Tensor,
) -> (f32, usize) {
    use candle_qlora::models::{Checkpointing, Positions};
    let labels = ids.to_dtype(DType::I64).unwrap();
    let (sum, n) = model
        .loss_sum(
            ids,
            &labels,
            &Positions::Range(0),
            &Checkpointing::default(),
        )
        .unwrap();
    (sum.to_scalar::<f32>().unwrap(), n)
}

/// The mean causal-LM loss (a differentiable scalar) of input embeddings `embeds` with labels `ids`, with or
/// without checkpointed layers.
pub fn embeds_loss(
    model: &candle_qlora::models::LlamaModel,
    embeds: &candle_core::Tensor,
    ids: &candle_core::Tensor,
    checkpointing: bool,
) -> candle_core::Tensor {
    use candle_qlora::models::{Checkpointing, Positions};
    let ck = Checkpointing {
        enabled: checkpointing,
        ..Default::default()
    };
    let h = model
        .forward_embeds(embeds, &Positions::Range(0), &ck)
        .unwrap();
    let (sum, n) = model
        .loss_from_hidden(&h, &ids.to_dtype(DType::I64).unwrap())
        .unwrap();
    (sum / n as f64).unwrap()
}

/// Token ids from a JSON array of numbers (golden files).
pub fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}
