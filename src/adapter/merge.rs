//! Merging an adapter into its base: `W' = W + s·B·A` (DoRA: `W' = (m / ‖W + s·B·A‖) ⊙ (W + s·B·A)` per row),
//! computed in float32 (the adapter's master dtype: float64 in a float64 model) from the dequantized base — the
//! recommended way to deploy a QLoRA adapter (one rounding, at the final dtype, instead of PEFT's dequantize → add
//! → re-quantize).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Result, Tensor};

use crate::error::Error;
use crate::files::apart::check_output_apart;
use crate::files::{read_json, refuse_existing, replace_dir, write_safetensors, RawTensor};
use crate::loading::bnb::{bnb_entries, quantization_config_json};
use crate::lora::targets::parameter_of;
use crate::lora::{LoraAdapter, LoraLinear};
use crate::models::config::HubExperts;
use crate::models::{Architecture, LlamaModel, ModelConfig, TextTokenizer};
use crate::precision::TorchDtype;
use crate::quant::{Nf4Tensor, QuantConfig};

/// The merged weight `[out, in]` of `layer` with `adapter`, in the adapter's dtype (float32; float64 for a float64
/// model's adapters).
pub fn merged_weight(layer: &LoraLinear, adapter: &LoraAdapter) -> Result<Tensor> {
    let w = layer.base.weight.to_dense(adapter.b.dtype())?;
    let delta = (adapter
        .b
        .as_tensor()
        .detach()
        .matmul(&adapter.a.as_tensor().detach())?
        * adapter.scaling)?;
    let merged = (w + delta)?;
    match &adapter.magnitude {
        None => Ok(merged),
        Some(m) => {
            let norm = merged.sqr()?.sum_keepdim(1)?.sqrt()?;
            merged.broadcast_mul(&m.as_tensor().detach().unsqueeze(1)?.broadcast_div(&norm)?)
        }
    }
}

/// The merged weight of the active adapter, or the base weight (f32) when none is active.
pub fn effective_weight(layer: &LoraLinear) -> Result<Tensor> {
    match layer.active_adapter() {
        Some(a) => merged_weight(layer, a),
        None => layer.base.weight.to_dense(DType::F32),
    }
}

/// Output options of [`merge_to_folder`].
#[derive(Clone, Debug)]
pub struct MergeOptions {
    /// Dtype of the written weights (bf16, f16 or f32).
    pub dtype: DType,
    /// Re-quantize the merged linear weights to 4 bits (bitsandbytes layout) instead of writing them dense.
    pub requantize: Option<QuantConfig>,
    /// Replace an existing output folder (only once the new one is complete).
    pub overwrite: bool,
}

/// What [`merge_to_folder`] did.
#[derive(Clone, Debug, PartialEq)]
pub struct MergeReport {
    /// Linear weights that an adapter changed.
    pub merged_modules: usize,
    /// Largest `|W' − W|` over all merged weights (before the output dtype).
    pub max_abs_change: f64,
    /// Tensors written.
    pub tensors: usize,
}

/// A Hugging Face `config.json` for `config` (used when the source has none, e.g. a GGUF file).
/// The weight tensors a Hub checkpoint holds for projection `name` (weight `w`): `{name}.weight`, except for a
/// mixture's router and experts, written in the Hub's per-expert layout that transformers reads for every family:
/// the fused gate/up weight split in two, under the family's names ([`HubExperts::PerExpert`]: Qwen's
/// `mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`; Mixtral's `block_sparse_moe.experts.{e}.w1` / `w3` / `w2`
/// and `block_sparse_moe.gate`).
fn hub_tensors(arch: Architecture, name: &str, w: Tensor) -> Result<Vec<(String, Tensor)>> {
    let (block, gate, up, down) = match arch.hub_experts() {
        HubExperts::PerExpert {
            block,
            gate,
            up,
            down,
        } => (block, gate, up, down),
        // Stacked experts are written together by the caller.
        HubExperts::Stacked => return Ok(vec![(format!("{name}.weight"), w)]),
    };
    let block = |layer: &str| format!("{layer}.{block}");
    if let Some(layer) = name.strip_suffix(".mlp.gate") {
        return Ok(vec![(format!("{}.gate.weight", block(layer)), w)]);
    }
    let Some((layer, rest)) = name.split_once(".mlp.experts.") else {
        return Ok(vec![(format!("{name}.weight"), w)]);
    };
    let (expert, projection) = rest.split_once('.').unwrap_or((rest, ""));
    let prefix = format!("{}.experts.{expert}", block(layer));
    Ok(match projection {
        "gate_up_proj" => {
            let half = w.dim(0)? / 2;
            vec![
                (
                    format!("{prefix}.{gate}.weight"),
                    w.narrow(0, 0, half)?.contiguous()?,
                ),
                (
                    format!("{prefix}.{up}.weight"),
                    w.narrow(0, half, half)?.contiguous()?,
                ),
            ]
        }
        _ => vec![(format!("{prefix}.{down}.weight"), w)],
    })
}

fn hf_config_json(config: &ModelConfig, dtype: DType) -> serde_json::Value {
    let mut v = config.to_hf_config();
    v["torch_dtype"] = serde_json::json!(TorchDtype::of(dtype));
    v
}

/// Writes `model` with its active adapter merged into a standard Hugging Face folder at `output`: `config.json`,
/// tokenizer files, and `model.safetensors` (dense weights in `options.dtype`, or bitsandbytes 4-bit linears with
/// `requantize`). 4-bit bases are dequantized before merging, so the merge itself adds no rounding but the final
/// dtype's. `source_folder` supplies `config.json` and tokenizer files when the model came from a folder; an
/// `output` that is, is inside or contains it is refused (`files::apart`), as replacing it would destroy the base.
pub fn merge_to_folder(
    model: &LlamaModel,
    tokenizer: Option<&TextTokenizer>,
    source_folder: Option<&Path>,
    output: &Path,
    options: &MergeOptions,
) -> crate::Result<MergeReport> {
    if let Some(source) = source_folder {
        check_output_apart(
            ("output", output),
            &[("the base model's folder", source)],
            "merged",
        )?;
    }
    refuse_existing(output, options.overwrite)?;
    let raw = |t: &Tensor| RawTensor::from_tensor(&t.to_dtype(options.dtype)?);
    let mut tensors: Vec<(String, RawTensor<'static>)> = Vec::new();
    let mut report = MergeReport {
        merged_modules: 0,
        max_abs_change: 0.0,
        tensors: 0,
    };
    // The active adapter's trained embedding table, if any.
    tensors.push((
        "model.embed_tokens.weight".into(),
        raw(&model.embedding_table()?)?,
    ));
    // Norm weights are stored as the family writes them (Gemma: the scale minus one).
    let offset = model.config().architecture.norm_weight_offset();
    let stored_norm = |w: &Tensor| -> crate::Result<RawTensor<'static>> {
        if offset != 0.0 {
            raw(&(w - offset)?)
        } else {
            raw(w)
        }
    };
    tensors.push(("model.norm.weight".into(), stored_norm(&model.norm)?));
    let head = model.head_weight()?;
    let head_differs = !model.config().tie_word_embeddings
        || (&head.to_dtype(DType::F64)? - model.embed_tokens.to_dtype(DType::F64)?)?
            .abs()?
            .sum_all()?
            .to_scalar::<f64>()?
            != 0.0;
    if head_differs {
        tensors.push(("lm_head.weight".into(), raw(&head)?));
    }
    for (i, layer) in model.layers.iter().enumerate() {
        for (name, w) in layer.norms() {
            tensors.push((format!("model.layers.{i}.{name}.weight"), stored_norm(w)?));
        }
        if let Some(sinks) = layer.attention_sinks() {
            let sinks = Tensor::new(sinks, model.embed_tokens.device())?;
            tensors.push((format!("model.layers.{i}.self_attn.sinks"), raw(&sinks)?));
        }
    }
    let arch = model.config().architecture;
    // gpt-oss's experts, written as transformers holds them: `[experts, in, out]` per projection, with biases.
    let mut stacked_experts: BTreeMap<String, (Vec<Tensor>, Vec<Tensor>)> = BTreeMap::new();
    for (name, lin) in model.linears() {
        let w = effective_weight(lin)?;
        if lin.active_adapter().is_some() {
            let base = lin.base.weight.to_dense(w.dtype())?;
            let change = (&w - base)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_dtype(DType::F64)?
                .to_scalar::<f64>()?;
            report.max_abs_change = report.max_abs_change.max(change);
            report.merged_modules += 1;
        }
        if let Some(key) = (arch.hub_experts() == HubExperts::Stacked)
            .then(|| parameter_of(&name))
            .flatten()
            .filter(|p| p.contains(".mlp.experts."))
        {
            // `linears()` lists the experts in order.
            let (weights, biases) = stacked_experts.entry(key).or_default();
            weights.push(w.t()?.contiguous()?);
            biases.extend(lin.base.bias.clone());
            continue;
        }
        // transformers + bitsandbytes quantize `nn.Linear`s only: a mixture's router and experts stay dense.
        let requantize = options
            .requantize
            .as_ref()
            .filter(|_| parameter_of(&name).is_none());
        for (key, w) in hub_tensors(model.config().architecture, &name, w)? {
            match requantize {
                Some(cfg) => {
                    let q = Nf4Tensor::quantize_named(&w.to_dtype(options.dtype)?, cfg, &key)?;
                    tensors.extend(bnb_entries(&key, &q));
                }
                None => tensors.push((key, raw(&w)?)),
            }
        }
        if let Some(b) = &lin.base.bias {
            tensors.push((format!("{name}.bias"), raw(b)?));
        }
    }
    for (key, (weights, biases)) in stacked_experts {
        tensors.push((key.clone(), raw(&Tensor::stack(&weights, 0)?)?));
        if !biases.is_empty() {
            tensors.push((format!("{key}_bias"), raw(&Tensor::stack(&biases, 0)?)?));
        }
    }
    report.tensors = tensors.len();

    replace_dir(output, |staging| {
        let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
        write_safetensors(&staging.join("model.safetensors"), tensors, Some(meta))?;
        let mut config = match source_folder
            .map(|d| d.join("config.json"))
            .filter(|p| p.exists())
        {
            Some(p) => read_json(&p)?,
            None => hf_config_json(model.config(), options.dtype),
        };
        if let Some(obj) = config.as_object_mut() {
            obj.remove("quantization_config");
            if head_differs {
                obj.insert("tie_word_embeddings".into(), false.into());
            }
            obj.insert(
                "torch_dtype".into(),
                TorchDtype::of(options.dtype).as_str().into(),
            );
            if let Some(cfg) = &options.requantize {
                obj.insert(
                    "quantization_config".into(),
                    quantization_config_json(cfg, TorchDtype::of(options.dtype)),
                );
            }
        }
        let text = serde_json::to_string_pretty(&config)
            .map_err(|e| Error::InvalidInput(e.to_string()))?
            + "\n";
        std::fs::write(staging.join("config.json"), text)
            .map_err(|e| Error::io("cannot write", staging.join("config.json"), e))?;
        let copied = [
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "generation_config.json",
            "chat_template.jinja",
        ];
        let mut have_tokenizer = false;
        if let Some(dir) = source_folder {
            for f in copied {
                if dir.join(f).exists() {
                    std::fs::copy(dir.join(f), staging.join(f))
                        .map_err(|e| Error::io("cannot copy", dir.join(f), e))?;
                    have_tokenizer |= f == "tokenizer.json";
                }
            }
        }
        if let (false, Some(tok)) = (have_tokenizer, tokenizer) {
            tok.save_folder(staging)?;
        }
        Ok(report)
    })
}
