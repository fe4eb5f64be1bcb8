//! Loading a model and its tokenizer: weights by Hugging Face name from safetensors (sharded, bitsandbytes 4-bit)
//! or GGUF, checked against the configuration, quantized on load one tensor at a time.

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;

use super::bnb::{read_bnb_frame, read_bnb_weight};
use super::gguf::GgufFile;
use super::hub::{hub_fetcher, hub_required, hub_snapshot, HUB_FILES};
use super::in_file::{frozen_weight, Piece, StoredTensors, WeightInFile};
use super::safetensors::ShardedSafetensors;
use super::source::ModelSource;
use crate::error::{Error, Result};
use crate::files::{first_non_finite, MappedSafetensors};
use crate::lora::LoraLinear;
use crate::models::config::validate::ConfigKeys;
use crate::models::{LayerWeights, LlamaModel, ModelConfig, MoeConfig, TextTokenizer};
use crate::ops::frozen_linear::StoredBlocks;
use crate::ops::rope::{LongRopeScaling, RopeScaling};
use crate::ops::{FrozenLinear, FrozenWeight};
use crate::precision::master_dtype;
use crate::quant::mxfp4::{dequantize_mxfp4, MXFP4_BLOCK};
use crate::quant::{Nf4Tensor, QuantConfig};

/// How to load a model.
#[derive(Clone, Debug)]
pub struct LoadOptions {
    /// Quantize the linear weights on load (one tensor at a time); `None` keeps them as stored.
    pub quantization: Option<QuantConfig>,
    /// Activation / matmul dtype.
    pub compute_dtype: DType,
    /// Leave the linear weights of a Hugging Face folder in their files, each read (and quantized) again at every
    /// use ([`FrozenWeight::Deferred`]): the model holds only its embeddings, head and norms, which lets an export
    /// stream a model larger than memory. Slow for anything that uses a weight more than once (training,
    /// generation).
    pub defer_linear_weights: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            quantization: None,
            compute_dtype: DType::F32,
            defer_linear_weights: false,
        }
    }
}

/// A model with its tokenizer.
pub struct LoadedModel {
    /// The model.
    pub model: LlamaModel,
    /// Its tokenizer (a folder without `tokenizer.json` has none).
    pub tokenizer: Option<TextTokenizer>,
    /// Where it came from (for messages and adapter configs).
    pub source: String,
}

impl LoadedModel {
    /// The tokenizer, or an error saying the model folder lacks one.
    pub fn tokenizer(&self) -> Result<&TextTokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| no_tokenizer(&self.source))
    }
}

/// The error for model `spec` (as [`load_model`] takes it) without a tokenizer, saying where one goes: a folder's
/// `tokenizer.json`, or a GGUF file's own metadata (a file beside it is not read).
pub fn no_tokenizer(spec: &str) -> Error {
    let is_gguf = Path::new(spec)
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    Error::Model(match is_gguf {
        true => format!(
            "{spec} has no tokenizer in its metadata (`tokenizer.ggml.*`); use a GGUF file written with its \
             tokenizer (llama.cpp's converter writes one), or the model's Hugging Face folder"
        ),
        false => format!(
            "{spec} has no tokenizer.json; copy the tokenizer files (tokenizer.json, tokenizer_config.json) into \
             the model folder"
        ),
    })
}

/// Tensors by Hugging Face name from either file kind.
enum Weights {
    Safetensors(ShardedSafetensors),
    Gguf(Box<(GgufFile, ModelConfig)>),
}

impl Weights {
    fn where_(&self) -> String {
        match self {
            Weights::Safetensors(s) => s.folder().display().to_string(),
            Weights::Gguf(g) => g.0.path().display().to_string(),
        }
    }

    fn has(&self, name: &str) -> bool {
        match self {
            Weights::Safetensors(s) => s.file_of(name).is_some(),
            Weights::Gguf(g) => g.0.has(name),
        }
    }

    /// A dense tensor, checked against the shape the config implies.
    fn dense(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = match self {
            Weights::Safetensors(s) => {
                let file = s.file_of(name).ok_or_else(|| {
                    Error::Model(format!(
                        "tensor `{name}` is missing from {}",
                        s.folder().display()
                    ))
                })?;
                s.mark_read(name);
                let st = file.tensors()?;
                let view = st
                    .tensor(name)
                    .map_err(|e| Error::invalid_file(file.path(), format!("`{name}`: {e}")))?;
                let t = view.load(&Device::Cpu).map_err(|e| {
                    Error::invalid_file(file.path(), format!("cannot read `{name}`: {e}"))
                })?;
                file.release(view.data());
                t
            }
            Weights::Gguf(g) => {
                g.0.tensor(name, g.1.num_attention_heads, g.1.num_key_value_heads)?
            }
        };
        self.check_shape(name, t.dims(), shape)?;
        check_finite(&t, name, &self.where_())?;
        Ok(t)
    }

    /// An error unless tensor `name`, of shape `found`, has the shape the config implies.
    fn check_shape(&self, name: &str, found: &[usize], shape: &[usize]) -> Result<()> {
        self.check_shape_of("tensor", name, found, shape)
    }

    /// [`Weights::check_shape`] for a `kind` of tensor (`tensor`, `4-bit tensor`).
    fn check_shape_of(
        &self,
        kind: &str,
        name: &str,
        found: &[usize],
        shape: &[usize],
    ) -> Result<()> {
        match found == shape {
            true => Ok(()),
            false => Err(Error::Model(format!(
                "{kind} `{name}` in {} has shape {found:?}, but the config implies {shape:?}",
                self.where_(),
            ))),
        }
    }

    /// The shape of tensor `name` when it is stored as plain elements, which [`StoredTensors::element_runs`] reads in parts:
    /// a safetensors tensor not in bitsandbytes 4 bits, or a GGUF tensor (dequantized as read). `None` when it is
    /// missing or stored in 4 bits.
    fn plain_shape(&self, name: &str) -> Result<Option<Vec<usize>>> {
        let s = match self {
            Weights::Gguf(g) => return Ok(g.0.shape(name)),
            Weights::Safetensors(s) => s,
        };
        let Some(file) = s.file_of(name) else {
            return Ok(None);
        };
        let st = file.tensors()?;
        if is_bnb_4bit(&st.names(), name) {
            return Ok(None);
        }
        let view = st
            .tensor(name)
            .map_err(|e| Error::invalid_file(file.path(), format!("`{name}`: {e}")))?;
        DType::try_from(view.dtype())
            .map_err(|e| Error::invalid_file(file.path(), format!("`{name}`: {e}")))?;
        Ok(Some(view.shape().to_vec()))
    }

    /// Records tensor `name` as read, left in its file to be read in parts later.
    fn mark_read(&self, name: &str) {
        match self {
            Weights::Safetensors(s) => s.mark_read(name),
            Weights::Gguf(g) => g.0.mark_read(name),
        }
    }

    /// [`Weights::left_in_file`] of a tensor that is stored plain: missing, the error of reading it.
    fn plain_in_file(&self, name: &str, shape: &[usize]) -> Result<String> {
        match self.left_in_file(name, shape)? {
            Some(name) => Ok(name),
            None => self.dense(name, shape).map(|_| name.to_string()),
        }
    }

    /// Tensor `name` stored as plain elements of `shape`, recorded as read; `None` when it is missing or stored in
    /// 4 bits.
    fn left_in_file(&self, name: &str, shape: &[usize]) -> Result<Option<String>> {
        let Some(found) = self.plain_shape(name)? else {
            return Ok(None);
        };
        self.check_shape(name, &found, shape)?;
        self.mark_read(name);
        Ok(Some(name.to_string()))
    }

    /// The safetensors file holding tensor `name`, which is read in parts.
    fn file_read_in_parts(&self, name: &str) -> Result<&MappedSafetensors> {
        let Weights::Safetensors(s) = self else {
            return Err(Error::Model(format!(
                "`{name}` in {}: only a safetensors tensor is read in parts",
                self.where_()
            )));
        };
        s.file_of(name).ok_or_else(|| {
            Error::Model(format!(
                "tensor `{name}` is missing from {}",
                s.folder().display()
            ))
        })
    }

    /// `read` of safetensors tensor `name` (which is read in parts): its file, its view and its type.
    fn with_view<T>(
        &self,
        name: &str,
        read: impl FnOnce(&MappedSafetensors, &TensorView<'_>, DType) -> Result<T>,
    ) -> Result<T> {
        let file = self.file_read_in_parts(name)?;
        let st = file.tensors()?;
        let view = st
            .tensor(name)
            .map_err(|e| Error::invalid_file(file.path(), format!("`{name}`: {e}")))?;
        let dtype = DType::try_from(view.dtype())
            .map_err(|e| Error::invalid_file(file.path(), format!("`{name}`: {e}")))?;
        read(file, &view, dtype)
    }

    /// `read` of tensor `name` (its file, and that file parsed) when it is stored as bitsandbytes 4-bit, then
    /// recorded as read with its companions; `None` unless it is stored so.
    fn with_bnb<T>(
        &self,
        name: &str,
        read: impl FnOnce(&MappedSafetensors, &SafeTensors<'_>) -> Result<T>,
    ) -> Result<Option<T>> {
        let Weights::Safetensors(s) = self else {
            return Ok(None);
        };
        let Some(file) = s.file_of(name) else {
            return Ok(None);
        };
        let st = file.tensors()?;
        let names = st.names();
        if !is_bnb_4bit(&names, name) {
            return Ok(None);
        }
        let out = read(file, &st)?;
        mark_read_with_companions(s, &names, name);
        Ok(Some(out))
    }

    /// A bitsandbytes 4-bit weight, if stored that way.
    fn nf4(&self, name: &str) -> Result<Option<Nf4Tensor>> {
        self.with_bnb(name, |file, st| read_bnb_weight(st, name, file.path()))
    }

    /// Tensor `name` when stored as bitsandbytes 4-bit, checked to have `shape`.
    fn nf4_of_shape(&self, name: &str, shape: &[usize]) -> Result<Option<Nf4Tensor>> {
        let q = self.nf4(name)?;
        if let Some(q) = &q {
            self.check_shape_of("4-bit tensor", name, q.shape(), shape)?;
        }
        Ok(q)
    }

    /// A dense tensor, also when stored as bitsandbytes 4-bit (then dequantized to float32, and its quantization
    /// settings returned).
    fn dense_or_dequantized(
        &self,
        name: &str,
        shape: &[usize],
    ) -> Result<(Tensor, Option<QuantConfig>)> {
        Ok(match self.nf4_of_shape(name, shape)? {
            Some(q) => (q.dequantize(DType::F32)?, Some(q.config())),
            None => (self.dense(name, shape)?, None),
        })
    }

    /// Linear weight `name`: a bitsandbytes 4-bit tensor as stored, otherwise the dense one (quantized with
    /// `quant` when given).
    fn stored_or_quantized(
        &self,
        name: &str,
        shape: [usize; 2],
        quant: Option<&QuantConfig>,
    ) -> Result<FrozenWeight> {
        match self.nf4_of_shape(name, &shape)? {
            Some(q) => Ok(FrozenWeight::Nf4(Arc::new(q))),
            None => frozen_weight(self.dense(name, &shape)?, name, quant),
        }
    }

    /// The first of `names` stored, or an error naming them all.
    fn first_of<'a>(&self, names: &'a [String]) -> Result<&'a str> {
        names
            .iter()
            .find(|n| self.has(n))
            .map(String::as_str)
            .ok_or_else(|| {
                Error::Model(
                    format!(
                        "tensor `{}` is missing from {}",
                        names.join("` (or `"),
                        self.where_()
                    ) + if names.len() > 1 { ")" } else { "" },
                )
            })
    }

    fn linear(
        &self,
        prefix: &str,
        shape: [usize; 2],
        bias: bool,
        quant: Option<&QuantConfig>,
    ) -> Result<LoraLinear> {
        let weight = self.stored_or_quantized(&format!("{prefix}.weight"), shape, quant)?;
        let bias = if bias {
            Some(
                self.dense(&format!("{prefix}.bias"), &shape[..1])?
                    .to_dtype(DType::F32)?,
            )
        } else {
            None
        };
        Ok(LoraLinear::new(Arc::new(FrozenLinear::new(weight, bias))))
    }
}

impl Weights {
    /// Linear layer `prefix` as [`Weights::linear`] loads it, its weight left in the file ([`WeightInFile`]): plain
    /// of `shape` (a GGUF tensor too), or bitsandbytes 4-bit (its state checked now, its codes read at use).
    fn deferred_linear(
        weights: &Arc<Weights>,
        prefix: &str,
        shape: [usize; 2],
        bias: bool,
        quant: Option<&QuantConfig>,
    ) -> Result<LoraLinear> {
        let name = format!("{prefix}.weight");
        let elements = shape[0] * shape[1];
        let weight = match weights.left_in_file(&name, &shape)? {
            Some(_) => {
                let pieces = vec![Piece::elements(&name, 0..elements)];
                WeightInFile::plain(weights.clone(), name, shape, pieces, quant)
            }
            None => match weights.bnb_state(&name, shape)? {
                Some(config) => {
                    WeightInFile::stored_4bit(weights.clone(), name.clone(), &name, shape, config)
                }
                // Missing: the error of reading it.
                None => return weights.linear(prefix, shape, bias, quant),
            },
        };
        let bias = match bias {
            true => Some(
                weights
                    .dense(&format!("{prefix}.bias"), &shape[..1])?
                    .to_dtype(DType::F32)?,
            ),
            false => None,
        };
        let weight = FrozenWeight::Deferred(Arc::new(weight));
        Ok(LoraLinear::new(Arc::new(FrozenLinear::new(weight, bias))))
    }

    /// The quantization settings of bitsandbytes 4-bit weight `name`, checked to be of `shape`, recorded as read
    /// with its companions; `None` unless it is stored so. Only its state is read (not its codes).
    fn bnb_state(&self, name: &str, shape: [usize; 2]) -> Result<Option<QuantConfig>> {
        self.with_bnb(name, |file, st| {
            let frame = read_bnb_frame(st, name, file.path())?;
            self.check_shape_of("4-bit tensor", name, frame.shape(), &shape)?;
            Ok(frame.config())
        })
    }
}

/// A weight left in its file reads its tensors from the folder or file.
impl StoredTensors for Weights {
    fn place(&self) -> String {
        self.where_()
    }

    fn element_runs(&self, name: &str, runs: &[Range<usize>]) -> Result<Tensor> {
        let part = match self {
            Weights::Gguf(g) => {
                let (heads, kv_heads) = (g.1.num_attention_heads, g.1.num_key_value_heads);
                let parts = runs
                    .iter()
                    .map(|run| g.0.elements(name, run.clone(), heads, kv_heads))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&parts, 0)?
            }
            Weights::Safetensors(_) => self.with_view(name, |file, view, dtype| {
                let size = dtype.size_in_bytes();
                let mut joined = Vec::with_capacity(runs.iter().map(|r| r.len() * size).sum());
                for run in runs {
                    let bytes = view
                        .data()
                        .get(run.start * size..run.end * size)
                        .ok_or_else(|| {
                            Error::invalid_file(
                                file.path(),
                                format!("`{name}` holds no elements {run:?}"),
                            )
                        })?;
                    joined.extend_from_slice(bytes);
                    file.release(bytes);
                }
                let count = joined.len() / size;
                Ok(Tensor::from_raw_buffer(
                    &joined,
                    dtype,
                    &[count],
                    &Device::Cpu,
                )?)
            })?,
        };
        // A non-finite value is named by its element of the tensor.
        if let Some((mut at, value)) = first_non_finite(&part)? {
            let run = runs.iter().find(|run| {
                let inside = at < run.len();
                if !inside {
                    at -= run.len();
                }
                inside
            });
            let element = run.map_or(at, |run| run.start + at);
            return Err(non_finite_weight(name, element, value, &self.where_()));
        }
        Ok(part)
    }

    fn bytes_in_file(&self, name: &str, range: Range<usize>) -> Result<usize> {
        if let Weights::Gguf(g) = self {
            let (heads, kv_heads) = (g.1.num_attention_heads, g.1.num_key_value_heads);
            return g.0.bytes_of(name, range, heads, kv_heads);
        }
        self.with_view(name, |_, _, dtype| Ok(range.len() * dtype.size_in_bytes()))
    }

    fn bnb_values(&self, name: &str, range: Range<usize>) -> Result<Tensor> {
        if range.is_empty() {
            return Ok(Tensor::zeros(0, DType::F32, &Device::Cpu)?);
        }
        let file = self.file_read_in_parts(name)?;
        let st = file.tensors()?;
        let frame = read_bnb_frame(&st, name, file.path())?;
        let block = frame.config().blocksize;
        let blocks = range.start / block..range.end.div_ceil(block);
        let values = frame.dequantize_blocks(&st, blocks.clone())?;
        Ok(values.narrow(0, range.start - blocks.start * block, range.len())?)
    }

    fn bnb_bytes(&self, name: &str, range: Range<usize>) -> Result<usize> {
        let file = self.file_read_in_parts(name)?;
        let st = file.tensors()?;
        let config = read_bnb_frame(&st, name, file.path())?.config();
        let blocks = match range.is_empty() {
            true => 0,
            false => range.end.div_ceil(config.blocksize) - range.start / config.blocksize,
        };
        let scale = if config.double_quant { 1 } else { 4 };
        Ok(blocks * (config.blocksize / 2 + scale))
    }

    fn stored_4bit_weight(&self, name: &str, shape: [usize; 2]) -> Result<FrozenWeight> {
        self.stored_or_quantized(name, shape, None)
    }

    fn bnb_blocks(&self, name: &str, blocks: Range<usize>) -> Result<StoredBlocks> {
        let file = self.file_read_in_parts(name)?;
        let st = file.tensors()?;
        let frame = read_bnb_frame(&st, name, file.path())?;
        let (packed, scales) = frame.read_blocks(&st, blocks)?;
        let bytes = packed.len();
        Ok(StoredBlocks {
            packed: Tensor::from_vec(packed, bytes, &Device::Cpu)?,
            scales,
            rebuild: Box::new(move |packed, scales| {
                frame
                    .with_blocks(packed, scales)
                    .map_err(candle_core::Error::wrap)
            }),
        })
    }
}

/// Marks tensor `name` of `s` read, with its companions among `names` (its file's: a 4-bit weight's `.absmax`,
/// `.quant_map`, `.quant_state.…`).
fn mark_read_with_companions(s: &ShardedSafetensors, names: &[&str], name: &str) {
    s.mark_read(name);
    for companion in names.iter().filter(|k| {
        k.strip_prefix(name)
            .is_some_and(|rest| rest.starts_with('.'))
    }) {
        s.mark_read(companion);
    }
}

/// Whether tensor `name` is stored as bitsandbytes 4-bit: `names` (its file's) hold its `quant_state` companions.
fn is_bnb_4bit(names: &[&str], name: &str) -> bool {
    names.iter().any(|k| {
        k.strip_prefix(name)
            .is_some_and(|rest| rest.starts_with(".quant_state."))
    })
}

/// The router and experts of sparse layer `p` (`model.layers.{l}`) in [`ModelConfig::layer_linears`]' order, from
/// either layout transformers reads: one tensor per expert (the Hub's: Mixtral's `block_sparse_moe.experts.{e}.w1`
/// / `w3` / `w2`, Qwen's `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`; bitsandbytes 4-bit ones stay 4-bit),
/// or the fused 3-D tensors transformers 5 holds (`mlp.experts.gate_up_proj` `[experts, 2·width,
/// hidden]`, `mlp.experts.down_proj` `[experts, hidden, width]`). Each expert's gate and up projections become one
/// `[2·width, hidden]` weight (gate rows first), quantized on its own; the router stays dense, as in transformers,
/// where it is no `nn.Linear` that bitsandbytes would replace.
fn sparse_linears(
    weights: &Weights,
    p: &str,
    moe: &MoeConfig,
    hidden: usize,
    quant: Option<&QuantConfig>,
) -> Result<Vec<LoraLinear>> {
    let (experts, width) = (moe.num_experts, moe.moe_intermediate_size);
    let block = sparse_block(weights, p);
    let mut out = vec![router(weights, p, experts, hidden)?];
    let fused_gate_up = format!("{p}.{block}.experts.gate_up_proj");
    let fused = if weights.has(&fused_gate_up) {
        let down = format!("{p}.{block}.experts.down_proj");
        Some((
            weights.dense(&fused_gate_up, &[experts, 2 * width, hidden])?,
            weights.dense(&down, &[experts, hidden, width])?,
        ))
    } else {
        None
    };
    for e in 0..experts {
        let ours = format!("{p}.mlp.experts.{e}");
        let (gate_up, down) = match &fused {
            Some((gate_up, down)) => (
                frozen_weight(
                    gate_up.get(e)?,
                    &format!("{ours}.gate_up_proj.weight"),
                    quant,
                )?,
                frozen_weight(down.get(e)?, &format!("{ours}.down_proj.weight"), quant)?,
            ),
            None => {
                let name = |mixtral: &str, qwen: &str| -> Result<String> {
                    let names = [
                        format!("{p}.{block}.experts.{e}.{mixtral}.weight"),
                        format!("{p}.{block}.experts.{e}.{qwen}.weight"),
                    ];
                    weights.first_of(&names).map(str::to_string)
                };
                let (gate, up) = (name("w1", "gate_proj")?, name("w3", "up_proj")?);
                // A bitsandbytes 4-bit expert keeps 4 bits: its down projection as stored, its gate and up
                // (two tensors in the checkpoint, one here) quantized again as one with the stored settings.
                let (gate, stored) = weights.dense_or_dequantized(&gate, &[width, hidden])?;
                let (up, _) = weights.dense_or_dequantized(&up, &[width, hidden])?;
                (
                    frozen_weight(
                        Tensor::cat(&[gate, up], 0)?,
                        &format!("{ours}.gate_up_proj.weight"),
                        quant.or(stored.as_ref()),
                    )?,
                    weights.stored_or_quantized(
                        &name("w2", "down_proj")?,
                        [hidden, width],
                        quant,
                    )?,
                )
            }
        };
        out.push(wrap(gate_up));
        out.push(wrap(down));
    }
    Ok(out)
}

/// Which module of sparse layer `p` holds the router and experts: Mixtral's `block_sparse_moe`, or `mlp`.
fn sparse_block(weights: &Weights, p: &str) -> &'static str {
    match weights.has(&format!("{p}.block_sparse_moe.gate.weight")) {
        true => "block_sparse_moe",
        false => "mlp",
    }
}

/// A linear layer of `weight`, without a bias.
fn wrap(weight: FrozenWeight) -> LoraLinear {
    LoraLinear::new(Arc::new(FrozenLinear::new(weight, None)))
}

/// The router of sparse layer `p`, dense.
fn router(weights: &Weights, p: &str, experts: usize, hidden: usize) -> Result<LoraLinear> {
    let name = format!("{p}.{}.gate.weight", sparse_block(weights, p));
    Ok(wrap(FrozenWeight::Dense(
        weights.dense(&name, &[experts, hidden])?,
    )))
}

/// [`sparse_linears`] with the experts left in their files ([`WeightInFile`]): each projection of an expert a run
/// of a stacked tensor's elements, or its gate projection then its up projection (bitsandbytes 4-bit ones
/// dequantized as read, then quantized again as one, as [`sparse_linears`] does; a 4-bit down projection read as
/// stored). `None` when a stacked layout is not stored plain (then read at load).
fn experts_in_file(
    weights: &Arc<Weights>,
    p: &str,
    moe: &MoeConfig,
    hidden: usize,
    quant: Option<&QuantConfig>,
) -> Result<Option<Vec<LoraLinear>>> {
    let (experts, width) = (moe.num_experts, moe.moe_intermediate_size);
    let block = sparse_block(weights, p);
    let (gate_up_size, down_size) = (2 * width * hidden, hidden * width);
    let (gate_up_shape, down_shape) = ([2 * width, hidden], [hidden, width]);
    let stacked = format!("{p}.{block}.experts.gate_up_proj");
    let stacked = match weights.has(&stacked) {
        true => {
            let down = format!("{p}.{block}.experts.down_proj");
            let gate_up = weights.left_in_file(&stacked, &[experts, 2 * width, hidden])?;
            match (
                gate_up,
                weights.left_in_file(&down, &[experts, hidden, width])?,
            ) {
                (Some(gate_up), Some(down)) => Some((gate_up, down)),
                _ => return Ok(None),
            }
        }
        false => None,
    };
    let mut made = Vec::with_capacity(experts);
    for e in 0..experts {
        let ours = |projection: &str| format!("{p}.mlp.experts.{e}.{projection}.weight");
        let plain = |projection: &str, shape: [usize; 2], pieces: Vec<Piece>| {
            WeightInFile::plain(weights.clone(), ours(projection), shape, pieces, quant)
        };
        made.push(match &stacked {
            Some((gate_up, down)) => (
                plain(
                    "gate_up_proj",
                    gate_up_shape,
                    vec![Piece::elements(
                        gate_up,
                        e * gate_up_size..(e + 1) * gate_up_size,
                    )],
                ),
                plain(
                    "down_proj",
                    down_shape,
                    vec![Piece::elements(down, e * down_size..(e + 1) * down_size)],
                ),
            ),
            None => {
                let stored = |mixtral: &str, qwen: &str| {
                    let names = [
                        format!("{p}.{block}.experts.{e}.{mixtral}.weight"),
                        format!("{p}.{block}.experts.{e}.{qwen}.weight"),
                    ];
                    weights.first_of(&names).map(str::to_string)
                };
                // Gate then up: plain elements, or bitsandbytes 4-bit ones dequantized (whose settings the
                // joined weight is quantized with, unless the load sets its own).
                let mut stored_quant = None;
                let mut gate_up = Vec::new();
                for name in [stored("w1", "gate_proj")?, stored("w3", "up_proj")?] {
                    let half = 0..gate_up_size / 2;
                    gate_up.push(match weights.left_in_file(&name, &[width, hidden])? {
                        Some(_) => Piece::elements(&name, half),
                        None => match weights.bnb_state(&name, [width, hidden])? {
                            Some(config) => {
                                stored_quant = Some(config);
                                Piece::Dequantized {
                                    tensor: name,
                                    range: half,
                                }
                            }
                            None => return Ok(None),
                        },
                    });
                }
                let gate_up = WeightInFile::plain(
                    weights.clone(),
                    ours("gate_up_proj"),
                    gate_up_shape,
                    gate_up,
                    quant.or(stored_quant.as_ref()),
                );
                let down = stored("w2", "down_proj")?;
                let down = match weights.left_in_file(&down, &down_shape)? {
                    Some(_) => plain(
                        "down_proj",
                        down_shape,
                        vec![Piece::elements(&down, 0..down_size)],
                    ),
                    None => match weights.bnb_state(&down, down_shape)? {
                        Some(config) => WeightInFile::stored_4bit(
                            weights.clone(),
                            ours("down_proj"),
                            &down,
                            down_shape,
                            config,
                        ),
                        None => return Ok(None),
                    },
                };
                (gate_up, down)
            }
        });
    }
    let mut out = vec![router(weights, p, experts, hidden)?];
    for (gate_up, down) in made {
        for weight in [gate_up, down] {
            out.push(wrap(FrozenWeight::Deferred(Arc::new(weight))));
        }
    }
    Ok(Some(out))
}

/// gpt-oss's router (`mlp.router`, with its bias) and experts, from transformers' 3-D tensors
/// (`mlp.experts.gate_up_proj` `[experts, hidden, 2·width]` with gate and up interleaved along the last axis,
/// `down_proj` `[experts, width, hidden]`, and their biases) or the checkpoint's MXFP4 ones (`*_blocks` /
/// `*_scales`, stored `[experts, out, in]`), dequantized exactly. Each expert's projections become `[out, in]`
/// weights (gate/up rows still interleaved) with their biases, quantized on their own; the router stays dense.
fn gpt_oss_linears(
    weights: &Arc<Weights>,
    p: &str,
    moe: &MoeConfig,
    hidden: usize,
    quant: Option<&QuantConfig>,
    in_file: bool,
) -> Result<Vec<LoraLinear>> {
    let (experts, width) = (moe.num_experts, moe.moe_intermediate_size);
    let linear = |w: FrozenWeight, b: Tensor| -> Result<LoraLinear> {
        let bias = Some(b.to_dtype(DType::F32)?);
        Ok(LoraLinear::new(Arc::new(FrozenLinear::new(w, bias))))
    };
    let router = format!("{p}.mlp.router");
    let mut out = vec![linear(
        FrozenWeight::Dense(weights.dense(&format!("{router}.weight"), &[experts, hidden])?),
        weights.dense(&format!("{router}.bias"), &[experts])?,
    )?];
    let stacked = |projection: &str, out_dim: usize, in_dim: usize| -> Result<ExpertStack> {
        let name = format!("{p}.mlp.experts.{projection}");
        let blocks = format!("{name}_blocks");
        let (rows, cols) = (out_dim, in_dim);
        if !weights.has(&blocks) {
            let shape = [experts, in_dim, out_dim];
            return Ok(match in_file {
                true => ExpertStack::TransposedInFile {
                    tensor: weights.plain_in_file(&name, &shape)?,
                    rows,
                    cols,
                },
                false => ExpertStack::Dense(weights.dense(&name, &shape)?),
            });
        }
        if in_dim % MXFP4_BLOCK != 0 {
            return Err(Error::Model(format!(
                "`{blocks}`: MXFP4 needs the input width ({in_dim}) to be a multiple of {MXFP4_BLOCK}"
            )));
        }
        let groups = in_dim / MXFP4_BLOCK;
        let (codes_shape, scales_shape) = (
            [experts, out_dim, groups, MXFP4_BLOCK / 2],
            [experts, out_dim, groups],
        );
        let scales = format!("{name}_scales");
        Ok(match in_file {
            true => ExpertStack::Mxfp4InFile {
                blocks: weights.plain_in_file(&blocks, &codes_shape)?,
                scales: weights.plain_in_file(&scales, &scales_shape)?,
                rows,
                cols,
            },
            false => ExpertStack::Mxfp4 {
                codes: weights.dense(&blocks, &codes_shape)?,
                scales: weights.dense(&scales, &scales_shape)?,
                place: format!("`{blocks}` in {}", weights.where_()),
            },
        })
    };
    let gate_up = stacked("gate_up_proj", 2 * width, hidden)?;
    let down = stacked("down_proj", hidden, width)?;
    let gate_up_bias = weights.dense(
        &format!("{p}.mlp.experts.gate_up_proj_bias"),
        &[experts, 2 * width],
    )?;
    let down_bias = weights.dense(
        &format!("{p}.mlp.experts.down_proj_bias"),
        &[experts, hidden],
    )?;
    for e in 0..experts {
        let ours = format!("{p}.mlp.experts.{e}");
        let weight = |stack: &ExpertStack, projection: &str| -> Result<FrozenWeight> {
            stack.weight(weights, e, format!("{ours}.{projection}.weight"), quant)
        };
        out.push(linear(
            weight(&gate_up, "gate_up_proj")?,
            gate_up_bias.get(e)?,
        )?);
        out.push(linear(weight(&down, "down_proj")?, down_bias.get(e)?)?);
    }
    Ok(out)
}

/// One projection of every gpt-oss expert, as stored: MXFP4 codes and scales `[experts, out, …]`, or transformers'
/// dense `[experts, in, out]`; read, or left in the file (each expert's weight then read in parts, [`Piece`]).
/// Experts are decoded one at a time, so a layer's experts are never all in float32.
enum ExpertStack {
    Mxfp4 {
        codes: Tensor,
        scales: Tensor,
        /// The tensor and file, for errors.
        place: String,
    },
    Dense(Tensor),
    Mxfp4InFile {
        blocks: String,
        scales: String,
        rows: usize,
        cols: usize,
    },
    TransposedInFile {
        tensor: String,
        rows: usize,
        cols: usize,
    },
}

impl ExpertStack {
    /// Expert `e`'s `[out, in]` weight as the model holds it (quantized with `quant`), named `name`: decoded to
    /// float32 from a stack read, or left in the file.
    fn weight(
        &self,
        weights: &Arc<Weights>,
        e: usize,
        name: String,
        quant: Option<&QuantConfig>,
    ) -> Result<FrozenWeight> {
        let (piece, rows, cols) = match self {
            ExpertStack::Mxfp4 {
                codes,
                scales,
                place,
            } => {
                let dense = dequantize_mxfp4(&codes.get(e)?, &scales.get(e)?)
                    .map_err(|err| Error::Model(format!("{place}: {err}")))?;
                return frozen_weight(dense, &name, quant);
            }
            ExpertStack::Dense(t) => {
                let dense = t.get(e)?.t()?.contiguous()?.to_dtype(DType::F32)?;
                return frozen_weight(dense, &name, quant);
            }
            ExpertStack::Mxfp4InFile {
                blocks,
                scales,
                rows,
                cols,
            } => {
                let piece = Piece::Mxfp4 {
                    blocks: blocks.clone(),
                    scales: scales.clone(),
                    expert: e,
                    rows: *rows,
                    cols: *cols,
                };
                (piece, *rows, *cols)
            }
            ExpertStack::TransposedInFile { tensor, rows, cols } => {
                let piece = Piece::Transposed {
                    tensor: tensor.clone(),
                    expert: e,
                    rows: *rows,
                    cols: *cols,
                };
                (piece, *rows, *cols)
            }
        };
        let weight = WeightInFile::plain(weights.clone(), name, [rows, cols], vec![piece], quant);
        Ok(FrozenWeight::Deferred(Arc::new(weight)))
    }
}

/// An error naming tensor `name` of `place` when it holds a NaN or an infinity: training on it would give a NaN
/// loss from the first step, before any update. Read in chunks, so the check needs no copy of a large tensor.
fn check_finite(t: &Tensor, name: &str, place: &str) -> Result<()> {
    match first_non_finite(t)? {
        None => Ok(()),
        Some((at, value)) => Err(non_finite_weight(name, at, value, place)),
    }
}

/// The error for tensor `name` of `place` whose element `element` is `value`, a NaN or an infinity.
fn non_finite_weight(name: &str, element: usize, value: f32, place: &str) -> Error {
    Error::Model(format!(
        "tensor `{name}` in {place} holds {value} at element {element}: the model's weights are damaged (or were \
         saved from a diverged run); use an intact copy of the model"
    ))
}

impl Weights {
    /// How the files name layer `l`'s tensors: `model.layers.{l}.…`, GGUF's `blk.{l}.…`.
    fn layer_prefix(&self) -> &'static str {
        match self {
            Weights::Safetensors(_) => "model.layers.",
            Weights::Gguf(_) => "blk.",
        }
    }

    /// The layer-numbered tensor of the lowest layer at or beyond `layers`, with the number of layers the weights
    /// hold.
    fn beyond_layers(&self, layers: usize) -> Option<(String, usize)> {
        let prefix = self.layer_prefix();
        let names: Vec<&str> = match self {
            Weights::Safetensors(s) => s.names().collect(),
            Weights::Gguf(g) => {
                g.0.content()
                    .tensor_infos
                    .keys()
                    .map(String::as_str)
                    .collect()
            }
        };
        let layer_of = |name: &str| -> Option<usize> {
            name.strip_prefix(prefix)?.split('.').next()?.parse().ok()
        };
        let held = names.iter().filter_map(|n| layer_of(n)).max()? + 1;
        names
            .into_iter()
            .filter_map(|n| layer_of(n).filter(|l| *l >= layers).map(|l| (l, n)))
            .min()
            .map(|(_, name)| (name.to_string(), held))
    }

    /// Checks, before anything is read, that the weights are the model the configuration describes where a
    /// mismatch would load silently: layers beyond `num_hidden_layers` (transformers drops them with a warning,
    /// leaving a different model) and an untied head with no `lm_head.weight` (transformers initializes it at
    /// random, which trains and generates garbage).
    fn check_matches(&self, cfg: &ModelConfig) -> Result<()> {
        let (config_file, layer_key) = match self {
            Weights::Safetensors(s) => (
                s.folder().join("config.json").display().to_string(),
                "num_hidden_layers".to_string(),
            ),
            Weights::Gguf(g) => (
                g.0.path().display().to_string(),
                format!("{}.block_count", g.0.arch()),
            ),
        };
        if let Some((name, held)) = self.beyond_layers(cfg.num_hidden_layers) {
            return Err(Error::Model(format!(
                "tensor `{name}` in {} is not used: {config_file} sets {layer_key} = {}, but the weights hold {held} \
                 layers; set {layer_key} = {held} (or use the config the weights were saved with)",
                self.where_(),
                cfg.num_hidden_layers,
            )));
        }
        if !cfg.tie_word_embeddings && !self.has("lm_head.weight") {
            return Err(Error::Model(format!(
                "`lm_head.weight` is missing from {}, but {config_file} says the output head is not tied to the \
                 embeddings (`tie_word_embeddings` = false{}); transformers would initialize the head at random, \
                 which trains and generates garbage. Use the complete model files, or set \
                 `\"tie_word_embeddings\": true` if the model's head is its embedding matrix",
                self.where_(),
                if cfg.architecture.ties_embeddings_by_default() {
                    ""
                } else {
                    ", also its default"
                }
            )));
        }
        Ok(())
    }

    /// The stored tensors of layer `layer` (or of the whole model, with `None`) that loading has not read, without
    /// those transformers and llama.cpp leave out too: old checkpoints' rotary buffers (`rotary_emb.inv_freq`,
    /// GGUF's `attn_rot_embd`), which they recompute, and a tied model's stored `lm_head.weight` (its head is the
    /// embedding matrix).
    fn unread(&self, layer: Option<usize>, cfg: &ModelConfig) -> Vec<String> {
        let prefix = layer.map_or(String::new(), |l| format!("{}{l}.", self.layer_prefix()));
        let mut unread = match self {
            Weights::Safetensors(s) => s.unread(&prefix),
            Weights::Gguf(g) => g.0.unread(&prefix),
        };
        let ignored = |n: &str| {
            n.ends_with(".rotary_emb.inv_freq")
                || n.ends_with(".attn_rot_embd")
                || (cfg.tie_word_embeddings && n == "lm_head.weight")
        };
        unread.retain(|n| !ignored(n));
        unread
    }

    /// Refuses stored tensors that loading left unread — of layer `layer` right after it is built, so a mismatch
    /// stops the load early, or of the whole model at the end. Such a tensor is part of the checkpoint the model
    /// described by the configuration lacks (biases the architecture does not have, norms of another family): the
    /// model trained would not be the checkpoint's. transformers only warns here; loading on would silently train
    /// and save a different model.
    fn check_all_read(&self, layer: Option<usize>, cfg: &ModelConfig) -> Result<()> {
        let unread = self.unread(layer, cfg);
        let Some(first) = unread.first() else {
            return Ok(());
        };
        let shown: Vec<&str> = unread[1..].iter().take(3).map(String::as_str).collect();
        let more = match unread.len() - 1 {
            0 => String::new(),
            n => format!(
                " (and {n} more: {}{})",
                shown.join(", "),
                if n > shown.len() { ", …" } else { "" }
            ),
        };
        let described = match self {
            Weights::Safetensors(s) => format!(
                "the {} model {} describes",
                cfg.architecture.model_type(),
                s.folder().join("config.json").display()
            ),
            Weights::Gguf(g) => format!("the {} model its metadata describes", g.0.arch()),
        };
        Err(Error::Model(format!(
            "tensor `{first}` in {}{more} is not used by {described}: the weights are of another model than the \
             configuration (another architecture or variant), and loading would silently leave the tensor out. Use \
             the configuration saved with these weights",
            self.where_()
        )))
    }
}

fn build_model(weights: &Arc<Weights>, cfg: ModelConfig, opts: &LoadOptions) -> Result<LlamaModel> {
    weights.check_matches(&cfg)?;
    let quant = opts.quantization.as_ref();
    let arch = cfg.architecture;
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    // Norm weights as the model uses them: Gemma stores `w` for a scale of `1 + w` (llama.cpp's GGUF stores the
    // scale itself).
    let offset = match weights.as_ref() {
        Weights::Gguf(_) => 0.0,
        Weights::Safetensors(_) => arch.norm_weight_offset(),
    };
    // Norms are float32 (`1 + w` rounded to float32, as transformers computes it), float64 for a float64 model.
    let norm_dtype = master_dtype(opts.compute_dtype);
    let norm = |name: &str, width: usize| -> Result<Tensor> {
        let w = weights.dense(name, &[width])?.to_dtype(norm_dtype)?;
        Ok(if offset != 0.0 { (w + offset)? } else { w })
    };
    let embed = weights.dense("model.embed_tokens.weight", &[v, h])?;
    let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let optional_norm = |present: bool, name: &str, width: usize| {
            present
                .then(|| norm(&format!("{p}.{name}.weight"), width))
                .transpose()
        };
        let sparse = cfg.moe.as_ref().filter(|m| m.sparse_layers[l]);
        let mut linears = Vec::new();
        for (name, shape) in cfg.layer_linears(l) {
            if name == arch.router_name() {
                // The router opens the experts, loaded together (see `sparse_linears`).
                let moe = sparse.expect("only sparse layers have a router");
                linears.extend(match moe.clamped_swiglu {
                    Some(_) => {
                        gpt_oss_linears(weights, &p, moe, h, quant, opts.defer_linear_weights)?
                    }
                    None => {
                        let in_file = match opts.defer_linear_weights {
                            true => experts_in_file(weights, &p, moe, h, quant)?,
                            false => None,
                        };
                        match in_file {
                            Some(linears) => linears,
                            None => sparse_linears(weights, &p, moe, h, quant)?,
                        }
                    }
                });
            } else if !name.starts_with("mlp.experts.") {
                let bias = cfg.attention_bias
                    && name.starts_with("self_attn.")
                    && (name != "self_attn.o_proj" || arch.biases_attention_output());
                let prefix = format!("{p}.{name}");
                linears.push(match opts.defer_linear_weights {
                    true => Weights::deferred_linear(weights, &prefix, shape, bias, quant)?,
                    false => weights.linear(&prefix, shape, bias, quant)?,
                });
            }
        }
        layers.push(LayerWeights {
            input_layernorm: norm(&format!("{p}.input_layernorm.weight"), h)?,
            post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
            pre_feedforward_layernorm: optional_norm(
                arch.has_feedforward_norms(),
                "pre_feedforward_layernorm",
                h,
            )?,
            post_feedforward_layernorm: optional_norm(
                arch.has_feedforward_norms(),
                "post_feedforward_layernorm",
                h,
            )?,
            q_norm: optional_norm(arch.has_qk_norm(), "self_attn.q_norm", cfg.head_dim)?,
            k_norm: optional_norm(arch.has_qk_norm(), "self_attn.k_norm", cfg.head_dim)?,
            sinks: arch
                .has_attention_sinks()
                .then(|| {
                    let name = format!("{p}.self_attn.sinks");
                    Ok::<_, Error>(
                        weights
                            .dense(&name, &[cfg.num_attention_heads])?
                            .to_dtype(DType::F32)?,
                    )
                })
                .transpose()?,
            linears,
        });
        weights.check_all_read(Some(l), &cfg)?;
    }
    // transformers keeps lm_head unquantized; so do we.
    let lm_head = if cfg.tie_word_embeddings {
        FrozenLinear::new(FrozenWeight::Dense(embed.clone()), None)
    } else {
        FrozenLinear::new(
            FrozenWeight::Dense(weights.dense("lm_head.weight", &[v, h])?),
            None,
        )
    };
    let final_norm = norm("model.norm.weight", h)?;
    weights.check_all_read(None, &cfg)?;
    Ok(LlamaModel::new(
        cfg,
        embed,
        layers,
        final_norm,
        Arc::new(lm_head),
        opts.compute_dtype,
    )?)
}

/// Loads a model and its tokenizer from a folder, a `.gguf` file or a Hub id (see [`ModelSource::parse`]).
/// Linear weights are quantized one at a time when `opts.quantization` is set, so the full-precision model is
/// never in memory at once; bitsandbytes 4-bit folders load without re-quantizing.
pub fn load_model(spec: &str, revision: Option<&str>, opts: &LoadOptions) -> Result<LoadedModel> {
    match ModelSource::parse(spec, revision)? {
        ModelSource::Folder(dir) => {
            let cfg = ModelConfig::from_hf_config_file(&dir.join("config.json"))?;
            if let Some(problem) = generation_config_problem(&dir) {
                eprintln!(
                    "note: {problem}; qlora does not read generation_config.json, so it is ignored here, but \
                     transformers skips an invalid one and fails on a wrong type (loading or generating): fix or \
                     delete it"
                );
            }
            let weights = Arc::new(Weights::Safetensors(ShardedSafetensors::open_folder(&dir)?));
            let model = build_model(&weights, cfg, opts)?;
            let tokenizer = folder_tokenizer(&dir)?;
            Ok(LoadedModel {
                model,
                tokenizer,
                source: dir.display().to_string(),
            })
        }
        ModelSource::Gguf(path) => {
            let file = GgufFile::open(&path)?;
            let cfg = gguf_config(&file)?;
            let tokenizer = gguf_tokenizer(&file)?;
            let weights = Arc::new(Weights::Gguf(Box::new((file, cfg.clone()))));
            let model = build_model(&weights, cfg, opts)?;
            Ok(LoadedModel {
                model,
                tokenizer,
                source: path.display().to_string(),
            })
        }
        ModelSource::Hub { id, revision } => {
            let dir = hub_snapshot(&id, &revision)?;
            let mut loaded = load_model(dir.to_str().unwrap_or_default(), None, opts)?;
            loaded.source = format!("{id}@{revision}");
            Ok(loaded)
        }
    }
}

/// What is wrong with a model folder's `generation_config.json`, if it has one that transformers' `generate`
/// could not use: not a JSON object, or a generation setting of the wrong type.
fn generation_config_problem(dir: &Path) -> Option<String> {
    let path = dir.join("generation_config.json");
    let text = std::fs::read(&path).ok()?;
    let place = path.display();
    let value: serde_json::Value = match serde_json::from_slice(&text) {
        Ok(v) => v,
        Err(e) => return Some(format!("{place} is not valid JSON ({e})")),
    };
    let Some(obj) = value.as_object() else {
        return Some(format!("{place} is not a JSON object"));
    };
    use serde_json::Value as V;
    // Whole numbers may be negative (`pad_token_id = -1` is common and harmless).
    let whole = |v: &V| v.is_i64() || v.is_u64();
    let token_ids = |v: &V| match v {
        V::Array(ids) => ids.iter().all(whole),
        v => whole(v),
    };
    /// A key, what its value must be, and the test of that.
    type Expected<'a> = (&'a str, &'a str, &'a dyn Fn(&V) -> bool);
    let expected: [Expected; 10] = [
        ("do_sample", "true or false", &V::is_boolean),
        ("temperature", "a number", &V::is_number),
        ("top_p", "a number", &V::is_number),
        ("repetition_penalty", "a number", &V::is_number),
        ("top_k", "a whole number", &whole),
        ("max_length", "a whole number", &whole),
        ("max_new_tokens", "a whole number", &whole),
        ("bos_token_id", "a token id", &whole),
        ("eos_token_id", "a token id or a list of them", &token_ids),
        ("pad_token_id", "a token id", &whole),
    ];
    expected.iter().find_map(|(key, what, ok)| {
        let v = obj.get(*key).filter(|v| !v.is_null())?;
        (!ok(v)).then(|| format!("{place}: `{key}` = {v} must be {what}"))
    })
}

/// The configuration of a GGUF file: its metadata, and the RoPE factors llama.cpp stores as tensors — Phi-3's
/// LongRoPE, or Llama 3's scaling as one divisor per frequency (`rope_freqs`), which is LongRoPE with equal short
/// and long factors and no cos/sin multiplier.
fn gguf_config(file: &GgufFile) -> Result<ModelConfig> {
    let path = file.path();
    let mut cfg = ModelConfig::from_gguf(file.content(), path, file.has("lm_head.weight"))?;
    let long_rope = match (
        file.long_rope(cfg.max_position_embeddings)?,
        file.rope_frequency_factors()?,
    ) {
        (Some(long_rope), _) => Some(long_rope),
        (None, Some(factors)) => {
            if cfg.rope_scaling.is_some() {
                return Err(Error::invalid_file(
                    path,
                    "both `rope.scaling.type` metadata and a `rope_freqs` tensor scale RoPE; llama.cpp's converter \
                     writes one or the other: convert the model again",
                ));
            }
            Some(LongRopeScaling {
                short_factor: factors.clone(),
                long_factor: factors,
                original_max_position_embeddings: cfg.max_position_embeddings,
                attention_factor: 1.0,
            })
        }
        (None, None) => None,
    };
    if let Some(long_rope) = long_rope {
        let expected = cfg.rotary_dim / 2;
        if long_rope.short_factor.len() != expected || long_rope.long_factor.len() != expected {
            return Err(Error::invalid_file(
                path,
                format!(
                    "RoPE factor tensors hold {} / {} values; the rotary dimension {} needs {expected}",
                    long_rope.short_factor.len(),
                    long_rope.long_factor.len(),
                    cfg.rotary_dim
                ),
            ));
        }
        cfg.rope_scaling = Some(RopeScaling::LongRope(long_rope));
        cfg.validate(path, ConfigKeys::Gguf(file.arch()))?;
    }
    Ok(cfg)
}

/// The tokenizer of a GGUF file, if its metadata has one (`tokenizer.ggml.*`).
fn gguf_tokenizer(file: &GgufFile) -> Result<Option<TextTokenizer>> {
    if file.metadata().contains_key("tokenizer.ggml.tokens") {
        TextTokenizer::from_gguf(file.content(), file.path()).map(Some)
    } else {
        Ok(None)
    }
}

/// The tokenizer of a model folder, if it has one.
fn folder_tokenizer(dir: &Path) -> Result<Option<TextTokenizer>> {
    if dir.join("tokenizer.json").exists() {
        TextTokenizer::from_folder(dir).map(Some)
    } else {
        Ok(None)
    }
}

/// The tokenizer of a model (with its chat template) without loading the weights — cheap, so data can be checked
/// before a long load: from a folder, a `.gguf` file's metadata, or a Hub id (only the config and tokenizer files
/// are fetched). `None` when the model has none.
pub fn load_tokenizer(spec: &str, revision: Option<&str>) -> Result<Option<TextTokenizer>> {
    match ModelSource::parse(spec, revision)? {
        ModelSource::Folder(dir) => folder_tokenizer(&dir),
        ModelSource::Gguf(path) => gguf_tokenizer(&GgufFile::open(&path)?),
        ModelSource::Hub { id, revision } => {
            let fetch = hub_fetcher(&id, &revision)?;
            let config = hub_required(&fetch, &id, &revision, HUB_FILES[0])?;
            for optional in &HUB_FILES[1..] {
                let _ = fetch(optional);
            }
            folder_tokenizer(config.parent().unwrap_or(Path::new(".")))
        }
    }
}

/// The configuration of a model without loading its weights: from a folder's `config.json`, a `config.json` file,
/// a `.gguf` file's metadata, or a Hub id (only `config.json` is fetched).
pub fn load_model_config(spec: &str, revision: Option<&str>) -> Result<ModelConfig> {
    let path = Path::new(spec);
    if path.is_file() && path.extension().is_some_and(|e| e == "json") {
        return ModelConfig::from_hf_config_file(path);
    }
    match ModelSource::parse(spec, revision)? {
        ModelSource::Folder(dir) => ModelConfig::from_hf_config_file(&dir.join("config.json")),
        ModelSource::Gguf(path) => gguf_config(&GgufFile::open(&path)?),
        ModelSource::Hub { id, revision } => {
            let fetch = hub_fetcher(&id, &revision)?;
            let config = hub_required(&fetch, &id, &revision, HUB_FILES[0])?;
            ModelConfig::from_hf_config_file(&config)
        }
    }
}
