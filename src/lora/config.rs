//! `LoraConfig` with PEFT's field names and defaults: a serde type read from `adapter_config.json` (every key PEFT
//! writes is tolerated) or a run config's `[lora]` table, and written back as PEFT writes it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{json, Value};

use crate::error::{at_key, Error, Result};
use crate::files::read_json;

/// Which modules get an adapter (`target_modules`): a list of names, a regex string, or `"all-linear"`.
#[derive(Clone, Debug, PartialEq)]
pub enum TargetModules {
    /// Module names or name suffixes: `q_proj` matches `model.layers.0.self_attn.q_proj`.
    List(Vec<String>),
    /// A regular expression that must match the whole module name (`re.fullmatch`).
    Regex(String),
    /// Every linear layer except the output head (`"all-linear"`).
    AllLinear,
}

impl Serialize for TargetModules {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            TargetModules::AllLinear => s.serialize_str("all-linear"),
            TargetModules::Regex(r) => s.serialize_str(r),
            // PEFT keeps target modules in a set and writes them sorted.
            TargetModules::List(l) => {
                let mut l = l.clone();
                l.sort();
                l.serialize(s)
            }
        }
    }
}

impl<'de> Deserialize<'de> for TargetModules {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Targets;
        impl<'de> Visitor<'de> for Targets {
            type Value = TargetModules;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of module names, a regex string or \"all-linear\"")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<TargetModules, E> {
                Ok(if s == "all-linear" {
                    TargetModules::AllLinear
                } else {
                    TargetModules::Regex(s.to_string())
                })
            }
            fn visit_seq<A: de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<TargetModules, A::Error> {
                let mut names = Vec::new();
                while let Some(name) = seq.next_element::<String>()? {
                    names.push(name);
                }
                Ok(TargetModules::List(names))
            }
        }
        d.deserialize_any(Targets)
    }
}

/// How adapter weights start (`init_lora_weights`: `true`, `false` or `"gaussian"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum InitLoraWeights {
    /// `true`: A ~ kaiming-uniform(a=√5), B = 0 (the adapter starts as a no-op).
    #[default]
    Default,
    /// `false`: A and B both random (for tests; the adapter is not a no-op).
    Random,
    /// `"gaussian"`: A ~ N(0, 1/r), B = 0.
    Gaussian,
}

impl Serialize for InitLoraWeights {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            InitLoraWeights::Default => s.serialize_bool(true),
            InitLoraWeights::Random => s.serialize_bool(false),
            InitLoraWeights::Gaussian => s.serialize_str("gaussian"),
        }
    }
}

impl<'de> Deserialize<'de> for InitLoraWeights {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct Init;
        impl Visitor<'_> for Init {
            type Value = InitLoraWeights;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false or \"gaussian\"")
            }
            fn visit_bool<E: de::Error>(self, b: bool) -> std::result::Result<InitLoraWeights, E> {
                Ok(if b {
                    InitLoraWeights::Default
                } else {
                    InitLoraWeights::Random
                })
            }
            fn visit_str<E: de::Error>(self, s: &str) -> std::result::Result<InitLoraWeights, E> {
                match s {
                    "gaussian" => Ok(InitLoraWeights::Gaussian),
                    other => Err(E::custom(format!(
                        "init_lora_weights \"{other}\" is not supported (true, false, \"gaussian\")"
                    ))),
                }
            }
        }
        d.deserialize_any(Init)
    }
}

/// PEFT's `LoraConfig`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
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
    /// Parameters to adapt (PEFT's `target_parameters`): a mixture of experts' router (`mlp.gate.weight`) and
    /// experts (`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`: one rank-`r` pair per expert), matched like a
    /// `target_modules` list.
    pub target_parameters: Option<Vec<String>>,
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
            target_parameters: None,
            modules_to_save: None,
            base_model_name_or_path: None,
            revision: None,
        }
    }
}

/// PEFT's default `target_modules` for Llama-family models.
pub const DEFAULT_LLAMA_TARGETS: [&str; 2] = ["q_proj", "v_proj"];

/// The keys of `adapter_config.json` that describe features this implementation does not have: an adapter that
/// uses one is refused rather than loaded wrong.
#[derive(Deserialize, Default)]
#[serde(default)]
struct PeftOnlyKeys {
    peft_type: Option<String>,
    fan_in_fan_out: bool,
    lora_bias: bool,
    layers_to_transform: Option<Value>,
    layer_replication: Option<Value>,
    trainable_token_indices: Option<Value>,
}

impl PeftOnlyKeys {
    fn check(&self) -> std::result::Result<(), String> {
        if let Some(t) = self.peft_type.as_deref().filter(|t| *t != "LORA") {
            return Err(format!(
                "peft_type is `{t}`; only LORA adapters are supported"
            ));
        }
        if self.fan_in_fan_out {
            return Err(
                "fan_in_fan_out = true (GPT-2 Conv1D layers) is not supported for Llama-family models".into(),
            );
        }
        if self.lora_bias {
            return Err("lora_bias = true is not supported".into());
        }
        let set = [
            ("layers_to_transform", &self.layers_to_transform),
            ("layer_replication", &self.layer_replication),
            ("trainable_token_indices", &self.trainable_token_indices),
        ];
        match set.iter().find(|(_, v)| v.is_some()) {
            Some((key, _)) => Err(format!("`{key}` is set; it is not supported yet")),
            None => Ok(()),
        }
    }
}

/// The largest LoRA rank accepted: far above any layer's width (a rank beyond min(in, out) adds nothing), and small
/// enough that an adapter's sizes cannot overflow.
pub const MAX_RANK: usize = 1 << 16;

/// The message for a rank above [`MAX_RANK`].
pub fn rank_too_large(r: usize) -> String {
    format!(
        "rank {r} is larger than any layer (at most {MAX_RANK}; QLoRA ranks are usually 8 to 256)"
    )
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

    /// The first setting that shapes the adapter in which `self` and `other` differ: its key and the two values
    /// as text (`None` when they train the same adapter).
    pub fn first_difference(&self, other: &LoraConfig) -> Option<(&'static str, String, String)> {
        let text = |a: &dyn std::fmt::Debug| format!("{a:?}");
        // Module lists are sets to PEFT (it saves them in any order): compared sorted, shown as JSON.
        fn set<T: Serialize>(value: &T) -> String {
            let mut v = serde_json::to_value(value).unwrap_or_default();
            if let Value::Array(items) = &mut v {
                items.sort_by_key(|i| i.to_string());
            }
            v.to_string()
        }
        let settings = [
            ("r", text(&self.r), text(&other.r)),
            (
                "lora_alpha",
                text(&self.lora_alpha),
                text(&other.lora_alpha),
            ),
            (
                "lora_dropout",
                text(&self.lora_dropout),
                text(&other.lora_dropout),
            ),
            (
                "use_rslora",
                text(&self.use_rslora),
                text(&other.use_rslora),
            ),
            ("use_dora", text(&self.use_dora), text(&other.use_dora)),
            (
                "target_modules",
                set(&self.target_modules),
                set(&other.target_modules),
            ),
            (
                "target_parameters",
                set(&self.target_parameters),
                set(&other.target_parameters),
            ),
            (
                "exclude_modules",
                set(&self.exclude_modules),
                set(&other.exclude_modules),
            ),
            (
                "rank_pattern",
                text(&self.rank_pattern),
                text(&other.rank_pattern),
            ),
            (
                "alpha_pattern",
                text(&self.alpha_pattern),
                text(&other.alpha_pattern),
            ),
            (
                "modules_to_save",
                set(&self.modules_to_save),
                set(&other.modules_to_save),
            ),
        ];
        settings.into_iter().find(|(_, a, b)| a != b)
    }

    /// Rejects settings this implementation does not support, saying which.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("LoraConfig: {m}")));
        if self.r == 0 {
            return bad("r must be at least 1".into());
        }
        let too_large = rank_too_large;
        if self.r > MAX_RANK {
            return bad(format!("r = {}: {}", self.r, too_large(self.r)));
        }
        if let Some((k, r)) = self.rank_pattern.iter().find(|(_, r)| **r > MAX_RANK) {
            return bad(format!("rank_pattern[{k:?}] = {r}: {}", too_large(*r)));
        }
        if !self.lora_alpha.is_finite() || self.lora_alpha <= 0.0 {
            return bad(format!(
                "lora_alpha = {}: must be more than 0 (the update is scaled by lora_alpha / r; 0 trains nothing)",
                self.lora_alpha
            ));
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
        if self
            .target_parameters
            .as_ref()
            .is_some_and(|t| !t.is_empty())
        {
            // PEFT's `ParamWrapper` refuses these too.
            if self.lora_dropout != 0.0 {
                return bad(format!(
                    "lora_dropout = {} with target_parameters: PEFT adapts parameters without dropout; set \
                     lora_dropout = 0",
                    self.lora_dropout
                ));
            }
            if self.use_dora {
                return bad(
                    "use_dora with target_parameters: PEFT has no DoRA for parameters".into(),
                );
            }
        }
        if let Some((k, _)) = self.rank_pattern.iter().find(|(_, r)| **r == 0) {
            return bad(format!("rank_pattern[{k:?}] must be at least 1"));
        }
        for key in self.rank_pattern.keys().chain(self.alpha_pattern.keys()) {
            regex::Regex::new(key)
                .map_err(|e| Error::InvalidInput(format!("LoraConfig: pattern {key:?}: {e}")))?;
        }
        Ok(())
    }

    /// Reads `adapter_config.json` (unknown keys are ignored, missing keys take PEFT's defaults).
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&read_json::<Value>(path)?, path)
    }

    /// Parses an `adapter_config.json` object; `path` names it in errors.
    pub fn from_json(v: &Value, path: &Path) -> Result<Self> {
        let bad = |msg: String| Error::invalid_file(path, msg);
        let Value::Object(obj) = v else {
            return Err(bad("expected a JSON object".into()));
        };
        // `null` means "PEFT's default", as a missing key does.
        let mut obj = obj.clone();
        obj.retain(|_, v| !v.is_null());
        let obj = Value::Object(obj);
        let extras: PeftOnlyKeys =
            serde_path_to_error::deserialize(&obj).map_err(|e| bad(at_key(e)))?;
        extras.check().map_err(bad)?;
        let config: LoraConfig =
            serde_path_to_error::deserialize(&obj).map_err(|e| bad(at_key(e)))?;
        config.validate().map_err(|e| bad(e.to_string()))?;
        Ok(config)
    }

    /// `adapter_config.json` as PEFT 0.21 writes it: every key, sorted, `inference_mode: true`.
    pub fn to_json(&self) -> Value {
        // Python writes an integral alpha as an integer.
        let number = |x: f64| {
            if x.fract() == 0.0 && x.abs() < 1e15 {
                json!(x as i64)
            } else {
                json!(x)
            }
        };
        let Ok(Value::Object(mut m)) = serde_json::to_value(self) else {
            unreachable!("a LoraConfig serializes to a JSON object")
        };
        m.insert("lora_alpha".into(), number(self.lora_alpha));
        m.insert(
            "alpha_pattern".into(),
            Value::Object(
                self.alpha_pattern
                    .iter()
                    .map(|(k, v)| (k.clone(), number(*v)))
                    .collect(),
            ),
        );
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
            "trainable_token_indices",
            "use_bdlora",
            "velora_config",
        ];
        for k in nulls {
            m.insert(k.into(), Value::Null);
        }
        let constants = [
            ("ensure_weight_tying", json!(false)),
            ("fan_in_fan_out", json!(false)),
            ("inference_mode", json!(true)),
            ("loftq_config", json!({})),
            ("lora_bias", json!(false)),
            ("megatron_core", json!("megatron.core")),
            ("peft_type", json!("LORA")),
            ("peft_version", json!("0.21.2")),
            ("qalora_group_size", json!(16)),
            ("task_type", json!("CAUSAL_LM")),
            ("use_qalora", json!(false)),
        ];
        for (k, v) in constants {
            m.insert(k.into(), v);
        }
        Value::Object(m)
    }
}
