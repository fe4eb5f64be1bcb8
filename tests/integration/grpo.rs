//! GRPO against TRL 1.16's `GRPOTrainer` (goldens: `scripts/golden_grpo.py`): the same completions and rewards fed
//! to both (ours through the rollouts file), and the loss, gradient norm and TRL's metrics of three optimizer steps
//! for every `loss_type`, `beta` 0 and 0.04, one and two iterations, each `scale_rewards`, token and sequence
//! importance sampling, accumulation, clip-higher with `delta`, masked truncated completions and the entropy mask —
//! starting from a PEFT adapter with non-zero B whose frozen copy is the reference. Also the command's run on the
//! test model with a reward command, a checkpoint resumed mid-generation, and SmolLM2 from code.

use candle_core::DType;
use candle_qlora::adapter::load_adapter;
use candle_qlora::data::PromptDataset;
use candle_qlora::loading::{load_model, load_tokenizer, LoadOptions};
use candle_qlora::optim::{OptimizerName, SchedulerType};
use candle_qlora::trainer::grpo::Reward;
use candle_qlora::trainer::{GrpoConfig, IntervalStrategy, Trainer, TrainingArguments};
use serde_json::Value;

use crate::common::{data_path, ids_of};

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data_path("grpo/golden.json")).unwrap()).unwrap()
}

fn model_dir() -> String {
    data_path("dpo/tiny-llama-chat").display().to_string()
}

fn rollouts() -> PromptDataset {
    let tokenizer = load_tokenizer(&model_dir(), None).unwrap().unwrap();
    PromptDataset::from_jsonl(
        &data_path("grpo/rollouts.jsonl"),
        &tokenizer,
        true,
        false,
        1024,
    )
    .unwrap()
}

/// Our settings for a golden case: TRL's names, read as a `[grpo]` section would be.
fn grpo_config(settings: &Value) -> GrpoConfig {
    let mut table = toml::Table::new();
    for (k, v) in settings.as_object().unwrap() {
        if ["gradient_accumulation_steps", "per_device_train_batch_size"].contains(&k.as_str()) {
            continue;
        }
        let v: toml::Value = serde_json::from_value(v.clone()).unwrap();
        table.insert(k.clone(), v);
    }
    table.insert("num_generations".into(), 4.into());
    table.insert("max_completion_length".into(), 6.into());
    table.insert("shuffle_dataset".into(), false.into());
    table.try_into().unwrap()
}

fn golden_args(out: &std::path::Path, settings: &Value) -> TrainingArguments {
    let int = |k: &str, default: usize| {
        settings
            .get(k)
            .and_then(Value::as_u64)
            .map_or(default, |v| v as usize)
    };
    TrainingArguments {
        output_dir: out.display().to_string(),
        per_device_train_batch_size: int("per_device_train_batch_size", 8),
        gradient_accumulation_steps: int("gradient_accumulation_steps", 1),
        max_steps: 3,
        learning_rate: 5e-2,
        lr_scheduler_type: SchedulerType::Linear,
        weight_decay: 0.0,
        max_grad_norm: 1.0,
        optim: OptimizerName::AdamWTorch,
        logging_steps: 1.0,
        eval_strategy: IntervalStrategy::No,
        save_strategy: IntervalStrategy::No,
        seed: 0,
        use_cpu: true,
        disable_tqdm: true,
        ..Default::default()
    }
}

/// A GRPO trainer on the tiny model in float64, continuing the golden adapter, on the golden rollouts.
fn trainer(out: &std::path::Path, settings: &Value) -> Trainer {
    let options = LoadOptions {
        compute_dtype: DType::F64,
        ..Default::default()
    };
    let mut model = load_model(&model_dir(), None, &options).unwrap().model;
    let lora = load_adapter(&mut model, &data_path("dpo/adapter"), "default").unwrap();
    let tokenizer = load_tokenizer(&model_dir(), None).unwrap().unwrap();
    Trainer::new_grpo(
        model,
        golden_args(out, settings),
        &lora,
        grpo_config(settings),
        rollouts(),
        PromptDataset::default(),
        Vec::<Reward>::new(),
        tokenizer,
    )
    .unwrap()
}

#[test]
fn rollout_completions_tokenize_as_trl_does() {
    let g = golden();
    let data = rollouts();
    for (prompt, rollout) in data.prompts.iter().zip(&data.rollouts) {
        let key: Vec<String> = prompt.ids.iter().map(u32::to_string).collect();
        let expected = g["completion_ids"][key.join(" ")].as_array().unwrap();
        let tokenizer = load_tokenizer(&model_dir(), None).unwrap().unwrap();
        for (text, want) in rollout.completions.iter().zip(expected) {
            assert_eq!(
                tokenizer.encode(text, false).unwrap(),
                ids_of(want),
                "{text}"
            );
        }
    }
}

/// How far our GRPO steps may be from TRL's, relative to `1 + |value|`: both sides compute in float64 from end to
/// end, so what remains is float64 rounding in other operation orders over three optimizer steps (~1e-13); 1e-9
/// leaves room for that and stays far below a real difference (the bar is 1e-5).
const TRL_TOLERANCE: f64 = 1e-9;

#[test]
fn grpo_steps_equal_trl_for_every_loss_type_and_option() {
    let g = golden();
    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    for (name, case) in g["cases"].as_object().unwrap() {
        let dir = tempfile::tempdir().unwrap();
        let settings = &case["settings"];
        let out = trainer(dir.path(), settings).train(None).unwrap();
        let steps: Vec<_> = out
            .log_history
            .iter()
            .filter(|e| e.loss.is_some())
            .collect();
        assert_eq!(steps.len(), 3, "{name}");
        for (k, want) in case["steps"].as_array().unwrap().iter().enumerate() {
            let mut check = |what: &str, got: Option<f64>| {
                let expected = want[what].as_f64().unwrap();
                let line = format!("{name} step {} {what}: ours {got:?}, TRL {expected}", k + 1);
                let Some(got) = got else {
                    failures.push(format!("{line} (missing)"));
                    return;
                };
                let err = (got - expected).abs() / (1.0 + expected.abs());
                if err > worst.0 {
                    worst = (err, line.clone());
                }
                if err >= TRL_TOLERANCE {
                    failures.push(format!("{line} (relative {err:.2e})"));
                }
            };
            check("loss", steps[k].loss);
            check("grad_norm", steps[k].grad_norm);
            check("learning_rate", steps[k].learning_rate);
            for (key, value) in want.as_object().unwrap() {
                if ["loss", "grad_norm", "learning_rate", "step"].contains(&key.as_str())
                    || value.is_null()
                {
                    continue;
                }
                check(key, steps[k].metrics.get(key).copied());
            }
        }
    }
    eprintln!(
        "largest relative difference from TRL: {:.2e} ({})",
        worst.0, worst.1
    );
    assert!(
        failures.is_empty(),
        "{} differences beyond {TRL_TOLERANCE:e} relative to 1 + |TRL's value|:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// `qlora train` with `[grpo]` on the tiny model with an NF4 base: completions sampled in the loop, scored by a
/// regular expression and a command, TRL's metrics logged and the completions written each logged step; then
/// `--resume` from a checkpoint taken between the two passes over a generation batch (`num_iterations = 2`) gives
/// the uninterrupted run's adapter bit for bit (the batch is in the checkpoint; the sampling draws are counter-based).
#[test]
fn train_command_samples_scores_and_resumes_a_grpo_run() {
    let dir = tempfile::tempdir().unwrap();
    let prompts: Vec<String> = (0..6)
        .map(|i| {
            format!(
                "{{\"prompt\": \"t{} t{}\", \"target\": \"t{}\"}}",
                5 + i,
                6 + i,
                20 + i
            )
        })
        .collect();
    std::fs::write(dir.path().join("prompts.jsonl"), prompts.join("\n")).unwrap();
    // A reward in another language: 1 when the completion holds the prompt's target token.
    std::fs::write(
        dir.path().join("score.py"),
        "import sys, json\nfor line in sys.stdin:\n    x = json.loads(line)\n    \
         print(1.0 if x['target'] in x['completion'].split() else 0.0)\n",
    )
    .unwrap();
    let config = dir.path().join("run.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {model:?}\n[model.quantization]\nload_in_4bit = true\n\
             [lora]\nr = 4\nlora_alpha = 8\ntarget_modules = \"all-linear\"\n\
             [data]\ntrain_file = \"prompts.jsonl\"\n\
             [grpo]\nnum_generations = 4\nmax_completion_length = 5\nnum_iterations = 2\nbeta = 0.04\n\
             [[grpo.reward_funcs]]\ntype = \"regex\"\nname = \"short\"\npattern = '^\\S+( \\S+)?$'\n\
             [[grpo.reward_funcs]]\ntype = \"command\"\nname = \"target\"\ncommand = [\"python3\", {score:?}]\n\
             [training]\noutput_dir = {out:?}\nper_device_train_batch_size = 8\nmax_steps = 4\nsave_steps = 1\n\
             logging_steps = 1\nlearning_rate = 1e-2\nseed = 3\nreport_to = \"tensorboard\"\n",
            model = model_dir(),
            score = dir.path().join("score.py").to_str().unwrap(),
            out = dir.path().join("out").to_str().unwrap(),
        ),
    )
    .unwrap();
    let (ok, text) = crate::trainer::run_train(&config, &[]);
    assert!(ok, "{text}");
    assert!(
        text.contains("6 training prompts, 0 evaluation prompts"),
        "{text}"
    );
    let out = dir.path().join("out");
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let steps: Vec<Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(steps.len(), 4, "{log}");
    for (k, step) in steps.iter().enumerate() {
        for key in [
            "loss",
            "grad_norm",
            "kl",
            "entropy",
            "clip_ratio/region_mean",
        ] {
            assert!(step[key].is_number(), "step {}: {key} in {step}", k + 1);
        }
        // Steps 1 and 3 generate (the second pass over a batch reuses it): their rewards are logged.
        let generated = k % 2 == 0;
        for key in [
            "reward",
            "rewards/short/mean",
            "rewards/target/mean",
            "completions/mean_length",
        ] {
            assert_eq!(
                step[key].is_number(),
                generated,
                "step {}: {key} in {step}",
                k + 1
            );
        }
    }
    let samples = std::fs::read_to_string(out.join("completions/completions_00001.jsonl")).unwrap();
    let first: Value = serde_json::from_str(samples.lines().next().unwrap()).unwrap();
    assert!(
        first["rewards"]["target"].is_number() && first["completion"].is_string(),
        "{first}"
    );
    assert_eq!(samples.lines().count(), 8);
    // TensorBoard's own reader finds the completions as a text of the generating steps.
    let board = std::fs::read_dir(out.join("runs"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let read = std::process::Command::new("python3")
        .arg(crate::common::repo_root().join("scripts/read_tensorboard.py"))
        .arg("--texts")
        .arg(&board)
        .output()
        .unwrap();
    if read.status.success() {
        let texts: Value = serde_json::from_slice(&read.stdout).unwrap();
        let steps: Vec<u64> = texts["train/completions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e[0].as_u64().unwrap())
            .collect();
        assert_eq!(steps, vec![1, 3], "{texts}");
        assert!(texts["train/completions"][0][1]
            .as_str()
            .unwrap()
            .contains("| prompt |"));
    } else {
        let said = String::from_utf8_lossy(&read.stderr);
        assert!(
            said.contains("No module named 'tensorboard'") && std::env::var_os("CI").is_none(),
            "reading the event file failed: {said}"
        );
    }
    let adapter = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
    assert!(out
        .join("checkpoint-3")
        .join(candle_qlora::trainer::grpo::GENERATION_FILE)
        .is_file());
    std::fs::remove_dir_all(out.join("checkpoint-4")).unwrap();
    let (ok, text) = crate::trainer::run_train(&config, &["--resume"]);
    assert!(ok, "{text}");
    assert_eq!(
        std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        adapter,
        "resumed from checkpoint-3, in the middle of a generation batch"
    );
}

/// The real model (SmolLM2-135M-Instruct in NF4) through GRPO from code: the cities questions, completions sampled
/// in the loop and scored by a Rust closure reading the `answer` column, TRL's metrics logged, and the evaluation's
/// reward reported (its samples seeded alike, so two evaluations of the same adapter agree).
#[test]
fn smollm2_grpo_samples_scores_and_evaluates_from_code() {
    use candle_qlora::trainer::grpo::{same_answer, RewardInputs};
    let Some(path) = crate::common::test_model() else {
        return;
    };
    let nf4 = LoadOptions {
        quantization: Some(candle_qlora::quant::QuantConfig::nf4()),
        ..Default::default()
    };
    let loaded = load_model(path.to_str().unwrap(), None, &nf4).unwrap();
    let tokenizer = loaded.tokenizer.clone().unwrap();
    let prompts = |name: &str, n: usize| {
        let file = crate::common::repo_root().join("configs/data").join(name);
        let mut data = PromptDataset::from_jsonl(&file, &tokenizer, false, false, 128).unwrap();
        data.prompts.truncate(n);
        data
    };
    let city = Reward::new("city", |x: &RewardInputs<'_>| {
        Ok(x.completions
            .iter()
            .zip(x.columns)
            .map(|(c, cols)| {
                let answer = cols["answer"].as_str().unwrap();
                Some(if same_answer(c.trim_end_matches('.'), answer) {
                    1.0
                } else {
                    0.0
                })
            })
            .collect())
    });
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        output_dir: dir.path().display().to_string(),
        per_device_train_batch_size: 4,
        per_device_eval_batch_size: 4,
        learning_rate: 5e-4,
        max_steps: 2,
        optim: OptimizerName::PagedAdamW8bit,
        gradient_checkpointing: true,
        logging_steps: 1.0,
        save_strategy: IntervalStrategy::No,
        disable_tqdm: true,
        ..Default::default()
    };
    let grpo = GrpoConfig {
        num_generations: 4,
        max_completion_length: 8,
        ..Default::default()
    };
    let lora = candle_qlora::lora::LoraConfig {
        r: 8,
        lora_alpha: 16.0,
        target_modules: Some(candle_qlora::lora::TargetModules::AllLinear),
        ..Default::default()
    };
    let (train, eval) = (
        prompts("cities-prompts-train.jsonl", 2),
        prompts("cities-prompts-eval.jsonl", 2),
    );
    let mut t = Trainer::new_grpo(
        loaded.model,
        args,
        &lora,
        grpo,
        train,
        eval,
        vec![city],
        tokenizer,
    )
    .unwrap();
    let before = t.evaluate().unwrap();
    let again = t.evaluate().unwrap();
    assert_eq!(
        (before.loss, &before.metrics),
        (again.loss, &again.metrics),
        "an evaluation samples alike each time"
    );
    let out = t.train(None).unwrap();
    for step in &out.log_history {
        for key in [
            "reward",
            "rewards/city/mean",
            "completions/mean_length",
            "entropy",
            "generation_share",
        ] {
            assert!(step.metrics[key].is_finite(), "{key}: {step:?}");
        }
        assert!((0.0..=1.0).contains(&step.metrics["reward"]));
        assert!(step.metrics["completions/mean_length"] <= 8.0);
    }
    let samples =
        std::fs::read_to_string(dir.path().join("completions/completions_00002.jsonl")).unwrap();
    let texts: Vec<String> = samples
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["completion"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(texts.len(), 4);
    assert!(
        texts.iter().any(|t| t.chars().any(char::is_alphabetic)),
        "{texts:?}"
    );
    eprintln!(
        "held-out reward before {:.3}; completions at step 2: {texts:?}",
        before.metrics["reward"]
    );
}

/// A mixture of experts whose config sets `output_router_logits` (the tiny Qwen 2-MoE, coefficient 0.1) adds its
/// load-balancing loss to GRPO's, as TRL does, and logs it.
#[test]
fn a_mixture_of_experts_adds_its_load_balancing_loss() {
    let model_dir = data_path("models/tiny-qwen2-moe").display().to_string();
    let tokenizer = load_tokenizer(&model_dir, None).unwrap().unwrap();
    let rollouts = PromptDataset::from_jsonl(
        &data_path("grpo/rollouts.jsonl"),
        &tokenizer,
        true,
        false,
        1024,
    )
    .unwrap();
    let model = load_model(&model_dir, None, &LoadOptions::default())
        .unwrap()
        .model;
    let lora = candle_qlora::lora::LoraConfig {
        r: 4,
        target_modules: Some(candle_qlora::lora::TargetModules::AllLinear),
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let settings = serde_json::json!({});
    let out = Trainer::new_grpo(
        model,
        golden_args(dir.path(), &settings),
        &lora,
        grpo_config(&settings),
        rollouts,
        PromptDataset::default(),
        Vec::<Reward>::new(),
        tokenizer,
    )
    .unwrap()
    .train(None)
    .unwrap();
    for step in out.log_history.iter().filter(|e| e.loss.is_some()) {
        let aux = step.aux_loss.expect("the load-balancing loss is logged");
        assert!(aux.is_finite() && aux > 0.0, "{step:?}");
    }
}
