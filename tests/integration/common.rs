//! Helpers shared by the integration tests.

use std::path::{Path, PathBuf};

use candle_core::DType;
use candle_qlora::files::MappedSafetensors;
use candle_qlora::lora::LoraAdapter;
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

/// How far a float64 result of ours may be from a float64 reference (transformers, PEFT, TRL run in float64 from end
/// to end by the golden scripts), relative to the larger of 1 and the reference's largest magnitude. Both sides then
/// round only at float64's 2⁻⁵³ per operation, in their own orders: over the few thousand operations behind a tiny
/// model's logit that stays below 1e-13 of the values' magnitude, on any CPU and with any matrix kernels. 1e-9
/// leaves four orders of magnitude for it, and is far below any real difference (a misplaced term, scale or mask
/// moves these values by 1e-4 or more).
pub const F64_TOLERANCE: f64 = 1e-9;

/// Asserts that `got` equals the float64 reference `expected` to [`F64_TOLERANCE`], naming `what`.
pub fn assert_f64_close(what: &str, got: &candle_core::Tensor, expected: &candle_core::Tensor) {
    assert_eq!(got.dims(), expected.dims(), "{what}: shapes differ");
    let scale = max_abs(expected).max(1.0);
    let d = max_abs_diff(got, expected);
    assert!(
        d <= F64_TOLERANCE * scale,
        "{what}: differs from the float64 reference by {d:.3e}, beyond {F64_TOLERANCE:e} × {scale:.3} (both sides \
         float64: only rounding in other operation orders, ~1e-13, is allowed for)"
    );
}

/// [`assert_f64_close`] for one number.
pub fn assert_f64_scalar_close(what: &str, got: f64, expected: f64) {
    let t = |x: f64| candle_core::Tensor::new(&[x], &candle_core::Device::Cpu).unwrap();
    assert_f64_close(what, &t(got), &t(expected));
}

/// float32's unit roundoff, 2⁻²⁴: the largest relative error of one rounded operation.
pub const F32_UNIT_ROUNDOFF: f64 = 1.0 / 16_777_216.0;

/// The worst-case distance of a float32 result from the exact one, for a value of magnitude up to `magnitude`
/// computed through `terms` rounded additions in all along its chain of dependent sums (each of the n terms of a
/// length-n dot product, reduction or softmax adds one): the classical first-order bound γₙ·|x| ≈ n·u·|x| of
/// recursive summation. It holds for any order of the sums, so for any CPU's matrix kernels (AVX2 and AVX-512
/// kernels sum in other orders and blocks, which is all that differs between machines).
pub fn float32_bound(terms: usize, magnitude: f64) -> f64 {
    terms as f64 * F32_UNIT_ROUNDOFF * magnitude.max(1.0)
}

/// The rounded additions along the longest chain from a token's embedding to a logit of a decoder with `config`'s
/// shapes over `seq` positions (for [`float32_bound`]): per layer the input norm (hidden), the q/k/v projections
/// (hidden), the scores (head_dim), the softmax and its weighted sum (seq each), the output projection (the
/// attention width), the MLP's norm (hidden), gate/up (hidden) and down (intermediate) projections — a mixture of
/// experts adds the router (hidden) and the sum over experts — then the final norm and the head (hidden each).
pub fn decoder_chain_terms(config: &candle_qlora::models::ModelConfig, seq: usize) -> usize {
    let (hidden, head_dim) = (config.hidden_size, config.head_dim);
    let (mut intermediate, mut experts) = (config.intermediate_size, 0);
    if let Some(m) = &config.moe {
        let shared = m.shared_expert_intermediate_size.unwrap_or(0);
        intermediate = intermediate.max(m.moe_intermediate_size).max(shared);
        experts = hidden + m.num_experts_per_tok + 1;
    }
    let layer = 4 * hidden + head_dim + 2 * seq + config.q_width() + intermediate + experts;
    config.num_hidden_layers * layer + 2 * hidden
}

/// Asserts that float32 `got` is within the float32 rounding bound of `expected` for values computed through
/// `model`'s decoder over `seq` positions: [`float32_bound`] over [`decoder_chain_terms`] times `chains`, the
/// float32 passes between the two (1: a forward against a float64 reference; 2: a backward, which runs the chain
/// again, or two float32 forwards; 4: two float32 backwards).
pub fn assert_f32_within_bound(
    what: &str,
    model: &candle_qlora::models::LlamaModel,
    (seq, chains): (usize, usize),
    got: &candle_core::Tensor,
    expected: &candle_core::Tensor,
) {
    let terms = chains * decoder_chain_terms(model.config(), seq);
    assert_f32_within_terms(what, terms, got, expected);
}

/// Asserts that float32 `got` is within [`float32_bound`] of `expected` for values computed through `terms` rounded
/// additions along their chain.
pub fn assert_f32_within_terms(
    what: &str,
    terms: usize,
    got: &candle_core::Tensor,
    expected: &candle_core::Tensor,
) {
    let bound = float32_bound(terms, max_abs(expected));
    let d = max_abs_diff(got, expected);
    assert!(
        d <= bound,
        "{what}: the float32 result differs by {d:.3e}, beyond the float32 rounding bound {bound:.3e} ({terms} \
         rounded additions along the chain × 2⁻²⁴ × the largest magnitude)"
    );
}

/// The rounded operations along the chain of one float32 merged weight of `adapter` ([`merged_weight`]): the r-term
/// sum of B·A, the scaling and the addition to W; DoRA then takes the row's norm (`in` terms and a square root),
/// divides the magnitude by it and rescales the row.
///
/// [`merged_weight`]: candle_qlora::adapter::merge::merged_weight
pub fn merge_terms(adapter: &LoraAdapter) -> usize {
    let (r, inp) = adapter.a.dims2().unwrap();
    match adapter.magnitude {
        None => r + 2,
        Some(_) => r + 2 + inp + 3,
    }
}

/// The rounded operations one projection adapted by `adapter` adds to its `in`-term sum along a float32 forward:
/// LoRA's branch `x·Aᵀ` (`in` terms, beside `x·Wᵀ`), `·Bᵀ` (r more), the scaling and the addition to the base
/// output; DoRA's scale `m / ‖W + s·B·A‖` comes from a longer chain (the r + 2 of the merge, the row's `in` squares,
/// the square root, the division), and applying it takes three more (`(scale − 1)·base`, `scale·delta`, their sum).
pub fn branch_terms(adapter: &LoraAdapter) -> usize {
    let (r, _) = adapter.a.dims2().unwrap();
    match adapter.magnitude {
        None => r + 2,
        Some(_) => r + 7,
    }
}

/// What the active adapters of `model` add to [`decoder_chain_terms`], `per_projection` of the most expensive one
/// for each projection along the chain: four per layer (q/k/v, o, gate/up, down), five in a mixture of experts
/// (whose router weighs the experts' outputs).
pub fn adapter_chain_terms(
    model: &candle_qlora::models::LlamaModel,
    per_projection: fn(&LoraAdapter) -> usize,
) -> usize {
    let worst = model
        .linears()
        .into_iter()
        .filter_map(|(_, l)| l.active_adapter().map(|a| per_projection(a)))
        .max()
        .unwrap_or(0);
    let per_layer = if model.config().moe.is_some() { 5 } else { 4 };
    per_layer * model.config().num_hidden_layers * worst
}

/// Writes `expected.safetensors` into the adapter folder `adapter` for `scripts/golden_peft.py check-ours`, which
/// compares it with PEFT in float64: `input_ids` (`ids`), and, from the adapter on the model folder `base` computing
/// in float64, the `logits` of them and `merged.<module>.weight` of every adapted module.
pub fn write_peft_expected(adapter: &Path, base: &Path, ids: &candle_core::Tensor) {
    use candle_qlora::adapter::{load_adapter, merge::merged_weight};
    let opts = candle_qlora::loading::LoadOptions {
        compute_dtype: DType::F64,
        ..Default::default()
    };
    let mut model = candle_qlora::loading::load_model(base.to_str().unwrap(), None, &opts)
        .unwrap()
        .model;
    load_adapter(&mut model, adapter, "default").unwrap();
    let mut expected = std::collections::HashMap::new();
    expected.insert("input_ids".to_string(), ids.clone());
    let logits = model.logits(&ids.to_dtype(DType::U32).unwrap()).unwrap();
    expected.insert("logits".to_string(), logits);
    for (name, lin) in model.linears() {
        if let Some(a) = lin.active_adapter() {
            let merged = merged_weight(lin, a).unwrap();
            expected.insert(format!("merged.{name}.weight"), merged);
        }
    }
    candle_core::safetensors::save(&expected, adapter.join("expected.safetensors")).unwrap();
}

/// Largest magnitude in a tensor (as f64).
pub fn max_abs(t: &candle_core::Tensor) -> f64 {
    t.to_dtype(DType::F64)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
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
) -> (f64, usize) {
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
    (
        sum.to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap(),
        n,
    )
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
