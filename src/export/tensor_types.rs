//! Which ggml type each tensor of an export is written in: one type for every matrix, or one of llama-quantize's
//! k-quant mixes (`q4_k_m`, `q5_k_m`), which give the tensors that quantization hurts most — the output head, half
//! the layers' value projections and down projections — more bits. The choices are llama-quantize's, so an export
//! in a mix equals `llama-quantize` run on the converter's float32 file.

use super::ggml::GgmlType;

/// What an export's `--quant` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantization {
    /// Every matrix in this type, as `convert_hf_to_gguf.py --outtype` writes the float types and `q8_0`, and as
    /// `llama-quantize --pure` writes the other block types; a matrix whose rows do not divide into the type's
    /// blocks takes llama-quantize's fallback (`q4_k` → `q5_0`, `q5_k` → `q5_1`, `q6_k` → `q8_0`, `q2_k` and
    /// `q3_k` → `q4_0`; float16 when no block fits).
    Uniform(GgmlType),
    /// llama-quantize's `Q4_K_M`: `q4_k`, with `q6_k` for the output head and for the value and down projections
    /// of the first and last eighth of the layers and of every third layer between.
    Q4KM,
    /// llama-quantize's `Q5_K_M`: as `q4_k_m` with `q5_k` for the rest.
    Q5KM,
}

impl Quantization {
    /// Every mix, by name.
    const MIXES: [(Quantization, &'static str); 2] = [
        (Quantization::Q4KM, "q4_k_m"),
        (Quantization::Q5KM, "q5_k_m"),
    ];

    /// Its name (`--quant`).
    pub fn name(self) -> &'static str {
        match self {
            Quantization::Uniform(t) => t.name(),
            mix => Self::MIXES
                .iter()
                .find(|(m, _)| *m == mix)
                .map_or("", |(_, n)| n),
        }
    }

    /// Whether llama.cpp's converter writes files so (the float types and `q8_0`); llama-quantize writes the others.
    pub fn written_by_converter(self) -> bool {
        matches!(
            self,
            Quantization::Uniform(GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 | GgmlType::Q8_0)
        )
    }

    /// The type of the matrices the mix does not single out.
    fn base(self) -> GgmlType {
        match self {
            Quantization::Uniform(t) => t,
            Quantization::Q4KM => GgmlType::Q4K,
            Quantization::Q5KM => GgmlType::Q5K,
        }
    }

    /// llama.cpp's `general.file_type` (`llama_ftype`) for a file so written: a k-quant type alone is recorded as
    /// llama-quantize records it (`Q4_K` is its name for `Q4_K_M`).
    pub fn file_type(self) -> u32 {
        match self.base() {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q4_0 => 2,
            GgmlType::Q4_1 => 3,
            GgmlType::Q8_0 => 7,
            GgmlType::Q5_0 => 8,
            GgmlType::Q5_1 => 9,
            GgmlType::Q2K => 10,
            GgmlType::Q3K => 12,
            GgmlType::Q4K => 15,
            GgmlType::Q5K => 17,
            GgmlType::Q6K => 18,
            GgmlType::Bf16 => 32,
        }
    }
}

impl From<GgmlType> for Quantization {
    fn from(t: GgmlType) -> Self {
        Quantization::Uniform(t)
    }
}

impl std::str::FromStr for Quantization {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let lower = s.to_ascii_lowercase();
        if let Some((mix, _)) = Self::MIXES.iter().find(|(_, n)| *n == lower) {
            return Ok(*mix);
        }
        s.parse::<GgmlType>()
            .map(Quantization::Uniform)
            .map_err(|_| {
                let mut known: Vec<&str> = GgmlType::ALL.iter().map(|t| t.name()).collect();
                known.extend(Self::MIXES.iter().map(|(_, n)| *n));
                format!("unknown quantization `{s}`; known: {}", known.join(", "))
            })
    }
}

/// The model facts llama-quantize's choices depend on.
#[derive(Clone, Copy, Debug)]
pub struct ModelShape<'a> {
    /// `general.architecture`.
    pub arch: &'a str,
    /// Transformer blocks.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Experts of a mixture-of-experts layer (0 for a dense model).
    pub experts: usize,
}

/// llama-quantize's broad kinds of tensor, by llama.cpp name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Output,
    TokenEmbedding,
    /// Value projections (and fused projections that hold them).
    AttentionValue,
    AttentionKey,
    AttentionOutput,
    FeedForwardDown,
    Other,
}

fn kind(name: &str) -> Kind {
    if name == "output.weight" {
        Kind::Output
    } else if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
        Kind::TokenEmbedding
    } else if ["attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"]
        .iter()
        .any(|k| name.contains(k))
    {
        Kind::AttentionValue
    } else if name.contains("attn_k.weight") {
        Kind::AttentionKey
    } else if name.contains("attn_output.weight") {
        Kind::AttentionOutput
    } else if name.contains("ffn_down") {
        Kind::FeedForwardDown
    } else {
        Kind::Other
    }
}

/// Whether a tensor is quantized at all: matrices, not norms nor expert routers (nor, in the converter's files,
/// the shared expert's gate, which llama-quantize would quantize).
fn quantizable(name: &str, shape: &[usize], quantization: Quantization) -> bool {
    let kept = name.contains("_norm.weight")
        || name.contains("ffn_gate_inp.weight")
        || (quantization.written_by_converter() && name.contains("ffn_gate_inp_shexp.weight"));
    shape.len() >= 2 && !kept
}

/// Where llama-quantize puts a tensor in its file: the tensors outside the blocks first, then block by block, by
/// name within each (`llama_model_loader`'s `weight_name_comparer`). Its counters follow this order.
pub fn llama_quantize_order(name: &str) -> (i64, &str) {
    let layer = name
        .strip_prefix("blk.")
        .and_then(|rest| rest.split('.').next())
        .and_then(|l| l.parse().ok())
        .unwrap_or(-1);
    (layer, name)
}

/// The types of `tensors` (llama.cpp name and shape, in the file's order, which llama-quantize's counters follow):
/// vectors and norms float32; matrices in `quantization`'s type for them, or its fallback where their rows do not
/// divide into that type's blocks.
pub fn tensor_types(
    quantization: Quantization,
    tensors: &[(&str, &[usize])],
    model: ModelShape,
) -> Vec<GgmlType> {
    let mut mix = MixState {
        value_projections: tensors
            .iter()
            .filter(|(n, _)| kind(n) == Kind::AttentionValue)
            .count(),
        tied_embeddings: !tensors.iter().any(|(n, _)| kind(n) == Kind::Output),
        value_index: 0,
        down_index: 0,
    };
    tensors
        .iter()
        .map(|&(name, shape)| {
            if !quantizable(name, shape, quantization) {
                return GgmlType::F32;
            }
            let chosen = match quantization {
                Quantization::Uniform(t) => t,
                mix_type => mix.choose(mix_type, name, shape, model),
            };
            fallback(chosen, *shape.last().unwrap_or(&0))
        })
        .collect()
}

/// llama-quantize's running counts over the tensors of one file.
struct MixState {
    value_projections: usize,
    tied_embeddings: bool,
    value_index: usize,
    down_index: usize,
}

/// llama-quantize's `use_more_bits`: the first and last eighth of `n` and every third one between.
fn more_bits(i: usize, n: usize) -> bool {
    let (i, n) = (i as i64, n as i64);
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

impl MixState {
    /// llama-quantize's type for the matrix `name` in the mix `quantization` (before the fallback).
    fn choose(
        &mut self,
        quantization: Quantization,
        name: &str,
        shape: &[usize],
        model: ModelShape,
    ) -> GgmlType {
        let base = quantization.base();
        let kind = kind(name);
        if kind == Kind::Output || (self.tied_embeddings && kind == Kind::TokenEmbedding) {
            // The output head (or the embeddings that serve as it): q6_k, or q8_0 when its rows are not whole
            // super-blocks.
            return match shape.last().is_some_and(|&c| base.fits_row(c)) {
                true => GgmlType::Q6K,
                false => GgmlType::Q8_0,
            };
        }
        match kind {
            Kind::AttentionValue => {
                let mut chosen = match more_bits(self.value_index, self.value_projections) {
                    true => GgmlType::Q6K,
                    false => base,
                };
                let seventy_b = model.layers == 80
                    && match model.arch {
                        "llama" => model.heads != model.kv_heads,
                        "qwen2" => true,
                        _ => false,
                    };
                if seventy_b && chosen == GgmlType::Q4K {
                    chosen = GgmlType::Q5K;
                }
                if model.experts == 8 {
                    chosen = GgmlType::Q8_0;
                }
                self.value_index += 1;
                chosen
            }
            Kind::AttentionKey if model.experts == 8 => GgmlType::Q8_0,
            Kind::AttentionOutput if model.experts == 8 && quantization == Quantization::Q4KM => {
                GgmlType::Q5K
            }
            Kind::FeedForwardDown => {
                // Of a mixture the layer is read from the name: its experts' tensors need not be consecutive.
                let layer = match model.experts > 1 {
                    true => name
                        .strip_prefix("blk.")
                        .and_then(|r| r.split('.').next())
                        .and_then(|l| l.parse().ok())
                        .unwrap_or(self.down_index),
                    false => self.down_index,
                };
                self.down_index += 1;
                match more_bits(layer, model.layers) {
                    true => GgmlType::Q6K,
                    false => base,
                }
            }
            _ => base,
        }
    }
}

/// llama-quantize's type for a matrix of `columns` columns meant to be `chosen`: `chosen` where its rows divide
/// into the blocks, else a smaller-block type, else float16.
fn fallback(chosen: GgmlType, columns: usize) -> GgmlType {
    if chosen.fits_row(columns) {
        return chosen;
    }
    let smaller = match chosen {
        GgmlType::Q2K | GgmlType::Q3K => GgmlType::Q4_0,
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        other => other,
    };
    match smaller.fits_row(columns) {
        true => smaller,
        false => GgmlType::F16,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_bits_picks_llama_quantizes_layers() {
        let picked: Vec<usize> = (0..32).filter(|&i| more_bits(i, 32)).collect();
        assert_eq!(
            picked,
            [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
        );
    }

    #[test]
    fn names_parse_and_print() {
        for name in ["q4_k_m", "Q5_K_M", "q6_k", "f16"] {
            let q: Quantization = name.parse().unwrap();
            assert_eq!(q.name(), name.to_ascii_lowercase());
        }
        let err = "q4_k_s".parse::<Quantization>().unwrap_err();
        assert!(err.contains("q4_k_m") && err.contains("q2_k"), "{err}");
    }

    #[test]
    fn rows_that_do_not_fit_fall_back() {
        assert_eq!(fallback(GgmlType::Q4K, 576), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q6K, 64), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::Q3K, 48), GgmlType::F16);
        assert_eq!(fallback(GgmlType::Q4K, 512), GgmlType::Q4K);
    }
}
