//! Peak resident memory of a GGUF export that streams: a Llama-2-7B-shaped model (13 GB of bf16 weights) with a
//! QLoRA adapter on every linear layer, merged into its 4-bit base and written as `q4_k_m`, the linear weights read
//! from their files one at a time (`LoadOptions::defer_linear_weights`, what `qlora export` loads).
//!
//! ```text
//! cargo run --release --example export_memory [-- --quant TYPE]
//! ```
//! It writes (once, into `target/export-memory-7b/`) the model — hidden 4096, 32 layers, 32 heads, MLP 11008,
//! vocabulary 32000, an untied head — as 33 bf16 safetensors shards with random weights, then exports it to
//! `target/export-memory-7b.gguf` and prints the peak resident set above the baseline, the files' sizes and the
//! time. Linux only (reads VmHWM). It needs about 18 GB of disk.

#[path = "common/random_weights.rs"]
mod random_weights;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use candle_qlora::adapter::Adapters;
use candle_qlora::export::{gguf, GgufOptions, Quantization};
use candle_qlora::files::{write_safetensors, RawTensor};
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::memory::process_memory;
use candle_qlora::quant::QuantConfig;

/// Peak resident set size of this process in bytes (`VmHWM`).
fn peak_rss() -> Result<u64> {
    process_memory()
        .peak_rss
        .context("no peak resident set size (Linux /proc only)")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quant: Quantization = match args.as_slice() {
        [flag, q] if flag == "--quant" => q.parse().map_err(anyhow::Error::msg)?,
        [] => Quantization::Q4KM,
        _ => anyhow::bail!("usage: export_memory [--quant TYPE]"),
    };
    let folder = seven_b_folder()?;
    let files: u64 = std::fs::read_dir(&folder)?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().extension().is_some_and(|x| x == "safetensors"))
        .map(|e| e.metadata().map_or(0, |m| m.len()))
        .sum();
    let baseline = peak_rss()?;
    let start = std::time::Instant::now();
    let options = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        defer_linear_weights: true,
        ..Default::default()
    };
    let mut model = load_model(folder.to_str().unwrap(), None, &options)?.model;
    let lora = LoraConfig {
        r: 16,
        lora_alpha: 32.0,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    model.add_adapter("default", &lora, 7)?;
    // B starts at zero: random values make the merge change every weight, as a trained adapter does.
    for (name, var) in model.adapter_parameters("default")? {
        if name.contains("lora_B") {
            var.set(&Tensor::randn(0f32, 0.01, var.shape(), &Device::Cpu)?)?;
        }
    }
    let loaded = start.elapsed().as_secs_f64();
    let output = folder.with_extension("gguf");
    let report = gguf(
        &model,
        &folder,
        &output,
        &GgufOptions {
            quant,
            tokenizer_pre: Some("default".into()),
            adapter_only: false,
            ollama: false,
            overwrite: true,
            progress: true,
        },
    )?;
    let peak = peak_rss()?;
    println!(
        "model: {} ({:.1} MiB of bf16 safetensors)",
        folder.display(),
        mib(files)
    );
    println!(
        "exported {} tensors ({} adapted) to {} in {}: {:.1} MiB",
        report.tensors,
        report.adapted_modules,
        output.display(),
        quant.name(),
        mib(report.bytes)
    );
    println!(
        "load {loaded:.1} s, export {:.1} s; peak resident {:.1} MiB above a baseline of {:.1} MiB ({:.3}× the files)",
        start.elapsed().as_secs_f64() - loaded,
        mib(peak - baseline),
        mib(baseline),
        (peak - baseline) as f64 / files as f64
    );
    Ok(())
}

/// A Llama-2-7B-shaped folder with random bf16 weights (a shard for the embeddings and head, one per layer, and
/// the index), written once into `target/export-memory-7b/`.
fn seven_b_folder() -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/export-memory-7b");
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        return Ok(dir);
    }
    let (hidden, inter, layers, heads, vocab) = (4096, 11008, 32, 32, 32000);
    std::fs::create_dir_all(&dir)?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": heads, "vocab_size": vocab, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 4096, "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2,
        "torch_dtype": "bfloat16"
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/models/tiny-llama/tokenizer.json"),
        dir.join("tokenizer.json"),
    )?;
    let mut shards: Vec<Vec<(String, Vec<usize>)>> = vec![vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("lm_head.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
    ]];
    for l in 0..layers {
        shards.push(random_weights::llama_layer_shapes(l, hidden, hidden, inter));
    }
    eprintln!("writing a 7B-shaped bf16 model to {} (once)", dir.display());
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut weight_map = serde_json::Map::new();
    let count = shards.len();
    for (i, shard) in shards.into_iter().enumerate() {
        let file = format!("model-{:05}-of-{count:05}.safetensors", i + 1);
        let tensors: Vec<(String, RawTensor)> = shard
            .into_iter()
            .map(|(name, shape)| {
                weight_map.insert(name.clone(), file.clone().into());
                let raw = random_weights::random_bf16_tensor(&mut state, &name, shape);
                (name, raw)
            })
            .collect();
        write_safetensors(&dir.join(&file), tensors, None)?;
    }
    let index_json = serde_json::json!({ "metadata": {}, "weight_map": weight_map });
    std::fs::write(&index, serde_json::to_string_pretty(&index_json)?)?;
    Ok(dir)
}
