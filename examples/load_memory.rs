//! Peak resident memory of loading a model as NF4 (quantized on load, one tensor at a time) versus unquantized
//! f32, each measured in a fresh child process of this example, side by side in one run.
//!
//! ```text
//! cargo run --release --example load_memory [-- --model FILE.gguf|MODEL_DIR]
//! ```
//! Defaults to the SmolLM2-135M test model cached by `scripts/fetch-test-model.sh`. Linux only (reads VmHWM).

use std::process::Command;

use anyhow::{bail, Context, Result};
use candle_qlora::loading::{cached_test_model, load_model, LoadOptions};
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
        [] => cached_test_model()
            .context("no --model and no cached test model: run scripts/fetch-test-model.sh")?
            .display()
            .to_string(),
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
    Ok(())
}
