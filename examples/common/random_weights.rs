//! Random bf16 Llama weights for the examples that write a model-shaped folder (`load_memory`, `export_memory`).

use candle_qlora::files::RawTensor;

/// The tensors of Llama layer `layer` (`model.layers.{layer}.…`) and their shapes: `hidden` wide, `kv` rows in the
/// key and value projections, an MLP `inter` wide.
pub fn llama_layer_shapes(
    layer: usize,
    hidden: usize,
    kv: usize,
    inter: usize,
) -> Vec<(String, Vec<usize>)> {
    [
        ("self_attn.q_proj.weight", vec![hidden, hidden]),
        ("self_attn.k_proj.weight", vec![kv, hidden]),
        ("self_attn.v_proj.weight", vec![kv, hidden]),
        ("self_attn.o_proj.weight", vec![hidden, hidden]),
        ("mlp.gate_proj.weight", vec![inter, hidden]),
        ("mlp.up_proj.weight", vec![inter, hidden]),
        ("mlp.down_proj.weight", vec![hidden, inter]),
        ("input_layernorm.weight", vec![hidden]),
        ("post_attention_layernorm.weight", vec![hidden]),
    ]
    .into_iter()
    .map(|(name, shape)| (format!("model.layers.{layer}.{name}"), shape))
    .collect()
}

/// Tensor `name` of `shape` as bf16: small uniform weights (`±0.02`; norms, by name, are 1) from the splitmix64
/// stream `state`.
pub fn random_bf16_tensor(state: &mut u64, name: &str, shape: Vec<usize>) -> RawTensor<'static> {
    let n: usize = shape.iter().product();
    let norm = name.ends_with("norm.weight");
    let mut bytes = Vec::with_capacity(2 * n);
    for _ in 0..n {
        *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        let uniform = (z >> 40) as f32 / (1u64 << 24) as f32;
        let value = if norm { 1.0 } else { (uniform - 0.5) * 0.04 };
        bytes.extend_from_slice(&half::bf16::from_f32(value).to_le_bytes());
    }
    RawTensor {
        dtype: safetensors::Dtype::BF16,
        shape,
        data: std::borrow::Cow::Owned(bytes),
    }
}
