//! Random bf16 weights for the examples that write a model-shaped folder (`load_memory`, `export_memory`).

/// Small uniform weights (`±0.02`; norms, by name, are 1) as bf16 little-endian bytes, `n` of them, from the
/// splitmix64 stream `state`.
pub fn random_bf16_bytes(state: &mut u64, n: usize, norm: bool) -> Vec<u8> {
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
    bytes
}
