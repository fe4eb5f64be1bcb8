//! A short QLoRA run on the real SmolLM2-135M-Instruct: eval loss on held-out data goes down, the saved adapter
//! reloads with the identical eval loss, and (with `QLORA_PEFT_CHECK_DIR=DIR`) the adapter, the eval data and a
//! float64 model's losses are written for `scripts/golden_peft.py check-trained DIR`, which loads them in PEFT and
//! compares the losses in float64.

use candle_core::DType;
use candle_qlora::adapter::{load_adapter, Adapters};
use candle_qlora::data::{DataConfig, Dataset, TokenizedExample};
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::optim::{OptimizerName, SchedulerType};
use candle_qlora::quant::{BnbKernels, QuantConfig};
use candle_qlora::trainer::evaluate;
use candle_qlora::trainer::{Trainer, TrainingArguments};

fn arithmetic(
    file: &str,
    tok: &candle_qlora::models::TextTokenizer,
    n: usize,
) -> Vec<TokenizedExample> {
    let path = crate::common::repo_root().join("configs/data").join(file);
    let config = DataConfig {
        max_length: 64,
        ..Default::default()
    };
    let mut data = Dataset::from_jsonl(&path, tok, &config).unwrap();
    data.rows.truncate(n);
    data.rows
}

#[test]
fn smollm2_qlora_run_lowers_eval_loss_and_reloads_identically() {
    let Some(path) = crate::common::test_model() else {
        return;
    };
    let path = path.to_str().unwrap();
    let nf4 = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        compute_dtype: DType::F32,
        ..Default::default()
    };
    let loaded = load_model(path, None, &nf4).unwrap();
    let tok = loaded.tokenizer.clone().unwrap();
    let train = arithmetic("arithmetic-train.jsonl", &tok, 16);
    let eval = arithmetic("arithmetic-eval.jsonl", &tok, 8);
    let before = evaluate(&loaded.model, &eval, 8).unwrap().loss;

    let dir = tempfile::tempdir().unwrap();
    let out = std::env::var_os("QLORA_PEFT_CHECK_DIR")
        .map(|d| std::path::PathBuf::from(d).join("trained-smollm2"))
        .unwrap_or_else(|| dir.path().join("out"));
    let args = TrainingArguments {
        output_dir: out.display().to_string(),
        overwrite_output_dir: true,
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: 1,
        learning_rate: 2e-3,
        max_steps: 4,
        lr_scheduler_type: SchedulerType::Constant,
        optim: OptimizerName::PagedAdamW8bit,
        gradient_checkpointing: true,
        logging_steps: 1.0,
        save_strategy: candle_qlora::trainer::IntervalStrategy::No,
        disable_tqdm: true,
        ..Default::default()
    };
    let lora = LoraConfig {
        r: 8,
        lora_alpha: 16.0,
        lora_dropout: 0.05,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    let mut trainer = Trainer::new(loaded.model, args, &lora, train, eval.clone()).unwrap();
    trainer.set_base_model_name(path);
    trainer.train(None).unwrap();
    let after = evaluate(&trainer.model, &eval, 8).unwrap().loss;
    assert!(after < before - 0.1, "eval loss {before} → {after}");

    // A fresh NF4 model with the saved adapter gives exactly the same eval loss.
    let mut fresh = load_model(path, None, &nf4).unwrap().model;
    load_adapter(&mut fresh, &out, "default").unwrap();
    fresh.set_adapter("default").unwrap();
    let reloaded = evaluate(&fresh, &eval, 8).unwrap().loss;
    assert_eq!(reloaded, after);

    if std::env::var_os("QLORA_PEFT_CHECK_DIR").is_some() {
        // What PEFT must reproduce in float64: the eval rows and our float64 losses without and with the adapter,
        // on the base as transformers loads the GGUF (dequantized) and quantized to NF4 as bitsandbytes on CPU does.
        let losses = |quantization: Option<QuantConfig>| {
            let opts = LoadOptions {
                quantization,
                compute_dtype: DType::F64,
                ..Default::default()
            };
            let mut model = load_model(path, None, &opts).unwrap().model;
            let base = evaluate(&model, &eval, 8).unwrap().loss;
            load_adapter(&mut model, &out, "default").unwrap();
            model.set_adapter("default").unwrap();
            (base, evaluate(&model, &eval, 8).unwrap().loss)
        };
        let (base_f64, adapted_f64) = losses(None);
        let bnb_cpu = QuantConfig {
            kernels: BnbKernels::Cpu,
            ..QuantConfig::nf4()
        };
        let (base_nf4_f64, adapted_nf4_f64) = losses(Some(bnb_cpu));
        let rows: Vec<serde_json::Value> = eval
            .iter()
            .map(|e| serde_json::json!({"input_ids": e.input_ids, "labels": e.labels}))
            .collect();
        let expected = serde_json::json!({
            "model": path,
            "examples": rows,
            "base_loss_f64": base_f64,
            "adapted_loss_f64": adapted_f64,
            "base_loss_nf4_f64": base_nf4_f64,
            "adapted_loss_nf4_f64": adapted_nf4_f64,
        });
        std::fs::write(
            out.join("expected_eval.json"),
            serde_json::to_string_pretty(&expected).unwrap(),
        )
        .unwrap();
    }
}
