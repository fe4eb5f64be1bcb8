//! GRPO's generation half, timed: G = 8 sampled completions of 64 tokens of one prompt, decoded as one batch by
//! `generate_group` (the prompt once, its KV cache repeated to 8 rows), against the same 8 completions generated one
//! at a time by `generate`, in the same run on the same NF4 model, and the ratio of their tokens per second.
//!
//! ```text
//! cargo run --release --example grpo_generation_speed [-- --model FILE.gguf|MODEL_DIR] [--rounds N]
//! ```
//! Model: `--model` if given, else the SmolLM2-135M-Instruct GGUF `scripts/fetch-test-model.sh` caches, else the
//! tiny random Llama of `tests/data/models/tiny-llama` (it says which); quantized to NF4 on load, float32 compute,
//! on the CPU. Both sides sample at temperature 1 with no filtering (TRL's defaults) and ignore end-of-sequence
//! tokens, so each makes exactly 8 × 64 tokens; tokens/s = those tokens / wall seconds of the calls (prompt
//! included). After one short warm-up of each, the rounds alternate the two, and the medians are printed.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_qlora::loading::{cached_test_model, load_model, LoadOptions};
use candle_qlora::models::{
    generate, generate_group, ChatMessage, GenerationConfig, LlamaModel, SamplingConfig,
};
use candle_qlora::quant::QuantConfig;

const GROUP: usize = 8;
const NEW_TOKENS: usize = 64;
const QUESTION: &str = "Write a short poem about the sea and the city at night.";

/// The prompt's ids: the question in the chat template where the tokenizer has one, else as plain text, else (no
/// tokenizer) a fixed row of ids.
fn prompt_ids(loaded: &candle_qlora::loading::LoadedModel) -> Result<Vec<u32>> {
    let Ok(tok) = loaded.tokenizer() else {
        return Ok((1..24).collect());
    };
    let text = match tok.chat_template {
        Some(_) => tok.apply_chat_template(
            &[ChatMessage {
                role: "user".into(),
                content: QUESTION.into(),
            }],
            true,
        )?,
        None => QUESTION.into(),
    };
    Ok(tok.encode(&text, false)?)
}

/// Seconds of one group of `n` completions of `tokens` tokens by `generate_group`.
fn time_group(
    model: &LlamaModel,
    prompt: &[u32],
    n: usize,
    tokens: usize,
    seed: u64,
) -> Result<f64> {
    let start = Instant::now();
    let rows = generate_group(
        model,
        prompt,
        n,
        tokens,
        &SamplingConfig::default(),
        &[],
        seed,
    )?;
    let secs = start.elapsed().as_secs_f64();
    if rows.iter().any(|r| r.ids.len() != tokens) {
        bail!("a group completion is not {tokens} tokens long");
    }
    Ok(secs)
}

/// Seconds of `n` completions of `tokens` tokens by `generate`, one after another.
fn time_one_by_one(
    model: &LlamaModel,
    prompt: &[u32],
    n: usize,
    tokens: usize,
    seed: u64,
) -> Result<f64> {
    let start = Instant::now();
    for i in 0..n {
        let config = GenerationConfig {
            temperature: 1.0,
            seed: seed + i as u64,
            eos_token_ids: Some(vec![]),
            ..GenerationConfig::greedy(tokens)
        };
        let out = generate(model, prompt, &config, |_| Ok(()))?;
        if out.len() != tokens {
            bail!("a completion is {} tokens, not {tokens}", out.len());
        }
    }
    Ok(start.elapsed().as_secs_f64())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut model = None;
    let mut rounds = 3usize;
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.next()) {
            ("--model", Some(v)) => model = Some(v.clone()),
            ("--rounds", Some(v)) => rounds = v.parse().context("--rounds")?,
            _ => bail!("usage: grpo_generation_speed [--model FILE.gguf|MODEL_DIR] [--rounds N]"),
        }
    }
    let (spec, which) = match model {
        Some(m) => (m.clone(), m),
        None => match cached_test_model() {
            Some(p) => (
                p.display().to_string(),
                format!("{} (the test model)", p.display()),
            ),
            None => {
                let tiny = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/models/tiny-llama");
                (
                    tiny.to_string(),
                    format!(
                        "{tiny} (a tiny random Llama: no cached test model; scripts/fetch-test-model.sh fetches it)"
                    ),
                )
            }
        },
    };
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        compute_dtype: DType::F32,
        ..Default::default()
    };
    let loaded = load_model(&spec, None, &opts)?;
    let prompt = prompt_ids(&loaded)?;
    let model = &loaded.model;
    println!("model: {which}, NF4, float32 compute, CPU");
    println!(
        "prompt: {} tokens; {GROUP} completions of {NEW_TOKENS} tokens (temperature 1, EOS ignored), {} threads",
        prompt.len(),
        rayon::current_num_threads()
    );
    time_group(model, &prompt, GROUP, 2, 999)?;
    time_one_by_one(model, &prompt, 1, 2, 999)?;
    let tokens = (GROUP * NEW_TOKENS) as f64;
    let (mut group, mut single, mut ratios) = (vec![], vec![], vec![]);
    for round in 0..rounds {
        let seed = 1000 * round as u64;
        let g = tokens / time_group(model, &prompt, GROUP, NEW_TOKENS, seed)?;
        let s = tokens / time_one_by_one(model, &prompt, GROUP, NEW_TOKENS, seed)?;
        println!(
            "round {}: generate_group {g:8.1} tokens/s   generate one at a time {s:8.1} tokens/s   ratio {:.2}",
            round + 1,
            g / s
        );
        group.push(g);
        single.push(s);
        ratios.push(g / s);
    }
    println!(
        "median of {rounds}: generate_group {:.1} tokens/s, generate one at a time {:.1} tokens/s, ratio {:.2}",
        median(group),
        median(single),
        median(ratios)
    );
    Ok(())
}
