//! The checks every parsed configuration goes through: sizes that fit together and that some model has, and
//! numbers that do not make every value NaN or infinite, named as the file names them ([`ConfigKeys`]).

use std::path::Path;

use super::keys::bad;
use super::ModelConfig;
use crate::error::Result;
use crate::ops::rope::RopeScaling;

/// The largest vocabulary, width, head count or context a config may declare (real models stay far below).
const MAX_SIZE: usize = 1 << 24;
/// The most experts a sparse layer may have (models have at most a few hundred).
const MAX_EXPERTS: usize = 1 << 12;
/// The most decoder layers a config may declare (models have at most a few hundred).
const MAX_LAYERS: usize = 1 << 12;
/// The most entries (`max_position_embeddings × head_dim`) of each RoPE table, float32: 2 GiB for cos and sin each.
const MAX_ROPE_ENTRIES: usize = 1 << 29;

/// `layers`, refused before anything per layer is built when no model has that many.
pub(super) fn layer_count(layers: usize, path: &Path) -> Result<usize> {
    if layers > MAX_LAYERS {
        return Err(bad(
            path,
            format!("num_hidden_layers = {layers} is more than any model has (at most {MAX_LAYERS}); the file is damaged"),
        ));
    }
    Ok(layers)
}

impl ModelConfig {
    /// Refuses what no model has and what would make every value NaN or infinite: head counts and widths that do
    /// not fit together, sizes beyond any model, and a norm epsilon, RoPE base or RoPE scaling that is not a
    /// positive finite number. Every parsed configuration goes through it; `keys` names the values as the file
    /// does.
    pub(crate) fn validate(&self, path: &Path, keys: ConfigKeys<'_>) -> Result<()> {
        self.validate_numbers(path, keys)?;
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || self.num_attention_heads % self.num_key_value_heads != 0
        {
            return Err(bad(
                path,
                format!(
                    "num_attention_heads ({}) must be a positive multiple of num_key_value_heads ({})",
                    self.num_attention_heads, self.num_key_value_heads
                ),
            ));
        }
        if self.head_dim == 0
            || self.head_dim % 2 != 0
            || self.hidden_size == 0
            || self.vocab_size == 0
        {
            return Err(bad(
                path,
                format!(
                    "inconsistent sizes: head_dim {} (must be even and positive), hidden_size {}, vocab_size {}",
                    self.head_dim, self.hidden_size, self.vocab_size
                ),
            ));
        }
        if self.rotary_dim == 0 || self.rotary_dim % 2 != 0 || self.rotary_dim > self.head_dim {
            return Err(bad(
                path,
                format!(
                    "the rotated dimensions ({}, head_dim × partial_rotary_factor) must be even, positive and at most head_dim ({})",
                    self.rotary_dim, self.head_dim
                ),
            ));
        }
        let zero = [
            ("intermediate_size", self.intermediate_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((key, _)) = zero.iter().find(|(_, v)| *v == 0) {
            return Err(bad(
                path,
                format!("`{}` = 0: must be at least 1", keys.name(key)),
            ));
        }
        // Sizes no model has are a damaged file: refuse them before anything is computed or allocated from them.
        let sizes = [
            ("vocab_size", self.vocab_size, MAX_SIZE),
            ("hidden_size", self.hidden_size, MAX_SIZE),
            ("intermediate_size", self.intermediate_size, MAX_SIZE),
            ("num_attention_heads", self.num_attention_heads, MAX_SIZE),
            ("head_dim", self.head_dim, MAX_SIZE),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_SIZE,
            ),
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
        ];
        let moe = self.moe.as_ref();
        let sizes = [
            sizes.as_slice(),
            &[
                ("num_experts", moe.map_or(0, |m| m.num_experts), MAX_EXPERTS),
                (
                    "moe_intermediate_size",
                    moe.map_or(0, |m| m.moe_intermediate_size),
                    MAX_SIZE,
                ),
                (
                    "shared_expert_intermediate_size",
                    moe.and_then(|m| m.shared_expert_intermediate_size)
                        .unwrap_or(0),
                    MAX_SIZE,
                ),
            ],
        ]
        .concat();
        if let Some((key, value, max)) = sizes.iter().find(|(_, v, max)| v > max) {
            return Err(bad(
                path,
                format!("{key} = {value} is more than any model has (at most {max}); the file is damaged"),
            ));
        }
        // The RoPE tables are built for every position up front.
        let rope_entries = self.max_position_embeddings * self.head_dim;
        if rope_entries > MAX_ROPE_ENTRIES {
            return Err(bad(
                path,
                format!(
                    "max_position_embeddings {} × head_dim {} = {rope_entries} RoPE table entries, more than {MAX_ROPE_ENTRIES} \
                     (4 GiB of tables); lower max_position_embeddings",
                    self.max_position_embeddings, self.head_dim
                ),
            ));
        }
        Ok(())
    }
}

/// Where a configuration's values come from, to name them as that file does in errors.
#[derive(Clone, Copy, Debug)]
pub(crate) enum ConfigKeys<'a> {
    /// A Hugging Face `config.json`.
    Json,
    /// GGUF metadata of this `general.architecture`.
    Gguf(&'a str),
}

impl ConfigKeys<'_> {
    /// The key of `field` (a `config.json` name) in this kind of file.
    fn name(self, field: &str) -> String {
        let ConfigKeys::Gguf(arch) = self else {
            return field.to_string();
        };
        let gguf = match field {
            "rms_norm_eps" => "attention.layer_norm_rms_epsilon",
            "rope_theta" => "rope.freq_base",
            "intermediate_size" => "feed_forward_length",
            "max_position_embeddings" => "context_length",
            "rope_scaling.factor" => "rope.scaling.factor",
            "rope_scaling.attention_factor" => "rope.scaling.attn_factor",
            "rope_scaling.short_factor" => "rope_factors_short (tensor)",
            "rope_scaling.long_factor" => "rope_factors_long (tensor)",
            other => other,
        };
        format!("{arch}.{gguf}")
    }
}

impl ModelConfig {
    /// The norm epsilon, RoPE bases and RoPE scaling: each a positive finite number (a zero or negative epsilon
    /// divides by zero or takes the root of a negative number, a non-positive base or scaling factor gives
    /// infinite or NaN frequencies), and Llama 3's band with `high_freq_factor > low_freq_factor` (equal ones
    /// divide by zero in the smoothing, transformers warns on both).
    fn validate_numbers(&self, path: &Path, keys: ConfigKeys<'_>) -> Result<()> {
        let mut checks: Vec<(&str, f64, &str)> = vec![
            ("rms_norm_eps", self.rms_norm_eps, "models use 1e-6 to 1e-5"),
            ("rope_theta", self.rope_theta, "models use 1e4 to 1e6"),
        ];
        if let Some(theta) = self.sliding_rope_theta {
            checks.push(("rope_local_base_freq", theta, "Gemma 3 uses 1e4"));
        }
        let factor_hint = "1 is no scaling, larger extends the context";
        match &self.rope_scaling {
            None => {}
            Some(RopeScaling::Linear { factor }) => {
                checks.push(("rope_scaling.factor", *factor, factor_hint))
            }
            Some(RopeScaling::Llama3(s)) => {
                checks.push(("rope_scaling.factor", s.factor, factor_hint));
                checks.push((
                    "rope_scaling.low_freq_factor",
                    s.low_freq_factor,
                    "Llama 3.1 uses 1",
                ));
                checks.push((
                    "rope_scaling.high_freq_factor",
                    s.high_freq_factor,
                    "Llama 3.1 uses 4",
                ));
            }
            Some(RopeScaling::Yarn(s)) => {
                checks.push(("rope_scaling.factor", s.factor, factor_hint));
                checks.push(("rope_scaling.beta_fast", s.beta_fast, "the default is 32"));
                checks.push(("rope_scaling.beta_slow", s.beta_slow, "the default is 1"));
                checks.push((
                    "rope_scaling.attention_factor",
                    s.attention_factor,
                    "leave it out for YaRN's default",
                ));
            }
            Some(RopeScaling::LongRope(s)) => {
                checks.push((
                    "rope_scaling.attention_factor",
                    s.attention_factor,
                    "leave it out for LongRoPE's default",
                ));
                for (key, factors) in [
                    ("rope_scaling.short_factor", &s.short_factor),
                    ("rope_scaling.long_factor", &s.long_factor),
                ] {
                    if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
                        checks.push((key, *f, "every factor is a positive number"));
                    }
                }
            }
        }
        if let Some((key, value, hint)) =
            checks.iter().find(|(_, v, _)| !(v.is_finite() && *v > 0.0))
        {
            return Err(bad(
                path,
                format!(
                    "`{}` = {value}: must be a positive finite number ({hint}); with it every value the model \
                     computes is NaN or infinite",
                    keys.name(key)
                ),
            ));
        }
        if let Some(RopeScaling::Llama3(s)) = &self.rope_scaling {
            if s.high_freq_factor <= s.low_freq_factor {
                return Err(bad(
                    path,
                    format!(
                        "`rope_scaling.high_freq_factor` = {} must be greater than `rope_scaling.low_freq_factor` = {} \
                         (Llama 3.1 uses 4 and 1)",
                        s.high_freq_factor, s.low_freq_factor
                    ),
                ));
            }
        }
        Ok(())
    }
}
