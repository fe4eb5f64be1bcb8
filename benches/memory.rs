//! Predicted vs measured training memory on SmolLM2-135M (CPU): for six configurations (micro-batch, sequence,
//! checkpointing, NF4 or float32 base) one training step runs under the tracking allocator, and its peak heap bytes
//! (the trainer's memory timeline) are compared with `memory::estimate` — within ±15% is the target. It also shows
//! what gradient checkpointing saves at batch 4 × 512 tokens (target: at most half the activations).
//!
//! ```text
//! scripts/fetch-test-model.sh && cargo bench --bench memory
//! ```

use candle_core::DType;
use candle_qlora::data::TokenizedExample;
use candle_qlora::loading::{cached_test_model, load_model, load_model_config, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::memory::{estimate, human_bytes, DeviceKind, EstimateArgs};
use candle_qlora::optim::OptimizerName;
use candle_qlora::quant::QuantConfig;
use candle_qlora::trainer::{IntervalStrategy, Trainer, TrainingArguments};

#[global_allocator]
static ALLOCATOR: candle_qlora::memory::TrackingAllocator = candle_qlora::memory::TrackingAllocator;

/// Full rows of `seq` token ids (every label counted).
fn rows(n: usize, seq: usize) -> Vec<TokenizedExample> {
    (0..n)
        .map(|r| {
            let ids: Vec<u32> = (0..seq)
                .map(|i| (1000 + (r * 7919 + i * 104_729) % 40_000) as u32)
                .collect();
            TokenizedExample::learning_every_token(ids)
        })
        .collect()
}

/// Measured peak heap bytes and activation bytes of one step.
fn measure(model_path: &str, args: &EstimateArgs) -> (u64, u64) {
    let opts = LoadOptions {
        quantization: args.quantize.then(QuantConfig::nf4),
        compute_dtype: DType::F32,
        ..Default::default()
    };
    let model = load_model(model_path, None, &opts).expect("model").model;
    let dir = tempfile::tempdir().expect("tempdir");
    let training = TrainingArguments {
        output_dir: dir.path().display().to_string(),
        per_device_train_batch_size: args.batch,
        max_steps: 1,
        optim: args.optim,
        gradient_checkpointing: args.gradient_checkpointing,
        activation_memory_budget_mib: args.activation_memory_budget_mib,
        save_strategy: IntervalStrategy::No,
        disable_tqdm: true,
        ..Default::default()
    };
    let lora = LoraConfig {
        r: args.lora_r,
        lora_alpha: 2.0 * args.lora_r as f64,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    let mut trainer =
        Trainer::new(model, training, &lora, rows(args.batch, args.seq), vec![]).expect("trainer");
    trainer.set_base_model_name(model_path);
    trainer.train(None).expect("train");
    let text = std::fs::read_to_string(dir.path().join("memory_timeline.json")).expect("timeline");
    let v: serde_json::Value = serde_json::from_str(&text).expect("json");
    (
        v["peak"][0]["peak"].as_u64().expect("peak"),
        v["peak"][1]["activations"].as_u64().expect("activations"),
    )
}

fn main() {
    let Some(model) = cached_test_model() else {
        eprintln!("skipped: run scripts/fetch-test-model.sh first");
        return;
    };
    let path = model.display().to_string();
    let config = load_model_config(&path, None).expect("config");
    // (batch, seq, checkpointing, NF4 base, activation memory budget in MiB)
    let configs = [
        (1, 128, false, true, None),
        (1, 256, true, true, None),
        (2, 256, false, true, None),
        (2, 256, false, false, None),
        (4, 512, true, true, None),
        (4, 512, false, true, None),
        (4, 256, true, true, Some(600.0)),
    ];
    println!("| batch × seq | checkpointing | base | predicted peak | measured peak | predicted / measured | measured activations |");
    println!("|---|---|---|---:|---:|---:|---:|");
    let mut activations = vec![];
    for (batch, seq, ckpt, nf4, budget) in configs {
        let args = EstimateArgs {
            batch,
            seq,
            lora_r: 16,
            optim: OptimizerName::PagedAdamW8bit,
            gradient_checkpointing: ckpt,
            activation_memory_budget_mib: budget,
            quantize: nf4,
            device: DeviceKind::Cpu,
            ..Default::default()
        };
        let predicted = estimate(&config, &args).expect("estimate").total_bytes;
        let (measured, act) = measure(&path, &args);
        if (batch, seq, budget) == (4, 512, None) {
            activations.push(act);
        }
        println!(
            "| {batch} × {seq} | {} | {} | {} | {} | {:.3} | {} |",
            match (ckpt, budget) {
                (false, _) => "off".to_string(),
                (true, None) => "on".to_string(),
                (true, Some(mib)) => format!("on, {mib} MiB kept"),
            },
            if nf4 { "NF4" } else { "f32" },
            human_bytes(predicted),
            human_bytes(measured),
            predicted as f64 / measured as f64,
            human_bytes(act)
        );
    }
    if let [with, without] = activations[..] {
        println!(
            "\nbatch 4 × 512: activations with checkpointing {} vs without {} → {:.3}× (target ≤ 0.5)",
            human_bytes(with),
            human_bytes(without),
            with as f64 / without as f64
        );
    }
}
