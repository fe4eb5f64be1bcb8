//! Settings that matched or changed nothing and were once accepted: the bad-input table's rows for them
//! (`bad_inputs::Case`, each advice applied as there), and tests of the settings that now take effect instead of
//! being refused: `load_best_model_at_end` at a partial epoch, DPO's metrics for the best model, an empty
//! `TENSORBOARD_LOGGING_DIR`.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::bad_inputs::{failures, Case};
use crate::common::data_path;
use crate::trainer::write_tiny_config;

/// `args` as owned strings.
fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|a| a.to_string()).collect()
}

/// `qlora train --config config` with `--set` overrides `sets`, in an output folder it may overwrite.
fn train(config: &Path, sets: &[&str]) -> Vec<String> {
    let mut args = strings(&["train", "--config", &config.display().to_string()]);
    for s in sets.iter().chain(&["training.overwrite_output_dir=true"]) {
        args.extend(strings(&["--set", s]));
    }
    args
}

/// Runs `qlora args…` in `dir`: (exit code, stdout + stderr).
fn run(dir: &Path, args: &[String]) -> (i32, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// The `--set` naming `path` as the model.
fn model_set(path: &Path) -> String {
    format!("model.name_or_path={:?}", path.display().to_string())
}

/// The `--set` naming `path` as `key` of `[data]`.
fn data_set(key: &str, path: &Path) -> String {
    format!("data.{key}={:?}", path.display().to_string())
}

/// DPO's settings on the tiny Llama with a chat template and EOS, training on `dpo/pairs.jsonl`, then `more`.
fn dpo(more: &[&str]) -> Vec<String> {
    let mut sets = vec![
        "dpo.beta=0.1".to_string(),
        model_set(&data_path("dpo/tiny-llama-chat")),
        data_set("train_file", &data_path("dpo/pairs.jsonl")),
    ];
    sets.extend(more.iter().map(|s| s.to_string()));
    sets
}

/// A model folder whose weights cannot be read: a row that stops before them passed every earlier check.
fn write_unreadable_model(dir: &Path) -> PathBuf {
    let model = dir.join("unreadable_weights");
    std::fs::create_dir_all(&model).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(data_path("models/tiny-llama").join(f), model.join(f)).unwrap();
    }
    std::fs::write(model.join("model.safetensors"), "not weights").unwrap();
    model
}

/// A DPO run of two steps saving each, in `dir/dpo_run`: its first checkpoint.
fn write_dpo_checkpoint(dir: &Path, config: &Path) -> PathBuf {
    let out = dir.join("dpo_run");
    let sets = dpo(&[
        &format!("training.output_dir={:?}", out.display().to_string()),
        "training.max_steps=2",
        "training.save_strategy=\"steps\"",
        "training.save_steps=1",
        "training.per_device_train_batch_size=1",
    ]);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let (code, text) = run(dir, &train(config, &sets));
    assert_eq!(code, 0, "{text}");
    out.join("checkpoint-1")
}

fn cases(dir: &Path) -> Vec<Case> {
    let config = write_tiny_config(dir, "", "max_steps = 1\nsave_strategy = \"no\"\n");
    let unreadable = model_set(&write_unreadable_model(dir));
    let case = |args: Vec<String>, exit: i32, says: &'static str| Case {
        args,
        exit,
        says,
        fix: None,
    };
    let train = |sets: &[&str]| train(&config, sets);
    let early = |sets: &[&str]| train(&[&[unreadable.as_str()], sets].concat());
    let dpo_train = |more: &[&str]| {
        let sets = dpo(more);
        train(&sets.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let moe = |name: &str| model_set(&data_path(&format!("models/{name}")));
    let experts = "lora.target_parameters=[\"mlp.gate.weight\", \"mlp.experts.gate_up_proj\", \
                   \"mlp.experts.down_proj\"]";
    // Pairs whose chosen and rejected are equal on every line; evaluation pairs, one with empty equal answers.
    let equal = dir.join("equal_pairs.jsonl");
    std::fs::write(
        &equal,
        "{\"prompt\": \"t5 t6\", \"chosen\": \" t8\", \"rejected\": \" t8\"}\n\
         {\"prompt\": \"t11\", \"chosen\": \" t13 t14\", \"rejected\": \" t13 t14\"}\n",
    )
    .unwrap();
    let empty_eval = dir.join("empty_eval.jsonl");
    std::fs::write(
        &empty_eval,
        "{\"prompt\": \"t5 t6\", \"chosen\": \" t8\", \"rejected\": \" t9\"}\n\
         {\"prompt\": \"t11\", \"chosen\": \"\", \"rejected\": \"\"}\n",
    )
    .unwrap();
    let equal_set = data_set("train_file", &equal);
    let eval_set = data_set("eval_file", &empty_eval);
    // A DPO checkpoint, resumed with [model] adapter added (a copy of its own first checkpoint's adapter, so the
    // LoRA settings agree and only the reference changes; outside output_dir, which may not hold what a run reads).
    let checkpoint = write_dpo_checkpoint(dir, &config);
    let continued = dir.join("continued_adapter");
    std::fs::create_dir_all(&continued).unwrap();
    for file in std::fs::read_dir(&checkpoint).unwrap() {
        let file = file.unwrap().path();
        if file.is_file() {
            std::fs::copy(&file, continued.join(file.file_name().unwrap())).unwrap();
        }
    }
    let resumed = |adapter: bool| {
        let out = format!(
            "training.output_dir={:?}",
            dir.join("dpo_run").display().to_string()
        );
        let with = format!("model.adapter={:?}", continued.display().to_string());
        let mut sets = vec![
            out.as_str(),
            "training.max_steps=2",
            "training.per_device_train_batch_size=1",
        ];
        if adapter {
            sets.push(&with);
        }
        let mut args = dpo_train(&sets);
        args.extend(strings(&["--resume", &checkpoint.display().to_string()]));
        args
    };
    let estimate = |world: &str| {
        strings(&[
            "estimate",
            "--model",
            &data_path("models/tiny-llama").display().to_string(),
            "--dpo",
            "--device",
            "cuda",
            "--world-size",
            world,
        ])
    };
    vec![
        // lora.target_parameters naming nothing that exists: a dense model, a made-up parameter, a checkpoint's
        // tensor name for a parameter.
        case(
            train(&[
                "lora.target_parameters=[\"mlp.experts.gate_up_proj\"]",
                "lora.lora_dropout=0",
            ]),
            1,
            "[lora] target_parameters = [\"mlp.experts.gate_up_proj\"]: this llama model has no mixture-of-experts \
             layer",
        )
        .fixed_by(&["lora.target_parameters=[]"]),
        case(
            train(&[
                &moe("tiny-mixtral"),
                "lora.target_parameters=[\"mlp.experts.up_proj\"]",
                "lora.lora_dropout=0",
            ]),
            1,
            "`mlp.experts.up_proj` matches no parameter of this model; the parameters PEFT can adapt are \
             mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj",
        )
        .fixed_by(&[experts]),
        case(
            train(&[
                &moe("tiny-mixtral"),
                "lora.target_parameters=[\"block_sparse_moe.experts.0.w1.weight\"]",
                "lora.lora_dropout=0",
            ]),
            1,
            "transformers' module path and parameter name, which a checkpoint's tensor names need not be",
        )
        .fixed_by(&[experts]),
        // Preference pairs with nothing to prefer: equal answers on every line, and evaluation pairs whose
        // answers are empty and equal (TRL would count them in the accuracy as ties).
        case(
            dpo_train(&[&equal_set]),
            1,
            "equal_pairs.jsonl:1: `chosen` and `rejected` are the same: there is no preference to learn",
        )
        .fixed_as(dpo_train(&[])),
        case(
            dpo_train(&[&eval_set]),
            1,
            "empty_eval.jsonl:2: `chosen` and `rejected` are the same",
        )
        .fixed_by(&["data.skip_bad_lines=true"]),
        // A loss never finite (IPO with beta 1e-30): every update skipped is an error, not the unchanged adapter
        // saved; and with the limit of steps in a row reached, the advice is the loss's settings.
        case(
            dpo_train(&["dpo.beta=1e-30", "dpo.loss_type=\"ipo\""]),
            1,
            "the loss was not finite at any of this run's 1 step(s), so every update was skipped",
        )
        .fixed_by(&["dpo.beta=0.1"]),
        case(
            dpo_train(&[
                "dpo.beta=1e-30",
                "dpo.loss_type=\"ipo\"",
                "training.max_steps=3",
                "training.max_consecutive_nonfinite_losses=2",
            ]),
            1,
            "the learning rate is not the cause: check [dpo] beta (now 1e-30",
        )
        .fixed_by(&["dpo.beta=0.1"]),
        case(
            dpo_train(&["dpo.loss_weights=[-1.0]"]),
            1,
            "[dpo]: loss_weights[0] = -1 (for loss_type \"sigmoid\"): must be a number ≥ 0",
        )
        .fixed_by(&["dpo.loss_weights=[1.0]"]),
        // --resume after adding [model] adapter would change the DPO reference.
        case(
            resumed(true),
            1,
            "resuming would change the reference mid-run; remove [model] adapter to resume this run",
        )
        .fixed_as(resumed(false)),
        case(
            early(&["training.trace_steps=[5]"]),
            1,
            "trace_steps holds 5, a step this run never takes: it has optimizer steps 1 to 1; trace steps in that \
             range, e.g. trace_steps = [1]",
        )
        .fixed_by(&["training.trace_steps=[1]"]),
        case(
            estimate("2"),
            1,
            "--world-size 2 with --dpo: DPO runs in one process for now, and qlora train refuses it",
        )
        .fixed_as(estimate("1")),
        // metric_for_best_model: what the evaluation logs, DPO's metrics included (as TRL).
        case(
            early(&[
                "training.metric_for_best_model=\"eval_rewards/accuracies\"",
                "training.eval_strategy=\"steps\"",
                "data.eval_split=0.25",
            ]),
            1,
            "metric_for_best_model = \"eval_rewards/accuracies\": this run's evaluation logs no \
             eval_rewards/accuracies; it logs \"eval_loss\"",
        )
        .fixed_by(&["training.metric_for_best_model=\"eval_loss\""]),
        case(
            dpo_train(&[
                "training.metric_for_best_model=\"eval_rewards/accuracies\"",
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"epoch\"",
                "training.save_strategy=\"epoch\"",
                "data.eval_split=0.25",
            ]),
            0,
            "Loading best model from",
        ),
    ]
}

#[test]
fn settings_that_change_nothing_are_refused_with_a_fix() {
    let dir = tempfile::tempdir().unwrap();
    let failures = failures(dir.path(), cases(dir.path()));
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

/// The log entries of run folder `out`.
fn log(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("log.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// As transformers 5 (its epoch loop ends at `max_steps` and calls `on_epoch_end`): with the epoch strategies and
/// `max_steps` shorter than an epoch, the last step evaluates and saves, and `load_best_model_at_end` loads it.
#[test]
fn a_partial_last_epoch_evaluates_and_saves_for_the_best_model() {
    let dir = tempfile::tempdir().unwrap();
    // 16 examples, 4 held out: 6 steps of 2 per epoch; the run stops at 2.
    let config = write_tiny_config(dir.path(), "eval_split = 0.25\n", "max_steps = 2\n");
    let (code, text) = run(
        dir.path(),
        &train(
            &config,
            &[
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"epoch\"",
                "training.save_strategy=\"epoch\"",
            ],
        ),
    );
    assert_eq!(code, 0, "{text}");
    let out = dir.path().join("out");
    let evaluated: Vec<u64> = log(&out)
        .iter()
        .filter(|e| e.get("eval_loss").is_some())
        .map(|e| e["step"].as_u64().unwrap())
        .collect();
    assert_eq!(evaluated, [2], "{text}");
    assert!(out.join("checkpoint-2").is_dir(), "{text}");
    assert!(text.contains("Loading best model from"), "{text}");
}

/// DPO's `eval_rewards/accuracies` picks the best checkpoint as TRL's trainer would: higher is better (the name
/// does not end in `loss`), the first evaluation reaching the highest value is the best.
#[test]
fn dpo_metrics_pick_the_best_checkpoint_higher_being_better() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(dir.path(), "", "");
    let sets = dpo(&[
        "training.metric_for_best_model=\"rewards/accuracies\"",
        "training.eval_strategy=\"steps\"",
        "training.eval_steps=1",
        "training.save_strategy=\"steps\"",
        "training.save_steps=1",
        "training.max_steps=3",
        "training.per_device_train_batch_size=1",
        "training.learning_rate=0.01",
        "data.eval_split=0.5",
    ]);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let (code, text) = run(dir.path(), &train(&config, &sets));
    assert_eq!(code, 0, "{text}");
    let out = dir.path().join("out");
    let evaluations: Vec<(u64, f64)> = log(&out)
        .iter()
        .filter_map(|e| {
            Some((
                e["step"].as_u64()?,
                e.get("eval_rewards/accuracies")?.as_f64()?,
            ))
        })
        .collect();
    assert_eq!(evaluations.len(), 3, "{text}");
    let highest = evaluations.iter().map(|e| e.1).fold(f64::MIN, f64::max);
    let first_best = evaluations.iter().find(|e| e.1 == highest).unwrap().0;
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("checkpoint-3/trainer_state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        state["best_metric"].as_f64(),
        Some(highest),
        "{evaluations:?}"
    );
    assert_eq!(
        state["best_global_step"].as_u64(),
        Some(first_best),
        "{evaluations:?}"
    );
    let best = state["best_model_checkpoint"].as_str().unwrap();
    assert!(
        best.ends_with(&format!("checkpoint-{first_best}")),
        "{best}"
    );
}

/// `TENSORBOARD_LOGGING_DIR` set but empty is unset: the events go to transformers' default folder under
/// `output_dir`, not into the working directory.
#[test]
fn an_empty_tensorboard_logging_dir_is_unset() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(dir.path(), "", "max_steps = 1\nsave_strategy = \"no\"\n");
    let args = train(&config, &["training.report_to=\"tensorboard\""]);
    let out = Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(&args)
        .current_dir(dir.path())
        .env("TENSORBOARD_LOGGING_DIR", "")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    let events = |d: &Path| {
        std::fs::read_dir(d)
            .map(|r| {
                r.filter(|e| {
                    let name = e.as_ref().unwrap().file_name();
                    name.to_string_lossy().starts_with("events.out.tfevents")
                })
                .count()
            })
            .unwrap_or(0)
    };
    assert_eq!(
        events(dir.path()),
        0,
        "an event file in the working directory"
    );
    let runs = dir.path().join("out/runs");
    let folders: Vec<PathBuf> = std::fs::read_dir(&runs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(folders.len(), 1, "{folders:?}");
    assert_eq!(events(&folders[0]), 1);
}
