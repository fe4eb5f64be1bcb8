//! bitsandbytes' safetensors layout for 4-bit weights, and quantizing safetensors files and model folders into it.
//!
//! A quantized weight `P.weight` is stored as (bitsandbytes `QuantState.as_dict(packed=True)`):
//!
//! | key | content |
//! |---|---|
//! | `P.weight` | packed codes, U8 `[(n+1)/2, 1]` (other storage dtypes are read as raw bytes) |
//! | `P.weight.absmax` | U8 codes (double quant) or F32 absmax, one per block |
//! | `P.weight.quant_map` | F32 `[16]`, the 4-bit codebook |
//! | `P.weight.nested_absmax` | F32, one per 256 absmax codes (double quant only) |
//! | `P.weight.nested_quant_map` | F32 `[256]`, the signed dynamic map (double quant only) |
//! | `P.weight.quant_state.bitsandbytes__nf4` (or `__fp4`) | U8 bytes of a JSON object: `quant_type`, `blocksize`, `dtype`, `shape` (+ `nested_blocksize`, `nested_dtype`, `nested_offset`) |
//!
//! Loading always uses the maps stored in the file, so checkpoints quantized on any host load exactly.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};
use serde::Deserialize;

use super::safetensors::{weight_files, INDEX_FILE};
use crate::error::{Error, Result};
use crate::files::apart::check_output_apart;
use crate::files::{
    candle_float_dtype, read_json, refuse_existing, replace_dir, view_to_f32, write_safetensors,
    MappedSafetensors, RawTensor,
};
use crate::models::pyjson::python_float;
use crate::precision::TorchDtype;
use crate::quant::{
    check_nested_blocksize, BlockScales, NestedAbsmax, Nf4Tensor, QuantConfig, QuantType,
    ALLOWED_BLOCKSIZES,
};

const QUANT_STATE_KEY: &str = ".quant_state.bitsandbytes__";

/// The JSON blob of `P.weight.quant_state.bitsandbytes__<type>`.
#[derive(Debug, Deserialize)]
struct QuantStateJson {
    quant_type: String,
    blocksize: usize,
    dtype: String,
    shape: Vec<usize>,
    nested_blocksize: Option<usize>,
    nested_dtype: Option<String>,
    nested_offset: Option<f64>,
}

/// The quant-state JSON exactly as bitsandbytes serializes it (`json.dumps` key order and separators).
fn quant_state_json(t: &Nf4Tensor) -> String {
    let shape: Vec<String> = t.shape().iter().map(|d| d.to_string()).collect();
    let mut json = format!(
        "{{\"quant_type\": \"{}\", \"blocksize\": {}, \"dtype\": \"{}\", \"shape\": [{}]",
        t.quant_type(),
        t.blocksize(),
        TorchDtype::of(t.dtype()),
        shape.join(", ")
    );
    if let BlockScales::Nested(n) = t.scales() {
        json.push_str(&format!(
            ", \"nested_blocksize\": {}, \"nested_dtype\": \"float32\", \"nested_offset\": {}",
            n.blocksize,
            python_float(n.offset as f64)
        ));
    }
    json.push('}');
    json
}

/// The tensors that store quantized weight `name` in bitsandbytes' layout.
pub fn bnb_entries(name: &str, t: &Nf4Tensor) -> Vec<(String, RawTensor<'static>)> {
    let mut out = vec![
        (
            name.to_string(),
            RawTensor::u8(vec![t.packed().len(), 1], t.packed().to_vec()),
        ),
        (
            format!("{name}.quant_map"),
            RawTensor::f32(vec![16], t.code()),
        ),
        (
            format!("{name}{QUANT_STATE_KEY}{}", t.quant_type()),
            RawTensor::u8(
                vec![quant_state_json(t).len()],
                quant_state_json(t).into_bytes(),
            ),
        ),
    ];
    match t.scales() {
        BlockScales::Plain(absmax) => out.push((
            format!("{name}.absmax"),
            RawTensor::f32(vec![absmax.len()], absmax),
        )),
        BlockScales::Nested(n) => {
            out.push((
                format!("{name}.absmax"),
                RawTensor::u8(vec![n.codes.len()], n.codes.clone()),
            ));
            out.push((
                format!("{name}.nested_absmax"),
                RawTensor::f32(vec![n.absmax.len()], &n.absmax),
            ));
            out.push((
                format!("{name}.nested_quant_map"),
                RawTensor::f32(vec![n.code.len()], &n.code),
            ));
        }
    }
    out
}

/// Names of the bitsandbytes-quantized weights in a file (those with a `quant_state` entry).
pub fn quantized_weight_names(st: &SafeTensors<'_>) -> Vec<String> {
    let mut names: Vec<String> = st
        .names()
        .into_iter()
        .filter_map(|k| k.find(QUANT_STATE_KEY).map(|i| k[..i].to_string()))
        .collect();
    names.sort();
    names.dedup();
    names
}

/// Reads quantized weight `name` from a parsed file; `path` is for error messages.
pub fn read_bnb_weight(st: &SafeTensors<'_>, name: &str, path: &Path) -> Result<Nf4Tensor> {
    let frame = read_bnb_frame(st, name, path)?;
    let (packed, scales) = frame.read_blocks(st, 0..frame.blocks())?;
    frame.with_blocks(packed, scales)
}

/// A bitsandbytes 4-bit weight as its file describes it, less its packed codes and block scales (what grows with
/// the weight): read first, it rebuilds the weight from those, read whole or a run of blocks at a time
/// ([`BnbFrame::read_blocks`], [`BnbFrame::with_blocks`]).
pub struct BnbFrame {
    name: String,
    path: PathBuf,
    code: [f32; 16],
    shape: Vec<usize>,
    dtype: DType,
    quant_type: QuantType,
    blocksize: usize,
    /// Double quantization's nested absmax, map, offset and block size (the block scales are then 8-bit codes).
    nested: Option<(Vec<f32>, Vec<f32>, f32, usize)>,
}

/// The frame of quantized weight `name` of a parsed file ([`BnbFrame`]); `path` is for error messages.
pub fn read_bnb_frame(st: &SafeTensors<'_>, name: &str, path: &Path) -> Result<BnbFrame> {
    let bad = |reason: String| Error::InvalidQuantState {
        name: name.to_string(),
        reason: format!("{reason} (in `{}`)", path.display()),
    };
    let get = |key: &str| -> Result<TensorView<'_>> {
        st.tensor(key)
            .map_err(|_| bad(format!("tensor `{key}` is missing")))
    };
    let state_keys: Vec<String> = st
        .names()
        .into_iter()
        .filter(|k| {
            k.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with(QUANT_STATE_KEY))
        })
        .map(str::to_string)
        .collect();
    let state_key = match state_keys.as_slice() {
        [one] => one.clone(),
        [] => return Err(bad(format!("no `{name}{QUANT_STATE_KEY}nf4|fp4` entry"))),
        many => return Err(bad(format!("several quant-state entries: {many:?}"))),
    };
    let suffix = &state_key[name.len() + QUANT_STATE_KEY.len()..];
    let key_type: QuantType = suffix.parse().map_err(|_| {
        bad(format!(
            "`{state_key}` names quant type `{suffix}`; only nf4 and fp4 are supported"
        ))
    })?;
    let json_bytes = get(&state_key)?.data().to_vec();
    let state: QuantStateJson = serde_json::from_slice(&json_bytes).map_err(|e| {
        bad(format!(
            "`{state_key}` is not the expected JSON ({e}); the file may be corrupt"
        ))
    })?;
    let quant_type: QuantType = state.quant_type.parse().map_err(|_| {
        bad(format!(
            "`{state_key}` has quant_type `{}`; only nf4 and fp4 are supported",
            state.quant_type
        ))
    })?;
    if quant_type != key_type {
        return Err(bad(format!(
            "`{state_key}` says quant_type `{}`",
            state.quant_type
        )));
    }
    let dtype = state
        .dtype
        .parse::<TorchDtype>()
        .map_err(|e| bad(format!("`{state_key}`: {e}")))?
        .dtype();
    let packed_bytes = get(name)?.data().len();
    let code_view = get(&format!("{name}.quant_map"))?;
    let code_vec =
        f32_values(&code_view).ok_or_else(|| bad("`quant_map` is not float32".into()))?;
    let code: [f32; 16] = code_vec
        .try_into()
        .map_err(|v: Vec<f32>| bad(format!("`quant_map` has {} entries, expected 16", v.len())))?;
    let absmax_view = get(&format!("{name}.absmax"))?;
    let nested = match (state.nested_offset, state.nested_blocksize) {
        (Some(offset), Some(nested_blocksize)) => {
            check_nested_blocksize(nested_blocksize).map_err(bad)?;
            if let Some(d) = state.nested_dtype.as_deref().filter(|d| *d != "float32") {
                return Err(bad(format!(
                    "nested_dtype `{d}` is not supported (bitsandbytes writes float32)"
                )));
            }
            if absmax_view.dtype() != Dtype::U8 {
                return Err(bad(format!(
                    "`absmax` is {:?}; double-quantized absmax must be U8 codes",
                    absmax_view.dtype()
                )));
            }
            let nested_absmax = f32_values(&get(&format!("{name}.nested_absmax"))?)
                .ok_or_else(|| bad("`nested_absmax` is not float32".into()))?;
            let nested_code = f32_values(&get(&format!("{name}.nested_quant_map"))?)
                .ok_or_else(|| bad("`nested_quant_map` is not float32".into()))?;
            Some((nested_absmax, nested_code, offset as f32, nested_blocksize))
        }
        (None, None) if absmax_view.dtype() == Dtype::F32 => None,
        (None, None) => {
            return Err(bad(
                "`absmax` is not float32 and there is no nested state".into()
            ))
        }
        _ => {
            return Err(bad(
                "the JSON has only part of the nested state (nested_offset / nested_blocksize)"
                    .into(),
            ))
        }
    };
    // The stored sizes against the shape, so that a run of blocks is read exactly.
    if !ALLOWED_BLOCKSIZES.contains(&state.blocksize) {
        return Err(bad(format!(
            "blocksize {} is not one of {ALLOWED_BLOCKSIZES:?}",
            state.blocksize
        )));
    }
    let n = state
        .shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .filter(|&n| n > 0)
        .ok_or_else(|| {
            bad(format!(
                "shape {:?} has no elements, or more than any tensor",
                state.shape
            ))
        })?;
    if packed_bytes != n.div_ceil(2) {
        return Err(bad(format!(
            "{packed_bytes} packed bytes for shape {:?}: expected {} (two 4-bit codes per byte)",
            state.shape,
            n.div_ceil(2)
        )));
    }
    let blocks = n.div_ceil(state.blocksize);
    let scale_bytes = if nested.is_some() { 1 } else { 4 };
    if absmax_view.data().len() != blocks * scale_bytes {
        return Err(bad(format!(
            "{} absmax values for {n} elements at blocksize {}: expected {blocks}",
            absmax_view.data().len() / scale_bytes,
            state.blocksize
        )));
    }
    Ok(BnbFrame {
        name: name.to_string(),
        path: path.to_path_buf(),
        code,
        shape: state.shape,
        dtype,
        quant_type,
        blocksize: state.blocksize,
        nested,
    })
}

impl BnbFrame {
    fn bad(&self, reason: String) -> Error {
        Error::InvalidQuantState {
            name: self.name.clone(),
            reason: format!("{reason} (in `{}`)", self.path.display()),
        }
    }

    /// The weight's shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The 4-bit format it is stored in (the settings [`Nf4Tensor::config`] gives of the weight).
    pub fn config(&self) -> QuantConfig {
        QuantConfig {
            quant_type: self.quant_type,
            blocksize: self.blocksize,
            double_quant: self.nested.is_some(),
            ..QuantConfig::nf4()
        }
    }

    /// The weight's 4-bit blocks.
    pub fn blocks(&self) -> usize {
        self.shape
            .iter()
            .product::<usize>()
            .div_ceil(self.blocksize)
    }

    /// Blocks `blocks` of the weight as stored in `st` (its file, parsed): their packed codes (two a byte, the
    /// last block's short at the weight's end) and their scales, 1-D on the host — 8-bit codes with double
    /// quantization, float32 absmax without. Only those bytes of the file are read.
    pub fn read_blocks(
        &self,
        st: &SafeTensors<'_>,
        blocks: std::ops::Range<usize>,
    ) -> Result<(Vec<u8>, Tensor)> {
        let get = |key: &str| -> Result<TensorView<'_>> {
            st.tensor(key)
                .map_err(|_| self.bad(format!("tensor `{key}` is missing")))
        };
        // Sizes were checked against the shape (`read_bnb_frame`): the last block's codes end with the data.
        let half = self.blocksize / 2;
        let packed_view = get(&self.name)?;
        let packed = packed_view.data();
        let to = (blocks.end * half).min(packed.len());
        let packed = packed
            .get(blocks.start * half..to)
            .ok_or_else(|| self.bad(format!("no blocks {blocks:?} in the packed codes")))?
            .to_vec();
        let absmax = get(&format!("{}.absmax", self.name))?;
        let dtype = match self.nested {
            Some(_) => DType::U8,
            None => DType::F32,
        };
        let size = dtype.size_in_bytes();
        let bytes = absmax
            .data()
            .get(blocks.start * size..blocks.end * size)
            .ok_or_else(|| {
                self.bad(format!(
                    "`absmax` holds {} bytes, not the scales of blocks {blocks:?}",
                    absmax.data().len()
                ))
            })?;
        let scales = Tensor::from_raw_buffer(bytes, dtype, &[blocks.len()], &Device::Cpu)?;
        Ok((packed, scales))
    }

    /// The float32 values of blocks `blocks` of the weight (1-D, the last block short at the weight's end), as
    /// [`Nf4Tensor::dequantize`] gives them: each block's scale first (with double quantization `map[c] · absmax₂ +
    /// offset`, rounded after each step), then `code[nibble] · scale`. Only those blocks are read from `st`.
    pub fn dequantize_blocks(
        &self,
        st: &SafeTensors<'_>,
        blocks: std::ops::Range<usize>,
    ) -> Result<Tensor> {
        let (packed, scales) = self.read_blocks(st, blocks.clone())?;
        let scales = match &self.nested {
            Some((absmax, map, offset, nested)) => {
                let codes = scales.to_vec1::<u8>()?;
                let scale = |(i, c): (usize, &u8)| {
                    NestedAbsmax::block_scale(map, *c, absmax[(blocks.start + i) / nested], *offset)
                };
                codes.iter().enumerate().map(scale).collect()
            }
            None => scales.to_vec1::<f32>()?,
        };
        let n: usize = self.shape.iter().product();
        let elements = (blocks.end * self.blocksize).min(n) - blocks.start * self.blocksize;
        let part = Nf4Tensor::from_parts(
            packed,
            BlockScales::Plain(scales),
            self.code,
            vec![elements],
            self.dtype,
            self.quant_type,
            self.blocksize,
        )
        .map_err(|e| self.bad(e.to_string()))?;
        part.dequantize(DType::F32)
    }

    /// The weight of this frame with `packed` and `scales`, every block's ([`BnbFrame::read_blocks`]'s, joined in
    /// order), checked to fit.
    pub fn with_blocks(&self, packed: Vec<u8>, scales: Tensor) -> Result<Nf4Tensor> {
        let scales = match &self.nested {
            Some((absmax, code, offset, blocksize)) => BlockScales::Nested(NestedAbsmax {
                codes: scales.to_vec1::<u8>()?,
                absmax: absmax.clone(),
                code: code.clone(),
                offset: *offset,
                blocksize: *blocksize,
            }),
            None => BlockScales::Plain(scales.to_vec1::<f32>()?),
        };
        Nf4Tensor::from_parts(
            packed,
            scales,
            self.code,
            self.shape.clone(),
            self.dtype,
            self.quant_type,
            self.blocksize,
        )
        .map_err(|e| self.bad(e.to_string()))
    }
}

fn f32_values(view: &TensorView<'_>) -> Option<Vec<f32>> {
    (view.dtype() == Dtype::F32)
        .then(|| view_to_f32(view))
        .flatten()
}

/// Every quantized weight of a bitsandbytes safetensors file, by name.
pub fn read_bnb_file(path: impl AsRef<Path>) -> Result<BTreeMap<String, Nf4Tensor>> {
    let file = MappedSafetensors::open(path.as_ref())?;
    let st = file.tensors()?;
    quantized_weight_names(&st)
        .into_iter()
        .map(|name| read_bnb_weight(&st, &name, file.path()).map(|t| (name, t)))
        .collect()
}

/// Writes quantized weights (and nothing else) to a safetensors file in bitsandbytes' layout, atomically.
pub fn write_bnb_file<'a>(
    path: impl AsRef<Path>,
    weights: impl IntoIterator<Item = (&'a str, &'a Nf4Tensor)>,
) -> Result<()> {
    let entries = weights
        .into_iter()
        .flat_map(|(name, t)| bnb_entries(name, t));
    write_safetensors(
        path.as_ref(),
        entries,
        Some(HashMap::from([("format".to_string(), "pt".to_string())])),
    )
}

/// Modules transformers never turns into 4-bit layers: embeddings and the output head.
const NOT_QUANTIZED_MODULES: [&str; 6] = [
    "lm_head",
    "embed_tokens",
    "embed_out",
    "wte",
    "wpe",
    "word_embeddings",
];

/// True for the weights transformers' bitsandbytes integration quantizes: 2-D `*.weight` tensors of linear layers,
/// not embeddings, norms, `lm_head`, or a mixture of experts' router (`mlp.gate`, Mixtral's `block_sparse_moe.gate`,
/// gpt-oss's `mlp.router`;
/// transformers 5 holds it as a plain parameter, which stays in the checkpoint's dtype).
pub fn is_quantizable_linear(name: &str, shape: &[usize]) -> bool {
    let Some(module) = name.strip_suffix(".weight") else {
        return false;
    };
    let last = module.rsplit('.').next().unwrap_or(module);
    let router = [".mlp.gate", ".block_sparse_moe.gate", ".mlp.router"]
        .iter()
        .any(|r| module.ends_with(r));
    shape.len() == 2 && !NOT_QUANTIZED_MODULES.contains(&last) && !last.contains("norm") && !router
}

/// Options for [`quantize_path`].
#[derive(Clone, Debug)]
pub struct QuantizeOptions {
    /// How to quantize each linear weight.
    pub config: QuantConfig,
    /// `bnb_4bit_compute_dtype` written to a model folder's `config.json`.
    pub compute_dtype: TorchDtype,
    /// Replace an existing output (it is only removed once the new output is complete).
    pub overwrite: bool,
}

impl Default for QuantizeOptions {
    fn default() -> Self {
        QuantizeOptions {
            config: QuantConfig::nf4(),
            compute_dtype: TorchDtype::BFloat16,
            overwrite: false,
        }
    }
}

/// What [`quantize_path`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantizeReport {
    /// Linear weights quantized.
    pub quantized_tensors: usize,
    /// Parameters in those weights.
    pub quantized_params: usize,
    /// Bytes those weights take after quantization (codes and statistics).
    pub quantized_bytes: usize,
    /// Tensors copied unchanged (embeddings, norms, `lm_head`, biases).
    pub kept_tensors: usize,
    /// Safetensors files written.
    pub files: Vec<PathBuf>,
}

impl QuantizeReport {
    /// Bits per quantized parameter.
    pub fn bits_per_parameter(&self) -> f64 {
        self.quantized_bytes as f64 * 8.0 / self.quantized_params.max(1) as f64
    }
}

/// Quantizes a `.safetensors` file or a model folder (see [`quantize_file`] and [`quantize_model_dir`]).
pub fn quantize_path(
    input: &Path,
    output: &Path,
    options: &QuantizeOptions,
) -> Result<QuantizeReport> {
    if input.is_dir() {
        quantize_model_dir(input, output, options)
    } else {
        quantize_file(input, output, options)
    }
}

/// Quantizes every linear weight of one safetensors file into bitsandbytes' layout and copies the other tensors.
pub fn quantize_file(
    input: &Path,
    output: &Path,
    options: &QuantizeOptions,
) -> Result<QuantizeReport> {
    options.config.validate()?;
    check_output_apart(("output", output), &[("input", input)], "nf4")?;
    refuse_existing(output, options.overwrite)?;
    let mut report = QuantizeReport::default();
    quantize_one_file(input, output, options, &mut report)?;
    Ok(report)
}

/// An error saying what to do when `input` is a GGUF file (by its magic bytes, whatever its name): its weights are
/// already quantized in llama.cpp's formats, and the model loads from it directly.
fn refuse_gguf(input: &Path) -> Result<()> {
    use std::io::Read;
    let mut magic = [0u8; 4];
    let is_gguf = std::fs::File::open(input)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF";
    if !is_gguf {
        return Ok(());
    }
    Err(Error::invalid_file(
        input,
        "this is a GGUF file, whose weights are already quantized (llama.cpp's formats), not safetensors: train, \
         evaluate or generate on it directly (`--model` / `name_or_path` = the .gguf file; its weights are read \
         as floats, and its linear weights quantized to NF4 on load with `--quantize nf4` / `load_in_4bit`), or \
         quantize the model's Hugging Face folder (config.json + *.safetensors) instead",
    ))
}

/// Quantizes `input` into `output` (which must not exist or may be replaced), adding to `report`.
fn quantize_one_file(
    input: &Path,
    output: &Path,
    options: &QuantizeOptions,
    report: &mut QuantizeReport,
) -> Result<BTreeMap<String, usize>> {
    refuse_gguf(input)?;
    let file = MappedSafetensors::open(input)?;
    let st = file.tensors()?;
    if let Some(already) = quantized_weight_names(&st).first() {
        return Err(Error::invalid_file(
            input,
            format!("`{already}` is already bitsandbytes-quantized; quantize the original (unquantized) weights"),
        ));
    }
    let mut entries: Vec<(String, RawTensor<'_>)> = Vec::new();
    let mut names: Vec<&str> = st.names();
    names.sort();
    for name in names {
        let view = st
            .tensor(name)
            .map_err(|e| Error::invalid_file(input, format!("tensor `{name}`: {e}")))?;
        let dtype = candle_float_dtype(view.dtype());
        match dtype {
            Some(dtype) if is_quantizable_linear(name, view.shape()) => {
                let values = view_to_f32(&view).unwrap_or_default();
                let q = Nf4Tensor::quantize_values(
                    &values,
                    view.shape(),
                    dtype,
                    &options.config,
                    name,
                )?;
                report.quantized_tensors += 1;
                report.quantized_params += q.elem_count();
                report.quantized_bytes += q.size_in_bytes();
                entries.extend(bnb_entries(name, &q));
            }
            _ => {
                report.kept_tensors += 1;
                entries.push((name.to_string(), RawTensor::from_view(&view)));
            }
        }
    }
    let sizes = entries
        .iter()
        .map(|(k, t)| (k.clone(), t.data.len()))
        .collect();
    let metadata = file
        .metadata()?
        .or_else(|| Some(HashMap::from([("format".to_string(), "pt".to_string())])));
    write_safetensors(output, entries, metadata)?;
    report.files.push(output.to_path_buf());
    Ok(sizes)
}

/// Quantizes a Hugging Face model folder: every safetensors shard (same file names), the shard index, and
/// `config.json` with the `quantization_config` transformers expects, so `AutoModelForCausalLM.from_pretrained`
/// loads the result with bitsandbytes. Tokenizer and other files are copied. The folder is built next to `output`
/// and renamed into place when complete.
pub fn quantize_model_dir(
    input: &Path,
    output: &Path,
    options: &QuantizeOptions,
) -> Result<QuantizeReport> {
    options.config.validate()?;
    check_output_apart(("output", output), &[("input", input)], "nf4")?;
    refuse_existing(output, options.overwrite)?;
    let config_path = input.join("config.json");
    let mut config: serde_json::Value = read_json(&config_path)?;
    let Some(config_obj) = config.as_object_mut() else {
        return Err(Error::invalid_file(&config_path, "expected a JSON object"));
    };
    if config_obj.contains_key("quantization_config") {
        return Err(Error::invalid_file(
            &config_path,
            "the model is already quantized (`quantization_config` is set)",
        ));
    }
    config_obj.insert(
        "quantization_config".into(),
        quantization_config_json(&options.config, options.compute_dtype),
    );

    let mut entries: Vec<PathBuf> = std::fs::read_dir(input)
        .map_err(|e| Error::io("cannot list", input, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    entries.sort();
    let shards = weight_files(input)?;
    // With --overwrite, the old output goes only once the new one is complete.
    replace_dir(output, |staging| {
        let mut report = QuantizeReport::default();
        let mut weight_map = BTreeMap::new();
        let mut total_size = 0usize;
        for shard in &shards {
            let file_name = shard
                .file_name()
                .map(|n| n.to_os_string())
                .unwrap_or_default();
            let sizes = quantize_one_file(shard, &staging.join(&file_name), options, &mut report)?;
            for (key, size) in sizes {
                total_size += size;
                weight_map.insert(
                    key,
                    serde_json::Value::String(file_name.to_string_lossy().into_owned()),
                );
            }
        }
        report.files = report
            .files
            .iter()
            .map(|f| output.join(f.file_name().unwrap_or_default()))
            .collect();
        if input.join(INDEX_FILE).exists() {
            let index = serde_json::json!({ "metadata": { "total_size": total_size }, "weight_map": weight_map });
            write_json(&staging.join("model.safetensors.index.json"), &index)?;
        }
        write_json(&staging.join("config.json"), &config)?;
        for path in &entries {
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let is_weights = name.ends_with(".safetensors")
                || name == INDEX_FILE
                || name == "config.json"
                || [".bin", ".pt", ".pth", ".gguf"]
                    .iter()
                    .any(|ext| name.ends_with(ext));
            if !is_weights {
                std::fs::copy(path, staging.join(&name))
                    .map_err(|e| Error::io("cannot copy", path, e))?;
            }
        }
        Ok(report)
    })
}

/// transformers' `BitsAndBytesConfig.to_dict()` for a 4-bit config with the given compute dtype name.
pub fn quantization_config_json(
    config: &QuantConfig,
    compute_dtype: TorchDtype,
) -> serde_json::Value {
    serde_json::json!({
        "_load_in_4bit": true,
        "_load_in_8bit": false,
        "bnb_4bit_compute_dtype": compute_dtype,
        "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_quant_type": config.quant_type.as_str(),
        "bnb_4bit_use_double_quant": config.double_quant,
        "llm_int8_enable_fp32_cpu_offload": false,
        "llm_int8_has_fp16_weight": false,
        "llm_int8_skip_modules": null,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": true,
        "load_in_8bit": false,
        "quant_method": "bitsandbytes",
    })
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value)
        .map_err(|e| Error::invalid_file(path, e.to_string()))?
        + "\n";
    std::fs::write(path, text).map_err(|e| Error::io("cannot write", path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_weights_are_recognized() {
        assert!(is_quantizable_linear(
            "model.layers.0.self_attn.q_proj.weight",
            &[64, 64]
        ));
        assert!(is_quantizable_linear(
            "model.layers.3.mlp.down_proj.weight",
            &[64, 128]
        ));
        assert!(!is_quantizable_linear(
            "model.embed_tokens.weight",
            &[100, 64]
        ));
        assert!(!is_quantizable_linear("lm_head.weight", &[100, 64]));
        assert!(!is_quantizable_linear("model.norm.weight", &[64]));
        assert!(!is_quantizable_linear(
            "model.layers.0.self_attn.q_proj.bias",
            &[64]
        ));
        // A mixture of experts: every expert is quantized, the router is not.
        assert!(is_quantizable_linear(
            "model.layers.0.block_sparse_moe.experts.7.w2.weight",
            &[64, 128]
        ));
        for router in [
            "model.layers.0.block_sparse_moe.gate.weight",
            "model.layers.0.mlp.gate.weight",
        ] {
            assert!(!is_quantizable_linear(router, &[8, 64]), "{router}");
        }
    }
}
