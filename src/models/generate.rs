//! Text generation with a KV cache: greedy, temperature, top-k and top-p sampling through candle-transformers'
//! `LogitsProcessor`, streaming each token as it comes, stopping at an end-of-sequence token. Each step runs in
//! inference mode ([`crate::ops::frozen_linear::InferenceMode`], through [`LlamaModel::forward_cached`]): 4-bit
//! weights on the CPU are multiplied by in place rather than dequantized per token.

use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::llama::{KvCache, LlamaModel};
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
