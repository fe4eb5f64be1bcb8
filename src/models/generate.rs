//! Text generation with a KV cache: greedy, temperature, top-k and top-p sampling through candle-transformers'
//! `LogitsProcessor`, streaming each token as it comes, stopping at an end-of-sequence token.

use candle_core::{Device, Tensor};
use candle_transformers::generation::{LogitsProcessor, Sampling};

use super::llama::{KvCache, LlamaModel};
use crate::error::Result;

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
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
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
            eos_token_ids: vec![],
        }
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
pub fn generate(
    model: &LlamaModel,
    prompt_ids: &[u32],
    config: &GenerationConfig,
    mut on_token: impl FnMut(u32) -> Result<()>,
) -> Result<Vec<u32>> {
    let device = Device::Cpu;
    let mut processor = LogitsProcessor::from_sampling(config.seed, config.sampling());
    let mut cache = KvCache::new(model.layers.len());
    let mut out = Vec::new();
    let mut input = Tensor::new(prompt_ids, &device)?.unsqueeze(0)?;
    for _ in 0..config.max_new_tokens {
        let logits = model.forward_cached(&input, &mut cache)?.squeeze(0)?;
        let next = processor.sample(&logits)?;
        if config.eos_token_ids.contains(&next) {
            break;
        }
        out.push(next);
        on_token(next)?;
        input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
    }
    Ok(out)
}
