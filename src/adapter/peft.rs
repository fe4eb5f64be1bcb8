//! PEFT's adapter files: `adapter_config.json` (every key PEFT writes, sorted, indent 2) and
//! `adapter_model.safetensors` (`base_model.model.<module>.lora_A.weight` `[r, in]`, `.lora_B.weight` `[out, r]`,
//! DoRA `.lora_magnitude_vector` `[out]`, float32, metadata `{"format": "pt"}`).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::safetensors::Load;
use candle_core::{DType, Device};

use crate::adapter::Adapters;
use crate::error::{Error, Result};
use crate::files::{read_json, write_atomic, write_safetensors, MappedSafetensors, RawTensor};
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
    let mut tensors = Vec::new();
    for (key, var) in model.adapter_parameters(name)? {
        let t = RawTensor::from_tensor(&var.as_tensor().to_dtype(DType::F32)?)?;
        tensors.push((key, t));
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
        tensors.insert(key.to_string(), t);
    }
    model
        .insert_adapter(name, &config, &slots, tensors, false)
        .map_err(|e| Error::invalid_file(&path, e.to_string()))?;
    Ok(config)
}
