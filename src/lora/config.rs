//! `LoraConfig` with PEFT's field names and defaults, read from and written to `adapter_config.json`.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Map, Value};

use crate::error::{Error, Result};

/// Which modules get an adapter (`target_modules`).
#[derive(Clone, Debug, PartialEq)]
pub enum TargetModules {
    /// Module names or name suffixes: `q_proj` matches `model.layers.0.self_attn.q_proj`.
    List(Vec<String>),
    /// A regular expression that must match the whole module name (`re.fullmatch`).
    Regex(String),
    /// Every linear layer except the output head (`"all-linear"`).
    AllLinear,
}

/// How adapter weights start (`init_lora_weights`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitLoraWeights {
    /// `true`: A ~ kaiming-uniform(a=√5), B = 0 (the adapter starts as a no-op).
    Default,
    /// `false`: A and B both random (for tests; the adapter is not a no-op).
    Random,
    /// `"gaussian"`: A ~ N(0, 1/r), B = 0.
    Gaussian,
}

/// PEFT's `LoraConfig`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraConfig {
    /// Rank.
    pub r: usize,
    /// Scaling numerator: the update is scaled by `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA).
    pub lora_alpha: f64,
    /// Dropout on the adapter's input during training.
    pub lora_dropout: f64,
    /// Modules to adapt; `None` = PEFT's default for Llama (`q_proj`, `v_proj`).
    pub target_modules: Option<TargetModules>,
    /// Modules never adapted (same matching rules as `target_modules`).
    pub exclude_modules: Option<TargetModules>,
    /// Bias training: only `"none"` is supported.
    pub bias: String,
    /// Scale by `lora_alpha / sqrt(r)`.
    pub use_rslora: bool,
    /// Per-module rank, keyed by a regex matched against the end of the module name.
    pub rank_pattern: BTreeMap<String, usize>,
    /// Per-module alpha, keyed like `rank_pattern`.
    pub alpha_pattern: BTreeMap<String, f64>,
    /// Initialization.
    pub init_lora_weights: InitLoraWeights,
    /// Weight-decomposed LoRA (DoRA): a trainable magnitude per output row.
    pub use_dora: bool,
    /// Modules trained in full and saved with the adapter (e.g. `lm_head`, `embed_tokens`).
    pub modules_to_save: Option<Vec<String>>,
    /// The base model's name or path, recorded in `adapter_config.json`.
    pub base_model_name_or_path: Option<String>,
    /// The base model's revision.
    pub revision: Option<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            r: 8,
            lora_alpha: 8.0,
            lora_dropout: 0.0,
            target_modules: None,
            exclude_modules: None,
            bias: "none".into(),
            use_rslora: false,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            init_lora_weights: InitLoraWeights::Default,
            use_dora: false,
            modules_to_save: None,
            base_model_name_or_path: None,
            revision: None,
        }
    }
}

/// PEFT's default `target_modules` for Llama-family models.
pub const DEFAULT_LLAMA_TARGETS: [&str; 2] = ["q_proj", "v_proj"];

fn bad(path: &Path, msg: String) -> Error {
    Error::invalid_file(path, msg)
}

fn targets_from_json(v: &Value, key: &str, path: &Path) -> Result<Option<TargetModules>> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) if s == "all-linear" => Ok(Some(TargetModules::AllLinear)),
        Value::String(s) => Ok(Some(TargetModules::Regex(s.clone()))),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| bad(path, format!("`{key}` must list strings")))
            })
            .collect::<Result<Vec<_>>>()
            .map(|l| Some(TargetModules::List(l))),
        _ => Err(bad(
            path,
            format!("`{key}` must be a list, a regex string or \"all-linear\""),
        )),
    }
}

fn targets_to_json(t: &Option<TargetModules>) -> Value {
    match t {
        None => Value::Null,
        Some(TargetModules::AllLinear) => json!("all-linear"),
        Some(TargetModules::Regex(r)) => json!(r),
        Some(TargetModules::List(l)) => {
            let mut l = l.clone();
            l.sort();
            json!(l)
        }
    }
}

impl LoraConfig {
    /// `lora_alpha / r` (or `/ sqrt(r)` with rsLoRA) for a module of rank `r` and alpha `alpha`.
    pub fn scaling(&self, r: usize, alpha: f64) -> f64 {
        if self.use_rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        }
    }

    /// Rejects settings this implementation does not support, saying which.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("LoraConfig: {m}")));
        if self.r == 0 {
            return bad("r must be at least 1".into());
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            return bad(format!(
                "lora_dropout {} must be in [0, 1)",
                self.lora_dropout
            ));
        }
        if self.bias != "none" {
            return bad(format!(
                "bias = \"{}\" is not supported: only \"none\" (train no biases) is; remove the setting",
                self.bias
            ));
        }
        if let Some((k, _)) = self.rank_pattern.iter().find(|(_, r)| **r == 0) {
            return bad(format!("rank_pattern[{k:?}] must be at least 1"));
        }
        for key in self.rank_pattern.keys().chain(self.alpha_pattern.keys()) {
            regex_lite_check(key)
                .map_err(|e| Error::InvalidInput(format!("LoraConfig: pattern {key:?}: {e}")))?;
        }
        Ok(())
    }

    /// Reads `adapter_config.json` (unknown keys are ignored, missing keys take PEFT's defaults).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read", path, e))?;
        let v: Value =
            serde_json::from_str(&text).map_err(|e| bad(path, format!("not valid JSON: {e}")))?;
        Self::from_json(&v, path)
    }

    /// Parses an `adapter_config.json` object; `path` names it in errors.
    pub fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let obj = v
            .as_object()
            .ok_or_else(|| bad(path, "expected a JSON object".into()))?;
        if let Some(t) = obj.get("peft_type").and_then(Value::as_str) {
            if t != "LORA" {
                return Err(bad(
                    path,
                    format!("peft_type is `{t}`; only LORA adapters are supported"),
                ));
            }
        }
        let d = LoraConfig::default();
        let num = |k: &str, default: f64| -> Result<f64> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x
                    .as_f64()
                    .ok_or_else(|| bad(path, format!("`{k}` must be a number"))),
            }
        };
        let flag = |k: &str| -> Result<bool> {
            match obj.get(k) {
                None | Some(Value::Null) => Ok(false),
                Some(x) => x
                    .as_bool()
                    .ok_or_else(|| bad(path, format!("`{k}` must be true or false"))),
            }
        };
        let string = |k: &str| obj.get(k).and_then(Value::as_str).map(str::to_string);
        let r = num("r", d.r as f64)?;
        if r < 1.0 || r.fract() != 0.0 {
            return Err(bad(
                path,
                format!("`r` must be a positive integer, got {r}"),
            ));
        }
        let init_lora_weights = match obj.get("init_lora_weights") {
            None | Some(Value::Null) | Some(Value::Bool(true)) => InitLoraWeights::Default,
            Some(Value::Bool(false)) => InitLoraWeights::Random,
            Some(Value::String(s)) if s == "gaussian" => InitLoraWeights::Gaussian,
            Some(other) => {
                return Err(bad(
                    path,
                    format!(
                        "init_lora_weights {other} is not supported (true, false, \"gaussian\")"
                    ),
                ))
            }
        };
        let rank_pattern = match obj.get("rank_pattern") {
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| {
                    v.as_u64()
                        .map(|r| (k.clone(), r as usize))
                        .ok_or_else(|| bad(path, format!("rank_pattern[{k:?}] must be an integer")))
                })
                .collect::<Result<_>>()?,
            _ => BTreeMap::new(),
        };
        let alpha_pattern = match obj.get("alpha_pattern") {
            Some(Value::Object(m)) => m
                .iter()
                .map(|(k, v)| {
                    v.as_f64()
                        .map(|a| (k.clone(), a))
                        .ok_or_else(|| bad(path, format!("alpha_pattern[{k:?}] must be a number")))
                })
                .collect::<Result<_>>()?,
            _ => BTreeMap::new(),
        };
        if flag("fan_in_fan_out")? {
            return Err(bad(path, "fan_in_fan_out = true (GPT-2 Conv1D layers) is not supported for Llama-family models".into()));
        }
        for unsupported in [
            "layers_to_transform",
            "layer_replication",
            "trainable_token_indices",
        ] {
            if obj.get(unsupported).is_some_and(|v| !v.is_null()) {
                return Err(bad(
                    path,
                    format!("`{unsupported}` is set; it is not supported yet"),
                ));
            }
        }
        if flag("lora_bias")? {
            return Err(bad(path, "lora_bias = true is not supported".into()));
        }
        let config = LoraConfig {
            r: r as usize,
            lora_alpha: num("lora_alpha", d.lora_alpha)?,
            lora_dropout: num("lora_dropout", 0.0)?,
            target_modules: targets_from_json(
                obj.get("target_modules").unwrap_or(&Value::Null),
                "target_modules",
                path,
            )?,
            exclude_modules: targets_from_json(
                obj.get("exclude_modules").unwrap_or(&Value::Null),
                "exclude_modules",
                path,
            )?,
            bias: string("bias").unwrap_or_else(|| "none".into()),
            use_rslora: flag("use_rslora")?,
            rank_pattern,
            alpha_pattern,
            init_lora_weights,
            use_dora: flag("use_dora")?,
            modules_to_save: match obj.get("modules_to_save") {
                Some(Value::Array(a)) => Some(
                    a.iter()
                        .filter_map(|x| x.as_str().map(str::to_string))
                        .collect(),
                ),
                _ => None,
            },
            base_model_name_or_path: string("base_model_name_or_path"),
            revision: string("revision"),
        };
        config.validate().map_err(|e| bad(path, e.to_string()))?;
        Ok(config)
    }

    /// `adapter_config.json` as PEFT 0.21 writes it: every key, sorted, `inference_mode: true`.
    pub fn to_json(&self) -> Value {
        let number = |x: f64| {
            if x.fract() == 0.0 && x.abs() < 1e15 {
                json!(x as i64)
            } else {
                json!(x)
            }
        };
        let mut m = Map::new();
        let nulls = [
            "alora_invocation_tokens",
            "arrow_config",
            "auto_mapping",
            "corda_config",
            "eva_config",
            "kasa_config",
            "layer_replication",
            "layers_pattern",
            "layers_to_transform",
            "lora_ga_config",
            "megatron_config",
            "monteclora_config",
            "target_parameters",
            "trainable_token_indices",
            "use_bdlora",
            "velora_config",
        ];
        for k in nulls {
            m.insert(k.into(), Value::Null);
        }
        m.insert(
            "alpha_pattern".into(),
            Value::Object(
                self.alpha_pattern
                    .iter()
                    .map(|(k, v)| (k.clone(), number(*v)))
                    .collect(),
            ),
        );
        m.insert(
            "base_model_name_or_path".into(),
            json!(self.base_model_name_or_path),
        );
        m.insert("bias".into(), json!(self.bias));
        m.insert("ensure_weight_tying".into(), json!(false));
        m.insert(
            "exclude_modules".into(),
            targets_to_json(&self.exclude_modules),
        );
        m.insert("fan_in_fan_out".into(), json!(false));
        m.insert("inference_mode".into(), json!(true));
        m.insert(
            "init_lora_weights".into(),
            match self.init_lora_weights {
                InitLoraWeights::Default => json!(true),
                InitLoraWeights::Random => json!(false),
                InitLoraWeights::Gaussian => json!("gaussian"),
            },
        );
        m.insert("loftq_config".into(), json!({}));
        m.insert("lora_alpha".into(), number(self.lora_alpha));
        m.insert("lora_bias".into(), json!(false));
        m.insert("lora_dropout".into(), json!(self.lora_dropout));
        m.insert("megatron_core".into(), json!("megatron.core"));
        m.insert("modules_to_save".into(), json!(self.modules_to_save));
        m.insert("peft_type".into(), json!("LORA"));
        m.insert("peft_version".into(), json!("0.21.2"));
        m.insert("qalora_group_size".into(), json!(16));
        m.insert("r".into(), json!(self.r));
        m.insert(
            "rank_pattern".into(),
            Value::Object(
                self.rank_pattern
                    .iter()
                    .map(|(k, v)| (k.clone(), json!(v)))
                    .collect(),
            ),
        );
        m.insert("revision".into(), json!(self.revision));
        m.insert(
            "target_modules".into(),
            targets_to_json(&self.target_modules),
        );
        m.insert("task_type".into(), json!("CAUSAL_LM"));
        m.insert("use_dora".into(), json!(self.use_dora));
        m.insert("use_qalora".into(), json!(false));
        m.insert("use_rslora".into(), json!(self.use_rslora));
        Value::Object(m)
    }
}

/// Checks that a pattern is a regex the matcher accepts.
fn regex_lite_check(pattern: &str) -> std::result::Result<(), String> {
    regex::Regex::new(pattern)
        .map(|_| ())
        .map_err(|e| e.to_string())
}
