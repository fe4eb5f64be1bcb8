//! DPO against TRL 1.16's `DPOTrainer` (goldens: `scripts/golden_dpo.py`): tokenization of the three preference
//! forms, and the loss and reward metrics of three optimizer steps (and the evaluation after each) for every
//! `loss_type`, RPO, the precomputed and the uniform reference, starting from a PEFT adapter with non-zero B whose
//! frozen copy is the reference.

use candle_core::DType;
use candle_qlora::adapter::load_adapter;
use candle_qlora::data::{DataConfig, PreferenceDataset, TruncationMode};
use candle_qlora::loading::{load_model, load_tokenizer, LoadOptions};
use candle_qlora::lora::LoraConfig;
use candle_qlora::optim::{OptimizerName, SchedulerType};
use candle_qlora::trainer::{DpoConfig, IntervalStrategy, LossType, Trainer, TrainingArguments};
use serde_json::Value;

use crate::common::{data_path, ids_of};

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data_path("dpo/golden.json")).unwrap()).unwrap()
}

fn model_dir() -> String {
    data_path("dpo/tiny-llama-chat").display().to_string()
}

fn pairs(file: &str) -> PreferenceDataset {
    let tokenizer = load_tokenizer(&model_dir(), None).unwrap().unwrap();
    let config = DataConfig {
        format: candle_qlora::data::DataFormat::Preference,
        ..Default::default()
    };
    PreferenceDataset::from_jsonl(
        &data_path(&format!("dpo/{file}")),
        &tokenizer,
        &config,
        TruncationMode::KeepStart,
    )
    .unwrap()
}

#[test]
fn preference_forms_tokenize_as_trl_does() {
    let g = golden();
    for (file, expected) in g["tokenized"].as_object().unwrap() {
        let data = pairs(file);
        let expected = expected.as_array().unwrap();
        assert_eq!(data.len(), expected.len(), "{file}");
        for (pair, e) in data.pairs.iter().zip(expected) {
            let prompt = pair
                .chosen
                .labels
                .iter()
                .take_while(|l| **l == -100)
                .count();
            let (chosen, rejected) = (&pair.chosen.input_ids, &pair.rejected.input_ids);
            assert_eq!(
                chosen[..prompt].to_vec(),
                ids_of(&e["prompt_ids"]),
                "{file}"
            );
            assert_eq!(
                rejected[..prompt].to_vec(),
                ids_of(&e["prompt_ids"]),
                "{file}"
            );
            assert_eq!(
                chosen[prompt..].to_vec(),
                ids_of(&e["chosen_ids"]),
                "{file}"
            );
            assert_eq!(
                rejected[prompt..].to_vec(),
                ids_of(&e["rejected_ids"]),
                "{file}"
            );
        }
    }
}

/// Our DPO settings for a golden case (the RPO case uses our `rpo_alpha`, TRL's spelling being the sft loss type).
fn dpo_config(name: &str, settings: &Value) -> DpoConfig {
    let loss_type: Vec<LossType> = settings["loss_type"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().parse().unwrap())
        .filter(|t| *t != LossType::Sft)
        .collect();
    DpoConfig {
        loss_type,
        beta: settings.get("beta").and_then(Value::as_f64).unwrap_or(0.1),
        label_smoothing: settings
            .get("label_smoothing")
            .and_then(Value::as_f64)
            .unwrap_or(0.0),
        rpo_alpha: (name == "rpo").then_some(0.5),
        precompute_ref_log_probs: settings
            .get("precompute")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        reference_free: settings
            .get("reference_free")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        ..Default::default()
    }
}

fn golden_args(out: &std::path::Path) -> TrainingArguments {
    TrainingArguments {
        output_dir: out.display().to_string(),
        per_device_train_batch_size: 4,
        per_device_eval_batch_size: 4,
        max_steps: 3,
        learning_rate: 5e-3,
        lr_scheduler_type: SchedulerType::Linear,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
        optim: OptimizerName::AdamWTorch,
        logging_steps: 1.0,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(1.0),
        save_strategy: IntervalStrategy::No,
        seed: 0,
        use_cpu: true,
        disable_tqdm: true,
        ..Default::default()
    }
}

/// A DPO trainer on the tiny model continuing the golden adapter.
fn trainer(
    out: &std::path::Path,
    dpo: DpoConfig,
    file: &str,
    edit: impl Fn(&mut TrainingArguments),
) -> Trainer {
    trainer_in(DType::F32, out, dpo, file, edit)
}

/// [`trainer`] with the model computing in `dtype`.
fn trainer_in(
    dtype: DType,
    out: &std::path::Path,
    dpo: DpoConfig,
    file: &str,
    edit: impl Fn(&mut TrainingArguments),
) -> Trainer {
    let options = LoadOptions {
        compute_dtype: dtype,
        ..Default::default()
    };
    let mut model = load_model(&model_dir(), None, &options).unwrap().model;
    let lora = load_adapter(&mut model, &data_path("dpo/adapter"), "default").unwrap();
    let mut args = golden_args(out);
    edit(&mut args);
    Trainer::new_dpo(model, args, &lora, dpo, pairs(file), pairs(file)).unwrap()
}

/// How far our DPO steps may be from TRL's, relative to `1 + |value|`. Both sides compute in float64 from end to end
/// (`scripts/golden_dpo.py`: TRL with the steps transformers keeps in float32 widened too), so what remains is float64
/// rounding in other operation orders: ~1e-16 per operation, grown over three optimizer steps to ~1e-13 at most.
/// 1e-9 leaves four orders of magnitude for that and stays far below any real difference (a wrong term of a loss
/// moves it by 1e-4 or more). Float32 could not give a bound that holds: AdamW's first steps divide each gradient
/// entry by its own magnitude, so float32 noise in near-zero entries becomes full-size updates that depend on the
/// CPU's matrix kernels — TRL's own float32 run is 2.3e-4 away from its float64 one in IPO's second gradient norm.
const TRL_TOLERANCE: f64 = 1e-9;

#[test]
fn dpo_steps_equal_trl_for_every_loss_type_rpo_and_each_reference() {
    let g = golden();
    let names = candle_qlora::trainer::dpo::METRICS;
    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    for (name, case) in g["cases"].as_object().unwrap() {
        let dir = tempfile::tempdir().unwrap();
        let dpo = dpo_config(name, &case["settings"]);
        let data = case["data"].as_str().unwrap();
        let mut t = trainer_in(DType::F64, dir.path(), dpo, data, |_| {});
        let out = t.train(None).unwrap();
        let train: Vec<_> = out
            .log_history
            .iter()
            .filter(|e| e.loss.is_some())
            .collect();
        let eval: Vec<_> = out
            .log_history
            .iter()
            .filter(|e| e.eval_loss.is_some())
            .collect();
        assert_eq!((train.len(), eval.len()), (3, 3), "{name}");
        for (k, want) in case["steps"].as_array().unwrap().iter().enumerate() {
            let mut check = |what: &str, got: f64| {
                let expected = want[what].as_f64().unwrap();
                let err = (got - expected).abs() / (1.0 + expected.abs());
                let line = format!("{name} step {} {what}: ours {got}, TRL {expected}", k + 1);
                if err > worst.0 {
                    worst = (err, line.clone());
                }
                if err >= TRL_TOLERANCE {
                    failures.push(format!("{line} (relative {err:.2e})"));
                }
            };
            check("loss", train[k].loss.unwrap());
            check("grad_norm", train[k].grad_norm.unwrap());
            check("eval_loss", eval[k].eval_loss.unwrap());
            for (prefix, metrics) in [("", &train[k].metrics), ("eval_", &eval[k].metrics)] {
                for n in names {
                    let key = format!("{prefix}{n}");
                    // Where the policy still equals the reference (the first step, before any update), every
                    // pair's margin is zero up to rounding, and "chosen above rejected" counts rounding noise on
                    // either side: the accuracy is a tie, not a result.
                    let rewards =
                        |side: &str| want[format!("{prefix}rewards/{side}")].as_f64().unwrap();
                    let tie =
                        rewards("chosen").abs().max(rewards("rejected").abs()) < TRL_TOLERANCE;
                    if n == "rewards/accuracies" && tie {
                        continue;
                    }
                    check(&key, metrics[&key]);
                }
            }
        }
    }
    eprintln!(
        "largest relative difference from TRL: {:.2e} ({})",
        worst.0, worst.1
    );
    assert!(
        failures.is_empty(),
        "{} differences beyond {TRL_TOLERANCE:e} relative to 1 + |TRL's value| (both sides float64: the bound covers \
         float64 rounding in other operation orders over three steps, see TRL_TOLERANCE):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn a_new_adapter_starts_at_the_base_model_which_is_its_reference() {
    let dir = tempfile::tempdir().unwrap();
    let model = load_model(&model_dir(), None, &LoadOptions::default())
        .unwrap()
        .model;
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: Some(candle_qlora::lora::TargetModules::AllLinear),
        ..Default::default()
    };
    let mut args = golden_args(dir.path());
    args.max_steps = 2;
    let mut t = Trainer::new_dpo(
        model,
        args,
        &lora,
        DpoConfig::default(),
        pairs("pairs.jsonl"),
        pairs("pairs.jsonl"),
    )
    .unwrap();
    let out = t.train(None).unwrap();
    let first = &out.log_history[0];
    // B = 0: the policy is the base model, the reference: every reward is exactly 0 and the loss log 2.
    assert_eq!(first.metrics["rewards/margins"], 0.0);
    assert!((first.loss.unwrap() - std::f64::consts::LN_2).abs() < 1e-6);
    let last_eval = out
        .log_history
        .iter()
        .rev()
        .find(|e| e.eval_loss.is_some())
        .unwrap();
    assert!(
        last_eval.metrics["eval_rewards/margins"] > 0.0,
        "{last_eval:?}"
    );
}

#[test]
fn a_resumed_dpo_run_with_precomputed_references_equals_the_uninterrupted_one() {
    let dpo = || DpoConfig {
        precompute_ref_log_probs: true,
        ..Default::default()
    };
    let steps = |edit: fn(&mut TrainingArguments)| {
        move |a: &mut TrainingArguments| {
            a.max_steps = 4;
            a.per_device_train_batch_size = 2;
            a.gradient_accumulation_steps = 1;
            a.gradient_checkpointing = true;
            a.optim = OptimizerName::PagedAdamW8bit;
            a.save_strategy = IntervalStrategy::Steps;
            a.save_steps = 2.0;
            a.eval_steps = Some(2.0);
            edit(a);
        }
    };
    let whole = tempfile::tempdir().unwrap();
    let full = trainer(whole.path(), dpo(), "pairs.jsonl", steps(|_| {}))
        .train(None)
        .unwrap();
    let ckpt = whole.path().join("checkpoint-2");
    let stored = ckpt.join(candle_qlora::trainer::dpo::REFERENCE_FILE);
    assert!(
        stored.is_file(),
        "the checkpoint keeps the reference log-probabilities"
    );

    let part = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(whole.path()).unwrap() {
        let p = entry.unwrap().path();
        if p.file_name().unwrap() == "checkpoint-2" {
            let to = part.path().join("checkpoint-2");
            std::fs::create_dir_all(&to).unwrap();
            for f in std::fs::read_dir(&p).unwrap() {
                let f = f.unwrap().path();
                std::fs::copy(&f, to.join(f.file_name().unwrap())).unwrap();
            }
        }
    }
    let mut resumed_trainer = trainer(part.path(), dpo(), "pairs.jsonl", steps(|_| {}));
    let resumed = resumed_trainer
        .train(Some(&part.path().join("checkpoint-2")))
        .unwrap();
    // The steps after the checkpoint, bit for bit (timings aside).
    let after = |log: &[candle_qlora::trainer::LogEntry]| -> Vec<_> {
        log.iter()
            .filter(|e| e.step > 2)
            .map(|e| (e.step, e.loss, e.grad_norm, e.eval_loss, e.metrics.clone()))
            .collect()
    };
    assert_eq!(after(&full.log_history), after(&resumed.log_history));
    assert_eq!(after(&full.log_history).len(), 3);
    let bytes = |d: &std::path::Path| std::fs::read(d.join("adapter_model.safetensors")).unwrap();
    assert_eq!(bytes(whole.path()), bytes(part.path()));
}

#[test]
fn train_command_runs_dpo_from_an_adapter_and_refuses_a_disagreeing_lora_section() {
    let dir = tempfile::tempdir().unwrap();
    let root = crate::common::repo_root();
    let config = |extra: &str| {
        let text = format!(
            "[model]\nname_or_path = \"{m}\"\nadapter = \"{a}\"\n{extra}\n[data]\ntrain_file = \"{d}\"\n\
             eval_file = \"{d}\"\n[dpo]\nbeta = 0.2\nloss_type = [\"sigmoid\", \"sft\"]\nloss_weights = [1.0, 0.1]\n\
             [training]\noutput_dir = \"{o}\"\nmax_steps = 2\nper_device_train_batch_size = 2\n\
             learning_rate = 1e-3\nlogging_steps = 1\neval_strategy = \"steps\"\neval_steps = 2\nsave_steps = 2\neval_on_start = true\n",
            m = root.join("tests/data/dpo/tiny-llama-chat").display(),
            a = root.join("tests/data/dpo/adapter").display(),
            d = root.join("tests/data/dpo/pairs-chat.jsonl").display(),
            o = dir.path().join("out").display(),
        );
        let path = dir.path().join("run.toml");
        std::fs::write(&path, text).unwrap();
        path
    };
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args([
            "train",
            "--config",
            config("[lora]\nr = 8").to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        text.contains("[lora] r = 8") && text.contains("has r = 4"),
        "{text}"
    );

    let text = crate::families::qlora(&["train", "--config", config("").to_str().unwrap()]);
    assert!(
        text.contains("4 training pairs") && text.contains("continuing adapter"),
        "{text}"
    );
    let log = std::fs::read_to_string(dir.path().join("out/log.jsonl")).unwrap();
    let entries: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for key in [
        "loss",
        "rewards/chosen",
        "rewards/accuracies",
        "rewards/margins",
        "logps/rejected",
    ] {
        assert!(
            entries[1].get(key).is_some(),
            "{key} missing from {}",
            entries[1]
        );
    }
    // eval_on_start: the evaluation before the first step, where the policy is its frozen copy: no margin at all.
    let start = &entries[0];
    assert_eq!(start["step"], 0, "{start}");
    assert_eq!(start["eval_rewards/margins"], 0.0, "{start}");
    assert!(start.get("eval_perplexity").is_none(), "{start}");
    let later = entries
        .iter()
        .rev()
        .find(|e| e.get("eval_loss").is_some())
        .unwrap();
    assert!(
        later["eval_rewards/margins"].as_f64().unwrap() != 0.0,
        "{later}"
    );
    assert!(dir
        .path()
        .join("out/checkpoint-2/adapter_model.safetensors")
        .is_file());
}

#[test]
fn supervised_training_continues_an_adapter_given_in_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let root = crate::common::repo_root();
    let data = dir.path().join("train.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"t5 t6 t7 t8 t9 t10\"}\n{\"text\": \"t11 t12 t13 t14\"}\n",
    )
    .unwrap();
    let path = dir.path().join("run.toml");
    std::fs::write(
        &path,
        format!(
            "[model]\nname_or_path = \"{m}\"\nadapter = \"{a}\"\n[data]\ntrain_file = \"train.jsonl\"\n\
             [training]\noutput_dir = \"{o}\"\nmax_steps = 1\nlearning_rate = 0.0\n",
            m = root.join("tests/data/dpo/tiny-llama-chat").display(),
            a = root.join("tests/data/dpo/adapter").display(),
            o = dir.path().join("out").display(),
        ),
    )
    .unwrap();
    crate::families::qlora(&["train", "--config", path.to_str().unwrap()]);
    // A zero learning rate leaves the continued adapter as it was loaded.
    let tensors = |p: std::path::PathBuf| {
        candle_core::safetensors::load(
            p.join("adapter_model.safetensors"),
            &candle_core::Device::Cpu,
        )
        .unwrap()
    };
    let (before, after) = (
        tensors(root.join("tests/data/dpo/adapter")),
        tensors(dir.path().join("out")),
    );
    assert_eq!(before.len(), after.len());
    for (k, t) in &before {
        let diff = crate::common::max_abs_diff(t, &after[k]);
        assert!(diff == 0.0, "{k} changed by {diff}");
    }
}

#[test]
fn smollm2_dpo_raises_the_held_out_reward_accuracy() {
    let Some(path) = crate::common::test_model() else {
        return;
    };
    let nf4 = LoadOptions {
        quantization: Some(candle_qlora::quant::QuantConfig::nf4()),
        compute_dtype: candle_core::DType::F32,
        ..Default::default()
    };
    let loaded = load_model(path.to_str().unwrap(), None, &nf4).unwrap();
    let tokenizer = loaded.tokenizer.clone().unwrap();
    let model_config = loaded.model.config().clone();
    let config = DataConfig {
        max_length: 96,
        ..Default::default()
    };
    let file = |name: &str, n: usize| {
        let path = crate::common::repo_root().join("configs/data").join(name);
        let mut data =
            PreferenceDataset::from_jsonl(&path, &tokenizer, &config, TruncationMode::KeepStart)
                .unwrap();
        data.pairs.truncate(n);
        data
    };
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        output_dir: dir.path().display().to_string(),
        per_device_train_batch_size: 4,
        learning_rate: 5e-4,
        max_steps: 4,
        lr_scheduler_type: SchedulerType::Constant,
        optim: OptimizerName::PagedAdamW8bit,
        gradient_checkpointing: true,
        logging_steps: 1.0,
        save_strategy: IntervalStrategy::No,
        disable_tqdm: true,
        ..Default::default()
    };
    let lora = LoraConfig {
        r: 8,
        lora_alpha: 16.0,
        target_modules: Some(candle_qlora::lora::TargetModules::AllLinear),
        ..Default::default()
    };
    let train = file("cities-preference-train.jsonl", 16);
    let eval = file("cities-preference-eval.jsonl", 8);
    let mut t =
        Trainer::new_dpo(loaded.model, args, &lora, DpoConfig::default(), train, eval).unwrap();
    let before = t.evaluate().unwrap();
    t.train(None).unwrap();
    let after = t.evaluate().unwrap();
    let (acc, margin) = ("rewards/accuracies", "rewards/margins");
    eprintln!(
        "held-out reward accuracy {} → {}, margin {:.4} → {:.4}, loss {:.4} → {:.4}",
        before.metrics[acc],
        after.metrics[acc],
        before.metrics[margin],
        after.metrics[margin],
        before.loss,
        after.loss
    );
    // A new adapter is its reference, up to the float32 rounding of the 4-bit LoRA op next to the plain 4-bit one:
    // each reward is β times a difference of two float32 sums of log-probabilities (up to 96 tokens, each of
    // magnitude up to the largest |log p| seen), within the float32 bound of two passes through the decoder.
    let logp = before.metrics["logps/chosen"]
        .abs()
        .max(before.metrics["logps/rejected"].abs());
    let terms = 2 * crate::common::decoder_chain_terms(&model_config, 96);
    let bound = DpoConfig::default().beta * crate::common::float32_bound(terms, logp);
    assert!(
        before.metrics[margin].abs() <= bound,
        "the margin of a new adapter is not within the float32 bound {bound:.2e}: {before:?}"
    );
    assert!(
        after.metrics[acc] >= 0.75 && after.metrics[margin] > 0.0,
        "{after:?}"
    );
    assert!(after.loss < before.loss);
}

/// DPO shares the trainer's checkpoints, so `load_best_model_at_end` works there too: at a learning rate of 0.1 the
/// preference loss on the pairs is lowest at step 2 (0.572; 0.600 and 0.649 at steps 4 and 6), so the final adapter
/// is checkpoint-2's and an evaluation after training gives step 2's loss again.
#[test]
fn dpo_loads_the_best_checkpoint_at_the_end() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = trainer(dir.path(), DpoConfig::default(), "pairs.jsonl", |a| {
        a.max_steps = 6;
        a.learning_rate = 0.1;
        a.per_device_train_batch_size = 2;
        a.lr_scheduler_type = SchedulerType::Constant;
        a.save_strategy = IntervalStrategy::Steps;
        a.save_steps = 2.0;
        a.eval_steps = Some(2.0);
        a.load_best_model_at_end = true;
    });
    let out = t.train(None).unwrap();
    let evals: Vec<(usize, f64)> = out
        .log_history
        .iter()
        .filter_map(|e| Some((e.step, e.eval_loss?)))
        .collect();
    let best = *evals.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    assert_eq!(best.0, 2, "the best evaluation is not the last: {evals:?}");
    let best_dir = dir.path().join("checkpoint-2");
    assert_eq!(
        t.state().best_model_checkpoint.as_deref(),
        Some(best_dir.to_str().unwrap())
    );
    let adapter = crate::trainer::adapter_tensors;
    assert_ne!(
        adapter(&best_dir),
        adapter(&dir.path().join("checkpoint-6"))
    );
    assert!(
        adapter(dir.path()) == adapter(&best_dir),
        "output_dir holds the best adapter"
    );
    assert_eq!(
        t.evaluate().unwrap().loss,
        best.1,
        "the model is the best one"
    );
}
