//! A model as llama.cpp's converter (`convert_hf_to_gguf.py`) writes it for its architecture (`llama`, with
//! Mixtral's experts; `phi3`, `qwen2`, `qwen2moe`, `qwen3`, `qwen3moe`): which tensors, under which names and in
//! which layouts (Llama's q/k rows permuted for its interleaved RoPE, Llama 3's `rope_freqs`, Phi-3's LongRoPE
//! factors, Qwen 2's biases, Qwen 3's q/k norms, experts stacked), in which order, and the metadata: the
//! architecture's hyperparameters, and the tokenizer ([`vocabulary`](super::vocabulary)). A model loaded from GGUF
//! (Gemma's too) keeps its file's metadata and tensor order.

use std::path::Path;

use candle_core::quantized::gguf_file::Value;

use super::ggml::GgmlType;
use super::gguf_writer::TensorRecord;
use super::tensor_types::{llama_quantize_order, tensor_types, ModelShape, Quantization};
use super::vocabulary::{entry, tokenizer_metadata, Entry};
use crate::adapter::effective_weight;
use crate::error::{Error, Result};
use crate::files::read_json;
use crate::loading::gguf::{gguf_name, permute, GgufFile};
use crate::lora::{LoraAdapter, LoraLinear};
use crate::models::{LlamaModel, ModelConfig};
use crate::ops::rope::{llama3_frequency_divisors, RopeScaling};

/// A tensor of the model as float32 values in row-major order.
fn values_of(t: &candle_core::Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?)
}

/// Where a tensor's values come from.
#[derive(Clone, Debug)]
pub(super) enum TensorSource {
    /// The embedding table in use (an adapter's trained copy, or the base's).
    Embedding,
    /// The final norm's weight.
    FinalNorm,
    /// The output head in use, when not tied to the embeddings.
    Head,
    /// A norm of a layer, by its Hugging Face module name.
    LayerNorm { layer: usize, module: &'static str },
    /// A linear layer's weight with the adapter merged in; q/k projections permuted over `heads` heads.
    Linear {
        name: String,
        permute_heads: Option<usize>,
    },
    /// One projection of every expert of a sparse layer (adapters merged in), stacked.
    Experts { layer: usize, part: ExpertPart },
    /// Llama 3's RoPE scaling as per-frequency divisors.
    RopeFactors(Vec<f32>),
    /// A linear layer's bias.
    Bias { name: String },
    /// A linear layer's adapter `A` `[r, in]`.
    LoraA { name: String },
    /// A linear layer's adapter `B` `[out, r]`, times `factor` (its scaling against the file's `alpha / r`), q/k
    /// rows permuted over `heads` heads.
    LoraB {
        name: String,
        permute_heads: Option<usize>,
        factor: f64,
    },
}

/// Which projection of the experts a stacked tensor holds.
#[derive(Clone, Copy, Debug)]
pub(super) enum ExpertPart {
    /// The gate projection: the first half of the rows of each expert's `gate_up_proj`.
    Gate,
    /// The up projection: the second half.
    Up,
    /// The down projection.
    Down,
}

/// The layer and expert of an expert's projection (`model.layers.{l}.mlp.experts.{e}.*`).
fn expert_of(name: &str) -> Option<(usize, usize)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once(".mlp.experts.")?;
    let (expert, _) = rest.split_once('.')?;
    Some((layer.parse().ok()?, expert.parse().ok()?))
}

/// A tensor to write: its record and where its values come from.
pub(super) struct Planned {
    pub record: TensorRecord,
    pub source: TensorSource,
}

/// A tensor to write before its type is chosen: llama.cpp name, shape, and where its values come from.
type Unplanned = (String, Vec<usize>, TensorSource);

/// Where the model came from.
enum Origin<'a> {
    /// A GGUF file: its metadata and tensor order are kept.
    Gguf(&'a GgufFile),
    /// A Hugging Face folder: its `config.json` and tokenizer files are converted, the pre-tokenizer named
    /// `tokenizer_pre` where given.
    Folder {
        path: &'a Path,
        tokenizer_pre: Option<&'a str>,
    },
}

/// The conversion of one model.
pub(super) struct Conversion<'a> {
    model: &'a LlamaModel,
    /// `general.architecture`.
    arch: String,
    origin: Origin<'a>,
    /// RoPE's per-frequency factors, written first: Llama 3's `rope_freqs`, or LongRoPE's `rope_factors_long` and
    /// `rope_factors_short` (Phi-3).
    rope_factors: Vec<(&'static str, Vec<f32>)>,
}

/// The llama.cpp architectures written.
const WRITTEN: [&str; 6] = ["llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3"];

/// The llama.cpp architectures written back from a GGUF file of their own (its metadata carried over), not from a
/// Hugging Face folder: Gemma's.
const CARRIED: [&str; 2] = ["gemma2", "gemma3"];

/// llama.cpp's architecture for a Hugging Face config, as its converter names it: Llama's for Llama, Mixtral and
/// Mistral (whose sliding window llama.cpp's `llama` has not: a config that sets one is refused rather than written
/// without it), Phi-3's, Qwen 2's, Qwen 2-MoE's, Qwen 3's and Qwen 3-MoE's own.
fn gguf_architecture(config: &ModelConfig) -> Result<&'static str> {
    Ok(match config.architecture.model_type() {
        "llama" => "llama",
        "mistral" | "mixtral" if config.sliding_window.is_none() => "llama",
        "mistral" | "mixtral" => {
            return Err(Error::InvalidInput(format!(
                "this Mistral/Mixtral model attends within a sliding window of {} tokens, which llama.cpp's `llama` \
                 architecture (the one its converter writes Mistral as) does not have: its GGUF would attend to \
                 every earlier token (a copy of its config.json with `\"sliding_window\": null` exports as \
                 llama.cpp's converter would, without the window)",
                config.sliding_window.unwrap_or_default()
            )))
        }
        "phi3" => "phi3",
        "qwen2" => "qwen2",
        "qwen2_moe" => "qwen2moe",
        "qwen3" => "qwen3",
        "qwen3_moe" => "qwen3moe",
        // Refused by the caller, naming the model type.
        _ => "",
    })
}

impl<'a> Conversion<'a> {
    /// The conversion of `model`, loaded from `gguf` (that file) or else from the folder `source`; `tokenizer_pre`
    /// names llama.cpp's pre-tokenizer for a folder's tokenizer where it is not recognized.
    pub fn new(
        model: &'a LlamaModel,
        gguf: Option<&'a GgufFile>,
        source: &'a Path,
        tokenizer_pre: Option<&'a str>,
    ) -> Result<Self> {
        let config = model.config();
        let model_type = config.architecture.model_type();
        let arch = match gguf {
            Some(file) => file.arch().to_string(),
            None => gguf_architecture(config)?.to_string(),
        };
        let carried_only = gguf.is_some() && CARRIED.contains(&arch.as_str());
        if !(WRITTEN.contains(&arch.as_str()) || carried_only) {
            return Err(Error::InvalidInput(format!(
                "GGUF export writes llama.cpp's `llama` (Llama, SmolLM, Mistral and Mixtral without a sliding window), \
                 `phi3`, `qwen2`, `qwen2moe`, `qwen3` and `qwen3moe` architectures so far (and `gemma2`, `gemma3` from a GGUF file of their \
                 own); this model is `{model_type}`{}",
                match gguf {
                    Some(f) => format!(" from a GGUF file of architecture `{}`", f.arch()),
                    None => String::new(),
                }
            )));
        }
        if let Some(moe) = &config.moe {
            if moe.sparse_layers.iter().any(|sparse| !sparse) {
                return Err(Error::InvalidInput(
                    "this mixture of experts has dense layers among its sparse ones (`mlp_only_layers` or a \
                     `decoder_sparse_step` above 1), which llama.cpp's architectures for it do not have"
                        .into(),
                ));
            }
        }
        let floats = |v: &[f64]| v.iter().map(|&f| f as f32).collect::<Vec<f32>>();
        let rope_factors = match (gguf, &config.rope_scaling) {
            (_, Some(RopeScaling::LongRope(s))) => vec![
                ("rope_factors_long.weight", floats(&s.long_factor)),
                ("rope_factors_short.weight", floats(&s.short_factor)),
            ],
            (Some(file), _) => file
                .rope_frequency_factors()?
                .map(|f| vec![("rope_freqs.weight", floats(&f))])
                .unwrap_or_default(),
            (None, Some(RopeScaling::Llama3(s))) => vec![(
                "rope_freqs.weight",
                llama3_frequency_divisors(config.rotary_dim, config.rope_theta, s),
            )],
            (None, None | Some(RopeScaling::Linear { .. })) => Vec::new(),
            (None, Some(other)) => {
                return Err(Error::InvalidInput(format!(
                    "GGUF export: RoPE scaling {other:?} is not written yet (Llama 3's, LongRoPE, linear and none are)"
                )))
            }
        };
        let origin = match gguf {
            Some(file) => Origin::Gguf(file),
            None => Origin::Folder {
                path: source,
                tokenizer_pre,
            },
        };
        Ok(Conversion {
            model,
            arch,
            origin,
            rope_factors,
        })
    }

    /// `general.architecture`.
    pub fn architecture(&self) -> &str {
        &self.arch
    }

    /// The tensors to write, in the order of the source — a GGUF file's, or the converter's for a folder (RoPE
    /// factors first, then by Hugging Face name, the order of its safetensors files) — or, for the types that
    /// llama-quantize writes, in its order.
    pub fn tensors(&self, quantization: Quantization) -> Result<Vec<Planned>> {
        // Each tensor under the name of the file's tensor the converter writes it after (it sorts by those).
        let mut hf: Vec<(String, Unplanned)> = Vec::new();
        let mut push = |hf_name: String, shape: Vec<usize>, source| -> Result<()> {
            let name = self.llama_cpp_name(&hf_name)?;
            hf.push((hf_name, (name, shape, source)));
            Ok(())
        };
        let embedding = self.model.embedding_table()?.dims().to_vec();
        push(
            "model.embed_tokens.weight".into(),
            embedding.clone(),
            TensorSource::Embedding,
        )?;
        for (i, layer) in self.model.layers.iter().enumerate() {
            for (module, w) in layer.norms() {
                push(
                    format!("model.layers.{i}.{module}.weight"),
                    w.dims().to_vec(),
                    TensorSource::LayerNorm { layer: i, module },
                )?;
            }
        }
        let mut stacked = Vec::new();
        for (name, linear) in self.model.linears() {
            if let Some((layer, expert)) = expert_of(&name) {
                if expert == 0 && name.ends_with(".down_proj") {
                    stacked.extend(self.stacked_experts(layer));
                }
                continue;
            }
            if let Some(bias) = &linear.base.bias {
                let source = TensorSource::Bias { name: name.clone() };
                push(format!("{name}.bias"), bias.dims().to_vec(), source)?;
            }
            let permute_heads = self.permuted_heads(&name);
            let (rows, columns) = linear.base.weight.dims2()?;
            let source = TensorSource::Linear {
                name: name.clone(),
                permute_heads,
            };
            push(format!("{name}.weight"), vec![rows, columns], source)?;
        }
        push(
            "model.norm.weight".into(),
            self.model.norm.dims().to_vec(),
            TensorSource::FinalNorm,
        )?;
        if self.writes_head()? {
            push("lm_head.weight".into(), embedding, TensorSource::Head)?;
        }
        hf.extend(stacked);
        if self.mixtral_files() {
            // Mixtral's checkpoints name the router `block_sparse_moe.gate`, which sorts before the layer's norms.
            for (file_name, _) in &mut hf {
                if let Some(layer) = file_name.strip_suffix(".mlp.gate.weight") {
                    *file_name = format!("{layer}.block_sparse_moe.gate.weight");
                }
            }
        }
        if let Origin::Folder { .. } = self.origin {
            hf.sort_by(|a, b| a.0.cmp(&b.0));
        }
        let mut out: Vec<Unplanned> = Vec::new();
        for (name, factors) in &self.rope_factors {
            let source = TensorSource::RopeFactors(factors.clone());
            out.push((name.to_string(), vec![factors.len()], source));
        }
        out.extend(hf.into_iter().map(|(_, tensor)| tensor));
        if let Origin::Gguf(file) = self.origin {
            let infos = &file.content().tensor_infos;
            out.sort_by_key(|(name, _, _)| infos.get(name).map_or(u64::MAX, |i| i.offset));
        }
        if !quantization.written_by_converter() {
            out.sort_by(|a, b| llama_quantize_order(&a.0).cmp(&llama_quantize_order(&b.0)));
        }
        Ok(self.typed(out, quantization))
    }

    /// Whether the checkpoint names its experts as Mixtral's does (`block_sparse_moe.experts.{e}.w1`/`w2`/`w3`).
    fn mixtral_files(&self) -> bool {
        self.model.config().architecture.model_type() == "mixtral"
    }

    /// The experts of sparse layer `layer` stacked as llama.cpp holds them (`ffn_gate_exps`, `ffn_up_exps`
    /// `[experts, width, hidden]`, `ffn_down_exps` `[experts, hidden, width]`), each under the file name after
    /// which the converter writes it: it writes all three once it has read the layer's last expert tensor (in name
    /// order), Mixtral's gate, down, up and Qwen's down, gate, up.
    fn stacked_experts(&self, layer: usize) -> Vec<(String, Unplanned)> {
        let config = self.model.config();
        let Some(moe) = &config.moe else {
            return Vec::new();
        };
        let (experts, width, hidden) = (
            moe.num_experts,
            moe.moe_intermediate_size,
            config.hidden_size,
        );
        let last_expert = (0..experts)
            .map(|e| e.to_string())
            .max()
            .unwrap_or_default();
        let (last_file_name, parts) = match self.mixtral_files() {
            true => (
                format!("model.layers.{layer}.block_sparse_moe.experts.{last_expert}.w3.weight"),
                [ExpertPart::Gate, ExpertPart::Down, ExpertPart::Up],
            ),
            false => (
                format!("model.layers.{layer}.mlp.experts.{last_expert}.up_proj.weight"),
                [ExpertPart::Down, ExpertPart::Gate, ExpertPart::Up],
            ),
        };
        parts
            .into_iter()
            .enumerate()
            .map(|(i, part)| {
                let (kind, shape) = match part {
                    ExpertPart::Gate => ("gate", vec![experts, width, hidden]),
                    ExpertPart::Up => ("up", vec![experts, width, hidden]),
                    ExpertPart::Down => ("down", vec![experts, hidden, width]),
                };
                // Right after that file name, in the converter's order among the three.
                let key = format!("{last_file_name}\u{1}{i}");
                let name = format!("blk.{layer}.ffn_{kind}_exps.weight");
                (key, (name, shape, TensorSource::Experts { layer, part }))
            })
            .collect()
    }

    /// `tensors` with the types `quantization` gives them, in their order.
    fn typed(&self, tensors: Vec<Unplanned>, quantization: Quantization) -> Vec<Planned> {
        let config = self.model.config();
        let shape = ModelShape {
            arch: &self.arch,
            layers: self.model.layers.len(),
            heads: config.num_attention_heads,
            kv_heads: config.num_key_value_heads,
            experts: config.moe.as_ref().map_or(0, |m| m.num_experts),
        };
        let named: Vec<(&str, &[usize])> = tensors
            .iter()
            .map(|(n, s, _)| (n.as_str(), s.as_slice()))
            .collect();
        let types = tensor_types(quantization, &named, shape);
        tensors
            .into_iter()
            .zip(types)
            .map(|((name, shape, source), ggml_type)| Planned {
                record: TensorRecord {
                    name,
                    shape,
                    ggml_type,
                },
                source,
            })
            .collect()
    }

    /// The active adapter's tensors, as llama.cpp's `convert_lora_to_gguf.py` writes them: for each adapted linear
    /// layer (by Hugging Face name) `<tensor>.lora_a` `[r, in]` and `<tensor>.lora_b` `[out, r]`, q/k rows of `B`
    /// permuted as the base's. llama.cpp scales every module by the file's `alpha` over its rank: that is the
    /// first module's `scaling · r` (PEFT's `lora_alpha`, or `lora_alpha · √r` for rsLoRA), and a module scaled
    /// otherwise (`rank_pattern`, `alpha_pattern`) has its `B` multiplied to match. Refused: no adapter, DoRA (which
    /// llama.cpp does not apply) and trained embeddings or head (which a llama.cpp adapter cannot carry).
    pub fn adapter_tensors(&self, quant: GgmlType) -> Result<(Vec<Planned>, f64)> {
        if let Some(saved) = self.model.active_saved() {
            if saved.embed_tokens.is_some() || saved.lm_head.is_some() {
                return Err(Error::InvalidInput(
                    "the adapter trains the embeddings or the head (`modules_to_save`), which a llama.cpp adapter \
                     cannot carry: export the model with the adapter merged in (without --adapter-only)"
                        .into(),
                ));
            }
        }
        let mut adapted: Vec<(String, &LoraAdapter)> = self
            .model
            .linears()
            .into_iter()
            .filter_map(|(name, l)| l.active_adapter().map(|a| (name, a.as_ref())))
            .collect();
        adapted.sort_by(|a, b| a.0.cmp(&b.0));
        let Some((_, first)) = adapted.first() else {
            return Err(Error::InvalidInput(
                "--adapter-only: the model has no adapter to write (give one with --adapter)"
                    .into(),
            ));
        };
        let rank = |a: &LoraAdapter| a.a.as_tensor().dim(0);
        let alpha = first.scaling * rank(first)? as f64;
        let mut out = Vec::new();
        for (name, adapter) in adapted {
            if expert_of(&name).is_some() {
                return Err(Error::InvalidInput(format!(
                    "`{name}` is an expert's projection: an adapter on experts is not written alone yet (llama.cpp \
                     holds the experts stacked); export the model with the adapter merged in (without --adapter-only)"
                )));
            }
            if adapter.magnitude.is_some() {
                return Err(Error::InvalidInput(format!(
                    "`{name}` is a DoRA module, which llama.cpp does not apply: export the model with the adapter \
                     merged in (without --adapter-only)"
                )));
            }
            let base = self.llama_cpp_name(&format!("{name}.weight"))?;
            let (r, columns) = adapter.a.as_tensor().dims2()?;
            let rows = adapter.b.as_tensor().dim(0)?;
            let permute_heads = self.permuted_heads(&name);
            for (suffix, shape, source) in [
                (
                    "lora_a",
                    vec![r, columns],
                    TensorSource::LoraA { name: name.clone() },
                ),
                (
                    "lora_b",
                    vec![rows, r],
                    TensorSource::LoraB {
                        name: name.clone(),
                        permute_heads,
                        factor: adapter.scaling * r as f64 / alpha,
                    },
                ),
            ] {
                out.push((format!("{base}.{suffix}"), shape, source));
            }
        }
        Ok((self.typed(out, Quantization::Uniform(quant)), alpha))
    }

    /// The metadata of an adapter file (`general.type = adapter`), as `convert_lora_to_gguf.py` writes it.
    pub fn adapter_metadata(&self, alpha: f64) -> Vec<Entry> {
        vec![
            entry("general.architecture", Value::String(self.arch.clone())),
            entry("general.type", Value::String("adapter".into())),
            entry("adapter.type", Value::String("lora".into())),
            entry("adapter.lora.alpha", Value::F32(alpha as f32)),
            entry("general.quantization_version", Value::U32(2)),
        ]
    }

    /// llama.cpp's name of the Hugging Face tensor `hf`.
    fn llama_cpp_name(&self, hf: &str) -> Result<String> {
        gguf_name(hf, &self.arch)
            .ok_or_else(|| Error::InvalidInput(format!("no llama.cpp name for tensor `{hf}`")))
    }

    /// The heads over which the rows of linear layer `name` are permuted: Llama's q and k projections, for
    /// llama.cpp's interleaved RoPE (Qwen's keep transformers' halves, as llama.cpp computes them).
    fn permuted_heads(&self, name: &str) -> Option<usize> {
        let config = self.model.config();
        match self.arch.as_str() {
            "llama" if name.ends_with("self_attn.q_proj") => Some(config.num_attention_heads),
            "llama" if name.ends_with("self_attn.k_proj") => Some(config.num_key_value_heads),
            _ => None,
        }
    }

    /// Whether the head is written (`output.weight`): when the model has one of its own — untied in its config,
    /// or trained apart from the embeddings by the adapter.
    fn writes_head(&self) -> Result<bool> {
        if !self.model.config().tie_word_embeddings {
            return Ok(true);
        }
        let head = self.model.head_weight()?;
        Ok(values_of(&head)? != values_of(&self.model.embedding_table()?)?)
    }

    /// A tensor's values in the order the file stores them.
    pub fn values(&self, source: &TensorSource) -> Result<Vec<f32>> {
        let model = self.model;
        match source {
            TensorSource::Embedding => values_of(&model.embedding_table()?),
            TensorSource::FinalNorm => values_of(&model.norm),
            TensorSource::Head => values_of(&model.head_weight()?),
            TensorSource::LayerNorm { layer, module } => {
                let norms = model.layers[*layer].norms();
                let (_, w) = norms.iter().find(|(m, _)| m == module).ok_or_else(|| {
                    Error::InvalidInput(format!("layer {layer} has no `{module}`"))
                })?;
                values_of(w)
            }
            TensorSource::Linear {
                name,
                permute_heads,
            } => permuted_values(&effective_weight(linear(model, name)?)?, *permute_heads),
            TensorSource::Experts { layer, part } => {
                let experts = model.config().moe.as_ref().map_or(0, |m| m.num_experts);
                let mut out = Vec::new();
                for e in 0..experts {
                    let prefix = format!("model.layers.{layer}.mlp.experts.{e}");
                    let w = match part {
                        ExpertPart::Down => {
                            effective_weight(linear(model, &format!("{prefix}.down_proj"))?)?
                        }
                        ExpertPart::Gate | ExpertPart::Up => {
                            let gate_up = effective_weight(linear(
                                model,
                                &format!("{prefix}.gate_up_proj"),
                            )?)?;
                            let width = gate_up.dim(0)? / 2;
                            let start = if matches!(part, ExpertPart::Up) {
                                width
                            } else {
                                0
                            };
                            gate_up.narrow(0, start, width)?
                        }
                    };
                    out.extend(values_of(&w)?);
                }
                Ok(out)
            }
            TensorSource::RopeFactors(f) => Ok(f.clone()),
            TensorSource::Bias { name } => match &linear(model, name)?.base.bias {
                Some(b) => values_of(b),
                None => Err(Error::InvalidInput(format!("`{name}` has no bias"))),
            },
            TensorSource::LoraA { name } => values_of(adapter_of(model, name)?.a.as_tensor()),
            TensorSource::LoraB {
                name,
                permute_heads,
                factor,
            } => {
                let b = adapter_of(model, name)?.b.as_tensor().clone();
                let b = if *factor != 1.0 { (b * *factor)? } else { b };
                permuted_values(&b, *permute_heads)
            }
        }
    }

    /// The file's metadata: a GGUF source's own (its file type replaced), or the converter's keys for a folder's
    /// config and tokenizer, in the converter's order.
    pub fn metadata(&self, quantization: Quantization) -> Result<Vec<Entry>> {
        let mut out = vec![
            entry("general.architecture", Value::String(self.arch.clone())),
            entry("general.type", Value::String("model".into())),
        ];
        let file_type = entry("general.file_type", Value::U32(quantization.file_type()));
        let quantization_version = entry("general.quantization_version", Value::U32(2));
        match self.origin {
            Origin::Gguf(file) => {
                let carried = file.metadata();
                let mut keys: Vec<&String> = carried
                    .keys()
                    .filter(|k| !REWRITTEN.contains(&k.as_str()))
                    .collect();
                keys.sort();
                out.extend(keys.into_iter().map(|k| (k.clone(), carried[k].clone())));
                out.push(file_type.clone());
                out.push(quantization_version.clone());
            }
            Origin::Folder {
                path: folder,
                tokenizer_pre,
            } => {
                let config = self.model.config();
                let hf_config: serde_json::Value = read_json(&folder.join("config.json"))?;
                let (head, tail) = match self.arch.as_str() {
                    "phi3" => phi3_metadata(config, &hf_config, &folder.join("config.json"))?,
                    arch => {
                        let explicit_head_dim =
                            hf_config.get("head_dim").is_some_and(|h| !h.is_null());
                        architecture_metadata(arch, config, explicit_head_dim)
                    }
                };
                if let ("phi3", Some(RopeScaling::LongRope(s))) =
                    (self.arch.as_str(), &config.rope_scaling)
                {
                    // The converter sets it while writing the factors, before the other keys.
                    let factor = Value::F32(s.attention_factor as f32);
                    out.insert(1, entry("phi3.rope.scaling.attn_factor", factor));
                }
                out.extend(head);
                out.push(file_type.clone());
                out.extend(tail);
                out.push(quantization_version.clone());
                out.extend(tokenizer_metadata(
                    folder,
                    config,
                    &self.arch,
                    tokenizer_pre,
                )?);
            }
        }
        if !quantization.written_by_converter() {
            // llama-quantize, which writes the other types, sets these two last.
            let last = ["general.quantization_version", "general.file_type"];
            out.retain(|(k, _)| !last.contains(&k.as_str()));
            out.push(quantization_version);
            out.push(file_type);
        }
        Ok(out)
    }
}

/// The linear layer `name` of `model`.
fn linear<'m>(model: &'m LlamaModel, name: &str) -> Result<&'m LoraLinear> {
    model
        .linears()
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, l)| l)
        .ok_or_else(|| Error::InvalidInput(format!("the model has no linear layer `{name}`")))
}

/// The active adapter of the linear layer `name`.
fn adapter_of<'m>(model: &'m LlamaModel, name: &str) -> Result<&'m LoraAdapter> {
    linear(model, name)?
        .active_adapter()
        .map(|a| a.as_ref())
        .ok_or_else(|| Error::InvalidInput(format!("`{name}` has no active adapter")))
}

/// A matrix's values, its rows permuted over `heads` heads when given (llama.cpp's q/k layout).
fn permuted_values(w: &candle_core::Tensor, heads: Option<usize>) -> Result<Vec<f32>> {
    match heads {
        Some(heads) => values_of(&permute(w, heads)?),
        None => values_of(w),
    }
}

/// The keys of a GGUF source that the export writes itself.
const REWRITTEN: [&str; 5] = [
    "general.architecture",
    "general.type",
    "general.file_type",
    "general.quantization_version",
    "general.alignment",
];

/// The converter's `<arch>.*` keys for a Llama config: those it writes before `general.file_type`, and after.
fn architecture_metadata(
    arch: &str,
    c: &ModelConfig,
    explicit_head_dim: bool,
) -> (Vec<Entry>, Vec<Entry>) {
    let key = |k: &str| format!("{arch}.{k}");
    let u = |n: usize| Value::U32(n as u32);
    let mut head = vec![
        entry(key("block_count"), u(c.num_hidden_layers)),
        entry(key("context_length"), u(c.max_position_embeddings)),
        entry(key("embedding_length"), u(c.hidden_size)),
        entry(key("feed_forward_length"), u(c.intermediate_size)),
        entry(key("attention.head_count"), u(c.num_attention_heads)),
        entry(key("attention.head_count_kv"), u(c.num_key_value_heads)),
        entry(key("rope.freq_base"), Value::F32(c.rope_theta as f32)),
        entry(
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
    ];
    if let Some(moe) = &c.moe {
        head.push(entry(key("expert_count"), u(moe.num_experts)));
        head.push(entry(key("expert_used_count"), u(moe.num_experts_per_tok)));
    }
    if explicit_head_dim {
        head.push(entry(key("attention.key_length"), u(c.head_dim)));
        head.push(entry(key("attention.value_length"), u(c.head_dim)));
    }
    // Llama's converter adds these; Qwen's does not.
    let mut tail = match arch {
        "llama" => vec![
            entry(key("vocab_size"), u(c.vocab_size)),
            entry(key("rope.dimension_count"), u(c.rotary_dim)),
        ],
        _ => Vec::new(),
    };
    if let (Some(moe), "qwen2moe" | "qwen3moe") = (&c.moe, arch) {
        tail.push(entry(
            key("expert_feed_forward_length"),
            u(moe.moe_intermediate_size),
        ));
        if let Some(shared) = moe.shared_expert_intermediate_size {
            tail.push(entry(key("expert_shared_feed_forward_length"), u(shared)));
        }
    }
    if let Some(RopeScaling::Linear { factor }) = c.rope_scaling {
        tail.push(entry(
            key("rope.scaling.type"),
            Value::String("linear".into()),
        ));
        tail.push(entry(key("rope.scaling.factor"), Value::F32(factor as f32)));
    }
    (head, tail)
}

/// The converter's `phi3.*` keys: those it writes before `general.file_type`, and after (the sliding window, 0
/// for none). The pre-training context length is LongRoPE's, else `config.json`'s.
fn phi3_metadata(
    c: &ModelConfig,
    hf: &serde_json::Value,
    config_file: &Path,
) -> Result<(Vec<Entry>, Vec<Entry>)> {
    let key = |k: &str| format!("phi3.{k}");
    let u = |n: usize| Value::U32(n as u32);
    let original = match &c.rope_scaling {
        Some(RopeScaling::LongRope(s)) => s.original_max_position_embeddings,
        _ => hf
            .get("rope_parameters")
            .and_then(|r| r.get("original_max_position_embeddings"))
            .or_else(|| hf.get("original_max_position_embeddings"))
            .and_then(|v| v.as_u64())
            .ok_or_else(|| Error::InvalidFile {
                path: config_file.to_path_buf(),
                reason: "a Phi-3 config needs `original_max_position_embeddings` (llama.cpp records the \
                         pre-training context length)"
                    .into(),
            })? as usize,
    };
    let head = vec![
        entry(key("context_length"), u(c.max_position_embeddings)),
        entry(key("rope.scaling.original_context_length"), u(original)),
        entry(key("embedding_length"), u(c.hidden_size)),
        entry(key("feed_forward_length"), u(c.intermediate_size)),
        entry(key("block_count"), u(c.num_hidden_layers)),
        entry(key("attention.head_count"), u(c.num_attention_heads)),
        entry(key("attention.head_count_kv"), u(c.num_key_value_heads)),
        entry(
            key("attention.layer_norm_rms_epsilon"),
            Value::F32(c.rms_norm_eps as f32),
        ),
        entry(key("rope.dimension_count"), u(c.rotary_dim)),
        entry(key("rope.freq_base"), Value::F32(c.rope_theta as f32)),
    ];
    let tail = vec![entry(
        key("attention.sliding_window"),
        u(c.sliding_window.unwrap_or(0)),
    )];
    Ok((head, tail))
}
