//! Peak resident memory of loading a model as NF4 (quantized on load, one tensor at a time, each tensor's file pages
//! released once read) versus unquantized f32, each measured in a fresh child process of this example, side by side
//! in one run, and compared with the size of the model's files.
//!
//! ```text
//! cargo run --release --example load_memory [-- --model FILE.gguf|MODEL_DIR]
//! ```
//! Without `--model`, it writes (once, into `target/load-memory-1b/`) a folder shaped like Llama-3.2-1B — bf16
//! safetensors with random weights, 2.5 GB — and measures that. Linux only (reads VmHWM).

#[path = "common/random_weights.rs"]
mod random_weights;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::memory::process_memory;
use candle_qlora::quant::QuantConfig;

/// Peak resident set size of this process in bytes (`VmHWM`).
fn peak_rss() -> Result<u64> {
    process_memory()
        .peak_rss
        .context("no peak resident set size (Linux /proc only)")
}

fn child(model: &str, mode: &str) -> Result<()> {
    let before = peak_rss()?;
    let quantization = match mode {
        "nf4" => Some(QuantConfig::nf4()),
        "f32" => None,
        other => bail!("unknown mode {other}"),
    };
    let start = std::time::Instant::now();
    let loaded = load_model(
        model,
        None,
        &LoadOptions {
            quantization,
            ..Default::default()
        },
    )?;
    println!(
        "{mode} {} {} {} {:.2}",
        before,
        peak_rss()?,
        loaded.model.weight_bytes(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, model, mode] = args.as_slice() {
        if flag == "--child" {
            return child(model, mode);
        }
    }
    let model = match args.as_slice() {
        [flag, m] if flag == "--model" => m.clone(),
        [] => one_b_folder()?.display().to_string(),
        _ => bail!("usage: load_memory [--model FILE.gguf|MODEL_DIR]"),
    };
    println!("model: {model}");
    println!(
        "{:<6} {:>14} {:>16} {:>14} {:>8}",
        "load", "peak RSS MiB", "(- baseline) MiB", "weights MiB", "seconds"
    );
    let mut peaks = vec![];
    for mode in ["f32", "nf4"] {
        let out = Command::new(std::env::current_exe()?)
            .args(["--child", &model, mode])
            .output()?;
        if !out.status.success() {
            bail!("child failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let f: Vec<&str> = text.split_whitespace().collect();
        let (base, peak, weights): (f64, f64, f64) = (f[1].parse()?, f[2].parse()?, f[3].parse()?);
        let mib = |x: f64| x / (1 << 20) as f64;
        println!(
            "{mode:<6} {:>14.1} {:>16.1} {:>14.1} {:>8}",
            mib(peak),
            mib(peak - base),
            mib(weights),
            f[4]
        );
        peaks.push(peak - base);
    }
    println!(
        "NF4 load peak / f32 load peak (above baseline): {:.2}",
        peaks[1] / peaks[0]
    );
    let files = model_file_bytes(Path::new(&model)) as f64;
    println!(
        "NF4 load peak (above baseline) / model files ({:.1} MiB): {:.2}",
        files / (1 << 20) as f64,
        peaks[1] / files
    );
    Ok(())
}

/// Bytes of the model's weight files: a file's size, or a folder's `*.safetensors`.
fn model_file_bytes(model: &Path) -> u64 {
    let size = |p: &Path| std::fs::metadata(p).map_or(0, |m| m.len());
    if model.is_file() {
        return size(model);
    }
    std::fs::read_dir(model)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .map(|p| size(&p))
        .sum()
}

/// A Llama-3.2-1B-shaped folder (hidden 2048, 16 layers, 32/8 heads, MLP 8192, vocabulary 128 256, tied head) with
/// random bf16 weights, written once into `target/load-memory-1b/`.
fn one_b_folder() -> Result<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/load-memory-1b");
    let weights = dir.join("model.safetensors");
    if weights.exists() {
        return Ok(dir);
    }
    let (hidden, inter, layers, heads, kv_heads, vocab) = (2048, 8192, 16, 32, 8, 128_256);
    let head_dim = hidden / heads;
    std::fs::create_dir_all(&dir)?;
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": true,
        "bos_token_id": 128000, "eos_token_id": 128001, "torch_dtype": "bfloat16"
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![vocab, hidden]),
        ("model.norm.weight".into(), vec![hidden]),
    ];
    for l in 0..layers {
        shapes.extend(random_weights::llama_layer_shapes(
            l,
            hidden,
            kv_heads * head_dim,
            inter,
        ));
    }
    eprintln!("writing a 1B-shaped bf16 model to {} (once)", dir.display());
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let tensors = shapes.into_iter().map(|(name, shape)| {
        let raw = random_weights::random_bf16_tensor(&mut state, &name, shape);
        (name, raw)
    });
    candle_qlora::files::write_safetensors(&weights, tensors, None)?;
    Ok(dir)
}
