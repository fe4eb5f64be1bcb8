//! ggml's tensor types that an export writes, and their encodings: float32, float16 and bfloat16 element by
//! element (the types llama.cpp's `convert_hf_to_gguf.py` writes, with `q8_0`), the block types `q8_0`, `q4_0`,
//! `q4_1`, `q5_0`, `q5_1` in blocks of 32, and the k-quants `q2_k` … `q6_k` in super-blocks of 256
//! (`k_quants.rs`). Each encoding follows ggml's reference quantizer (`ggml-quants.c`), so the bytes
//! equal those of llama.cpp's tools; the tests check them against the `gguf` Python package's quantizers and
//! ggml's own.

use half::f16;

use super::k_quants;

/// A tensor type of ggml (GGUF's tensor types) that an export can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// float32.
    F32,
    /// float16, rounded to nearest even.
    F16,
    /// bfloat16, rounded to nearest even (NaNs kept quiet), as ggml converts.
    Bf16,
    /// Blocks of 32: a float16 scale `d = max|x| / 127` and 32 signed bytes `round(x / d)`.
    Q8_0,
    /// Blocks of 32: a float16 scale `d = x_max / −8` (`x_max` the value of largest magnitude) and 4-bit codes
    /// `x / d + 8`.
    Q4_0,
    /// Blocks of 32: float16 `d = (max − min) / 15` and `min`, and 4-bit codes `(x − min) / d`.
    Q4_1,
    /// As `q4_0` with 5-bit codes: `d = x_max / −16`, codes `x / d + 16`, their fifth bits in a 32-bit word.
    Q5_0,
    /// As `q4_1` with 5-bit codes: `d = (max − min) / 31`.
    Q5_1,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 4-bit scales and minimums, 2-bit codes (2.625 bits a value).
    Q2K,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 6-bit scales, 3-bit codes (3.4375 bits a value).
    Q3K,
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 4-bit codes (4.5 bits a value).
    Q4K,
    /// Super-blocks of 256: 8 sub-blocks of 32 with 6-bit scales and minimums, 5-bit codes (5.5 bits a value).
    Q5K,
    /// Super-blocks of 256: 16 sub-blocks of 16 with 8-bit scales, 6-bit codes (6.5625 bits a value).
    Q6K,
}

impl GgmlType {
    /// Every type, in ggml's order.
    pub const ALL: [GgmlType; 13] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Bf16,
    ];

    /// Its number in ggml's `ggml_type` (what a GGUF tensor record stores).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q5_0 => 6,
            GgmlType::Q5_1 => 7,
            GgmlType::Q8_0 => 8,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 11,
            GgmlType::Q4K => 12,
            GgmlType::Q5K => 13,
            GgmlType::Q6K => 14,
            GgmlType::Bf16 => 30,
        }
    }

    /// Its name in llama.cpp's tools (`--outtype`, `llama-quantize`).
    pub fn name(self) -> &'static str {
        match self {
            GgmlType::F32 => "f32",
            GgmlType::F16 => "f16",
            GgmlType::Bf16 => "bf16",
            GgmlType::Q8_0 => "q8_0",
            GgmlType::Q4_0 => "q4_0",
            GgmlType::Q4_1 => "q4_1",
            GgmlType::Q5_0 => "q5_0",
            GgmlType::Q5_1 => "q5_1",
            GgmlType::Q2K => "q2_k",
            GgmlType::Q3K => "q3_k",
            GgmlType::Q4K => "q4_k",
            GgmlType::Q5K => "q5_k",
            GgmlType::Q6K => "q6_k",
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q5_1 => {
                32
            }
            GgmlType::Q2K | GgmlType::Q3K | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => {
                k_quants::SUPER_BLOCK
            }
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q8_0 => 34,
            GgmlType::Q4_0 => 18,
            GgmlType::Q4_1 => 20,
            GgmlType::Q5_0 => 22,
            GgmlType::Q5_1 => 24,
            GgmlType::Q2K => 84,
            GgmlType::Q3K => 110,
            GgmlType::Q4K => 144,
            GgmlType::Q5K => 176,
            GgmlType::Q6K => 210,
        }
    }

    /// Whether a row of `len` elements divides into whole blocks.
    pub fn fits_row(self, len: usize) -> bool {
        len % self.block_len() == 0
    }

    /// The bytes of `count` elements (a whole number of blocks).
    pub fn bytes(self, count: usize) -> usize {
        count / self.block_len() * self.block_bytes()
    }

    /// Appends the encoding of `values` (a whole number of blocks) to `out`.
    pub fn encode(self, values: &[f32], out: &mut Vec<u8>) {
        debug_assert!(self.fits_row(values.len()));
        out.reserve(self.bytes(values.len()));
        match self {
            GgmlType::F32 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes())),
            GgmlType::F16 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&f16::from_f32(*v).to_le_bytes())),
            GgmlType::Bf16 => values
                .iter()
                .for_each(|v| out.extend_from_slice(&to_bf16_bits(*v).to_le_bytes())),
            GgmlType::Q8_0 => values.chunks_exact(32).for_each(|block| {
                let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
                let d = amax / 127.0;
                let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                // `roundf`: halves away from zero, as Rust's `round`; the value is within ±127.
                out.extend(block.iter().map(|v| (v * inverse).round() as i8 as u8));
            }),
            GgmlType::Q4_0 | GgmlType::Q5_0 => values.chunks_exact(32).for_each(|block| {
                let levels = if self == GgmlType::Q4_0 { 16 } else { 32 };
                // The value of largest magnitude (the first of equals), its sign kept: it maps to code 0.
                let extreme = block
                    .iter()
                    .fold(0f32, |m, &v| if v.abs() > m.abs() { v } else { m });
                let d = extreme / -(levels as f32 / 2.0);
                let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
                let offset = levels as f32 / 2.0 + 0.5;
                let codes = block_codes(block, |v| {
                    ((v * inverse + offset) as i8).min(levels - 1) as u8
                });
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                put_codes(out, &codes, self == GgmlType::Q5_0);
            }),
            GgmlType::Q4_1 | GgmlType::Q5_1 => values.chunks_exact(32).for_each(|block| {
                let levels: i32 = if self == GgmlType::Q4_1 { 16 } else { 32 };
                let min = block
                    .iter()
                    .fold(f32::MAX, |m, &v| if v < m { v } else { m });
                let max = block
                    .iter()
                    .fold(-f32::MAX, |m, &v| if v > m { v } else { m });
                let d = (max - min) / (levels - 1) as f32;
                let inverse = if d != 0.0 { 1.0 / d } else { 0.0 };
                let codes = block_codes(block, |v| {
                    (((v - min) * inverse + 0.5) as i32).min(levels - 1) as u8
                });
                out.extend_from_slice(&f16::from_f32(d).to_le_bytes());
                out.extend_from_slice(&f16::from_f32(min).to_le_bytes());
                put_codes(out, &codes, self == GgmlType::Q5_1);
            }),
            GgmlType::Q2K => super_blocks(values, out, k_quants::q2_k),
            GgmlType::Q3K => super_blocks(values, out, k_quants::q3_k),
            GgmlType::Q4K => super_blocks(values, out, k_quants::q4_k),
            GgmlType::Q5K => super_blocks(values, out, k_quants::q5_k),
            GgmlType::Q6K => super_blocks(values, out, k_quants::q6_k),
        }
    }
}

/// Each super-block of `values` encoded by `encode_one`.
fn super_blocks(values: &[f32], out: &mut Vec<u8>, encode_one: fn(&[f32], &mut Vec<u8>)) {
    values
        .chunks_exact(k_quants::SUPER_BLOCK)
        .for_each(|block| encode_one(block, out));
}

/// A block's 32 codes, `code` of each value.
fn block_codes(block: &[f32], code: impl Fn(f32) -> u8) -> [u8; 32] {
    std::array::from_fn(|i| code(block[i]))
}

/// Appends 32 codes as ggml packs them: with `fifth_bits`, first a little-endian 32-bit word of their fifth bits
/// (bit j of code j); then 16 bytes, code j in the low nibble and code j + 16 in the high one.
fn put_codes(out: &mut Vec<u8>, codes: &[u8; 32], fifth_bits: bool) {
    if fifth_bits {
        let high = (0..32).fold(0u32, |w, j| w | (((codes[j] >> 4) & 1) as u32) << j);
        out.extend_from_slice(&high.to_le_bytes());
    }
    out.extend((0..16).map(|j| (codes[j] & 0x0f) | (codes[j + 16] << 4)));
}

/// ggml's float32 → bfloat16: round to nearest even; a NaN stays a NaN (its quiet bit set).
fn to_bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    if bits & 0x7fff_ffff > 0x7f80_0000 {
        return ((bits >> 16) | 64) as u16;
    }
    ((bits + 0x7fff + ((bits >> 16) & 1)) >> 16) as u16
}

impl std::str::FromStr for GgmlType {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        GgmlType::ALL
            .into_iter()
            .find(|t| t.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                format!(
                    "unknown tensor type `{s}`; known: {}",
                    GgmlType::ALL.map(GgmlType::name).join(", ")
                )
            })
    }
}
