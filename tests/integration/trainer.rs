//! The training loop on the tiny Llama: loss goes down, checkpoints are written and rotated, and resuming from a
//! checkpoint reproduces the uninterrupted run bit for bit.

use candle_core::Device;
use candle_qlora::adapter::Adapters;
use candle_qlora::data::Example;
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::optim::{OptimizerName, SchedulerType};
use candle_qlora::quant::QuantConfig;
use candle_qlora::trainer::{
    EarlyStoppingCallback, IntervalStrategy, MemoryMonitorCallback, Trainer, TrainingArguments,
};

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::data_path;

pub(crate) fn examples() -> Vec<candle_qlora::data::TokenizedExample> {
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
    trainer_with(output_dir, |_| {}, vec![])
}

/// The tiny-Llama trainer with `edit` applied to its arguments and `eval` as evaluation set.
fn trainer_with(
    output_dir: &std::path::Path,
    edit: impl Fn(&mut TrainingArguments),
    eval: Vec<candle_qlora::data::TokenizedExample>,
) -> Trainer {
    trainer_with_lora(output_dir, edit, |_| {}, eval)
}

/// [`trainer_with`], with `edit_lora` applied to the LoRA config too.
fn trainer_with_lora(
    output_dir: &std::path::Path,
    edit: impl Fn(&mut TrainingArguments),
    edit_lora: impl Fn(&mut LoraConfig),
    eval: Vec<candle_qlora::data::TokenizedExample>,
) -> Trainer {
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
    let mut args = TrainingArguments {
        output_dir: output_dir.display().to_string(),
        per_device_train_batch_size: 2,
        gradient_accumulation_steps: 2,
        learning_rate: 5e-3,
        max_steps: 8,
        warmup_steps: 2.0,
        lr_scheduler_type: SchedulerType::Cosine,
        optim: OptimizerName::PagedAdamW8bit,
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
    let mut lora = lora;
    edit(&mut args);
    edit_lora(&mut lora);
    let mut trainer = Trainer::new(model, args, &lora, examples(), eval).unwrap();
    trainer.set_base_model_name("tests/data/models/tiny-llama");
    trainer
}

/// A trainer built in code checks its data as a run config's is checked: evaluation asked for with no evaluation
/// data, and examples longer than the model's context (the tiny Llama's 256 positions), are refused by name.
#[test]
fn trainers_built_in_code_check_their_data() {
    let model = || {
        let opts = LoadOptions {
            quantization: Some(QuantConfig::nf4()),
            ..Default::default()
        };
        load_model(
            data_path("models/tiny-llama").to_str().unwrap(),
            None,
            &opts,
        )
        .unwrap()
        .model
    };
    let lora = LoraConfig::default();
    let steps = TrainingArguments {
        eval_strategy: IntervalStrategy::Steps,
        ..Default::default()
    };
    let err = Trainer::new(model(), steps, &lora, examples(), vec![])
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("eval_strategy = \"steps\" asks for evaluations"),
        "{err}"
    );
    let long = vec![candle_qlora::data::TokenizedExample::learning_every_token(
        (0..300).map(|i| 3 + i % 100).collect(),
    )];
    let err = Trainer::new(model(), TrainingArguments::default(), &lora, long, vec![])
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("the training set has 1 example(s) longer than the model's context of 256"),
        "{err}"
    );
}

/// Exact match counts an example when the greedy answer from its prompt (up to the end-of-sequence token) is its
/// labelled tokens, and not otherwise; `predict_with_generate` reports it with the evaluation loss.
#[test]
fn exact_match_compares_the_greedy_answer_with_the_labels() {
    use candle_qlora::data::TokenizedExample;
    use candle_qlora::models::{generate, ChatMessage, GenerationConfig};
    let Some(path) = crate::common::test_model() else {
        return;
    };
    let loaded = load_model(path.to_str().unwrap(), None, &LoadOptions::default()).unwrap();
    let tok = loaded.tokenizer().unwrap();
    let question = [ChatMessage {
        role: "user".into(),
        content: "What is the capital of France?".into(),
    }];
    let prompt = tok
        .encode(&tok.apply_chat_template(&question, true).unwrap(), false)
        .unwrap();
    // Generation stops at the model's end-of-sequence token by default and does not return it.
    let answer = generate(
        &loaded.model,
        &prompt,
        &GenerationConfig::greedy(32),
        |_| Ok(()),
    )
    .unwrap();
    assert!(answer.len() < 32, "the answer ends: {answer:?}");
    let example = |answer: &[u32]| TokenizedExample {
        input_ids: prompt.iter().chain(answer).copied().collect(),
        labels: prompt
            .iter()
            .map(|_| -100)
            .chain(answer.iter().map(|&t| t as i64))
            .collect(),
        truncated: false,
        segments: vec![],
    };
    let mut wrong = answer.clone();
    wrong.pop();
    let rows = [example(&answer), example(&wrong)];
    let hits = candle_qlora::trainer::exact_match(&loaded.model, &rows).unwrap();
    assert_eq!(hits, (1, 2));

    // The trainer's evaluation reports it only with `predict_with_generate`, over examples with a prompt (the tiny
    // model's plain-text rows have none).
    let dir = tempfile::tempdir().unwrap();
    let mut eval = examples()[..2].to_vec();
    let mut plain = trainer_with(dir.path(), |_| {}, eval.clone());
    assert_eq!(plain.evaluate().unwrap().exact_match, None);
    let generating = |eval| trainer_with(dir.path(), |a| a.predict_with_generate = true, eval);
    assert_eq!(
        generating(eval.clone()).evaluate().unwrap().exact_match,
        None
    );
    eval[0].labels[..2].fill(-100);
    let report = generating(eval).evaluate().unwrap();
    assert!(report.exact_match.is_some_and(|m| m == 0.0 || m == 1.0));
}

/// `bf16` in the arguments of a library-built `Trainer` takes effect, as in transformers (not only through a config).
#[test]
fn precision_flags_take_effect_through_the_library() {
    let dir = tempfile::tempdir().unwrap();
    let f32_run = trainer(dir.path());
    assert_eq!(f32_run.model.compute_dtype(), candle_core::DType::F32);
    let bf16_run = trainer_with(dir.path(), |a| a.bf16 = true, vec![]);
    assert_eq!(bf16_run.model.compute_dtype(), candle_core::DType::BF16);
    let fp16_run = trainer_with(dir.path(), |a| a.fp16 = true, vec![]);
    assert_eq!(fp16_run.model.compute_dtype(), candle_core::DType::F16);
}

#[test]
fn training_lowers_the_loss_and_resume_is_bit_identical() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a");
    let mut t = trainer(&a);
    let log = t.train(None).unwrap();
    let losses: Vec<f64> = log.log_history.iter().filter_map(|e| e.loss).collect();
    assert_eq!(losses.len(), 8);
    assert!(losses[7] < losses[0], "{losses:?}");
    assert!(a.join("adapter_model.safetensors").exists());
    // Rotation keeps the 2 newest checkpoints (2, 4, 6 and, as transformers does, the last step's 8 were written).
    assert!(
        !a.join("checkpoint-4").exists()
            && a.join("checkpoint-6").exists()
            && a.join("checkpoint-8").exists()
    );

    // A new process resumes from checkpoint-6 into another folder: same later losses, same final adapter.
    let b = dir.path().join("b");
    let mut t2 = trainer(&b);
    let log2 = t2.train(Some(&a.join("checkpoint-6"))).unwrap();
    let losses2: Vec<f64> = log2.log_history.iter().filter_map(|e| e.loss).collect();
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

/// Resuming refuses a checkpoint with a damaged file (checksums in its manifest), one trained on another base
/// model of the same shape (unless `ignore_base_model_mismatch`), and a different LoRA rank, each by name.
#[test]
fn damaged_or_foreign_checkpoints_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let two_steps = |a: &mut TrainingArguments| a.max_steps = 2;
    trainer_with(&dir.path().join("a"), two_steps, vec![])
        .train(None)
        .unwrap();
    let ckpt = dir.path().join("a/checkpoint-2");
    let resume =
        |t: &mut Trainer, from: &Path| t.train(Some(from)).map(|_| ()).map_err(|e| e.to_string());

    // Another base model of the same shape: refused, unless told to ignore it.
    let mut other = trainer_with(&dir.path().join("b"), two_steps, vec![]);
    other.model.embed_tokens = (&other.model.embed_tokens * 1.01).unwrap();
    let err = resume(&mut other, &ckpt).unwrap_err();
    assert!(err.contains("another base model"), "{err}");
    let ignore = |a: &mut TrainingArguments| {
        a.max_steps = 2;
        a.ignore_base_model_mismatch = true;
    };
    let mut other = trainer_with(&dir.path().join("b2"), ignore, vec![]);
    other.model.embed_tokens = (&other.model.embed_tokens * 1.01).unwrap();
    resume(&mut other, &ckpt).unwrap();

    // A different rank is named with both values.
    let mut wider = trainer_with_lora(&dir.path().join("c"), two_steps, |l| l.r = 8, vec![]);
    let err = resume(&mut wider, &ckpt).unwrap_err();
    assert!(
        err.contains("the checkpoint has r = 4, the config asks for r = 8"),
        "{err}"
    );

    // A few flipped bytes in the optimizer state (past the header, so the file still parses) name the file.
    let damaged = dir.path().join("damaged");
    std::fs::create_dir(&damaged).unwrap();
    for entry in std::fs::read_dir(&ckpt).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), damaged.join(entry.file_name())).unwrap();
    }
    let state = damaged.join("optimizer.safetensors");
    let mut bytes = std::fs::read(&state).unwrap();
    let end = bytes.len();
    for b in &mut bytes[end - 64..] {
        *b ^= 0x5a;
    }
    std::fs::write(&state, bytes).unwrap();
    let mut t = trainer_with(&dir.path().join("d"), two_steps, vec![]);
    let err = resume(&mut t, &damaged).unwrap_err();
    assert!(
        err.contains("optimizer.safetensors") && err.contains("damaged"),
        "{err}"
    );
}

/// Writes 16 lines of training text and a `qlora train` config for the tiny Llama (NF4, LoRA r=4) into `dir`, with
/// extra `[data]` and `[training]` lines; the output goes to `dir/out`.
pub(crate) fn write_tiny_config(dir: &Path, data: &str, training: &str) -> PathBuf {
    let lines: Vec<String> = (0..16)
        .map(|i| {
            format!(
                "{{\"text\": \"t{} t{} t{} t{} t{}\"}}",
                i + 1,
                i + 3,
                i + 5,
                i + 7,
                i + 9
            )
        })
        .collect();
    std::fs::write(dir.join("train.jsonl"), lines.join("\n")).unwrap();
    let config = dir.join("run.toml");
    let model = data_path("models/tiny-llama");
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {:?}\n[model.quantization]\nload_in_4bit = true\nbnb_4bit_quant_type = \"nf4\"\n\
             [lora]\nr = 4\nlora_alpha = 8\nlora_dropout = 0.1\ntarget_modules = \"all-linear\"\n\
             [data]\ntrain_file = \"train.jsonl\"\n{data}\
             [training]\noutput_dir = {:?}\nper_device_train_batch_size = 2\n{training}",
            model.to_str().unwrap(),
            dir.join("out").to_str().unwrap()
        ),
    )
    .unwrap();
    config
}

/// Runs `qlora train --config config extra…`: (success, stdout + stderr).
pub(crate) fn run_train(config: &Path, extra: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(["train", "--config", config.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

/// `qlora train --config` end to end on the tiny Llama, `--resume` from the latest checkpoint, and config errors.
#[test]
fn train_command_runs_a_config_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(
        dir.path(),
        "eval_split = 0.25\n",
        "max_steps = 4\nsave_steps = 2\nlogging_steps = 1\nlearning_rate = 5e-5\noptim = \"adamw_8bit\"\n\
         eval_strategy = \"steps\"\neval_steps = 2\n",
    );
    let run = |extra: &[&str]| run_train(&config, extra);
    let (ok, text) = run(&[]);
    assert!(ok, "{text}");
    assert!(
        text.contains("12 training examples, 4 evaluation examples") && text.contains("eval_loss"),
        "{text}"
    );
    let adapter = std::fs::read(dir.path().join("out/adapter_model.safetensors")).unwrap();
    assert!(dir
        .path()
        .join("out/checkpoint-2/optimizer.safetensors")
        .exists());

    // The last step's checkpoint is saved too (as transformers does); without it, --resume takes checkpoint-2.
    let last = dir.path().join("out/checkpoint-4");
    assert!(last.join("optimizer.safetensors").exists());
    std::fs::remove_dir_all(&last).unwrap();
    let log = std::fs::read_to_string(dir.path().join("out/log.jsonl")).unwrap();
    let (ok, text) = run(&["--resume"]);
    assert!(ok, "{text}");
    // The history up to the checkpoint is written back exactly as it was logged, to the last digit.
    let resumed = std::fs::read_to_string(dir.path().join("out/log.jsonl")).unwrap();
    let until_checkpoint = |log: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains("\"step\":1,") || l.contains("\"step\":2,"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(until_checkpoint(&resumed), until_checkpoint(&log));
    assert_eq!(until_checkpoint(&log).len(), 3, "{log}");
    assert_eq!(
        std::fs::read(dir.path().join("out/adapter_model.safetensors")).unwrap(),
        adapter,
        "resumed from checkpoint-2"
    );
    // The adapter records its NF4 base, and `eval` loads the base that way unless told otherwise.
    let eval = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args([
                "eval",
                "--model",
                data_path("models/tiny-llama").to_str().unwrap(),
            ])
            .args(["--adapter", dir.path().join("out").to_str().unwrap()])
            .args(["--data", dir.path().join("train.jsonl").to_str().unwrap()])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = eval(&[]);
    assert!(
        said.contains("nf4 base, blocksize 64, as the adapter was trained"),
        "{said}"
    );
    let said = eval(&["--quantize", "none"]);
    assert!(said.contains("base as stored"), "{said}");

    let (ok, text) = run(&["--set", "training.learning_rat=1e-3"]);
    assert!(
        !ok && text.contains("did you mean `learning_rate`"),
        "{text}"
    );
    let (ok, text) = run(&["--set", "data.packing=\"yes\""]);
    assert!(
        !ok && text.contains("[data] packing: invalid type") && text.contains("expected a boolean"),
        "{text}"
    );
    let (ok, text) = run(&["--set", "data.train_file=\"missing.jsonl\""]);
    assert!(!ok && text.contains("missing.jsonl"), "{text}");
    let (ok, text) = run(&["--set", "callbacks.early_stopping_patiense=2"]);
    assert!(
        !ok && text.contains("did you mean `early_stopping_patience`"),
        "{text}"
    );
    let (ok, text) = run(&["--set", "training.per_device_train_batch_size=\"two\""]);
    assert!(
        !ok && text.contains("run.toml") && text.contains("[training]"),
        "{text}"
    );
}

/// Every bundled recipe parses and validates.
#[test]
fn bundled_configs_are_valid() {
    let dir = crate::common::repo_root().join("configs");
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "toml") {
            let c = candle_qlora::trainer::RunConfig::load(&p, &[])
                .unwrap_or_else(|e| panic!("{}: {e}", p.display()));
            assert!(
                c.data.train_file.as_ref().unwrap().exists(),
                "{}",
                p.display()
            );
            assert_eq!(c.quant_config().unwrap(), Some(QuantConfig::nf4()));
            n += 1;
        }
    }
    assert_eq!(n, 14);
    // The GRPO recipe is GRPO, with its two checked rewards.
    let grpo =
        candle_qlora::trainer::RunConfig::load(&dir.join("smollm2-135m-grpo.toml"), &[]).unwrap();
    let grpo = grpo.grpo.unwrap();
    assert_eq!((grpo.num_generations, grpo.reward_funcs.len()), (8, 2));
    // The DPO recipe is DPO, and its commented continuation of an SFT adapter reads that adapter's settings.
    let dpo =
        candle_qlora::trainer::RunConfig::load(&dir.join("smollm2-135m-dpo.toml"), &[]).unwrap();
    assert_eq!(dpo.dpo.unwrap().beta, 0.1);
    let adapter = crate::common::data_path("dpo/adapter")
        .display()
        .to_string();
    let err = candle_qlora::trainer::RunConfig::load(
        &dir.join("smollm2-135m-dpo.toml"),
        &[format!("model.adapter=\"{adapter}\"")],
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("[lora] r = 16") && err.contains("has r = 4"),
        "{err}"
    );
    // The mixture-of-experts recipe's commented expert targets validate too.
    let moe = dir.join("qwen3-30b-a3b-qlora.toml");
    let experts = [
        r#"lora.target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]"#
            .to_string(),
        r#"lora.rank_pattern={ "mlp.experts.gate_up_proj" = 4, "mlp.experts.down_proj" = 4 }"#
            .to_string(),
    ];
    let c = candle_qlora::trainer::RunConfig::load(&moe, &experts).unwrap();
    assert_eq!(c.lora.target_parameters.as_ref().unwrap().len(), 2);
    assert_eq!(c.lora.rank_pattern["mlp.experts.down_proj"], 4);
}

/// Loss values of `out/log.jsonl`, by step.
fn logged_losses(out: &Path) -> Vec<(u64, f64)> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| Some((v["step"].as_u64()?, v["loss"].as_f64()?)))
        .collect()
}

/// True while `out` holds a checkpoint being written (or left half-written by a kill).
fn has_partial(out: &Path) -> bool {
    std::fs::read_dir(out)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .any(|e| e.file_name().to_string_lossy().ends_with(".partial"))
        })
        .unwrap_or(false)
}

/// Every complete checkpoint in `out` loads: adapter, optimizer state and trainer state parse.
fn assert_checkpoints_usable(out: &Path) {
    for e in std::fs::read_dir(out).unwrap() {
        let p = e.unwrap().path();
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        if !name.starts_with("checkpoint-") {
            continue;
        }
        assert!(
            p.join("trainer_state.json").exists(),
            "{name} is visible but incomplete"
        );
        for f in ["adapter_model.safetensors", "optimizer.safetensors"] {
            candle_core::safetensors::load(p.join(f), &Device::Cpu)
                .unwrap_or_else(|e| panic!("{name}/{f}: {e}"));
        }
        for f in [
            "trainer_state.json",
            "rng_state.json",
            "scheduler.json",
            "training_args.json",
        ] {
            let text = std::fs::read_to_string(p.join(f)).unwrap();
            serde_json::from_str::<serde_json::Value>(&text)
                .unwrap_or_else(|e| panic!("{name}/{f}: {e}"));
        }
        assert!(p.join("run_config.toml").exists());
    }
}

/// Ctrl-C: the first press lets the step finish and saves a checkpoint (even with `save_strategy = "no"`), exits
/// 130 with a resume command, and resuming ends with the uninterrupted run's adapter; a second press stops at once.
#[cfg(unix)]
#[test]
fn ctrl_c_saves_a_checkpoint_that_resumes_and_a_second_stops_at_once() {
    let training =
        "max_steps = 40\nsave_strategy = \"no\"\nlogging_steps = 1\nlearning_rate = 5e-3\n";
    let reference = tempfile::tempdir().unwrap();
    let (ok, text) = run_train(&write_tiny_config(reference.path(), "", training), &[]);
    assert!(ok, "{text}");
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(dir.path(), "", training);
    let out = dir.path().join("out");
    // Starts a run (with `extra` arguments) and presses Ctrl-C once it has logged a step, and a second time (when
    // `twice`) once the first press is acknowledged; returns its exit code and stderr.
    let interrupt = |extra: &[&str], twice: bool| {
        let stderr_path = dir.path().join("stderr.txt");
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args(["train", "--config", config.to_str().unwrap()])
            .args(extra)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&stderr_path).unwrap())
            .spawn()
            .unwrap();
        let said = || std::fs::read_to_string(&stderr_path).unwrap();
        let wait_for = |child: &mut std::process::Child, phrase: &str| {
            let started = std::time::Instant::now();
            while !said().contains(phrase) {
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "ended before `{phrase}`: {}",
                    said()
                );
                assert!(started.elapsed().as_secs() < 60, "no `{phrase}` in 60 s");
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
        };
        // SAFETY: signalling our own child process.
        let press = |child: &std::process::Child| unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGINT);
        };
        wait_for(&mut child, "Ctrl-C stops after the current step");
        press(&child);
        if twice {
            wait_for(&mut child, "Ctrl-C again");
            press(&child);
        }
        let code = child.wait().unwrap().code();
        (code, said())
    };

    // Twice, during a long first step (64 examples of 40 tokens): no checkpoint, exit 130.
    let long: Vec<String> = (0..64)
        .map(|i| {
            let words: Vec<String> = (0..40)
                .map(|j| format!("t{}", 1 + (i + j * 7) % 50))
                .collect();
            format!("{{\"text\": \"{}\"}}", words.join(" "))
        })
        .collect();
    std::fs::write(dir.path().join("long.jsonl"), long.join("\n")).unwrap();
    let long_step = [
        "--set",
        "data.train_file=\"long.jsonl\"",
        "--set",
        "training.gradient_accumulation_steps=32",
    ];
    let (code, said) = interrupt(&long_step, true);
    assert_eq!(code, Some(130), "{said}");
    assert!(
        !said.contains("resume with") && !said.contains("step 2/"),
        "{said}"
    );
    assert!(candle_qlora::trainer::latest_checkpoint(&out).is_none());
    std::fs::remove_dir_all(&out).unwrap();

    let (code, said) = interrupt(&[], false);
    assert_eq!(code, Some(130), "{said}");
    assert!(said.contains("resume with: qlora train --config"), "{said}");
    let checkpoint = candle_qlora::trainer::latest_checkpoint(&out).expect("a checkpoint");
    assert!(said.contains(&checkpoint.display().to_string()), "{said}");
    let (ok, text) = run_train(&config, &["--resume"]);
    assert!(ok, "{text}");
    assert_eq!(
        std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        std::fs::read(reference.path().join("out/adapter_model.safetensors")).unwrap(),
        "the resumed run's adapter"
    );
}

/// A run killed with SIGKILL again and again — between checkpoints and in the middle of checkpoint writes — and
/// resumed each time with `--resume` (packed data, NEFTune, dropout, 8-bit optimizer, checkpointing) ends with the adapter and logged losses of an uninterrupted run, bit for bit.
#[test]
fn killed_runs_resume_to_the_uninterrupted_result() {
    let training = "max_steps = 60\nsave_steps = 1\nsave_total_limit = 2\nlogging_steps = 1\nlearning_rate = 5e-3\n\
                    optim = \"paged_adamw_8bit\"\ngradient_accumulation_steps = 2\ngradient_checkpointing = true\n\
                    neftune_noise_alpha = 5.0\n";
    // Packed rows, so resume also covers the packed data path.
    let data = "packing = true\nmax_length = 24\n";
    let reference = tempfile::tempdir().unwrap();
    let config = write_tiny_config(reference.path(), data, training);
    let (ok, text) = run_train(&config, &[]);
    assert!(ok, "{text}");
    let expected_losses = logged_losses(&reference.path().join("out"));
    let expected_adapter =
        std::fs::read(reference.path().join("out/adapter_model.safetensors")).unwrap();
    assert_eq!(expected_losses.len(), 60);

    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(dir.path(), data, training);
    let out = dir.path().join("out");
    let (mut kills, mut kills_mid_write) = (0, 0);
    let mut delay_ms = 150u64;
    let finished = loop {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"));
        cmd.args(["train", "--config", config.to_str().unwrap()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        if candle_qlora::trainer::latest_checkpoint(&out).is_some() {
            cmd.arg("--resume");
        }
        let mut child = cmd.spawn().unwrap();
        if kills % 2 == 0 {
            std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        } else {
            // Kill as soon as a checkpoint is being written.
            let started = std::time::Instant::now();
            while !has_partial(&out) && started.elapsed().as_secs() < 20 {
                if child.try_wait().unwrap().is_some() {
                    break;
                }
            }
        }
        if child.try_wait().unwrap().is_some() || kills >= 12 {
            let status = child.wait().unwrap();
            assert!(status.success(), "the last resume failed");
            break true;
        }
        child.kill().unwrap(); // SIGKILL on Unix
        child.wait().unwrap();
        kills += 1;
        kills_mid_write += has_partial(&out) as usize;
        assert_checkpoints_usable(&out);
        delay_ms = 150 + (delay_ms * 7 + 13) % 250;
    };
    assert!(finished);
    assert!(
        kills >= 4 && kills_mid_write >= 1,
        "killed {kills} times, {kills_mid_write} during a checkpoint write"
    );
    eprintln!("killed {kills} times, {kills_mid_write} of them during a checkpoint write");
    assert_eq!(logged_losses(&out), expected_losses);
    assert_eq!(
        std::fs::read(out.join("adapter_model.safetensors")).unwrap(),
        expected_adapter,
        "final adapter after {kills} kills"
    );
}

/// Early stopping ends a run whose eval loss stops improving; the run's files are written; a diverging run stops
/// with an error after the configured number of non-finite losses; an earlier run's checkpoints are only replaced
/// with `overwrite_output_dir`.
#[test]
fn callbacks_divergence_and_output_dir_rules() {
    let dir = tempfile::tempdir().unwrap();
    // Learning rate 0: the eval loss never improves, so patience 2 stops after the third evaluation.
    let out = dir.path().join("early");
    let mut t = trainer_with(
        &out,
        |a| {
            a.learning_rate = 0.0;
            a.warmup_steps = 0.0;
            a.eval_strategy = IntervalStrategy::Steps;
            a.eval_steps = Some(1.0);
        },
        examples()[..4].to_vec(),
    );
    t.add_callback(Box::new(EarlyStoppingCallback::new(2, 0.0)));
    t.add_callback(Box::new(MemoryMonitorCallback::new(0.9)));
    let result = t.train(None).unwrap();
    assert!(
        result.stopped_early && result.global_step == 3,
        "{result:?}"
    );
    assert_eq!(t.state().eval_losses().len(), 3);
    for f in [
        "loss.svg",
        "train_results.json",
        "memory.jsonl",
        "log.jsonl",
        "adapter_model.safetensors",
    ] {
        assert!(out.join(f).exists(), "{f}");
    }
    assert_eq!(
        std::fs::read_to_string(out.join("memory.jsonl"))
            .unwrap()
            .lines()
            .count(),
        3
    );

    // A huge learning rate blows the weights up: non-finite losses are skipped, then the run stops with an error.
    let out = dir.path().join("diverge");
    let mut t = trainer_with(
        &out,
        |a| {
            a.learning_rate = 1e30;
            a.warmup_steps = 0.0;
            a.optim = OptimizerName::AdamWTorch;
            a.max_grad_norm = 0.0;
            a.max_consecutive_nonfinite_losses = 2;
        },
        vec![],
    );
    let err = t.train(None).unwrap_err().to_string();
    assert!(
        err.contains("not finite for 2 steps") && err.contains("learning_rate"),
        "{err}"
    );
    let skipped = t.state().log_history.iter().filter(|e| e.skipped).count();
    assert_eq!(skipped, 2);

    // `diverge` holds checkpoints now? It saved every 2 steps before diverging: a new run must not replace them.
    assert!(out.join("checkpoint-2").exists());
    let err = trainer(&out).train(None).unwrap_err().to_string();
    assert!(
        err.contains("overwrite_output_dir") && err.contains("checkpoint-"),
        "{err}"
    );
    // It holds a checkpoint, so resuming is among the ways out (a folder without one is not told to resume:
    // `bad_inputs.rs`).
    assert!(
        err.contains("resume it (resume_from_checkpoint, or --resume)"),
        "{err}"
    );
    let mut t = trainer_with(&out, |a| a.overwrite_output_dir = true, vec![]);
    t.train(None).unwrap();
    // The old checkpoint-2 is gone (the new run's was rotated away by save_total_limit = 2).
    assert!(!out.join("checkpoint-2").exists() && out.join("checkpoint-6").exists());
}

/// A diverged run never writes a checkpoint with a non-finite adapter or optimizer state, so rotation keeps the
/// last good one: two good steps (checkpoint-2), then a resumed run whose learning rate overflows float32 makes the
/// weights infinite at step 3; with `save_total_limit = 1`, checkpoint-2 must still be there at the end, and the
/// run ends in an error that says it diverged instead of saving a non-finite final adapter.
#[test]
fn non_finite_state_is_never_checkpointed() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let settings = |max_steps: i64, learning_rate: f64| {
        move |a: &mut TrainingArguments| {
            a.max_steps = max_steps;
            a.learning_rate = learning_rate;
            a.save_steps = 1.0;
            a.save_total_limit = Some(1);
            a.optim = OptimizerName::AdamWTorch;
            a.warmup_steps = 0.0;
            a.lr_scheduler_type = SchedulerType::Constant;
            a.max_grad_norm = 0.0;
            a.max_consecutive_nonfinite_losses = 0;
        }
    };
    trainer_with(&out, settings(2, 1e-3), vec![])
        .train(None)
        .unwrap();
    assert!(out.join("checkpoint-2").exists());
    let mut t = trainer_with(&out, settings(4, 1e39), vec![]);
    let err = t
        .train(Some(&out.join("checkpoint-2")))
        .unwrap_err()
        .to_string();
    assert!(err.contains("training diverged"), "{err}");
    // The first run's final adapter is still the one in the folder, finite.
    let adapter =
        candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    for (k, t) in &adapter {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        assert!(v.iter().all(|x| x.is_finite()), "{k}");
    }
    let kept: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert_eq!(
        kept,
        ["checkpoint-2"],
        "the newest finite checkpoint is kept"
    );
}

/// `to_device` moves a model before adapters exist (a no-op on its own device) and refuses once they do: adapters
/// are created on the model's device.
#[test]
fn a_model_moves_to_its_device_before_its_adapters() {
    let model = load_model(
        data_path("models/tiny-llama").to_str().unwrap(),
        None,
        &LoadOptions::default(),
    )
    .unwrap()
    .model;
    let mut model = model.to_device(&Device::Cpu).unwrap();
    assert!(model.device().is_cpu());
    model
        .add_adapter("default", &LoraConfig::default(), 1)
        .unwrap();
    let err = model.to_device(&Device::Cpu).err().unwrap().to_string();
    assert!(err.contains("before adding or loading adapters"), "{err}");
}

/// `report_to = "tensorboard"`: TensorBoard's own reader (the `tensorboard` package, `scripts/read_tensorboard.py`)
/// gets back every scalar of `log.jsonl` under transformers' tags (as float32, the event format's), at its step,
/// and nothing else but the tokens per second. Needs `pip install tensorboard` (CI installs it; elsewhere the test
/// is skipped with a message when it is missing).
#[test]
fn tensorboard_reads_back_exactly_the_logged_scalars() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let mut trainer = trainer_with(
        &out,
        |a| {
            a.report_to = candle_qlora::trainer::ReportTo(vec!["tensorboard".into()]);
            a.max_steps = 4;
            a.eval_strategy = IntervalStrategy::Steps;
            a.eval_steps = Some(2.0);
        },
        examples(),
    );
    trainer.train(None).unwrap();
    let runs = out.join("runs");
    let logdir = std::fs::read_dir(&runs)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    let name = logdir.file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.chars().take(3).all(|c| c.is_ascii_alphabetic()),
        "{name}: transformers' runs/<date>_<host>"
    );
    let read = Command::new("python3")
        .arg(crate::common::repo_root().join("scripts/read_tensorboard.py"))
        .arg(&logdir)
        .output()
        .unwrap();
    if !read.status.success() {
        let said = String::from_utf8_lossy(&read.stderr);
        let missing = said.contains("No module named 'tensorboard'");
        assert!(
            missing && std::env::var_os("CI").is_none(),
            "reading the event file failed: {said}"
        );
        eprintln!("skipped: the tensorboard package is missing (pip install tensorboard)");
        return;
    }
    // Compared as float32, what the events hold (the JSON between is read with 1-ulp float64 parsing).
    let board: std::collections::BTreeMap<String, Vec<(u64, f32)>> =
        serde_json::from_slice::<std::collections::BTreeMap<String, Vec<(u64, f64)>>>(&read.stdout)
            .unwrap()
            .into_iter()
            .map(|(tag, v)| (tag, v.into_iter().map(|(s, x)| (s, x as f32)).collect()))
            .collect();
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    let mut expected: std::collections::BTreeMap<String, Vec<(u64, f32)>> = Default::default();
    for line in log.lines() {
        let entry: candle_qlora::trainer::LogEntry = serde_json::from_str(line).unwrap();
        for (tag, value) in candle_qlora::trainer::tensorboard::scalars(&entry) {
            expected
                .entry(tag)
                .or_default()
                .push((entry.step as u64, value as f32));
        }
    }
    for tag in [
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "eval/loss",
        "train/memory_bytes",
    ] {
        assert!(
            board.contains_key(tag),
            "{tag} missing from {:?}",
            board.keys()
        );
    }
    assert_eq!(board, expected);
}

/// `trace_steps = [2]` writes `trace.json` in Chrome's trace-event format: one `step 2` span, spans that nest
/// (none overlaps another without containing it), a span per layer in each forward and each checkpointed layer's
/// recomputation and backward under it, our ops' forwards and backwards inside, the loss, the optimizer, data
/// loading and the checkpoint, memory counters, and top-level spans whose durations add up to the step (90% of it at least: the glue between
/// them is not traced).
#[test]
fn step_traces_nest_and_add_up_to_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(
        dir.path(),
        "",
        "max_steps = 3\nsave_steps = 2\nsave_total_limit = 1\ngradient_checkpointing = true\n\
         gradient_accumulation_steps = 2\ntrace_steps = [2]\n",
    );
    crate::families::qlora(&["train", "--config", config.to_str().unwrap()]);
    let text = std::fs::read_to_string(dir.path().join("out/trace.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = json["traceEvents"].as_array().unwrap();
    let spans: Vec<(String, String, f64, f64)> = events
        .iter()
        .filter(|e| e["ph"] == "X")
        .map(|e| {
            (
                e["name"].as_str().unwrap().to_string(),
                e["cat"].as_str().unwrap().to_string(),
                e["ts"].as_f64().unwrap(),
                e["dur"].as_f64().unwrap(),
            )
        })
        .collect();
    let steps: Vec<_> = spans.iter().filter(|s| s.1 == "step").collect();
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert_eq!(steps[0].0, "step 2");
    let (_, _, step_ts, step_dur) = steps[0].clone();
    // Nesting: two spans are disjoint or one holds the other (timestamps in µs, to the nanosecond).
    let eps = 1e-3;
    let within = |a: &(String, String, f64, f64), b: &(String, String, f64, f64)| {
        a.2 >= b.2 - eps && a.2 + a.3 <= b.2 + b.3 + eps
    };
    for (i, a) in spans.iter().enumerate() {
        assert!(within(a, steps[0]), "{a:?} outside the step");
        for b in &spans[i + 1..] {
            let disjoint = a.2 + a.3 <= b.2 + eps || b.2 + b.3 <= a.2 + eps;
            assert!(
                disjoint || within(a, b) || within(b, a),
                "{a:?} and {b:?} overlap"
            );
        }
    }
    let count = |name: &str, cat: &str| spans.iter().filter(|s| s.0 == name && s.1 == cat).count();
    // Two micro-batches, two layers each: forward spans per layer, recompute + backward under each layer and under
    // the final norm (the checkpointed chain's last block).
    assert_eq!(count("forward", "forward"), 2);
    assert_eq!(count("model.layers.1", "forward"), 2);
    assert_eq!(count("model.layers.0", "backward"), 2);
    assert_eq!(count("model.norm", "backward"), 2);
    assert_eq!(count("recompute", "recompute"), 6);
    for (name, cat) in [("loss", "loss"), ("data", "data"), ("backward", "backward")] {
        assert!(count(name, cat) >= 2, "{name}");
    }
    assert_eq!(count("optimizer", "optimizer"), 1);
    assert_eq!(count("checkpoint", "checkpoint"), 1);
    // Our ops inside the layers, forward and backward: the LoRA linears and the norms.
    for op in ["low-rank-linear", "rms-norm"] {
        assert!(count(op, "op") > 0 && count(op, "op backward") > 0, "{op}");
    }
    assert!(events
        .iter()
        .any(|e| e["ph"] == "C" && e["args"]["bytes"].as_u64().is_some_and(|b| b > 0)));
    // The step's direct children (spans inside it and inside no other span) cover it.
    let children: Vec<_> = spans
        .iter()
        .filter(|s| s.1 != "step")
        .filter(|s| {
            !spans
                .iter()
                .any(|o| o.1 != "step" && !std::ptr::eq(*s, o) && within(s, o) && o.3 > s.3)
        })
        .collect();
    let covered: f64 = children.iter().map(|s| s.3).sum();
    assert!(
        covered <= step_dur + eps && covered >= 0.9 * step_dur,
        "top-level spans {covered} µs of the step's {step_dur} µs (from {step_ts}): {children:?}"
    );
}

/// Records the checkpoint folders of `out` after every save.
struct CheckpointLister {
    out: PathBuf,
    seen: std::sync::Arc<std::sync::Mutex<Vec<Vec<usize>>>>,
}

impl candle_qlora::trainer::TrainerCallback for CheckpointLister {
    fn name(&self) -> &str {
        "CheckpointLister"
    }

    fn on_save(
        &mut self,
        _args: &TrainingArguments,
        _state: &candle_qlora::trainer::TrainerState,
        _dir: &Path,
    ) -> candle_qlora::Result<()> {
        let steps = candle_qlora::trainer::checkpoint::checkpoints(&self.out);
        let steps = steps.into_iter().map(|(s, _)| s).collect();
        self.seen.lock().unwrap().push(steps);
        Ok(())
    }
}

/// `save_total_limit = 1` as transformers 5: with `metric_for_best_model` the best checkpoint stays beside the
/// newest while training and alone at the end; without it only the newest stays. The learning rate is 0, so the
/// evaluation loss never improves on the first evaluation's and checkpoint-1 is the best.
#[test]
fn save_total_limit_keeps_the_best_checkpoint_as_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, metric: Option<&str>| {
        let out = dir.path().join(name);
        let mut t = trainer_with(
            &out,
            |a| {
                a.learning_rate = 0.0;
                a.max_steps = 4;
                a.save_steps = 1.0;
                a.save_total_limit = Some(1);
                a.eval_strategy = IntervalStrategy::Steps;
                a.eval_steps = Some(1.0);
                a.metric_for_best_model = metric.map(String::from);
            },
            examples()[..4].to_vec(),
        );
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        t.add_callback(Box::new(CheckpointLister {
            out: out.clone(),
            seen: seen.clone(),
        }));
        t.train(None).unwrap();
        let at_end: Vec<usize> = candle_qlora::trainer::checkpoint::checkpoints(&out)
            .into_iter()
            .map(|(s, _)| s)
            .collect();
        let best = t.state().best_model_checkpoint.clone();
        let seen = seen.lock().unwrap().clone();
        (seen, at_end, best)
    };
    let (seen, at_end, best) = run("best", Some("eval_loss"));
    assert_eq!(seen, [vec![1], vec![1, 2], vec![1, 3], vec![1, 4]]);
    assert_eq!(at_end, [1]);
    assert!(best.is_some_and(|b| b.ends_with("checkpoint-1")));
    let (seen, at_end, best) = run("newest", None);
    assert_eq!(seen, [vec![1], vec![2], vec![3], vec![4]]);
    assert_eq!((at_end, best), (vec![4], None));
}

/// The tensors of the adapter in folder `dir`, exactly (as f32: every saved dtype converts without rounding).
pub(crate) fn adapter_tensors(dir: &Path) -> std::collections::BTreeMap<String, Vec<f32>> {
    candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(k, t)| {
            let values = t.to_dtype(candle_core::DType::F32).unwrap();
            (k, values.flatten_all().unwrap().to_vec1().unwrap())
        })
        .collect()
}

/// `load_best_model_at_end` as transformers 5: at a learning rate of 0.2 the tiny run's evaluation loss is lowest
/// at step 4 (4.59; 4.98 at steps 6 and 8), so the adapter written to `output_dir` is checkpoint-4's, tensor for
/// tensor, not the last step's, announced as transformers logs it with the checkpoint's score. A run resumed from
/// checkpoint-6 (whose state records the best checkpoint) loads it at its end too.
#[test]
fn load_best_model_at_end_writes_the_best_checkpoints_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(
        dir.path(),
        "eval_split = 0.25\n",
        "max_steps = 8\nlearning_rate = 0.2\nlr_scheduler_type = \"constant\"\nlogging_steps = 1\n\
         eval_strategy = \"steps\"\neval_steps = 2\nsave_steps = 2\nload_best_model_at_end = true\n",
    );
    let out = dir.path().join("out");
    let (ok, text) = run_train(&config, &[]);
    assert!(ok, "{text}");
    // The evaluations: lowest at step 4, and the last step's worse.
    let evals: Vec<(u64, f64)> = std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter_map(|v| Some((v["step"].as_u64()?, v["eval_loss"].as_f64()?)))
        .collect();
    let steps: Vec<u64> = evals.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, [2, 4, 6, 8], "{evals:?}");
    let best = *evals.iter().min_by(|a, b| a.1.total_cmp(&b.1)).unwrap();
    assert_eq!(best.0, 4, "the best evaluation is not the last: {evals:?}");
    let best_dir = out.join("checkpoint-4");
    let line = format!(
        "Loading best model from {} (score: {}).",
        best_dir.display(),
        best.1
    );
    assert!(text.contains(&line), "{line}\n{text}");
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-8/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        state["best_model_checkpoint"].as_str(),
        Some(best_dir.to_str().unwrap())
    );
    let (last, best_adapter) = (
        adapter_tensors(&out.join("checkpoint-8")),
        adapter_tensors(&best_dir),
    );
    assert_ne!(best_adapter, last, "the best and the last adapters differ");
    assert!(
        adapter_tensors(&out) == best_adapter,
        "output_dir holds the best adapter"
    );

    // Resumed after the best checkpoint: the resumed run ends with the best adapter as well.
    std::fs::remove_dir_all(out.join("checkpoint-8")).unwrap();
    std::fs::remove_file(out.join("adapter_model.safetensors")).unwrap();
    let (ok, text) = run_train(&config, &["--resume"]);
    assert!(ok && text.contains(&line), "{text}");
    assert_eq!(adapter_tensors(&out.join("checkpoint-8")), last);
    assert!(
        adapter_tensors(&out) == best_adapter,
        "resumed: output_dir holds the best adapter"
    );

    // A damaged best adapter (its manifest's SHA-256) is an error naming it, not a silent last model.
    let weights = best_dir.join("adapter_model.safetensors");
    let good = std::fs::read(&weights).unwrap();
    let mut bad = good.clone();
    let middle = bad.len() - 8;
    bad[middle] ^= 1;
    std::fs::write(&weights, bad).unwrap();
    std::fs::remove_dir_all(out.join("checkpoint-8")).unwrap();
    let (ok, text) = run_train(&config, &["--resume"]);
    assert!(
        !ok && text.contains("adapter_model.safetensors") && text.contains("damaged"),
        "{text}"
    );
    std::fs::write(&weights, good).unwrap();

    // The best checkpoint removed: forgotten on resume (as transformers), and the last model is kept, saying why.
    std::fs::remove_dir_all(&best_dir).unwrap();
    let _ = std::fs::remove_dir_all(out.join("checkpoint-8"));
    let (ok, text) = run_train(&config, &["--resume"]);
    assert!(ok, "{text}");
    assert!(
        text.contains("recorded in the resumed state does not exist anymore")
            && text.contains(&format!(
                "no best checkpoint to load (the best evaluation, eval_loss {} at step 4, has no checkpoint)",
                best.1
            )),
        "{text}"
    );
    assert_eq!(adapter_tensors(&out), last);
}

/// Examples of 40 to 60 tokens of tiny `model`, so that a micro-batch of 2 has more token rows than the tiny
/// models' hidden size (64): their MLPs then run in two or more slices when tiled.
fn long_examples(model: &str) -> Vec<candle_qlora::data::TokenizedExample> {
    let loaded = load_model(
        data_path(&format!("models/{model}")).to_str().unwrap(),
        None,
        &LoadOptions::default(),
    )
    .unwrap();
    let tok = loaded.tokenizer.unwrap();
    (0..8)
        .map(|i| {
            let text: Vec<String> = (0..20 + 3 * i)
                .map(|j| format!("t{}", 1 + (i * 5 + j * 7) % 50))
                .collect();
            Example::Text(text.join(" "))
                .tokenize(&tok, 200, false)
                .unwrap()
        })
        .collect()
}

/// Activation offload changes where the layer inputs wait, not what is computed: the same losses and adapter, bit
/// for bit, with the MLP tiled or not and with a mixture of experts' router loss (on the CPU the inputs stay in
/// place; the GPU suite checks the copies). It needs checkpointing.
#[test]
fn activation_offloading_trains_as_without_it() {
    let dir = tempfile::tempdir().unwrap();
    for (model, tiled_mlp) in [
        ("tiny-llama", false),
        ("tiny-llama", true),
        ("tiny-qwen2-moe", false),
    ] {
        let run = |activation_offloading| {
            let how = TiledRun {
                model,
                compute_dtype: candle_core::DType::F32,
                tiled_mlp,
                gradient_checkpointing: true,
                lora_dropout: 0.0,
                activation_offloading,
            };
            let out = dir
                .path()
                .join(format!("{model}-{tiled_mlp}-{activation_offloading}"));
            tiled_run(&out, &how).unwrap()
        };
        let ((l0, a0), (l1, a1)) = (run(false), run(true));
        assert_eq!(l0, l1, "{model}, tiled MLP {tiled_mlp}");
        for (k, t) in &a0 {
            assert_eq!(crate::common::max_abs_diff(t, &a1[k]), 0.0, "{k}");
        }
    }
    let unchecked = TiledRun {
        model: "tiny-llama",
        compute_dtype: candle_core::DType::F32,
        tiled_mlp: false,
        gradient_checkpointing: false,
        lora_dropout: 0.0,
        activation_offloading: true,
    };
    let err = tiled_run(&dir.path().join("unchecked"), &unchecked)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("activation_offloading") && err.contains("gradient_checkpointing = true"),
        "{err}"
    );
}

/// How a [`tiled_run`] runs.
struct TiledRun {
    model: &'static str,
    compute_dtype: candle_core::DType,
    tiled_mlp: bool,
    gradient_checkpointing: bool,
    lora_dropout: f64,
    activation_offloading: bool,
}

/// A 4-step run of a tiny model (NF4 base, AdamW, LoRA r 4 on every projection, evaluated every 2 steps) as `run`
/// says: its logged training then evaluation losses, and its adapter.
fn tiled_run(
    dir: &Path,
    run: &TiledRun,
) -> candle_qlora::Result<(
    Vec<f64>,
    std::collections::HashMap<String, candle_core::Tensor>,
)> {
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        compute_dtype: run.compute_dtype,
        ..Default::default()
    };
    let path = data_path(&format!("models/{}", run.model));
    let model = load_model(path.to_str().unwrap(), None, &opts)?.model;
    let args = TrainingArguments {
        output_dir: dir.display().to_string(),
        per_device_train_batch_size: 2,
        gradient_accumulation_steps: 2,
        learning_rate: 5e-3,
        max_steps: 4,
        optim: OptimizerName::AdamWTorch,
        logging_steps: 1.0,
        save_steps: 100.0,
        gradient_checkpointing: run.gradient_checkpointing,
        tiled_mlp: run.tiled_mlp,
        activation_offloading: run.activation_offloading,
        eval_strategy: IntervalStrategy::Steps,
        eval_steps: Some(2.0),
        ..Default::default()
    };
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout: run.lora_dropout,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    let examples = long_examples(run.model);
    let eval = examples[4..].to_vec();
    let mut trainer = Trainer::new(model, args, &lora, examples, eval)?;
    let log = trainer.train(None)?;
    // The training losses, then the evaluation losses (evaluations run tiled too).
    let losses = log.log_history.iter().filter_map(|e| e.loss);
    let losses = losses
        .chain(log.log_history.iter().filter_map(|e| e.eval_loss))
        .collect();
    // The factors in memory (float64 for a float64 model; the adapter file holds float32, PEFT's).
    let mut adapter = std::collections::HashMap::new();
    for (name, linear) in trainer.model.linears() {
        if let Some(ad) = linear.active_adapter() {
            adapter.insert(format!("{name}.lora_A"), ad.a.as_tensor().clone());
            adapter.insert(format!("{name}.lora_B"), ad.b.as_tensor().clone());
        }
    }
    Ok((losses, adapter))
}

/// `tiled_mlp = true` trains as the untiled MLP, with gradient checkpointing on and off, on the tiny Llama and on
/// the tiny Qwen2-MoE (whose shared expert runs tiled over the micro-batch's ~100 rows; its routed experts' share
/// stays under one slice here: `models/moe.rs` checks tiled experts). In float64 the losses and the adapter agree
/// within 1e-10: the per-row values equal the untiled ones up to the order of a dot product's terms, and the
/// adapter's gradients — sums over the ~100 token rows of a micro-batch, accumulated slice by slice — differ by at
/// most 2·γₙ·Σ|terms| ≈ 2·100·1.1e-16·Σ|terms| ≈ 2e-14·Σ|terms| per step; AdamW's update divides the gradient by
/// its own running magnitude, so 4 steps keep the relative difference of that order (1e-10 leaves a margin of 10⁴
/// for Σ|terms| over |sum|). A tiled MLP with LoRA dropout on it is refused (its mask is drawn over the whole
/// input), as an error, not a panic.
#[test]
fn tiled_mlp_trains_as_the_untiled_mlp() {
    let dir = tempfile::tempdir().unwrap();
    let f64 = candle_core::DType::F64;
    for (model, checkpointing) in [
        ("tiny-llama", true),
        ("tiny-llama", false),
        ("tiny-qwen2-moe", true),
    ] {
        let run = |tiled_mlp| {
            let out = dir
                .path()
                .join(format!("{model}-{checkpointing}-{tiled_mlp}"));
            let how = TiledRun {
                model,
                compute_dtype: f64,
                tiled_mlp,
                gradient_checkpointing: checkpointing,
                lora_dropout: 0.0,
                activation_offloading: false,
            };
            tiled_run(&out, &how).unwrap()
        };
        let ((l0, a0), (l1, a1)) = (run(false), run(true));
        let case = format!("{model}, checkpointing {checkpointing}");
        assert_eq!(l0.len(), 6, "4 training and 2 evaluation losses");
        for (a, b) in l0.iter().zip(&l1) {
            assert!((a - b).abs() <= 1e-10 * a.abs(), "{case}: {l0:?} vs {l1:?}");
        }
        assert_eq!(a0.len(), a1.len());
        let worst = a0
            .iter()
            .map(|(k, t)| crate::common::max_abs_diff(t, &a1[k]))
            .fold(0.0, f64::max);
        let loss_diff = l0
            .iter()
            .zip(&l1)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        eprintln!("float64, {case}: losses max |Δ| {loss_diff:e}, adapter max |Δ| {worst:e}");
        for (k, t) in &a0 {
            let scale: f64 = t.abs().unwrap().max_all().unwrap().to_scalar().unwrap();
            let diff = crate::common::max_abs_diff(t, &a1[k]);
            assert!(diff <= 1e-10 * scale.max(1e-3), "{k}: {diff:e} ({case})");
        }
    }
    // Float32, the CPU's training dtype: how far the tiled run is from the untiled one, for the report.
    let f32_run = |tiled_mlp, lora_dropout| TiledRun {
        model: "tiny-llama",
        compute_dtype: candle_core::DType::F32,
        tiled_mlp,
        gradient_checkpointing: true,
        lora_dropout,
        activation_offloading: false,
    };
    let (l0, a0) = tiled_run(&dir.path().join("f32-plain"), &f32_run(false, 0.0)).unwrap();
    let (l1, a1) = tiled_run(&dir.path().join("f32-tiled"), &f32_run(true, 0.0)).unwrap();
    let worst = a0
        .iter()
        .map(|(k, t)| crate::common::max_abs_diff(t, &a1[k]))
        .fold(0.0, f64::max);
    eprintln!("float32: losses {l0:?} vs {l1:?}, adapter max |Δ| {worst:e}");

    let err = tiled_run(&dir.path().join("dropout"), &f32_run(true, 0.1))
        .unwrap_err()
        .to_string();
    assert!(err.contains("lora_dropout"), "{err}");
}
