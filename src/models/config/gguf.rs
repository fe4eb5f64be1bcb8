//! GGUF metadata (`<arch>.*`, llama.cpp's key names) read into a [`ModelConfig`]: the keys every family shares
//! here, the family's own (experts, defaults llama.cpp fixes) through its [`Family`](super::Family).

use std::path::Path;

use candle_core::quantized::gguf_file;

use super::family::{
    gguf_expert_names, llama_cpp_names, supported_model_types, Architecture, WindowKeys,
};
use super::keys::bad;
use super::layers::MoeConfig;
use super::validate::{layer_count, ConfigKeys};
use super::ModelConfig;
use crate::error::Result;
use crate::ops::rope::RopeScaling;

impl ModelConfig {
    /// Reads the `<arch>.*` metadata of a GGUF file. `has_output` says whether the file has `output.weight`
    /// (otherwise the head is tied to the embeddings).
    pub fn from_gguf(content: &gguf_file::Content, path: &Path, has_output: bool) -> Result<Self> {
        let md = &content.metadata;
        let arch_name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .ok_or_else(|| {
                bad(
                    path,
                    "GGUF metadata `general.architecture` is missing".into(),
                )
            })?
            .clone();
        let experts = md
            .get(&format!("{arch_name}.expert_count"))
            .and_then(|v| v.to_u32().ok())
            .filter(|n| *n > 0);
        let architecture =
            Architecture::from_gguf(&arch_name, experts.is_some()).ok_or_else(|| {
                bad(
                    path,
                    format!(
                        "GGUF architecture `{arch_name}` is not supported; supported: {} ({})",
                        supported_model_types(),
                        llama_cpp_names()
                    ),
                )
            })?;
        let key = |k: &str| format!("{arch_name}.{k}");
        if experts.is_some() && !architecture.is_moe() {
            return Err(bad(
                path,
                format!(
                    "GGUF files of `{arch_name}` with experts (`expert_count`) are not supported; load the model's \
                     Hugging Face folder instead (GGUF mixtures of experts load as {})",
                    gguf_expert_names()
                ),
            ));
        }
        let get_u = |k: &str| -> Result<usize> {
            md.get(&key(k))
                .ok_or_else(|| bad(path, format!("GGUF metadata `{}` is missing", key(k))))?
                .to_u64()
                .map(|v| v as usize)
                .map_err(|_| {
                    bad(
                        path,
                        format!("GGUF metadata `{}` is not an integer", key(k)),
                    )
                })
        };
        let get_f = |k: &str| -> Option<f64> {
            md.get(&key(k))
                .and_then(|v| v.to_f32().ok())
                .map(|v| v as f64)
        };
        let hidden_size = get_u("embedding_length")?;
        let num_attention_heads = get_u("attention.head_count")?;
        let vocab_size = match get_u("vocab_size") {
            Ok(v) => v,
            Err(_) => md
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok())
                .map(|v| v.len())
                .ok_or_else(|| {
                    bad(
                        path,
                        "neither `vocab_size` nor `tokenizer.ggml.tokens` is in the GGUF metadata"
                            .into(),
                    )
                })?,
        };
        // llama.cpp writes the head width as `attention.key_length` where it differs from hidden / heads, and the
        // rotated dimensions as `rope.dimension_count`.
        let head_dim =
            get_u("attention.key_length").unwrap_or(hidden_size / num_attention_heads.max(1));
        let rotary_dim = get_u("rope.dimension_count").unwrap_or(head_dim);
        let num_hidden_layers = layer_count(get_u("block_count")?, path)?;
        // llama.cpp's defaults where the family's keys are missing (Gemma 2: a 4096 window, caps of 50 and 30).
        let sliding_window = get_u("attention.sliding_window")
            .ok()
            .or(architecture.gguf_default_sliding_window())
            .filter(|w| *w > 0);
        let caps = architecture.gguf_default_softcapping();
        let softcap = |k: &str, default: Option<f64>| get_f(k).or(default).filter(|v| *v > 0.0);
        let rope_scaling = match md
            .get(&key("rope.scaling.type"))
            .and_then(|v| v.to_string().ok())
            .map(String::as_str)
        {
            None | Some("none") => None,
            // A missing factor is an error (it was plain RoPE before); `validate` refuses a non-positive one.
            Some("linear") => Some(RopeScaling::Linear {
                factor: get_f("rope.scaling.factor").ok_or_else(|| {
                    bad(
                        path,
                        format!(
                            "GGUF metadata `{}` is missing (rope scaling `linear` needs it)",
                            key("rope.scaling.factor")
                        ),
                    )
                })?,
            }),
            Some(other) => {
                return Err(bad(
                    path,
                    format!(
                        "GGUF rope scaling `{other}` is not supported (supported: none, linear)"
                    ),
                ))
            }
        };
        let u32_key = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        // What llama.cpp fixes per architecture (every layer sparse; the family's keys of the widths and whether it
        // renormalizes the top-k); transformers' defaults for the auxiliary loss, which a GGUF does not carry.
        let moe = match architecture.gguf_experts() {
            None => None,
            Some(keys) => {
                let experts = experts.ok_or_else(|| {
                    // Zero experts reads as none above; say which it was.
                    let problem = match u32_key(&key("expert_count")) {
                        Some(0) => "= 0: a mixture of experts has at least 1 expert",
                        _ => "is missing",
                    };
                    bad(
                        path,
                        format!("GGUF metadata `{}` {problem}", key("expert_count")),
                    )
                })? as usize;
                let per_token = get_u("expert_used_count")?;
                if per_token == 0 || per_token > experts {
                    return Err(bad(
                        path,
                        format!(
                            "GGUF metadata `{}` = {per_token}: must be between 1 and the {experts} experts",
                            key("expert_used_count")
                        ),
                    ));
                }
                Some(MoeConfig {
                    num_experts: experts,
                    num_experts_per_tok: per_token,
                    moe_intermediate_size: get_u(keys.width_key)?,
                    shared_expert_intermediate_size: keys
                        .shared_width_key
                        .map(get_u)
                        .transpose()?,
                    norm_topk_prob: keys.norm_topk_prob,
                    sparse_layers: vec![true; num_hidden_layers],
                    router_aux_loss_coef: 0.001,
                    output_router_logits: false,
                    clamped_swiglu: None,
                })
            }
        };
        let config = ModelConfig {
            architecture,
            vocab_size,
            hidden_size,
            intermediate_size: get_u("feed_forward_length")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads: get_u("attention.head_count_kv").unwrap_or(num_attention_heads),
            head_dim,
            rotary_dim,
            rms_norm_eps: get_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope_theta: get_f("rope.freq_base").unwrap_or(10_000.0),
            rope_scaling,
            sliding_rope_theta: architecture.default_sliding_rope_theta(),
            max_position_embeddings: get_u("context_length")?,
            tie_word_embeddings: !has_output,
            attention_bias: architecture.gguf_attention_bias(),
            activation: architecture.default_activation(),
            layer_types: architecture.default_layer_types(
                num_hidden_layers,
                &WindowKeys {
                    sliding_window,
                    ..WindowKeys::default()
                },
            ),
            sliding_window,
            query_pre_attn_scalar: architecture.gguf_query_pre_attn_scalar(
                num_hidden_layers,
                hidden_size,
                num_attention_heads,
            ),
            attn_logit_softcapping: softcap("attn_logit_softcapping", caps.map(|c| c.0)),
            final_logit_softcapping: softcap("final_logit_softcapping", caps.map(|c| c.1)),
            bos_token_id: u32_key("tokenizer.ggml.bos_token_id"),
            eos_token_ids: u32_key("tokenizer.ggml.eos_token_id").into_iter().collect(),
            moe,
        };
        config.validate(path, ConfigKeys::Gguf(&arch_name))?;
        Ok(config)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GGUF metadata that would make every value NaN is refused naming llama.cpp's key.
    #[test]
    fn gguf_numbers_that_give_nan_are_refused_by_their_key() {
        use gguf_file::Value as V;
        let content = |changes: &[(&str, V)]| {
            let mut metadata: std::collections::HashMap<String, V> = [
                ("general.architecture", V::String("llama".into())),
                ("llama.embedding_length", V::U32(64)),
                ("llama.attention.head_count", V::U32(4)),
                ("llama.feed_forward_length", V::U32(128)),
                ("llama.block_count", V::U32(2)),
                ("llama.context_length", V::U32(256)),
                ("llama.vocab_size", V::U32(100)),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
            for (k, v) in changes {
                metadata.insert(k.to_string(), v.clone());
            }
            gguf_file::Content {
                magic: gguf_file::VersionedMagic::GgufV3,
                metadata,
                tensor_infos: Default::default(),
                tensor_data_offset: 0,
            }
        };
        let path = Path::new("m.gguf");
        assert!(ModelConfig::from_gguf(&content(&[]), path, true).is_ok());
        for (changes, says) in [
            (
                vec![("llama.attention.layer_norm_rms_epsilon", V::F32(0.0))],
                "`llama.attention.layer_norm_rms_epsilon` = 0: must be a positive finite number",
            ),
            (
                vec![("llama.rope.freq_base", V::F32(f32::NAN))],
                "`llama.rope.freq_base` = NaN",
            ),
            (
                vec![("llama.rope.freq_base", V::F32(f32::INFINITY))],
                "`llama.rope.freq_base` = inf",
            ),
            (
                vec![
                    ("llama.rope.scaling.type", V::String("linear".into())),
                    ("llama.rope.scaling.factor", V::F32(-2.0)),
                ],
                "`llama.rope.scaling.factor` = -2",
            ),
            (
                vec![("llama.rope.scaling.type", V::String("linear".into()))],
                "`llama.rope.scaling.factor` is missing",
            ),
            (
                vec![("llama.context_length", V::U32(0))],
                "`llama.context_length` = 0: must be at least 1",
            ),
        ] {
            let err = ModelConfig::from_gguf(&content(&changes), path, true)
                .unwrap_err()
                .to_string();
            assert!(err.contains("m.gguf") && err.contains(says), "{err}");
        }
    }
}
