//! The training loop on the tiny Llama: loss goes down, checkpoints are written and rotated, and resuming from a
//! checkpoint reproduces the uninterrupted run bit for bit.

use candle_core::Device;
use candle_qlora::data::{DataFormat, Example};
use candle_qlora::loading::source::{load_model, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::quant::QuantConfig;
use candle_qlora::trainer::{Trainer, TrainingArguments};

use crate::common::data_path;

fn examples() -> Vec<candle_qlora::data::TokenizedExample> {
    let loaded = load_model(
        data_path("models/tiny-llama").to_str().unwrap(),
        None,
        &LoadOptions::default(),
    )
    .unwrap();
    let tok = loaded.tokenizer.unwrap();
    (0..12)
        .map(|i| {
            let text: Vec<String> = (0..6 + i % 4)
                .map(|j| format!("t{}", 1 + (i * 3 + j * 7) % 50))
                .collect();
            Example::Text(text.join(" "))
                .tokenize(&tok, 64, false)
                .unwrap()
        })
        .collect()
}

fn trainer(output_dir: &std::path::Path) -> Trainer {
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..Default::default()
    };
    let model = load_model(
        data_path("models/tiny-llama").to_str().unwrap(),
        None,
        &opts,
    )
    .unwrap()
    .model;
    let args = TrainingArguments {
        output_dir: output_dir.display().to_string(),
        per_device_train_batch_size: 2,
        gradient_accumulation_steps: 2,
        learning_rate: 5e-3,
        max_steps: 8,
        warmup_steps: 2.0,
        lr_scheduler_type: "cosine".into(),
        optim: "paged_adamw_8bit".into(),
        logging_steps: 1.0,
        save_steps: 2.0,
        save_total_limit: Some(2),
        gradient_checkpointing: true,
        ..Default::default()
    };
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.1,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    let _ = DataFormat::Auto;
    Trainer::new(
        model,
        args,
        &lora,
        examples(),
        vec![],
        "tests/data/models/tiny-llama",
    )
    .unwrap()
}

#[test]
fn training_lowers_the_loss_and_resume_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let mut t = trainer(&a);
    let log = t.train(None).unwrap();
    let losses: Vec<f64> = log.iter().filter_map(|e| e.loss).collect();
    assert_eq!(losses.len(), 8);
    assert!(losses[7] < losses[0], "{losses:?}");
    assert!(a.join("adapter_model.safetensors").exists());
    // Rotation keeps the 2 newest checkpoints (2, 4, 6 were written).
    assert!(
        !a.join("checkpoint-2").exists()
            && a.join("checkpoint-4").exists()
            && a.join("checkpoint-6").exists()
    );

    // A new process resumes from checkpoint-4 into another folder: same later losses, same final adapter.
    let b = dir.path().join("b");
    let mut t2 = trainer(&b);
    let log2 = t2.train(Some(&a.join("checkpoint-4"))).unwrap();
    let losses2: Vec<f64> = log2.iter().filter_map(|e| e.loss).collect();
    assert_eq!(losses, losses2, "logged losses of the resumed run");
    let read = |d: &std::path::Path| {
        candle_core::safetensors::load(d.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
    };
    let (fa, fb) = (read(&a), read(&b));
    assert_eq!(fa.len(), fb.len());
    for (k, t) in &fa {
        assert_eq!(crate::common::max_abs_diff(t, &fb[k]), 0.0, "{k}");
    }

    // The finished run's output is not overwritten by a new run.
    let err = trainer(&a).train(None).unwrap_err().to_string();
    assert!(err.contains("overwrite_output_dir"), "{err}");
}
