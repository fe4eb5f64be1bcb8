//! ggml's tensor types that an export writes, and their encodings: float32, float16 and bfloat16 element by
//! element, and `q8_0` in blocks of 32 — the types llama.cpp's `convert_hf_to_gguf.py` writes. Each encoding follows
//! ggml's reference quantizer (`ggml-quants.c`), so the bytes equal those of llama.cpp's tools; the tests check them
//! against the `gguf` Python package's quantizers.

use half::f16;

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
}

impl GgmlType {
    /// Every type, in ggml's order.
    pub const ALL: [GgmlType; 4] = [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0, GgmlType::Bf16];

    /// Its number in ggml's `ggml_type` (what a GGUF tensor record stores).
    pub fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
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
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_len(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q8_0 => 32,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            GgmlType::F32 => 4,
            GgmlType::F16 | GgmlType::Bf16 => 2,
            GgmlType::Q8_0 => 34,
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
        }
    }
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
