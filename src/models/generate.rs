//! Text generation with a KV cache: greedy, temperature, top-k and top-p sampling through candle-transformers'
//! `LogitsProcessor`, streaming each token as it comes, stopping at an end-of-sequence token; and GRPO's group
//! generation ([`generate_group`]): n completions of one prompt decoded as one batch, sampled with transformers'
//! processors ([`super::sampling`]) from counter-based draws. Each step runs in
//! inference mode ([`crate::ops::frozen_linear::InferenceMode`], through [`LlamaModel::forward_cached`]): 4-bit
//! weights on the CPU are multiplied by in place rather than dequantized per token.

use candle_core::{DType, Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::llama::{KvCache, LlamaModel};
use super::sampling::{draw_index, SamplingConfig};
use crate::error::{Error, Result};

/// How to pick tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationConfig {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 means greedy.
    pub temperature: f64,
    /// Nucleus sampling threshold (1.0 = off).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (None = off).
    pub top_k: Option<usize>,
    /// Sampling seed.
    pub seed: u64,
    /// Tokens that end generation: `None` (the default) takes the model's end-of-sequence tokens (its config's
    /// `eos_token_id`), `Some(vec![])` never stops before `max_new_tokens`.
    pub eos_token_ids: Option<Vec<u32>>,
}

impl GenerationConfig {
    /// Greedy decoding of up to `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerationConfig {
            max_new_tokens,
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            seed: 42,
            eos_token_ids: None,
        }
    }

    /// Checks the settings: at least one new token (transformers' `GenerationConfig.validate` refuses
    /// `max_new_tokens` ≤ 0), a finite temperature of 0 or more, `top_p` in (0, 1], `top_k` at least 1.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("generation: {m}")));
        if self.max_new_tokens == 0 {
            return bad(
                "max_new_tokens = 0: must be at least 1 (the tokens to generate at most)".into(),
            );
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return bad(format!(
                "temperature = {}: must be 0 (greedy) or more",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad(format!(
                "top_p = {}: must be in (0, 1] (1 keeps every token)",
                self.top_p
            ));
        }
        if self.top_k == Some(0) {
            return bad("top_k = 0: must be at least 1 (or unset)".into());
        }
        Ok(())
    }

    fn sampling(&self) -> Sampling {
        if self.temperature <= 0.0 {
            return Sampling::ArgMax;
        }
        let temperature = self.temperature;
        match (self.top_k, self.top_p < 1.0) {
            (None, false) => Sampling::All { temperature },
            (Some(k), false) => Sampling::TopK { k, temperature },
            (None, true) => Sampling::TopP {
                p: self.top_p,
                temperature,
            },
            (Some(k), true) => Sampling::TopKThenTopP {
                k,
                p: self.top_p,
                temperature,
            },
        }
    }
}

/// Generates after `prompt_ids`, calling `on_token` with each new token; returns the new tokens (without EOS).
/// Generation also stops where the model's context (`max_position_embeddings`) is full, as transformers does.
pub fn generate(
    model: &LlamaModel,
    prompt_ids: &[u32],
    config: &GenerationConfig,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    config.validate()?;
    if prompt_ids.is_empty() {
        return Err(Error::InvalidInput(
            "generation: the prompt has no tokens; give it some text".into(),
        ));
    }
    let context = model.config().max_position_embeddings;
    if prompt_ids.len() >= context {
        return Err(Error::InvalidInput(format!(
            "generation: the prompt's {} tokens fill the model's context of {context} positions",
            prompt_ids.len()
        )));
    }
    let max_new_tokens = config.max_new_tokens.min(context - prompt_ids.len());
    let device = Device::Cpu;
    let mut processor = LogitsProcessor::from_sampling(config.seed, config.sampling());
    let mut cache = KvCache::new(model.layers.len());
    let mut out = Vec::new();
    let mut input = Tensor::new(prompt_ids, &device)?.unsqueeze(0)?;
    let eos = config
        .eos_token_ids
        .as_deref()
        .unwrap_or(&model.config().eos_token_ids);
    for _ in 0..max_new_tokens {
        let logits = model.forward_cached(&input, &mut cache)?.squeeze(0)?;
        let next = processor.sample(&logits)?;
        if eos.contains(&next) {
            break;
        }
        out.push(next);
        on_token(next)?;
        input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
    }
    Ok(out)
}

/// One completion of [`generate_group`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupCompletion {
    /// The new tokens, including the end-of-sequence token when one ended the completion (TRL keeps it).
    pub ids: Vec<u32>,
    /// True when no end-of-sequence token came within the limit (`max_new_tokens`, or the model's context).
    pub truncated: bool,
}

/// Samples `n` completions of one prompt in a batch, as GRPO does (TRL's `GRPOTrainer` with transformers'
/// `generate`): the prompt runs once, its KV cache is repeated to `n` rows, and each step feeds the last token of
/// every row still generating as `[rows, 1]`. A row stops at a token of `eos` (kept in its completion) or after
/// `max_new_tokens` (fewer where the model's context, `max_position_embeddings`, fills first); a finished row
/// leaves the batch and the cache. Row `r`'s token `t` is drawn with `crate::rng::uniform(seed, draw_index(r, t))`
/// after `sampling`'s processors (history: the prompt and the row's tokens so far), so a row's completion depends
/// only on `(seed, r)` and not on `n` or on when the other rows stop. Runs on the model's device, in inference mode.
pub fn generate_group(
    model: &LlamaModel,
    prompt_ids: &[u32],
    n: usize,
    max_new_tokens: usize,
    sampling: &SamplingConfig,
    eos: &[u32],
    seed: u64,
) -> Result<Vec<GroupCompletion>> {
    sampling.validate()?;
    let bad = |m: String| Err(Error::InvalidInput(format!("group generation: {m}")));
    if n == 0 {
        return bad("n = 0: ask for at least one completion".into());
    }
    if max_new_tokens == 0 {
        return bad(
            "max_new_tokens = 0: must be at least 1 (the tokens to generate at most)".into(),
        );
    }
    if prompt_ids.is_empty() {
        return bad("the prompt has no tokens; give it some text".into());
    }
    let context = model.config().max_position_embeddings;
    if prompt_ids.len() >= context {
        return bad(format!(
            "the prompt's {} tokens fill the model's context of {context} positions",
            prompt_ids.len()
        ));
    }
    let max_new_tokens = max_new_tokens.min(context - prompt_ids.len());
    let device = model.device().clone();
    let mut cache = KvCache::new(model.layers.len());
    let prompt = Tensor::new(prompt_ids, &device)?.unsqueeze(0)?;
    let first = model.forward_cached(&prompt, &mut cache)?;
    let first = first.to_dtype(DType::F32)?.squeeze(0)?.to_vec1::<f32>()?;
    cache.repeat_rows(n)?;
    let mut done: Vec<Option<GroupCompletion>> = vec![None; n];
    let mut histories: Vec<Vec<u32>> = vec![prompt_ids.to_vec(); n];
    // The rows still generating, in batch order.
    let mut alive: Vec<usize> = (0..n).collect();
    let mut logits: Vec<Vec<f32>> = vec![first; n];
    for step in 0..max_new_tokens {
        let mut kept = Vec::with_capacity(alive.len());
        for (slot, (&row, scores)) in alive.iter().zip(logits.iter_mut()).enumerate() {
            let history = &mut histories[row];
            let token = sampling.sample(scores, history, seed, draw_index(row, step))?;
            history.push(token);
            let ended = eos.contains(&token);
            if ended || step + 1 == max_new_tokens {
                done[row] = Some(GroupCompletion {
                    ids: history[prompt_ids.len()..].to_vec(),
                    truncated: !ended,
                });
            } else {
                kept.push(slot);
            }
        }
        if kept.is_empty() {
            break;
        }
        if kept.len() < alive.len() {
            cache.select_rows(&kept)?;
            alive = kept.iter().map(|&slot| alive[slot]).collect();
        }
        let last: Vec<u32> = alive
            .iter()
            .map(|&row| *histories[row].last().expect("a generated token"))
            .collect();
        let input = Tensor::new(last.as_slice(), &device)?.unsqueeze(1)?;
        logits = model
            .forward_cached(&input, &mut cache)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
    }
    Ok(done
        .into_iter()
        .map(|c| c.expect("every row ends by max_new_tokens"))
        .collect())
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::models::config::ModelConfig;
    use crate::models::llama::LayerWeights;
    use crate::models::mlp::Linear;
    use crate::ops::{FrozenLinear, FrozenWeight};
    use crate::quant::{Nf4Tensor, QuantConfig};

    /// A tiny random model of `tests/data/models/` (Llama-named tensors, float32), its linears NF4 when `nf4`.
    fn tiny(folder: &str, nf4: bool) -> LlamaModel {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data/models")
            .join(folder);
        let config = ModelConfig::from_hf_config_file(&dir.join("config.json")).unwrap();
        let tensors =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        let get = |name: &str| tensors[name].clone();
        let frozen = |w: Tensor, quantize: bool| {
            let weight = match quantize {
                true => FrozenWeight::Nf4(Arc::new(
                    Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap(),
                )),
                false => FrozenWeight::Dense(w),
            };
            Arc::new(FrozenLinear::new(weight, None))
        };
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                LayerWeights {
                    input_layernorm: get(&format!("{p}.input_layernorm.weight")),
                    post_attention_layernorm: get(&format!("{p}.post_attention_layernorm.weight")),
                    pre_feedforward_layernorm: None,
                    post_feedforward_layernorm: None,
                    q_norm: None,
                    k_norm: None,
                    sinks: None,
                    linears: config
                        .layer_linears(l)
                        .iter()
                        .map(|(name, _)| {
                            Linear::new(frozen(get(&format!("{p}.{name}.weight")), nf4))
                        })
                        .collect(),
                }
            })
            .collect();
        LlamaModel::new(
            config,
            get("model.embed_tokens.weight"),
            layers,
            get("model.norm.weight"),
            frozen(get("lm_head.weight"), false),
            DType::F32,
        )
        .unwrap()
    }

    const PROMPT: [u32; 5] = [1, 17, 42, 9, 77];

    fn greedy_like() -> SamplingConfig {
        SamplingConfig {
            top_k: 1,
            ..Default::default()
        }
    }

    fn sampled() -> SamplingConfig {
        SamplingConfig {
            temperature: 1.3,
            top_p: 0.95,
            repetition_penalty: 1.1,
            ..Default::default()
        }
    }

    /// (a) With top_k = 1 every row is `generate`'s greedy output (plus the EOS it keeps), on a dense and an NF4
    /// model, and on a sliding-window model whose completions outgrow the window.
    #[test]
    fn top_k_one_rows_equal_greedy_generate() {
        for (folder, nf4) in [
            ("tiny-llama", false),
            ("tiny-llama", true),
            ("tiny-mistral-sw", false),
        ] {
            let model = tiny(folder, nf4);
            let eos = [2];
            let greedy = GenerationConfig {
                eos_token_ids: Some(eos.to_vec()),
                ..GenerationConfig::greedy(24)
            };
            let want = generate(&model, &PROMPT, &greedy, |_| Ok(())).unwrap();
            let rows = generate_group(&model, &PROMPT, 4, 24, &greedy_like(), &eos, 3).unwrap();
            assert_eq!(rows.len(), 4);
            for row in rows {
                let mut expected = want.clone();
                if want.len() < 24 {
                    expected.push(2);
                }
                assert_eq!(row.ids, expected, "{folder} nf4={nf4}");
                assert_eq!(row.truncated, want.len() == 24);
            }
        }
    }

    /// (b) The same seed gives the same completions; another seed, others.
    #[test]
    fn seed_decides_the_completions() {
        let model = tiny("tiny-llama", false);
        let run = |seed| generate_group(&model, &PROMPT, 4, 10, &sampled(), &[], seed).unwrap();
        let a = run(11);
        assert_eq!(a, run(11));
        assert_ne!(a, run(12));
        // The rows of one group differ from each other (each its own draws).
        assert_ne!(a[0].ids, a[1].ids);
    }

    /// (c) A row stops at an EOS token (kept, not truncated) or at the limit (truncated).
    #[test]
    fn rows_stop_at_eos_or_at_the_limit() {
        let model = tiny("tiny-llama", false);
        let free = generate_group(&model, &PROMPT, 2, 8, &greedy_like(), &[], 0).unwrap();
        for row in &free {
            assert_eq!(row.ids.len(), 8);
            assert!(row.truncated);
        }
        let g = &free[0].ids;
        let stop = g[3];
        let end = g.iter().position(|&t| t == stop).unwrap();
        let stopped = generate_group(&model, &PROMPT, 3, 8, &greedy_like(), &[stop], 0).unwrap();
        for row in &stopped {
            assert_eq!(row.ids, g[..=end].to_vec());
            assert!(!row.truncated);
        }
        // Sampled, with several EOS tokens: each row ends with its first EOS, or runs to the limit without one.
        let eos: Vec<u32> = (0..128).step_by(9).collect();
        let rows = generate_group(&model, &PROMPT, 8, 12, &sampled(), &eos, 5).unwrap();
        for row in &rows {
            let first_eos = row.ids.iter().position(|t| eos.contains(t));
            match row.truncated {
                true => assert_eq!((row.ids.len(), first_eos), (12, None)),
                false => assert_eq!(first_eos, Some(row.ids.len() - 1)),
            }
        }
        assert!(rows.iter().any(|r| r.truncated) && rows.iter().any(|r| !r.truncated));
    }

    /// (d) Row r's completion does not depend on the group's size, though rows leave the batch at different steps.
    #[test]
    fn a_row_is_the_same_in_any_group() {
        for folder in ["tiny-llama", "tiny-mistral-sw"] {
            let model = tiny(folder, false);
            let eos: Vec<u32> = (0..128).step_by(7).collect();
            let run = |n| generate_group(&model, &PROMPT, n, 16, &sampled(), &eos, 21).unwrap();
            let six = run(6);
            let mut lengths: Vec<usize> = six.iter().map(|r| r.ids.len()).collect();
            lengths.dedup();
            assert!(lengths.len() > 1, "{folder}: every row stopped together");
            assert_eq!(run(4), six[..4].to_vec(), "{folder}");
            assert_eq!(run(1), six[..1].to_vec(), "{folder}");
        }
    }

    #[test]
    fn group_settings_are_checked() {
        let model = tiny("tiny-llama", false);
        let err = |n, max, prompt: &[u32], s: &SamplingConfig| {
            generate_group(&model, prompt, n, max, s, &[], 0)
                .unwrap_err()
                .to_string()
        };
        assert!(err(0, 4, &PROMPT, &sampled()).contains("n = 0"));
        assert!(err(2, 0, &PROMPT, &sampled()).contains("max_new_tokens = 0"));
        assert!(err(2, 4, &[], &sampled()).contains("no tokens"));
        let hot = SamplingConfig {
            temperature: 0.0,
            ..Default::default()
        };
        assert!(err(2, 4, &PROMPT, &hot).contains("temperature = 0"));
        // The context bounds the completions: 250 prompt tokens leave 6 positions of 256.
        let long: Vec<u32> = (0..250).map(|i| i % 128).collect();
        let rows = generate_group(&model, &long, 2, 20, &sampled(), &[], 0).unwrap();
        assert!(rows.iter().all(|r| r.ids.len() == 6 && r.truncated));
    }
}
