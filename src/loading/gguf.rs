//! GGUF files: tensors dequantized one at a time under their Hugging Face names, q/k weights un-permuted back to
//! the HF layout (llama.cpp permutes them for its interleaved RoPE), and the model config from the metadata.

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use candle_core::quantized::{ggml_file, gguf_file};
use candle_core::{DType, Device, Tensor};

use super::read_names::ReadNames;
use crate::error::{Error, Result};
use crate::models::Architecture;
use crate::ops::rope::LongRopeScaling;

/// A GGUF file opened for reading tensors by Hugging Face name.
pub struct GgufFile {
    path: PathBuf,
    content: gguf_file::Content,
    file: Mutex<std::fs::File>,
    /// The file's size in bytes, which a tensor's rows must lie within.
    size: u64,
    /// `general.architecture` (empty when missing).
    arch: String,
    /// The llama.cpp names of the tensors read so far, so what a model leaves unread can be reported.
    read: ReadNames,
}

/// The llama.cpp name of a Hugging Face tensor name in a file of architecture `arch` (`general.architecture`: a
/// family may name a module its own way, as Gemma its norm after attention, [`Family::gguf_module`](crate::models::Family::gguf_module)).
pub fn gguf_name(hf: &str, arch: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_string());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let (module, suffix) = rest.rsplit_once('.')?;
    let family = Architecture::from_gguf(arch, false);
    if let Some(own) = family.and_then(|f| f.gguf_module(module)) {
        return Some(format!("blk.{layer}.{own}.{suffix}"));
    }
    let gguf_module = match module {
        "input_layernorm" => "attn_norm",
        "post_attention_layernorm" | "pre_feedforward_layernorm" => "ffn_norm",
        "post_feedforward_layernorm" => "post_ffw_norm",
        "self_attn.q_norm" => "attn_q_norm",
        "self_attn.k_norm" => "attn_k_norm",
        "self_attn.qkv_proj" => "attn_qkv",
        "mlp.gate_up_proj" => "ffn_up",
        "self_attn.q_proj" => "attn_q",
        "self_attn.k_proj" => "attn_k",
        "self_attn.v_proj" => "attn_v",
        "self_attn.o_proj" => "attn_output",
        "mlp.gate_proj" => "ffn_gate",
        "mlp.up_proj" => "ffn_up",
        "mlp.down_proj" => "ffn_down",
        // Mixtures of experts: the router, the shared expert and its gate.
        "mlp.gate" => "ffn_gate_inp",
        "mlp.shared_expert.gate_proj" => "ffn_gate_shexp",
        "mlp.shared_expert.up_proj" => "ffn_up_shexp",
        "mlp.shared_expert.down_proj" => "ffn_down_shexp",
        "mlp.shared_expert_gate" => "ffn_gate_inp_shexp",
        // The experts' projections, stacked `[experts, out, in]` (transformers 5's fused names, which carry no
        // `.weight`): llama.cpp keeps gate and up apart, `GgufFile::tensor` joins them.
        "mlp.experts" if suffix == "down_proj" => {
            return Some(format!("blk.{layer}.ffn_down_exps.weight"))
        }
        "mlp.experts" if suffix == "gate_up_proj" => {
            return Some(format!("blk.{layer}.ffn_gate_exps.weight"))
        }
        _ => return None,
    };
    Some(format!("blk.{layer}.{gguf_module}.{suffix}"))
}

impl GgufFile {
    /// Opens `path` and reads its header and metadata.
    pub fn open(path: &Path) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| Error::io("cannot open", path, e))?;
        // Candle's reader panics on some corrupt headers (a `general.alignment` of 0 divides by zero): that is a
        // bad file, not a crash.
        let content = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            gguf_file::Content::read(&mut file)
        }))
        .map_err(|_| Error::invalid_file(path, "not a readable GGUF file: its header is corrupt"))?
        .map_err(|e| Error::invalid_file(path, format!("not a readable GGUF file: {e}")))?;
        let size = file
            .metadata()
            .map_err(|e| Error::io("cannot read the size of", path, e))?
            .len();
        let arch = content
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        Ok(GgufFile {
            path: path.to_path_buf(),
            content,
            file: Mutex::new(file),
            size,
            arch,
            read: ReadNames::default(),
        })
    }

    /// Its `general.architecture` (empty when missing).
    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Header and metadata.
    pub fn content(&self) -> &gguf_file::Content {
        &self.content
    }

    /// The metadata as a map.
    pub fn metadata(&self) -> &HashMap<String, gguf_file::Value> {
        &self.content.metadata
    }

    /// True if the file has the tensor with this Hugging Face name.
    pub fn has(&self, hf_name: &str) -> bool {
        gguf_name(hf_name, &self.arch).is_some_and(|n| self.content.tensor_infos.contains_key(&n))
    }

    /// Reads and dequantizes (to f32) the tensor with Hugging Face name `hf_name`; q/k projection weights and
    /// biases of `llama` files are un-permuted to the HF layout using the given head counts.
    pub fn tensor(&self, hf_name: &str, n_head: usize, n_kv_head: usize) -> Result<Tensor> {
        let layout = self.layout(hf_name, n_head, n_kv_head)?;
        let all = layout.dims.iter().product();
        Ok(self.read_part(&layout, 0..all)?.reshape(layout.dims)?)
    }

    /// The shape [`GgufFile::tensor`] gives the tensor with Hugging Face name `hf_name`, if the file has it.
    pub fn shape(&self, hf_name: &str) -> Option<Vec<usize>> {
        // The head counts only matter to reading.
        self.layout(hf_name, 1, 1).ok().map(|l| l.dims)
    }

    /// Records the tensor with Hugging Face name `hf_name` as read (left in the file, read in parts later).
    pub fn mark_read(&self, hf_name: &str) {
        if let Ok(layout) = self.layout(hf_name, 1, 1) {
            self.read.mark(&layout.name);
            layout.up.iter().for_each(|up| self.read.mark(up));
        }
    }

    /// Elements `range` of the tensor [`GgufFile::tensor`] reads, taken flat (float32, 1-D): only the rows they
    /// lie in are read from the file (whole heads of a q/k projection llama.cpp permuted).
    pub fn elements(
        &self,
        hf_name: &str,
        range: Range<usize>,
        n_head: usize,
        n_kv_head: usize,
    ) -> Result<Tensor> {
        let layout = self.layout(hf_name, n_head, n_kv_head)?;
        let all: usize = layout.dims.iter().product();
        if range.end > all || range.start > range.end {
            return Err(Error::invalid_file(
                &self.path,
                format!("tensor `{hf_name}` holds no elements {range:?}"),
            ));
        }
        self.read_part(&layout, range)
    }

    /// The bytes of the file [`GgufFile::elements`] reads for elements `range` of the tensor with Hugging Face name
    /// `hf_name`.
    pub fn bytes_of(
        &self,
        hf_name: &str,
        range: Range<usize>,
        n_head: usize,
        n_kv_head: usize,
    ) -> Result<usize> {
        let layout = self.layout(hf_name, n_head, n_kv_head)?;
        Ok(layout.rows_read(&range).len() * layout.row_bytes)
    }

    /// How the rows of the tensor with Hugging Face name `hf_name` lie in the file (see [`StoredRows`]).
    fn layout(&self, hf_name: &str, n_head: usize, n_kv_head: usize) -> Result<StoredRows> {
        let name = gguf_name(hf_name, &self.arch)
            .filter(|n| self.content.tensor_infos.contains_key(n))
            .ok_or_else(|| {
                Error::invalid_file(&self.path, format!("tensor `{hf_name}` is missing"))
            })?;
        let (info, row_bytes) = self.stored(&name)?;
        let mut dims = info.shape.dims().to_vec();
        let width = row_width(&dims);
        let mut layout = StoredRows {
            name,
            up: None,
            heads: None,
            dims: dims.clone(),
            width,
            row_bytes,
        };
        if layout.name.ends_with("ffn_gate_exps.weight") {
            // transformers' fused `gate_up_proj`: each expert's gate rows, then its up rows.
            let up = layout.name.replace("ffn_gate_exps", "ffn_up_exps");
            let (up_info, _) = self.stored(&up).map_err(|_| {
                Error::invalid_file(&self.path, format!("tensor `{up}` is missing"))
            })?;
            if up_info.shape.dims() != dims.as_slice()
                || up_info.ggml_dtype != info.ggml_dtype
                || dims.len() != 3
            {
                return Err(Error::invalid_file(
                    &self.path,
                    format!(
                        "tensors `{}` {dims:?} and `{up}` {:?}: a mixture of experts' gate and up projections \
                         are stacked alike, `[experts, rows, columns]` of one type",
                        layout.name,
                        up_info.shape.dims()
                    ),
                ));
            }
            dims[1] *= 2;
            layout.dims = dims;
            layout.up = Some(up);
            return Ok(layout);
        }
        if layout.name.ends_with("ffn_gate_inp_shexp.weight") && dims.len() == 1 {
            layout.dims = vec![1, width]; // llama.cpp stores the shared expert's gate as a vector
        }
        let heads = if hf_name.contains("self_attn.q_proj") {
            n_head
        } else if hf_name.contains("self_attn.k_proj") {
            n_kv_head
        } else {
            0
        };
        if self.arch == "llama" && heads > 0 {
            // Rows of a weight, elements of a bias.
            let out = dims.first().copied().unwrap_or(1);
            if out % (2 * heads) != 0 {
                return Err(Error::invalid_file(
                    &self.path,
                    format!(
                        "tensor `{}` has {out} rows, which {heads} heads of pairs cannot share",
                        layout.name
                    ),
                ));
            }
            layout.heads = Some(heads);
        }
        Ok(layout)
    }

    /// Elements `range` of a tensor laid out as `layout` says, reading the rows that hold them.
    fn read_part(&self, layout: &StoredRows, range: Range<usize>) -> Result<Tensor> {
        if range.is_empty() {
            return Ok(Tensor::zeros(0, DType::F32, &Device::Cpu)?);
        }
        let rows = layout.rows_read(&range);
        let values = match (&layout.up, layout.heads) {
            (Some(up), _) => self.read_expert_rows(layout, up, rows.clone())?,
            (None, Some(heads)) => {
                let t = self.read_rows(&layout.name, rows.start, rows.len())?;
                // The heads read: of a weight's rows, or all of a bias (one row).
                let (out, heads) = match layout.dims.len() {
                    1 => (layout.width, heads),
                    _ => (rows.len(), heads * rows.len() / layout.rows()),
                };
                unpermute(&t.reshape((out, t.elem_count() / out))?, heads)?.flatten_all()?
            }
            (None, None) => self.read_rows(&layout.name, rows.start, rows.len())?,
        };
        let first = rows.start * layout.width;
        Ok(values.narrow(0, range.start - first, range.len())?)
    }

    /// Phi-3's LongRoPE as llama.cpp stores it (`rope_factors_short` / `rope_factors_long` tensors and
    /// `phi3.rope.scaling.*` keys), if the file has it.
    pub fn long_rope(&self, max_position_embeddings: usize) -> Result<Option<LongRopeScaling>> {
        let names = ["rope_factors_short.weight", "rope_factors_long.weight"];
        if !names
            .iter()
            .all(|n| self.content.tensor_infos.contains_key(*n))
        {
            return Ok(None);
        }
        let factors = |name: &str| -> Result<Vec<f64>> {
            let v: Vec<f32> = self.read(name)?.flatten_all()?.to_vec1()?;
            Ok(v.into_iter().map(f64::from).collect())
        };
        let key = |k: &str| {
            self.metadata()
                .get(&format!("{}.rope.scaling.{k}", self.arch))
        };
        let original = key("original_context_length")
            .and_then(|v| v.to_u64().ok())
            .filter(|v| *v >= 2)
            .ok_or_else(|| {
                Error::invalid_file(
                    &self.path,
                    format!(
                        "LongRoPE factors without `{}.rope.scaling.original_context_length`",
                        self.arch
                    ),
                )
            })? as usize;
        let factor = max_position_embeddings as f64 / original as f64;
        let attention_factor = match key("attn_factor").and_then(|v| v.to_f32().ok()) {
            Some(f) => f as f64,
            None => LongRopeScaling::default_attention_factor(factor, original),
        };
        Ok(Some(LongRopeScaling {
            short_factor: factors(names[0])?,
            long_factor: factors(names[1])?,
            original_max_position_embeddings: original,
            attention_factor,
        }))
    }

    /// The per-frequency divisors of llama.cpp's `rope_freqs` tensor, if the file has one: its converter writes
    /// Llama 3's frequency-dependent RoPE scaling (`rope_type = "llama3"`) that way instead of as metadata, each
    /// inverse frequency divided by its factor.
    pub fn rope_frequency_factors(&self) -> Result<Option<Vec<f64>>> {
        const NAME: &str = "rope_freqs.weight";
        if !self.content.tensor_infos.contains_key(NAME) {
            return Ok(None);
        }
        let factors: Vec<f32> = self.read(NAME)?.flatten_all()?.to_vec1()?;
        Ok(Some(factors.into_iter().map(f64::from).collect()))
    }

    /// The tensors (by llama.cpp name) starting with `prefix` that nothing has read yet, sorted.
    pub fn unread(&self, prefix: &str) -> Vec<String> {
        let stored = self.content.tensor_infos.keys().map(String::as_str);
        self.read.unread(stored, prefix)
    }

    /// Rows `rows` of joined experts (`layout.up` set): each expert's gate rows, then its up rows. The experts
    /// the rows hold whole are read as two runs, one of each tensor; an expert's rows at either end, run by run.
    fn read_expert_rows(
        &self,
        layout: &StoredRows,
        up: &str,
        rows: Range<usize>,
    ) -> Result<Tensor> {
        let expert_rows = layout.dims[1];
        let half = expert_rows / 2;
        let whole = rows.start.div_ceil(expert_rows)..rows.end / expert_rows;
        // Rows of one expert's, one tensor's run at a time.
        let runs = |rows: Range<usize>| -> Result<Vec<Tensor>> {
            let mut runs = Vec::new();
            let mut row = rows.start;
            while row < rows.end {
                let (expert, within) = (row / expert_rows, row % expert_rows);
                let (tensor, first, run_end) = match within < half {
                    true => (layout.name.as_str(), within, half),
                    false => (up, within - half, expert_rows),
                };
                let end = rows.end.min(expert * expert_rows + run_end);
                runs.push(self.read_rows(tensor, expert * half + first, end - row)?);
                row = end;
            }
            Ok(runs)
        };
        if whole.is_empty() {
            return Ok(Tensor::cat(&runs(rows)?, 0)?);
        }
        let of = |tensor: &str| -> Result<Tensor> {
            let t = self.read_rows(tensor, whole.start * half, whole.len() * half)?;
            Ok(t.reshape((whole.len(), half, layout.width))?)
        };
        let middle = Tensor::cat(&[of(&layout.name)?, of(up)?], 1)?.flatten_all()?;
        let mut parts = runs(rows.start..whole.start * expert_rows)?;
        parts.push(middle);
        parts.extend(runs(whole.end * expert_rows..rows.end)?);
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Reads and dequantizes (to f32) the tensor llama.cpp names `name`.
    fn read(&self, name: &str) -> Result<Tensor> {
        let (info, _) = self.stored(name)?;
        let dims = info.shape.dims().to_vec();
        let rows = dims.iter().product::<usize>() / row_width(&dims);
        Ok(self.read_rows(name, 0, rows)?.reshape(dims)?)
    }

    /// Tensor `name`'s information, checked to be readable in rows, and the bytes of one row (its last axis).
    fn stored(&self, name: &str) -> Result<(&gguf_file::TensorInfo, usize)> {
        let info = self.content.tensor_infos.get(name).ok_or_else(|| {
            Error::invalid_file(&self.path, format!("tensor `{name}` is missing"))
        })?;
        // Candle computes the byte size from the declared dimensions unchecked (an overflow), and reads an empty
        // tensor through a misaligned pointer (undefined behaviour; a debug build aborts): refuse both here.
        let dims = info.shape.dims();
        let elements = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
        let (block, block_bytes) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
        let bytes = elements.and_then(|n| (n / block).checked_mul(block_bytes));
        if elements == Some(0) || bytes.is_none() {
            let what = if elements == Some(0) {
                "no elements"
            } else {
                "more bytes than any file"
            };
            return Err(Error::invalid_file(
                &self.path,
                format!("tensor `{name}` has dimensions {dims:?}: {what}"),
            ));
        }
        let width = row_width(dims);
        if width % block != 0 {
            return Err(Error::invalid_file(
                &self.path,
                format!(
                    "tensor `{name}` has rows of {width} elements, not whole {:?} blocks of {block}",
                    info.ggml_dtype
                ),
            ));
        }
        Ok((info, width / block * block_bytes))
    }

    /// Rows `first..first + count` of tensor `name` (its last axis a row), dequantized to float32, flat: only
    /// their bytes are read.
    fn read_rows(&self, name: &str, first: usize, count: usize) -> Result<Tensor> {
        self.read.mark(name);
        let (info, row_bytes) = self.stored(name)?;
        let width = row_width(info.shape.dims());
        let (start, bytes) = (
            (self.content.tensor_data_offset)
                .saturating_add(info.offset)
                .saturating_add((first * row_bytes) as u64),
            count * row_bytes,
        );
        let unreadable = |why: String| {
            Error::invalid_file(
                &self.path,
                format!("cannot read tensor `{name}`: {why} (file truncated?)"),
            )
        };
        if start.saturating_add(bytes as u64) > self.size {
            return Err(unreadable(format!(
                "it needs {bytes} bytes at offset {start}, only {} remain in the file",
                self.size.saturating_sub(start)
            )));
        }
        let raw = {
            let mut file = self
                .file
                .lock()
                .map_err(|_| Error::invalid_file(&self.path, "file handle poisoned"))?;
            let mut raw = vec![0u8; bytes];
            file.seek(SeekFrom::Start(start))
                .and_then(|_| file.read_exact(&mut raw))
                .map_err(|e| unreadable(e.to_string()))?;
            raw
        };
        let q =
            ggml_file::qtensor_from_ggml(info.ggml_dtype, &raw, vec![count * width], &Device::Cpu)
                .map_err(|e| {
                    Error::invalid_file(&self.path, format!("cannot read tensor `{name}`: {e}"))
                })?;
        Ok(q.dequantize(&Device::Cpu)?)
    }
}

/// The elements of a row of a tensor of dimensions `dims`: its last axis (a scalar is one row of one).
fn row_width(dims: &[usize]) -> usize {
    dims.last().copied().unwrap_or(1)
}

/// How a tensor [`GgufFile::tensor`] reads by Hugging Face name lies in the file, its last axis a row: each row
/// a row of a stored tensor — of one tensor, as stored or with each head's rows in llama.cpp's pairs (a q/k
/// projection it permuted, read a whole head at a time), or of two (each expert's gate rows, then its up rows).
struct StoredRows {
    /// The llama.cpp name of the (first) stored tensor.
    name: String,
    /// The experts' up projections, whose rows follow each expert's gate rows (from `name`).
    up: Option<String>,
    /// The heads of a weight (or bias) whose rows (elements) llama.cpp permuted into pairs.
    heads: Option<usize>,
    /// The dimensions [`GgufFile::tensor`] gives.
    dims: Vec<usize>,
    /// Elements a row.
    width: usize,
    /// Bytes a row in the file.
    row_bytes: usize,
}

impl StoredRows {
    /// Rows in all.
    fn rows(&self) -> usize {
        self.dims.iter().product::<usize>() / self.width
    }

    /// The rows read for flat elements `range`: those holding them, whole heads of a permuted weight (all of a
    /// permuted bias, one row).
    fn rows_read(&self, range: &Range<usize>) -> Range<usize> {
        if range.is_empty() {
            return 0..0;
        }
        let group = self.heads.map_or(1, |heads| (self.rows() / heads).max(1));
        let group_elements = group * self.width;
        range.start / group_elements * group..range.end.div_ceil(group_elements) * group
    }
}

/// llama.cpp's `permute(w, n_head)` of a q/k projection for its interleaved RoPE: the rows of each head,
/// `[2, head_dim/2]` (transformers' halves), become `[head_dim/2, 2]` (pairs); [`unpermute`] undoes it.
pub fn permute(w: &Tensor, n_head: usize) -> candle_core::Result<Tensor> {
    let dims = w.dims().to_vec();
    let out = dims[0];
    let rest: usize = dims[1..].iter().product();
    w.reshape((n_head, 2, out / n_head / 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

/// Undoes llama.cpp's `permute(w, n_head)`: rows `[n_head, head_dim/2, 2]` back to `[n_head, 2, head_dim/2]`.
pub fn unpermute(w: &Tensor, n_head: usize) -> candle_core::Result<Tensor> {
    let dims = w.dims().to_vec();
    let out = dims[0];
    let rest: usize = dims[1..].iter().product();
    w.reshape((n_head, out / n_head / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `permute` is the inverse of `unpermute`, and moves row `h·d + 2j + k` to `h·d + k·d/2 + j` back and forth.
    #[test]
    fn permute_undoes_unpermute() {
        let w = Tensor::arange(0f32, 48.0, &Device::Cpu)
            .unwrap()
            .reshape((8, 6))
            .unwrap();
        let p = permute(&w, 2).unwrap();
        assert_eq!(
            unpermute(&p, 2).unwrap().to_vec2::<f32>().unwrap(),
            w.to_vec2::<f32>().unwrap()
        );
        // Head 0, rows of 4: HF rows [0, 1 | 2, 3] (halves) go to llama.cpp's [0, 2, 1, 3] (pairs).
        let firsts: Vec<f32> = p
            .narrow(1, 0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(firsts, [0.0, 12.0, 6.0, 18.0, 24.0, 36.0, 30.0, 42.0]);
    }

    #[test]
    fn names_map_to_llama_cpp() {
        let layer = |n: &str| format!("model.layers.2.{n}");
        let cases = [
            (
                "model.embed_tokens.weight".to_string(),
                "llama",
                "token_embd.weight",
            ),
            (
                layer("self_attn.q_proj.weight"),
                "llama",
                "blk.2.attn_q.weight",
            ),
            (
                layer("mlp.down_proj.weight"),
                "llama",
                "blk.2.ffn_down.weight",
            ),
            (layer("self_attn.k_proj.bias"), "qwen2", "blk.2.attn_k.bias"),
            (
                layer("post_attention_layernorm.weight"),
                "qwen3",
                "blk.2.ffn_norm.weight",
            ),
            (
                layer("self_attn.q_norm.weight"),
                "qwen3",
                "blk.2.attn_q_norm.weight",
            ),
            // Gemma's norms around each block.
            (
                layer("post_attention_layernorm.weight"),
                "gemma2",
                "blk.2.post_attention_norm.weight",
            ),
            (
                layer("pre_feedforward_layernorm.weight"),
                "gemma3",
                "blk.2.ffn_norm.weight",
            ),
            (
                layer("post_feedforward_layernorm.weight"),
                "gemma2",
                "blk.2.post_ffw_norm.weight",
            ),
            // Phi-3's fused projections.
            (
                layer("self_attn.qkv_proj.weight"),
                "phi3",
                "blk.2.attn_qkv.weight",
            ),
            (
                layer("mlp.gate_up_proj.weight"),
                "phi3",
                "blk.2.ffn_up.weight",
            ),
            // Mixtures of experts: the router, the stacked experts (gate joined with up on reading), the shared
            // expert and its gate.
            (
                layer("mlp.gate.weight"),
                "qwen3moe",
                "blk.2.ffn_gate_inp.weight",
            ),
            (
                layer("mlp.experts.gate_up_proj"),
                "qwen3moe",
                "blk.2.ffn_gate_exps.weight",
            ),
            (
                layer("mlp.experts.down_proj"),
                "qwen2moe",
                "blk.2.ffn_down_exps.weight",
            ),
            (
                layer("mlp.shared_expert.up_proj.weight"),
                "qwen2moe",
                "blk.2.ffn_up_shexp.weight",
            ),
            (
                layer("mlp.shared_expert_gate.weight"),
                "qwen2moe",
                "blk.2.ffn_gate_inp_shexp.weight",
            ),
        ];
        for (hf, arch, expected) in cases {
            assert_eq!(
                gguf_name(&hf, arch).as_deref(),
                Some(expected),
                "{hf} ({arch})"
            );
        }
        assert!(gguf_name("model.layers.0.unknown.weight", "llama").is_none());
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        let (n_head, hd, inp) = (2usize, 4usize, 3usize);
        let hf = Tensor::arange(0f32, (n_head * hd * inp) as f32, &Device::Cpu)
            .unwrap()
            .reshape((n_head * hd, inp))
            .unwrap();
        // llama.cpp: reshape(n_head, 2, hd/2, in).swapaxes(1, 2)
        let permuted = hf
            .reshape((n_head, 2, hd / 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((n_head * hd, inp))
            .unwrap();
        let back = unpermute(&permuted, n_head).unwrap();
        assert_eq!(back.to_vec2::<f32>().unwrap(), hf.to_vec2::<f32>().unwrap());
    }
}
