//! A Hugging Face `config.json`: read into a [`ModelConfig`] — the keys every family shares here (RoPE in
//! transformers 4's and 5's forms, `layer_types`, the activation), the family's own keys and defaults through its
//! [`Family`](super::Family) — and written back from one.

use std::path::Path;

use serde_json::Value;

use super::family::{refused_model_type, supported_model_types, Architecture, WindowKeys};
use super::keys::{bad, positive, HfConfig, TokenIds};
use super::layers::LayerAttention;
use super::validate::{layer_count, ConfigKeys};
use super::ModelConfig;
use crate::error::{at_key, Result};
use crate::files::read_json;
use crate::ops::rope::{Llama3RopeScaling, LongRopeScaling, RopeScaling, YarnRopeScaling};
use crate::ops::GateActivation;

impl ModelConfig {
    /// Reads a Hugging Face `config.json`.
    pub fn from_hf_config_file(path: &Path) -> Result<Self> {
        Self::from_hf_config(&read_json::<Value>(path)?, path)
    }

    /// Parses a `config.json` object; `path` names it in errors.
    pub fn from_hf_config(obj: &Value, path: &Path) -> Result<Self> {
        if let Some(reason) = obj
            .get("model_type")
            .and_then(Value::as_str)
            .and_then(refused_model_type)
        {
            return Err(bad(path, reason.into()));
        }
        let hf: HfConfig =
            serde_path_to_error::deserialize(obj).map_err(|e| bad(path, at_key(e)))?;
        let architecture = Architecture::parse(&hf.model_type).ok_or_else(|| {
            bad(
                path,
                format!(
                    "model_type `{}` is not supported; supported: {}",
                    hf.model_type,
                    supported_model_types()
                ),
            )
        })?;
        let head_dim = hf
            .head_dim
            .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1));
        let rope = rope_settings(obj, path, head_dim)?;
        // Qwen's families read `sliding_window` only with `use_sliding_window` (as transformers' configs do).
        let sliding_window =
            if architecture.gates_sliding_window() && hf.use_sliding_window != Some(true) {
                None
            } else {
                hf.sliding_window
            };
        if sliding_window == Some(0) {
            return Err(bad(path, "`sliding_window` must be at least 1".into()));
        }
        layer_count(hf.num_hidden_layers, path)?;
        let layer_types = match &hf.layer_types {
            Some(names) => parse_layer_types(names, hf.num_hidden_layers, path)?,
            None => architecture.default_layer_types(
                hf.num_hidden_layers,
                &WindowKeys {
                    sliding_window,
                    max_window_layers: hf.max_window_layers,
                    sliding_window_pattern: hf.sliding_window_pattern,
                },
            ),
        };
        let activation = activation_of(
            hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref()),
            architecture,
            path,
        )?;
        let moe = architecture.experts(&hf, path)?;
        let config = ModelConfig {
            architecture,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim,
            rotary_dim: rope.rotary_dim,
            rms_norm_eps: hf.rms_norm_eps.unwrap_or(1e-6),
            rope_theta: rope.theta.unwrap_or(architecture.default_rope_theta()),
            rope_scaling: match rope.scaling {
                None if obj.get("rope_scaling").is_none_or(Value::is_null)
                    && obj.get("rope_parameters").is_none_or(Value::is_null) =>
                {
                    architecture.default_rope_scaling()
                }
                scaling => scaling,
            },
            sliding_rope_theta: rope
                .sliding_theta
                .or(architecture.default_sliding_rope_theta()),
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf
                .tie_word_embeddings
                .unwrap_or(architecture.ties_embeddings_by_default()),
            attention_bias: architecture.attention_bias(&hf),
            activation,
            layer_types,
            sliding_window,
            query_pre_attn_scalar: positive(
                hf.query_pre_attn_scalar,
                "query_pre_attn_scalar",
                path,
            )?,
            attn_logit_softcapping: positive(
                hf.attn_logit_softcapping,
                "attn_logit_softcapping",
                path,
            )?,
            final_logit_softcapping: positive(
                hf.final_logit_softcapping,
                "final_logit_softcapping",
                path,
            )?,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.map(TokenIds::into_vec).unwrap_or_default(),
            moe,
        };
        config.validate(path, ConfigKeys::Json)?;
        Ok(config)
    }

    /// This configuration as a Hugging Face `config.json` object (transformers 4 key names, which transformers 5
    /// reads too); [`ModelConfig::from_hf_config`] reads it back to an equal configuration.
    pub fn to_hf_config(&self) -> Value {
        let arch = self.architecture;
        let activation_key = arch.activation_key();
        let mut v = serde_json::json!({
            "architectures": [arch.causal_lm_class()],
            "model_type": arch.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            activation_key: self.activation.hidden_act(),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids,
            "layer_types": self.layer_types.iter().map(|t| match t {
                LayerAttention::Full => "full_attention",
                LayerAttention::Sliding => "sliding_attention",
            }).collect::<Vec<_>>(),
            "sliding_window": self.sliding_window,
        });
        if arch.gates_sliding_window() {
            v["use_sliding_window"] = self.sliding_window.is_some().into();
        }
        arch.write_hf_keys(self.moe.as_ref(), &mut v);
        if self.rotary_dim != self.head_dim {
            v["partial_rotary_factor"] = (self.rotary_dim as f64 / self.head_dim as f64).into();
        }
        if let Some(theta) = self.sliding_rope_theta {
            v["rope_local_base_freq"] = theta.into();
        }
        let optional = [
            ("query_pre_attn_scalar", self.query_pre_attn_scalar),
            ("attn_logit_softcapping", self.attn_logit_softcapping),
            ("final_logit_softcapping", self.final_logit_softcapping),
        ];
        for (key, value) in optional {
            v[key] = value.into();
        }
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Llama3(s)) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": s.factor,
                    "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                    "original_max_position_embeddings": s.original_max_position_embeddings});
            }
            Some(RopeScaling::Linear { factor }) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "linear", "factor": factor});
            }
            Some(RopeScaling::LongRope(s)) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "longrope",
                    "short_factor": s.short_factor, "long_factor": s.long_factor,
                    "attention_factor": s.attention_factor});
                v["original_max_position_embeddings"] = s.original_max_position_embeddings.into();
            }
            Some(RopeScaling::Yarn(s)) => {
                v["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": s.factor,
                    "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate,
                    "original_max_position_embeddings": s.original_max_position_embeddings,
                    "attention_factor": s.attention_factor});
            }
        }
        v
    }
}

fn opt_f64(obj: &Value, key: &str, path: &Path) -> Result<Option<f64>> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| bad(path, format!("`{key}` must be a number"))),
    }
}

/// RoPE as a config declares it.
struct RopeSettings {
    theta: Option<f64>,
    scaling: Option<RopeScaling>,
    sliding_theta: Option<f64>,
    /// Leading dimensions of each head that RoPE rotates.
    rotary_dim: usize,
}

/// A `rope_scaling` / `rope_parameters` object's scaling (`obj` is the whole config, for keys transformers 4 kept
/// at the top level).
fn rope_scaling_of(
    scaling: &Value,
    obj: &Value,
    path: &Path,
    rotary_dim: usize,
) -> Result<Option<RopeScaling>> {
    let rope_type = scaling
        .get("rope_type")
        .or_else(|| scaling.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let number = |key: &str| -> Result<Option<f64>> {
        match opt_f64(scaling, key, path)? {
            Some(v) => Ok(Some(v)),
            None => opt_f64(obj, key, path),
        }
    };
    match rope_type {
        "default" => Ok(None),
        "llama3" => {
            let s: Llama3RopeScaling = serde_json::from_value(scaling.clone()).map_err(|e| {
                bad(path, format!("`rope_scaling` of type llama3 is incomplete: {e}"))
            })?;
            Ok(Some(RopeScaling::Llama3(s)))
        }
        "linear" => match number("factor")? {
            Some(factor) if factor > 0.0 => Ok(Some(RopeScaling::Linear { factor })),
            _ => Err(bad(
                path,
                "`rope_scaling` of type linear needs a positive `factor`".into(),
            )),
        },
        "longrope" | "su" => {
            let factors = |key: &str| -> Result<Vec<f64>> {
                let v: Vec<f64> = scaling
                    .get(key)
                    .and_then(|v| serde_json::from_value(v.clone()).ok())
                    .ok_or_else(|| {
                        bad(path, format!("`rope_scaling` of type longrope needs `{key}` (a list of numbers)"))
                    })?;
                if v.len() != rotary_dim / 2 || v.iter().any(|f| !(f.is_finite() && *f > 0.0)) {
                    return Err(bad(
                        path,
                        format!(
                            "`rope_scaling.{key}` must hold {} positive numbers (rotary dimension / 2), not {}",
                            rotary_dim / 2,
                            v.len()
                        ),
                    ));
                }
                Ok(v)
            };
            let original = number("original_max_position_embeddings")?
                .filter(|v| *v >= 2.0)
                .ok_or_else(|| {
                    bad(
                        path,
                        "LongRoPE needs `original_max_position_embeddings` (at least 2)".into(),
                    )
                })? as usize;
            let max = opt_f64(obj, "max_position_embeddings", path)?.unwrap_or(original as f64);
            let factor = number("factor")?.unwrap_or(max / original as f64);
            let attention_factor = match opt_f64(scaling, "attention_factor", path)? {
                Some(f) => f,
                None => LongRopeScaling::default_attention_factor(factor, original),
            };
            Ok(Some(RopeScaling::LongRope(LongRopeScaling {
                short_factor: factors("short_factor")?,
                long_factor: factors("long_factor")?,
                original_max_position_embeddings: original,
                attention_factor,
            })))
        }
        "yarn" => {
            let original = number("original_max_position_embeddings")?
                .filter(|v| *v >= 1.0)
                .ok_or_else(|| {
                    bad(
                        path,
                        "YaRN needs `original_max_position_embeddings` (at least 1)".into(),
                    )
                })? as usize;
            let max = opt_f64(obj, "max_position_embeddings", path)?.unwrap_or(original as f64);
            let factor = opt_f64(scaling, "factor", path)?.unwrap_or(max / original as f64);
            if !(factor.is_finite() && factor > 0.0) {
                return Err(bad(path, format!("YaRN's `factor` must be positive, not {factor}")));
            }
            let attention_factor = match opt_f64(scaling, "attention_factor", path)? {
                Some(f) => f,
                None => YarnRopeScaling::default_attention_factor(
                    factor,
                    opt_f64(scaling, "mscale", path)?,
                    opt_f64(scaling, "mscale_all_dim", path)?,
                ),
            };
            // transformers reads `beta_fast or 32`, `beta_slow or 1`: a 0 means the default too.
            let beta = |key: &str, default: f64| -> Result<f64> {
                Ok(opt_f64(scaling, key, path)?.filter(|v| *v != 0.0).unwrap_or(default))
            };
            Ok(Some(RopeScaling::Yarn(YarnRopeScaling {
                factor,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                original_max_position_embeddings: original,
                truncate: scaling.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                attention_factor,
            })))
        }
        other => Err(bad(
            path,
            format!("rope scaling type `{other}` is not supported (supported: default, llama3, linear, longrope, yarn); remove it to use plain RoPE"),
        )),
    }
}

/// Reads RoPE settings from `rope_theta`/`rope_scaling`/`partial_rotary_factor`/`rope_local_base_freq`
/// (transformers 4.x) or `rope_parameters` (5.x, per layer type for Gemma 3).
fn rope_settings(obj: &Value, path: &Path, head_dim: usize) -> Result<RopeSettings> {
    let params = obj.get("rope_parameters").filter(|v| v.is_object());
    let (full, sliding) = match params {
        Some(p) if p.get("full_attention").is_some() => (
            p.get("full_attention").filter(|v| v.is_object()),
            p.get("sliding_attention").filter(|v| v.is_object()),
        ),
        _ => (params, None),
    };
    let in_params = |key: &str| -> Result<Option<f64>> {
        full.map(|p| opt_f64(p, key, path))
            .transpose()
            .map(Option::flatten)
    };
    let partial_rotary_factor = match opt_f64(obj, "partial_rotary_factor", path)? {
        Some(f) => f,
        None => in_params("partial_rotary_factor")?.unwrap_or(1.0),
    };
    if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
        return Err(bad(
            path,
            format!("`partial_rotary_factor` must be in (0, 1], not {partial_rotary_factor}"),
        ));
    }
    let rotary_dim = (head_dim as f64 * partial_rotary_factor) as usize;
    let theta = match opt_f64(obj, "rope_theta", path)? {
        Some(t) => Some(t),
        None => in_params("rope_theta")?,
    };
    let scaling = match obj.get("rope_scaling").filter(|v| v.is_object()).or(full) {
        Some(s) => rope_scaling_of(s, obj, path, rotary_dim)?,
        None => None,
    };
    let sliding_theta = match opt_f64(obj, "rope_local_base_freq", path)? {
        Some(t) => Some(t),
        None => sliding
            .map(|p| opt_f64(p, "rope_theta", path))
            .transpose()?
            .flatten(),
    };
    Ok(RopeSettings {
        theta,
        scaling,
        sliding_theta,
        rotary_dim,
    })
}

/// The gated MLP activation a config names (`None`: the family's default).
fn activation_of(
    name: Option<&str>,
    architecture: Architecture,
    path: &Path,
) -> Result<GateActivation> {
    match name {
        None => Ok(architecture.default_activation()),
        Some(name) => GateActivation::from_hidden_act(name).ok_or_else(|| {
            bad(
                path,
                format!(
                    "activation `{name}` is not supported (supported: silu, gelu_pytorch_tanh)"
                ),
            )
        }),
    }
}

/// `layer_types` as written in a config.
fn parse_layer_types(names: &[String], layers: usize, path: &Path) -> Result<Vec<LayerAttention>> {
    if names.len() != layers {
        return Err(bad(
            path,
            format!(
                "`layer_types` lists {} layers, but num_hidden_layers is {layers}",
                names.len()
            ),
        ));
    }
    names
        .iter()
        .enumerate()
        .map(|(i, n)| match n.as_str() {
            "full_attention" => Ok(LayerAttention::Full),
            "sliding_attention" => Ok(LayerAttention::Sliding),
            other => Err(bad(
                path,
                format!("`layer_types[{i}]` = `{other}` is not supported (full_attention, sliding_attention)"),
            )),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<ModelConfig> {
        ModelConfig::from_hf_config(&v, Path::new("config.json"))
    }

    fn llama() -> Value {
        json!({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "eos_token_id": [1, 2]})
    }

    #[test]
    fn reads_llama_and_defaults() {
        let c = parse(llama()).unwrap();
        assert_eq!(c.head_dim, 16);
        assert_eq!(c.rope_theta, 10_000.0);
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert!(!c.attention_bias && !c.tie_word_embeddings);
    }

    #[test]
    fn reads_rope_parameters_of_transformers_5() {
        let mut v = llama();
        v["rope_parameters"] = json!({"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
        let c = parse(v).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3(s)) if s.factor == 8.0));
    }

    #[test]
    fn errors_name_the_key_and_list_supported_types() {
        let mut v = llama();
        v.as_object_mut().unwrap().remove("hidden_size");
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains("missing field `hidden_size`"),
            "{err}"
        );
        let mut v = llama();
        v["model_type"] = json!("gpt2");
        let err = parse(v).unwrap_err().to_string();
        assert!(err.contains("gpt2") && err.contains("qwen2"), "{err}");
        let mut v = llama();
        v["rope_scaling"] = json!({"rope_type": "dynamic", "factor": 4.0});
        let err = parse(v).unwrap_err().to_string();
        assert!(err.contains("`dynamic`") && err.contains("yarn"), "{err}");
        let mut v = llama();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("YaRN needs `original_max_position_embeddings`"),
            "{err}"
        );
    }

    fn gemma3_v4() -> Value {
        json!({"model_type": "gemma3_text", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32,
               "max_position_embeddings": 1024, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 512,
               "sliding_window_pattern": 6, "query_pre_attn_scalar": 256})
    }

    #[test]
    fn reads_gemma3_written_by_transformers_4() {
        let c = parse(gemma3_v4()).unwrap();
        let full: Vec<usize> = (0..12)
            .filter(|&i| c.layer_types[i] == LayerAttention::Full)
            .collect();
        assert_eq!(full, vec![5, 11]);
        assert_eq!(c.window_of(0), Some(512));
        assert_eq!(c.window_of(5), None);
        assert_eq!(c.sliding_rope_theta, Some(10000.0));
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(c.activation, GateActivation::GeluTanh);
        assert!(c.tie_word_embeddings);
        assert_eq!(c.attention_scale(), 1.0 / 16.0);
        assert_eq!(c.embedding_multiplier(), Some(8.0));
        // transformers 5 writes the same as per-layer-type RoPE parameters.
        let mut v5 = gemma3_v4();
        for key in ["rope_theta", "rope_local_base_freq", "rope_scaling"] {
            v5.as_object_mut().unwrap().remove(key);
        }
        v5["rope_parameters"] = json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}});
        assert_eq!(parse(v5).unwrap(), c);
    }

    #[test]
    fn sliding_windows_follow_transformers_defaults() {
        // Gemma 2 alternates, sliding first.
        let mut v = gemma3_v4();
        v["model_type"] = json!("gemma2");
        v["num_hidden_layers"] = json!(4);
        let c = parse(v).unwrap();
        use LayerAttention::{Full, Sliding};
        assert_eq!(c.layer_types, vec![Sliding, Full, Sliding, Full]);
        // Qwen2 ignores `sliding_window` unless `use_sliding_window`; then layers from `max_window_layers` slide.
        let mut v = llama();
        v["model_type"] = json!("qwen2");
        v["sliding_window"] = json!(32768);
        assert_eq!(parse(v.clone()).unwrap().sliding_window, None);
        v["use_sliding_window"] = json!(true);
        v["max_window_layers"] = json!(1);
        let c = parse(v).unwrap();
        assert_eq!(c.layer_types, vec![Full, Sliding]);
        // Mistral slides on every layer when it has a window; an explicit list wins.
        let mut v = llama();
        v["model_type"] = json!("mistral");
        v["sliding_window"] = json!(4096);
        assert_eq!(
            parse(v.clone()).unwrap().layer_types,
            vec![Sliding, Sliding]
        );
        v["layer_types"] = json!(["full_attention", "sliding_attention"]);
        assert_eq!(parse(v.clone()).unwrap().layer_types, vec![Full, Sliding]);
        v["layer_types"] = json!(["full_attention"]);
        assert!(parse(v.clone())
            .unwrap_err()
            .to_string()
            .contains("lists 1 layers"));
        v["layer_types"] = json!(["full_attention", "chunked_attention"]);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("chunked_attention"));
    }

    #[test]
    fn reads_phi3_longrope_and_partial_rotary() {
        let mut v = llama();
        v["model_type"] = json!("phi3");
        v["num_key_value_heads"] = json!(4);
        v["partial_rotary_factor"] = json!(0.5);
        v["max_position_embeddings"] = json!(131072);
        v["original_max_position_embeddings"] = json!(4096);
        v["rope_scaling"] = json!({"type": "su", "short_factor": [1.0, 1.0, 1.5, 2.0],
                                   "long_factor": [2.0, 3.0, 4.0, 5.0]});
        let c = parse(v.clone()).unwrap();
        assert_eq!((c.head_dim, c.rotary_dim), (16, 8));
        let Some(RopeScaling::LongRope(s)) = &c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert_eq!(s.original_max_position_embeddings, 4096);
        let expected = (1.0 + 32f64.ln() / 4096f64.ln()).sqrt();
        assert!((s.attention_factor - expected).abs() < 1e-12);
        let linears = c.layer_linears(0);
        assert_eq!(linears.len(), 4);
        assert_eq!(linears[0], ("self_attn.qkv_proj".into(), [16 * 4 * 3, 64]));
        v["rope_scaling"]["long_factor"] = json!([2.0, 3.0]);
        let err = parse(v).unwrap_err().to_string();
        assert!(
            err.contains("long_factor") && err.contains("4 positive numbers"),
            "{err}"
        );
    }

    #[test]
    fn bad_family_settings_are_named() {
        let mut v = gemma3_v4();
        v["hidden_activation"] = json!("relu");
        assert!(parse(v).unwrap_err().to_string().contains("relu"));
        let mut v = gemma3_v4();
        v["attn_logit_softcapping"] = json!(-1.0);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("attn_logit_softcapping"));
        let mut v = llama();
        v["partial_rotary_factor"] = json!(1.5);
        assert!(parse(v)
            .unwrap_err()
            .to_string()
            .contains("partial_rotary_factor"));
    }

    /// Qwen3-30B-A3B's config (the Hub's `config.json`, keys we read): every layer sparse, 128 experts of width
    /// 768, 8 per token, renormalized; `mlp_only_layers` and `decoder_sparse_step` make layers dense as
    /// transformers does; impossible expert counts are named.
    #[test]
    fn reads_mixture_of_experts_configs() {
        let qwen3_30b_a3b = json!({
            "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "router_aux_loss_coef": 0.001, "output_router_logits": false, "tie_word_embeddings": false,
            "use_sliding_window": false, "sliding_window": null
        });
        let c = parse(qwen3_30b_a3b.clone()).unwrap();
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(
            (
                moe.num_experts,
                moe.num_experts_per_tok,
                moe.moe_intermediate_size
            ),
            (128, 8, 768)
        );
        assert!(moe.norm_topk_prob && moe.sparse_layers.iter().all(|s| *s));
        assert!(c.architecture.has_qk_norm() && !c.attention_bias);
        let layer = c.layer_linears(0);
        assert_eq!(layer.len(), 4 + 1 + 2 * 128);
        assert_eq!(layer[4], ("mlp.gate".into(), [128, 2048]));
        assert_eq!(
            layer[5],
            ("mlp.experts.0.gate_up_proj".into(), [1536, 2048])
        );
        assert_eq!(layer[6], ("mlp.experts.0.down_proj".into(), [2048, 768]));

        let mut v = qwen3_30b_a3b.clone();
        v["mlp_only_layers"] = json!([0]);
        v["decoder_sparse_step"] = json!(2);
        let sparse = parse(v).unwrap().moe.unwrap().sparse_layers;
        assert_eq!(&sparse[..4], &[false, true, false, true]);
        assert_eq!(
            parse(
                json!({"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "max_position_embeddings": 64})
            )
            .unwrap()
            .moe
            .unwrap()
            .num_experts,
            8,
            "Mixtral's default"
        );
        for (key, value, says) in [
            (
                "num_experts_per_tok",
                json!(129),
                "num_experts_per_tok = 129",
            ),
            ("decoder_sparse_step", json!(0), "decoder_sparse_step"),
            ("router_aux_loss_coef", json!(-1.0), "router_aux_loss_coef"),
            ("num_experts", json!(1 << 20), "num_experts"),
            // A zero count is the count's fault, not the share a token takes.
            (
                "num_experts",
                json!(0),
                "`num_experts` = 0: a mixture of experts has at least 1",
            ),
        ] {
            let mut v = qwen3_30b_a3b.clone();
            v[key] = value;
            let err = parse(v).unwrap_err().to_string();
            assert!(err.contains(says), "{key}: {err}");
        }
    }

    /// What `to_hf_config` writes reads back to the same configuration, for every family's tiny model.
    #[test]
    fn hf_config_round_trips() {
        let models = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models");
        let mut checked = 0;
        for entry in std::fs::read_dir(&models).unwrap() {
            let path = entry.unwrap().path().join("config.json");
            if path.exists() {
                let c = ModelConfig::from_hf_config_file(&path).unwrap();
                assert_eq!(parse(c.to_hf_config()).unwrap(), c, "{}", path.display());
                checked += 1;
            }
        }
        assert!(checked >= 10);
        let c = parse(gemma3_v4()).unwrap();
        assert_eq!(parse(c.to_hf_config()).unwrap(), c);
    }
}
