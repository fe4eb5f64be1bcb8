//! Quantizes every linear weight of a model to NF4 (double quantization, blocksize 64) exactly as bitsandbytes
//! would, and reports what it costs and what it loses.
//!
//! ```text
//! cargo run --release --example quantize_model [-- --model FILE.gguf|FILE.safetensors|MODEL_DIR]
//! ```
//! Without `--model` it uses the SmolLM2-135M test model cached by `scripts/fetch-test-model.sh`, and if that is
//! not there, an embedded Llama-shaped set of random weights.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use candle_qlora::files::{candle_float_dtype, view_to_f32, MappedSafetensors};
use candle_qlora::loading::bnb::is_quantizable_linear;
use candle_qlora::loading::cached_test_model;
use candle_qlora::quant::{Nf4Tensor, QuantConfig, QuantType};

/// One weight to quantize: name, shape, float32 values.
struct Weight {
    name: String,
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// GGUF linear weights (`blk.N.*.weight`, 2-D), dequantized from their GGUF type to f32.
fn gguf_weights(path: &Path) -> Result<Vec<Weight>> {
    let mut file =
        std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let content = gguf_file::Content::read(&mut file)
        .with_context(|| format!("reading GGUF {}", path.display()))?;
    let mut names: Vec<&String> = content
        .tensor_infos
        .iter()
        .filter(|(name, info)| {
            name.starts_with("blk.") && name.ends_with(".weight") && info.shape.dims().len() == 2
        })
        .map(|(name, _)| name)
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let t = content
                .tensor(&mut file, name, &Device::Cpu)?
                .dequantize(&Device::Cpu)?;
            Ok(Weight {
                name: name.clone(),
                shape: t.dims().to_vec(),
                values: t.flatten_all()?.to_vec1()?,
            })
        })
        .collect()
}

/// Linear weights of a safetensors file or of every `*.safetensors` in a folder.
fn safetensors_weights(path: &Path) -> Result<Vec<Weight>> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut f: Vec<PathBuf> = std::fs::read_dir(path)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        f.sort();
        f
    } else {
        vec![path.to_path_buf()]
    };
    let mut out = vec![];
    for f in files {
        let file = MappedSafetensors::open(&f)?;
        let st = file.tensors()?;
        for (name, view) in st.iter() {
            if candle_float_dtype(view.dtype()).is_some()
                && is_quantizable_linear(name, view.shape())
            {
                out.push(Weight {
                    name: name.into(),
                    shape: view.shape().to_vec(),
                    values: view_to_f32(&view).unwrap_or_default(),
                });
            }
        }
    }
    Ok(out)
}

/// Llama-shaped random weights (4 layers, hidden 512, MLP 1408), for when no model is at hand.
fn embedded_weights() -> Result<Vec<Weight>> {
    let (hidden, mlp) = (512, 1408);
    let mut out = vec![];
    for layer in 0..4 {
        for (name, shape) in [
            ("self_attn.q_proj", [hidden, hidden]),
            ("self_attn.k_proj", [hidden / 4, hidden]),
            ("self_attn.v_proj", [hidden / 4, hidden]),
            ("self_attn.o_proj", [hidden, hidden]),
            ("mlp.gate_proj", [mlp, hidden]),
            ("mlp.up_proj", [mlp, hidden]),
            ("mlp.down_proj", [hidden, mlp]),
        ] {
            let t = Tensor::randn(0f32, 0.02, (shape[0], shape[1]), &Device::Cpu)?;
            out.push(Weight {
                name: format!("model.layers.{layer}.{name}.weight"),
                shape: shape.to_vec(),
                values: t.flatten_all()?.to_vec1()?,
            });
        }
    }
    Ok(out)
}

/// ||w - dequant(quant(w))|| / ||w||.
fn relative_error(w: &Weight, q: &Nf4Tensor) -> Result<f64> {
    let mut back = vec![0f32; w.values.len()];
    q.dequantize_into(&mut back)?;
    let (mut err, mut norm) = (0f64, 0f64);
    for (a, b) in w.values.iter().zip(&back) {
        err += ((a - b) as f64).powi(2);
        norm += (*a as f64).powi(2);
    }
    Ok((err / norm.max(f64::MIN_POSITIVE)).sqrt())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let model = match args.as_slice() {
        [flag, path] if flag == "--model" => Some(PathBuf::from(path)),
        [] => None,
        _ => bail!("usage: quantize_model [--model FILE.gguf|FILE.safetensors|MODEL_DIR]"),
    };
    let (source, weights) = match model.or_else(cached_test_model) {
        Some(p) if p.extension().is_some_and(|e| e == "gguf") => {
            (format!("GGUF {}", p.display()), gguf_weights(&p)?)
        }
        Some(p) => (
            format!("safetensors {}", p.display()),
            safetensors_weights(&p)?,
        ),
        None => (
            "embedded random Llama-shaped weights (no --model, no cached test model)".into(),
            embedded_weights()?,
        ),
    };
    if weights.is_empty() {
        bail!("no linear weights found in {source}");
    }
    println!("model: {source}");
    let config = QuantConfig::nf4();
    let (mut params, mut bytes, mut err_sum) = (0usize, 0usize, 0f64);
    let start = Instant::now();
    let mut quant_time = 0f64;
    for w in &weights {
        let t = Instant::now();
        let q = Nf4Tensor::quantize_values(&w.values, &w.shape, DType::BF16, &config, &w.name)?;
        quant_time += t.elapsed().as_secs_f64();
        params += q.elem_count();
        bytes += q.size_in_bytes();
        err_sum += relative_error(w, &q)?;
    }
    println!(
        "quantized {} linear weights, {:.1}M parameters, to NF4 + double quant (blocksize 64) in {:.2} s ({:.0}M params/s, {} threads)",
        weights.len(),
        params as f64 / 1e6,
        quant_time,
        params as f64 / 1e6 / quant_time,
        rayon::current_num_threads()
    );
    println!(
        "size: {:.1} MiB as bf16 -> {:.1} MiB ({:.3} bits/parameter); mean relative RMS error {:.4}",
        params as f64 * 2.0 / (1 << 20) as f64,
        bytes as f64 / (1 << 20) as f64,
        bytes as f64 * 8.0 / params as f64,
        err_sum / weights.len() as f64
    );
    let first = &weights[0];
    println!(
        "\ncodebook comparison on `{}` {:?}:",
        first.name, first.shape
    );
    println!(
        "{:<24} {:>12} {:>16}",
        "format", "bits/param", "relative error"
    );
    for (label, cfg) in [
        ("nf4 + double quant", QuantConfig::nf4()),
        (
            "nf4",
            QuantConfig {
                double_quant: false,
                ..QuantConfig::nf4()
            },
        ),
        (
            "fp4 + double quant",
            QuantConfig {
                quant_type: QuantType::Fp4,
                ..QuantConfig::nf4()
            },
        ),
        (
            "nf4, blocksize 256",
            QuantConfig {
                blocksize: 256,
                ..QuantConfig::nf4()
            },
        ),
    ] {
        let q = Nf4Tensor::quantize_values(
            &first.values,
            &first.shape,
            DType::BF16,
            &cfg,
            &first.name,
        )?;
        println!(
            "{label:<24} {:>12.3} {:>16.4}",
            q.bits_per_parameter(),
            relative_error(first, &q)?
        );
    }
    println!("\ndone in {:.1} s", start.elapsed().as_secs_f64());
    Ok(())
}
