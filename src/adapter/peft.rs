//! PEFT's adapter files: `adapter_config.json` (every key PEFT writes, sorted, indent 2) and
//! `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` `[r, in]`, `.lora_B.weight` `[out, r]`,
//! DoRA `.lora_magnitude_vector` `[out]`, float32, metadata `{"format": "pt"}`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::safetensors::Load;
use candle_core::{DType, Device, Tensor};

use crate::adapter::registry::{peft_key, AdapterSlot, Adapters};
use crate::error::{Error, Result};
use crate::files::{
    first_non_finite, read_json, write_atomic, write_safetensors, MappedSafetensors, RawTensor,
};
use crate::lora::LoraConfig;
use crate::models::LlamaModel;
use crate::ops::frozen_linear::FrozenWeight;
use crate::quant::{QuantConfig, QuantType};
use serde::{Deserialize, Serialize};

/// File name of the adapter configuration.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// File name of the adapter weights.
pub const ADAPTER_WEIGHTS: &str = "adapter_model.safetensors";
/// File name of the record of how the base's linear weights were stored when the adapter was trained (a file of
/// its own, so PEFT, which reads only `adapter_config.json`, is not disturbed).
pub const BASE_QUANTIZATION: &str = "base_quantization.json";

/// `base_quantization.json`, in `BitsAndBytesConfig`'s terms: `{"load_in_4bit": false}` for a base used as stored,
/// else the 4-bit type, blocksize and double quantization.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct BaseQuantizationFile {
    load_in_4bit: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bnb_4bit_quant_type: Option<QuantType>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bnb_4bit_blocksize: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    bnb_4bit_use_double_quant: Option<bool>,
}

/// An expert projection's adapter tensor in the model's naming (one module per expert): `(layer, expert,
/// projection, part)` of `base_model.model.{layer}.mlp.experts.{expert}.{projection}.{part}.weight`.
fn expert_key(key: &str) -> Option<(&str, usize, &str, &str)> {
    let (layer, rest) = key.split_once(".mlp.experts.")?;
    let mut parts = rest.split('.');
    let expert = parts.next()?.parse().ok()?;
    let (projection, part, weight) = (parts.next()?, parts.next()?, parts.next()?);
    (weight == "weight" && parts.next().is_none()).then_some((layer, expert, projection, part))
}

/// PEFT's key of a layer's stacked expert adapter `part` for `projection`: PEFT wraps the experts module once per
/// targeted parameter in registration order, so with both targeted `gate_up_proj`'s wrapper is the inner one
/// (`base_layer`).
fn stacked_key(layer: &str, projection: &str, part: &str, both: bool) -> String {
    let inner = if both && projection == "gate_up_proj" {
        "base_layer."
    } else {
        ""
    };
    format!("{layer}.mlp.experts.{inner}{part}.weight")
}

/// Adapter tensors with each layer's per-expert pairs stacked as PEFT's `ParamWrapper` holds a 3-D parameter's
/// adapter: `lora_A` `[experts · r, in]` (expert by expert), `lora_B` `[out, r · experts]` (column `k · experts +
/// e` is expert `e`'s column `k`). Other tensors pass through.
fn stack_experts(tensors: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    let mut groups: BTreeMap<(String, String, String), Vec<(usize, Tensor)>> = BTreeMap::new();
    for (key, t) in tensors {
        match expert_key(&key) {
            Some((layer, expert, projection, part)) => groups
                .entry((layer.into(), projection.into(), part.into()))
                .or_default()
                .push((expert, t)),
            None => out.push((key, t)),
        }
    }
    let adapted = |layer: &str, projection: &str| {
        groups.contains_key(&(layer.into(), projection.into(), "lora_A".into()))
    };
    for ((layer, projection, part), mut experts) in
        groups.iter().map(|(k, v)| (k.clone(), v.clone()))
    {
        experts.sort_by_key(|(e, _)| *e);
        let parts: Vec<Tensor> = experts.into_iter().map(|(_, t)| t).collect();
        let stacked = if part == "lora_A" {
            Tensor::cat(&parts, 0)?
        } else {
            let (rows, r) = parts[0].dims2()?;
            Tensor::stack(&parts, 2)?.reshape((rows, r * parts.len()))?
        };
        let both = adapted(&layer, "gate_up_proj") && adapted(&layer, "down_proj");
        out.push((stacked_key(&layer, &projection, &part, both), stacked));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// The reverse of [`stack_experts`] for the expert projections among `slots`: PEFT's stacked tensors split into
/// the model's per-expert ones (a stacked tensor missing or of the wrong size is left for the caller to name).
fn unstack_experts(
    mut tensors: BTreeMap<String, Tensor>,
    slots: &[AdapterSlot],
) -> Result<BTreeMap<String, Tensor>> {
    let mut experts: BTreeMap<(String, String), usize> = BTreeMap::new();
    for slot in slots {
        let key = peft_key(&slot.module, "lora_A.weight");
        if let Some((layer, _, projection, _)) = expert_key(&key) {
            *experts
                .entry((layer.to_string(), projection.to_string()))
                .or_default() += 1;
        }
    }
    for ((layer, projection), count) in &experts {
        let both = experts.contains_key(&(layer.clone(), "gate_up_proj".into()))
            && experts.contains_key(&(layer.clone(), "down_proj".into()));
        for part in ["lora_A", "lora_B"] {
            let key = stacked_key(layer, projection, part, both);
            let Some(t) = tensors.get(&key) else { continue };
            let (rows, cols) = t.dims2()?;
            let along = if part == "lora_A" { rows } else { cols };
            if along % count != 0 {
                continue;
            }
            let r = along / count;
            let t = tensors.remove(&key).expect("present above");
            for e in 0..*count {
                let one = if part == "lora_A" {
                    t.narrow(0, e * r, r)?
                } else {
                    t.reshape((rows, r, *count))?.narrow(2, e, 1)?.squeeze(2)?
                };
                let key = format!("{layer}.mlp.experts.{e}.{projection}.{part}.weight");
                tensors.insert(key, one.contiguous()?);
            }
        }
    }
    Ok(tensors)
}

/// How `model`'s linear weights are stored: the 4-bit config of the first quantized one, `None` when they are
/// dense.
pub fn base_quantization(model: &LlamaModel) -> Option<QuantConfig> {
    model
        .linears()
        .iter()
        .find_map(|(_, linear)| match &linear.base.weight {
            FrozenWeight::Dense(_) => None,
            FrozenWeight::Nf4(q) => Some(q.config()),
            FrozenWeight::Nf4OnDevice(q) => Some(q.config()),
            FrozenWeight::Deferred(d) => d.quantization(),
            FrozenWeight::Sharded(frame) => frame.quantization(),
        })
}

/// The base quantization adapter folder `dir` was trained with (`Some(None)`: a dense base), or `None` when the
/// adapter does not record it (made by PEFT, or by an older version).
pub fn read_base_quantization(dir: &Path) -> Result<Option<Option<QuantConfig>>> {
    let path = dir.join(BASE_QUANTIZATION);
    if !path.exists() {
        return Ok(None);
    }
    let file: BaseQuantizationFile = read_json(&path)?;
    if !file.load_in_4bit {
        return Ok(Some(None));
    }
    let defaults = QuantConfig::nf4();
    let config = QuantConfig {
        quant_type: file.bnb_4bit_quant_type.unwrap_or(defaults.quant_type),
        blocksize: file.bnb_4bit_blocksize.unwrap_or(defaults.blocksize),
        double_quant: file
            .bnb_4bit_use_double_quant
            .unwrap_or(defaults.double_quant),
        ..defaults
    };
    config
        .validate()
        .map_err(|e| Error::invalid_file(&path, e.to_string()))?;
    Ok(Some(Some(config)))
}

/// Writes adapter `name` of `model` to `dir` in PEFT's format. `base_model_name_or_path`, when given, is recorded
/// in the config (otherwise the adapter's own value, if any, is kept). Each file is written next to its final name
/// and renamed into place, so a crash leaves no half file.
pub fn save_adapter(
    model: &LlamaModel,
    name: &str,
    dir: &Path,
    base_model_name_or_path: Option<&str>,
) -> Result<()> {
    let mut config = model
        .adapter_configs
        .get(name)
        .ok_or_else(|| Error::InvalidInput(format!("no adapter named `{name}`")))?
        .clone();
    if let Some(base) = base_model_name_or_path {
        config.base_model_name_or_path = Some(base.to_string());
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
    let params = model
        .adapter_parameters(name)?
        .into_iter()
        .map(|(key, var)| (key, var.as_tensor().detach()))
        .collect();
    let mut tensors = Vec::new();
    for (key, t) in stack_experts(params)? {
        // A diverged adapter is not saved as if it were one: nothing that loads it could use it.
        if let Some((at, value)) = first_non_finite(&t)? {
            return Err(Error::InvalidInput(format!(
                "adapter `{name}` holds {value} in `{key}` (element {at}): training diverged, so it is not saved \
                 to {}; lower learning_rate (or clip harder: a smaller max_grad_norm, which 0 turns off) and train \
                 again from the last checkpoint",
                dir.display()
            )));
        }
        tensors.push((key, RawTensor::from_tensor(&t.to_dtype(DType::F32)?)?));
    }
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    write_safetensors(&dir.join(ADAPTER_WEIGHTS), tensors, Some(meta))?;
    let quantization = base_quantization(model);
    let record = BaseQuantizationFile {
        load_in_4bit: quantization.is_some(),
        bnb_4bit_quant_type: quantization.map(|q| q.quant_type),
        bnb_4bit_blocksize: quantization.map(|q| q.blocksize),
        bnb_4bit_use_double_quant: quantization.map(|q| q.double_quant),
    };
    let text =
        serde_json::to_string_pretty(&record).map_err(|e| Error::InvalidInput(e.to_string()))?;
    write_atomic(&dir.join(BASE_QUANTIZATION), text + "\n")?;
    let text = serde_json::to_string_pretty(&config.to_json())
        .map_err(|e| Error::InvalidInput(e.to_string()))?;
    write_atomic(&dir.join(ADAPTER_CONFIG), text)
}

/// Loads a PEFT adapter from `dir` into `model` under `name` and makes it active. Nothing changes unless the
/// whole adapter fits: unknown config keys are ignored, but missing or unexpected tensors and wrong shapes are an
/// error naming them.
pub fn load_adapter(model: &mut LlamaModel, dir: &Path, name: &str) -> Result<LoraConfig> {
    let config = LoraConfig::from_file(&dir.join(ADAPTER_CONFIG))?;
    let slots = model
        .adapter_slots(&config)
        .map_err(|e| Error::invalid_file(dir.join(ADAPTER_CONFIG), e.to_string()))?;
    let path = dir.join(ADAPTER_WEIGHTS);
    let file = MappedSafetensors::open(&path)?;
    let st = file.tensors()?;
    let mut tensors = BTreeMap::new();
    for (key, view) in st.iter() {
        let t = view
            .load(&Device::Cpu)
            .map_err(|e| Error::invalid_file(&path, format!("`{key}`: {e}")))?;
        if let Some((at, value)) = first_non_finite(&t)? {
            return Err(Error::invalid_file(
                &path,
                format!(
                    "`{key}` holds {value} at element {at}: the adapter was saved from a diverged run and cannot be \
                     used; use an earlier checkpoint's adapter"
                ),
            ));
        }
        tensors.insert(key.to_string(), t);
    }
    let tensors =
        unstack_experts(tensors, &slots).map_err(|e| Error::invalid_file(&path, e.to_string()))?;
    model
        .insert_adapter(name, &config, &slots, tensors, false)
        .map_err(|e| Error::invalid_file(&path, e.to_string()))?;
    Ok(config)
}
