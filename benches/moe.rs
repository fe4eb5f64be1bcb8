//! A QLoRA training step (forward + backward) of a top-2-of-8 mixture-of-experts model against a dense model with
//! the same active parameters, on the same tokens, timed alternately in one run.
//!
//! Both are 4-layer Llama-shaped models (hidden 384, 6 heads of 64, vocabulary 2048) loaded from folders this
//! bench writes, NF4 on load, LoRA r = 16 on every projection a token passes through. The dense one has a gated
//! MLP of width 2048; the mixture (`mixtral`) has 8 experts of width 1024 and a router, each token going to 2: per
//! token the same multiply-adds, plus the router (8 × 384) and the grouping of tokens by expert. The MLPs are
//! most of each layer's work, so the ratio shows what routing costs. Target: the mixture's step within 1.5× the
//! dense one's.
//!
//! `cargo bench --bench moe`

use std::collections::HashMap;
use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use candle_qlora::adapter::Adapters;
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::models::{Checkpointing, LlamaModel, Positions};
use candle_qlora::quant::QuantConfig;
use criterion::Criterion;

mod common;
use common::interleaved;

const HIDDEN: usize = 384;
const LAYERS: usize = 4;
const VOCAB: usize = 2048;
const EXPERTS: usize = 8;
const TOP_K: usize = 2;
const EXPERT_WIDTH: usize = 1024;
const BATCH: usize = 2;
const SEQ: usize = 256;

fn randn(dims: &[usize]) -> Tensor {
    Tensor::randn(0f32, 0.02, dims, &Device::Cpu).unwrap()
}

/// Writes a random model of `model_type` (`llama` with an MLP of `intermediate` width, or `mixtral` with
/// [`EXPERTS`] experts of that width) to `dir`, in the Hub's layout.
fn write_model(dir: &Path, model_type: &str, intermediate: usize) {
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "model_type": model_type, "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": intermediate,
        "num_hidden_layers": LAYERS, "num_attention_heads": 6, "num_key_value_heads": 6,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
        "num_local_experts": EXPERTS, "num_experts_per_tok": TOP_K,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut w: HashMap<String, Tensor> = HashMap::new();
    w.insert("model.embed_tokens.weight".into(), randn(&[VOCAB, HIDDEN]));
    w.insert("lm_head.weight".into(), randn(&[VOCAB, HIDDEN]));
    let ones = Tensor::ones(HIDDEN, DType::F32, &Device::Cpu).unwrap();
    w.insert("model.norm.weight".into(), ones.clone());
    for l in 0..LAYERS {
        let p = format!("model.layers.{l}");
        for n in ["input_layernorm", "post_attention_layernorm"] {
            w.insert(format!("{p}.{n}.weight"), ones.clone());
        }
        for n in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            w.insert(
                format!("{p}.self_attn.{n}.weight"),
                randn(&[HIDDEN, HIDDEN]),
            );
        }
        let mut mlp = |prefix: &str, names: [&str; 3]| {
            w.insert(
                format!("{prefix}.{}.weight", names[0]),
                randn(&[intermediate, HIDDEN]),
            );
            w.insert(
                format!("{prefix}.{}.weight", names[1]),
                randn(&[intermediate, HIDDEN]),
            );
            w.insert(
                format!("{prefix}.{}.weight", names[2]),
                randn(&[HIDDEN, intermediate]),
            );
        };
        if model_type == "mixtral" {
            for e in 0..EXPERTS {
                mlp(
                    &format!("{p}.block_sparse_moe.experts.{e}"),
                    ["w1", "w3", "w2"],
                );
            }
            w.insert(
                format!("{p}.block_sparse_moe.gate.weight"),
                randn(&[EXPERTS, HIDDEN]),
            );
        } else {
            mlp(&format!("{p}.mlp"), ["gate_proj", "up_proj", "down_proj"]);
        }
    }
    candle_core::safetensors::save(&w, dir.join("model.safetensors")).unwrap();
}

/// The model in `dir`, NF4, with a LoRA adapter (r = 16) on every linear layer, every expert and the router.
fn load(dir: &Path) -> LlamaModel {
    let options = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        compute_dtype: DType::F32,
        ..Default::default()
    };
    let mut model = load_model(dir.to_str().unwrap(), None, &options)
        .unwrap()
        .model;
    let lora = LoraConfig {
        r: 16,
        lora_alpha: 32.0,
        target_modules: Some(TargetModules::AllLinear),
        target_parameters: Some(vec![
            "mlp.gate.weight".into(),
            "mlp.experts.gate_up_proj".into(),
            "mlp.experts.down_proj".into(),
        ]),
        ..Default::default()
    };
    model.add_adapter("default", &lora, 0).unwrap();
    model
}

/// One training step's forward and backward of `model` on `ids` (gradient checkpointing on, as QLoRA runs).
fn step(model: &LlamaModel, ids: &Tensor) {
    let labels = ids.to_dtype(DType::I64).unwrap();
    let checkpointing = Checkpointing {
        enabled: true,
        ..Default::default()
    };
    let (sum, _) = model
        .loss_sum(ids, &labels, &Positions::Range(0), &checkpointing)
        .unwrap();
    black_box(sum.backward().unwrap());
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let (moe_dir, dense_dir) = (dir.path().join("moe"), dir.path().join("dense"));
    write_model(&moe_dir, "mixtral", EXPERT_WIDTH);
    write_model(&dense_dir, "llama", TOP_K * EXPERT_WIDTH);
    let (moe, dense) = (load(&moe_dir), load(&dense_dir));
    let ids: Vec<u32> = (0..BATCH * SEQ)
        .map(|i| ((i * 104_729) % VOCAB) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (BATCH, SEQ), &Device::Cpu).unwrap();
    let (moe_step, dense_step) = (|| step(&moe, &ids), || step(&dense, &ids));

    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(10))
        .configure_from_args();
    let mut group = c.benchmark_group("qlora_step");
    group.bench_function("moe_top2_of_8", |b| b.iter(moe_step));
    group.bench_function("dense_same_active", |b| b.iter(dense_step));
    group.finish();

    let (moe_s, dense_s, ratio) = interleaved(&moe_step, &dense_step);
    println!(
        "\n| step ({BATCH} × {SEQ} tokens, forward + backward) | MoE ms | dense ms | MoE / dense |"
    );
    println!("|---|---:|---:|---:|");
    println!(
        "| top-{TOP_K}-of-{EXPERTS} vs dense, same active parameters | {:.0} | {:.0} | {ratio:.2} |",
        moe_s * 1e3,
        dense_s * 1e3
    );
}
