//! What a user types wrong, through the `qlora` command: each case is an input, the exit code it must give and a
//! phrase its message must contain — and no case may panic. A case whose message says what to do carries that
//! advice, applied (`fixed_by`…): the command with it must get past the error. Add a row for every bad input found.

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use candle_core::{Device, Tensor};
use candle_qlora::trainer::config::RunConfig;
use serde_json::json;

use crate::common::data_path;
use crate::trainer::write_tiny_config;

/// One bad (or degenerate) input.
pub(crate) struct Case {
    /// The command's arguments.
    pub(crate) args: Vec<String>,
    /// The exit code it must end with (1: an error; 0: accepted, with the message as a note).
    pub(crate) exit: i32,
    /// A phrase of its output.
    pub(crate) says: &'static str,
    /// The message's advice applied: the command's arguments with it. That command must no longer say `says` and
    /// must succeed — or stop later, at [`Fix::then`], or at the unreadable weights of the `early` runs (every check
    /// before them passed).
    pub(crate) fix: Option<Fix>,
}

/// A case's advice, applied.
pub(crate) struct Fix {
    /// The command with the advice applied.
    args: Vec<String>,
    /// A phrase of a later check the advice leads to, where the fixed command may stop instead of succeeding.
    then: Option<&'static str>,
}

/// What the `early` runs print once every check before the weights passed: their weights are not safetensors.
const REACHED_THE_WEIGHTS: &str = "model.safetensors`: not a valid safetensors file";

impl Case {
    /// The advice is these `--set` overrides, added to the command.
    pub(crate) fn fixed_by(self, sets: &[&str]) -> Self {
        let flags: Vec<&str> = sets.iter().flat_map(|s| ["--set", s]).collect();
        self.fixed_with(&flags)
    }

    /// The advice is these arguments, added to the command.
    pub(crate) fn fixed_with(self, extra: &[&str]) -> Self {
        let mut args = self.args.clone();
        args.extend(extra.iter().map(|a| a.to_string()));
        self.fixed_as(args)
    }

    /// The advice turns the command into `args`.
    pub(crate) fn fixed_as(mut self, args: Vec<String>) -> Self {
        self.fix = Some(Fix { args, then: None });
        self
    }

    /// The fixed command may stop at the later check that says `phrase`.
    pub(crate) fn then(mut self, phrase: &'static str) -> Self {
        if let Some(fix) = &mut self.fix {
            fix.then = Some(phrase);
        }
        self
    }
}

/// Input files beside the tiny config: an empty example among good ones, and completion data whose answers are
/// empty.
fn write_inputs(dir: &Path) {
    let mut good: Vec<String> = (0..8)
        .map(|i| format!("{{\"text\": \"t{} t{} t{}\"}}", i + 3, i + 5, i + 7))
        .collect();
    good.push("{\"text\": \"\"}".into());
    std::fs::write(dir.join("with_empty.jsonl"), good.join("\n")).unwrap();
    std::fs::write(
        dir.join("no_answers.jsonl"),
        "{\"instruction\": \"say t3\", \"output\": \"\"}\n{\"instruction\": \"say t4\", \"output\": \"\"}\n",
    )
    .unwrap();
    // A Latin-1 byte on line 2.
    let mut latin1 = b"{\"text\": \"t3 t4\"}\n{\"text\": \"t3 ".to_vec();
    latin1.extend(b"\xe9 t5\"}\n{\"text\": \"t5 t6\"}\n");
    std::fs::write(dir.join("latin1.jsonl"), latin1).unwrap();
    std::fs::write(
        dir.join("chat.jsonl"),
        "{\"messages\": [{\"role\": \"user\", \"content\": \"t3\"}, {\"role\": \"assistant\", \"content\": \"t4\"}]}\n",
    )
    .unwrap();
    // Preference pairs: one whose rejected answer is a list of messages while the chosen one is text.
    std::fs::write(
        dir.join("mixed_pairs.jsonl"),
        "{\"prompt\": \"t3\", \"chosen\": \"t4\", \"rejected\": \"t5\"}\n\
         {\"prompt\": \"t3\", \"chosen\": \"t4\", \"rejected\": [{\"role\": \"assistant\", \"content\": \"t5\"}]}\n",
    )
    .unwrap();
    // A model folder whose weights cannot be read: data errors must come before the weights are loaded.
    let unreadable = dir.join("unreadable_weights");
    std::fs::create_dir_all(&unreadable).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(data_path("models/tiny-llama").join(f), unreadable.join(f)).unwrap();
    }
    std::fs::write(unreadable.join("model.safetensors"), "not weights").unwrap();
    // Preference pairs whose prompts are longer than 3 tokens.
    std::fs::write(
        dir.join("long_prompts.jsonl"),
        "{\"prompt\": \"t5 t6 t7 t8 t9\", \"chosen\": \" t10\", \"rejected\": \" t11\"}\n\
         {\"prompt\": \"t5 t6 t7 t8 t12\", \"chosen\": \" t13 t14\", \"rejected\": \" t15\"}\n",
    )
    .unwrap();
    // The output folder of a finished run that saved no checkpoint: its adapter alone.
    std::fs::create_dir_all(dir.join("finished")).unwrap();
    std::fs::write(dir.join("finished/adapter_model.safetensors"), "an adapter").unwrap();
    write_foreign_adapter(&dir.join("foreign_adapter"));
    write_nan_adapter(&dir.join("nan_adapter"));
    write_nan_model(&dir.join("nan_model"));
}

/// Trains the tiny config two steps on instruction data (`instructions.jsonl`, written beside it with an edited
/// copy, `instructions_edited.jsonl`) into
/// `dir/resumable`, returning its checkpoint.
fn write_checkpoint(dir: &Path, config: &Path) -> std::path::PathBuf {
    let lines: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "{{\"instruction\": \"say t{}\", \"output\": \"t{} t{}\"}}",
                i + 3,
                i + 4,
                i + 5
            )
        })
        .collect();
    std::fs::write(dir.join("instructions.jsonl"), lines.join("\n")).unwrap();
    // The same number of examples, one answer changed.
    let edited = lines.join("\n").replacen("t4 t5", "t4 t6", 1);
    std::fs::write(dir.join("instructions_edited.jsonl"), edited).unwrap();
    let out = dir.join("resumable");
    let status = Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(["train", "--config", config.to_str().unwrap()])
        .args(["--set", "data.train_file=\"instructions.jsonl\""])
        .args([
            "--set",
            &format!("training.output_dir={:?}", out.display().to_string()),
        ])
        .args([
            "--set",
            "training.max_steps=2",
            "--set",
            "training.save_strategy=\"steps\"",
        ])
        .args(["--set", "training.save_steps=2"])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    out.join("checkpoint-2")
}

/// The tiny Llama's all-linear PEFT adapter written to `out` with its tensors changed by `change`.
fn write_changed_adapter(out: &Path, change: impl FnOnce(&mut HashMap<String, Tensor>)) {
    let source = data_path("peft/lora_all_linear");
    std::fs::create_dir_all(out).unwrap();
    std::fs::copy(
        source.join("adapter_config.json"),
        out.join("adapter_config.json"),
    )
    .unwrap();
    let mut tensors =
        candle_core::safetensors::load(source.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    change(&mut tensors);
    candle_core::safetensors::save(&tensors, out.join("adapter_model.safetensors")).unwrap();
}

/// A PEFT adapter for a narrower model (every LoRA matrix cut to half its input or output width).
fn write_foreign_adapter(out: &Path) {
    write_changed_adapter(out, |tensors| {
        for (k, t) in tensors.iter_mut() {
            let dim = if k.contains("lora_A") { 1 } else { 0 };
            let half = t.dim(dim).unwrap() / 2;
            *t = t.narrow(dim, 0, half).unwrap();
        }
    });
}

/// The adapter with a NaN in one `lora_B` (as a diverged run would leave it).
fn write_nan_adapter(out: &Path) {
    write_changed_adapter(out, |tensors| {
        let key = tensors
            .keys()
            .find(|k| k.contains("lora_B"))
            .unwrap()
            .clone();
        let t = &tensors[&key];
        let nan = Tensor::full(f32::NAN, t.shape(), &Device::Cpu)
            .unwrap()
            .to_dtype(t.dtype())
            .unwrap();
        tensors.insert(key, nan);
    });
}

/// The tiny Llama with a NaN in its final norm.
fn write_nan_model(out: &Path) {
    let source = data_path("models/tiny-llama");
    std::fs::create_dir_all(out).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(source.join(f), out.join(f)).unwrap();
    }
    let mut tensors =
        candle_core::safetensors::load(source.join("model.safetensors"), &Device::Cpu).unwrap();
    let norm = &tensors["model.norm.weight"];
    let nan = Tensor::full(f32::NAN, 1, &Device::Cpu)
        .unwrap()
        .to_dtype(norm.dtype())
        .unwrap();
    let rest = norm.narrow(0, 1, norm.dim(0).unwrap() - 1).unwrap();
    let damaged = Tensor::cat(&[&nan, &rest], 0).unwrap();
    tensors.insert("model.norm.weight".into(), damaged);
    candle_core::safetensors::save(&tensors, out.join("model.safetensors")).unwrap();
}

/// The tiny MXFP4 gpt-oss with one expert scale set to 255 (E8M0's NaN) at `out/nan-scale`, and with a YaRN
/// `rope_parameters` that lacks `original_max_position_embeddings` at `out/bad-yarn`.
fn write_damaged_gpt_oss(out: &Path) {
    let source = data_path("models/tiny-gpt-oss-mxfp4");
    for (name, damage_scale) in [("nan-scale", true), ("bad-yarn", false)] {
        let dir = out.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(source.join("tokenizer.json"), dir.join("tokenizer.json")).unwrap();
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap())
                .unwrap();
        let mut tensors =
            candle_core::safetensors::load(source.join("model.safetensors"), &Device::Cpu).unwrap();
        if damage_scale {
            let key = "model.layers.1.mlp.experts.down_proj_scales";
            let scales = &tensors[key];
            let mut bytes: Vec<u8> = scales.flatten_all().unwrap().to_vec1().unwrap();
            bytes[5] = 255;
            let damaged = Tensor::from_vec(bytes, scales.shape(), &Device::Cpu).unwrap();
            tensors.insert(key.into(), damaged);
        } else {
            let rope = config["rope_parameters"].as_object_mut().unwrap();
            rope.remove("original_max_position_embeddings");
        }
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    }
}

/// Copies of the tiny Llama under `out/<name>`, each with some `config.json` keys set and its files then changed,
/// and data files beside them (a BOM, a conversation opened by the assistant, all lines bad, all examples empty).
fn write_changed_models(out: &Path) {
    let source = data_path("models/tiny-llama");
    let no_head = |dir: &Path| {
        let mut tensors =
            candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu).unwrap();
        tensors.remove("lm_head.weight");
        candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    };
    // A tensor the tiny Llama does not have, stored among its weights.
    let with_tensor = |name: &'static str, shape: &'static [usize]| {
        move |dir: &Path| {
            let mut tensors =
                candle_core::safetensors::load(dir.join("model.safetensors"), &Device::Cpu)
                    .unwrap();
            let zeros = Tensor::zeros(shape, candle_core::DType::F32, &Device::Cpu).unwrap();
            tensors.insert(name.into(), zeros);
            candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
        }
    };
    let file = |name: &'static str, text: String| {
        move |dir: &Path| std::fs::write(dir.join(name), &text).unwrap()
    };
    let gemma_template =
        std::fs::read_to_string(data_path("chat_templates/google-gemma-2-2b-it.jinja")).unwrap();
    let keep = |_: &Path| {};
    type ChangeFiles = Box<dyn Fn(&Path)>;
    let models: Vec<(&str, serde_json::Value, ChangeFiles)> =
        vec![
        ("eps-0", json!({"rms_norm_eps": 0.0}), Box::new(keep)),
        (
            "theta-negative",
            json!({"rope_theta": -1.0}),
            Box::new(keep),
        ),
        (
            "llama3-factor-0",
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 0.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
            Box::new(keep),
        ),
        (
            "llama3-band-empty",
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                   "high_freq_factor": 2.0, "original_max_position_embeddings": 64}}),
            Box::new(keep),
        ),
        (
            "yarn-attention-negative",
            json!({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                   "attention_factor": -1.0, "original_max_position_embeddings": 64}}),
            Box::new(keep),
        ),
        (
            "context-0",
            json!({"max_position_embeddings": 0}),
            Box::new(keep),
        ),
        (
            "fewer-layers",
            json!({"num_hidden_layers": 1}),
            Box::new(keep),
        ),
        ("no-head", json!({}), Box::new(no_head)),
        (
            "layer-bias",
            json!({}),
            Box::new(with_tensor("model.layers.1.self_attn.q_proj.bias", &[64])),
        ),
        (
            "extra-part",
            json!({}),
            Box::new(with_tensor("model.vision_tower.patch_embed.weight", &[4, 4])),
        ),
        (
            "old-rotary-buffer",
            json!({}),
            Box::new(with_tensor("model.layers.0.self_attn.rotary_emb.inv_freq", &[8])),
        ),
        (
            "other-safetensors",
            json!({}),
            Box::new(file("consolidated.safetensors", "not the model's".into())),
        ),
        (
            "renamed-weights",
            json!({}),
            Box::new(|dir: &Path| {
                std::fs::rename(dir.join("model.safetensors"), dir.join("weights.safetensors"))
                    .unwrap()
            }),
        ),
        (
            "no-head-tied",
            json!({"tie_word_embeddings": true}),
            Box::new(no_head),
        ),
        (
            "token-not-text",
            json!({}),
            Box::new(file("tokenizer_config.json", r#"{"eos_token": 7}"#.into())),
        ),
        (
            "template-not-text",
            json!({}),
            Box::new(file(
                "tokenizer_config.json",
                r#"{"chat_template": 5}"#.into(),
            )),
        ),
        (
            "generation-not-json",
            json!({}),
            Box::new(file("generation_config.json", "{not json".into())),
        ),
        (
            "generation-wrong-type",
            json!({}),
            Box::new(file(
                "generation_config.json",
                r#"{"max_new_tokens": "many"}"#.into(),
            )),
        ),
        (
            "alternating-template",
            json!({}),
            Box::new(file(
                "tokenizer_config.json",
                json!({"chat_template": gemma_template, "bos_token": "<s>", "eos_token": "</s>"})
                    .to_string(),
            )),
        ),
    ];
    for (name, changes, change_files) in models {
        let dir = out.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["config.json", "tokenizer.json", "model.safetensors"] {
            std::fs::copy(source.join(f), dir.join(f)).unwrap();
        }
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        for (k, v) in changes.as_object().unwrap() {
            config[k] = v.clone();
        }
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        change_files(&dir);
    }
    std::fs::write(
        out.join("bom.jsonl"),
        "\u{feff}{\"text\": \"t3 t4\"}\n{\"text\": \"t5 t6\"}\n",
    )
    .unwrap();
    std::fs::write(
        out.join("assistant_first.jsonl"),
        "{\"messages\": [{\"role\": \"assistant\", \"content\": \"t3\"}, {\"role\": \"user\", \"content\": \"t4\"}, \
         {\"role\": \"assistant\", \"content\": \"t5\"}]}\n",
    )
    .unwrap();
    std::fs::write(out.join("all_bad.jsonl"), "not json\n{\"txt\": \"t3\"}\n").unwrap();
    std::fs::write(
        out.join("all_empty.jsonl"),
        "{\"text\": \"\"}\n{\"text\": \"\"}\n",
    )
    .unwrap();
}

/// Inputs of the run checks made before the weights load: examples of 300 tokens (the tiny Llama's context is
/// 256 positions) and a file where a folder belongs.
fn write_run_check_inputs(dir: &Path) {
    let long: String = (0..300).map(|i| format!("t{} ", i % 100 + 3)).collect();
    let line = format!("{{\"text\": \"{}\"}}", long.trim());
    std::fs::write(dir.join("long.jsonl"), [line.as_str(); 4].join("\n")).unwrap();
    std::fs::write(dir.join("a_file"), "not a folder").unwrap();
}

fn cases(dir: &Path) -> Vec<Case> {
    let config = write_tiny_config(dir, "", "max_steps = 1\nsave_strategy = \"no\"\n");
    let mut more = launch_merge_and_message_cases(dir, &config);
    write_inputs(dir);
    write_damaged_gpt_oss(&dir.join("gpt-oss"));
    write_changed_models(&dir.join("changed"));
    let model = data_path("models/tiny-llama").display().to_string();
    let file = |name: &str| dir.join(name).display().to_string();
    let strings = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let train = |sets: &[&str]| {
        let mut args = strings(&["train", "--config", &config.display().to_string()]);
        for s in sets {
            args.extend(strings(&["--set", s]));
        }
        args.extend(strings(&["--set", "training.overwrite_output_dir=true"]));
        args
    };
    // `qlora <subcommand> --model <tiny Llama> extra…`.
    let on_model = |subcommand: &str, extra: &[&str]| {
        let mut args = strings(&[subcommand, "--model", &model]);
        args.extend(strings(extra));
        args
    };
    let generate = |extra: &[&str]| on_model("generate", extra);
    let eval = |extra: &[&str]| on_model("eval", extra);
    let estimate = |extra: &[&str]| on_model("estimate", extra);
    let case = |args: Vec<String>, exit: i32, says: &'static str| Case {
        args,
        exit,
        says,
        fix: None,
    };
    // A checkpoint of a run on instruction data; `resume_changed(sets)` resumes it with `sets` changed.
    let checkpoint = write_checkpoint(dir, &config);
    let resume_changed = |sets: &[&str]| {
        let mut args = train(&[&["data.train_file=\"instructions.jsonl\""], sets].concat());
        args.extend(strings(&["--resume", &checkpoint.display().to_string()]));
        args
    };
    let changed = |name: &str| dir.join("changed").join(name).display().to_string();
    let moe = |name: &str| {
        format!(
            "model.name_or_path={:?}",
            data_path(&format!("models/{name}")).display().to_string()
        )
    };
    let estimate_of = |name: &str| strings(&["estimate", "--model", &changed(name)]);
    let generate_on = |name: &str| {
        strings(&[
            "generate",
            "--model",
            &changed(name),
            "--prompt",
            "t3",
            "--max-new-tokens",
            "1",
        ])
    };
    let quantize_of = |input: &str| {
        strings(&[
            "quantize",
            "--input",
            input,
            "--output",
            &file("quantized.safetensors"),
        ])
    };
    let long_prompt: String = (0..250).map(|i| format!("t{} ", i % 100 + 3)).collect();
    // The tiny Llama's tokens with a chat template and an `eos_token` (tokenizer_config.json).
    let with_template = format!(
        "model.name_or_path={:?}",
        data_path("dpo/tiny-llama-chat").display().to_string()
    );
    // The run's checks come before the weights load: these runs name a model whose weights cannot be read, so a
    // check made after the load would say so instead of the phrase.
    write_run_check_inputs(dir);
    let unreadable = format!(
        "model.name_or_path={:?}",
        file("unreadable_weights").to_string()
    );
    let early = |sets: &[&str]| train(&[&[unreadable.as_str()], sets].concat());
    let resume = |path: &str| {
        let mut args = early(&[]);
        args.extend(strings(&["--resume", path]));
        args
    };
    vec![
        // Numbers out of range or not numbers at all: refused by name, with the range.
        case(
            train(&["training.logging_steps=nan"]),
            1,
            "`logging_steps` = NaN",
        ),
        case(train(&["training.save_steps=nan"]), 1, "`save_steps` = NaN"),
        case(train(&["training.eval_steps=nan"]), 1, "`eval_steps` = NaN"),
        case(
            train(&["training.learning_rate=nan"]),
            1,
            "`learning_rate` = NaN",
        ),
        case(
            train(&["training.learning_rate=inf"]),
            1,
            "`learning_rate` = inf",
        ),
        case(
            train(&["training.num_train_epochs=-2"]),
            1,
            "`num_train_epochs` = -2",
        ),
        case(
            train(&["training.adam_beta1=2.0"]),
            1,
            "`adam_beta1` = 2: must be in [0, 1)",
        ),
        case(train(&["training.adam_beta2=1.0"]), 1, "`adam_beta2` = 1"),
        case(train(&["training.adam_epsilon=-1e-8"]), 1, "`adam_epsilon`"),
        case(
            train(&["training.weight_decay=-5"]),
            1,
            "`weight_decay` = -5: must be 0 or more",
        ),
        case(
            train(&["training.warmup_ratio=1.5"]),
            1,
            "`warmup_ratio` = 1.5",
        ),
        case(train(&["training.max_grad_norm=nan"]), 1, "`max_grad_norm`"),
        case(
            train(&["lora.r=1152921504606846976"]),
            1,
            "larger than any layer",
        ),
        case(
            train(&["lora.lora_alpha=0"]),
            1,
            "lora_alpha = 0: must be more than 0",
        ),
        // Data that would train nothing.
        case(
            train(&["data.max_length=1"]),
            1,
            "max_length = 1: must be at least 2",
        ),
        case(
            train(&[
                &format!("data.train_file={:?}", file("no_answers.jsonl")),
                "data.completion_only_loss=true",
            ]),
            1,
            "has a token to learn (every label is -100, or the row is a single token): check that the answers are \
             not empty and that the prompts are shorter than the maximum length, or put the loss on every token \
             ([data] completion_only_loss = false)",
        )
        .fixed_by(&["data.completion_only_loss=false"]),
        // An empty example is dropped with a note, and the run goes on.
        case(
            train(&[&format!("data.train_file={:?}", file("with_empty.jsonl"))]),
            0,
            "1 empty examples skipped",
        ),
        case(
            eval(&["--data", &file("no_answers.jsonl")]),
            1,
            "has a token to learn (every label is -100, or the row is a single token): check that the answers are \
             not empty and that the prompts are shorter than the maximum length, or put the loss on every token \
             (--all-tokens)",
        )
        .fixed_with(&["--all-tokens"]),
        case(
            eval(&["--data", &file("with_empty.jsonl"), "--max-length", "0"]),
            1,
            "max_length = 0",
        ),
        // Generation settings (those of a flag refused as the flag's value, exit 2).
        case(generate(&["--prompt", ""]), 1, "the prompt has no tokens"),
        case(
            generate(&["--prompt", "t3", "--top-p", "2"]),
            2,
            "top_p = 2",
        ),
        case(
            generate(&["--prompt", "t3", "--top-p", "0"]),
            2,
            "top_p = 0",
        ),
        case(
            generate(&["--prompt", "t3", "--top-p=-0.5"]),
            2,
            "top_p = -0.5",
        ),
        case(
            generate(&["--prompt", "t3", "--temperature=-1"]),
            2,
            "temperature = -1",
        ),
        case(
            generate(&["--prompt", "t3", "--temperature", "NaN"]),
            2,
            "temperature = NaN",
        ),
        case(
            generate(&["--prompt", "t3", "--temperature", "1", "--top-k", "0"]),
            1,
            "top_k = 0",
        ),
        case(
            generate(&["--prompt", &long_prompt, "--max-new-tokens", "1000"]),
            0,
            "stopped at the model's context of 256 positions",
        ),
        // Files that are not what they should be: the file and line, the tensor, or a short summary.
        case(
            train(&[&format!("data.train_file={:?}", file("latin1.jsonl"))]),
            1,
            "save the file as UTF-8 (fix the line, or skip bad lines: [data] skip_bad_lines = true",
        )
        .fixed_by(&["data.skip_bad_lines=true"]),
        case(
            eval(&["--data", &file("latin1.jsonl")]),
            1,
            "--skip-bad-lines for qlora eval)",
        )
        .fixed_with(&["--skip-bad-lines"]),
        case(
            train(&[
                &format!("data.train_file={:?}", file("latin1.jsonl")),
                "data.skip_bad_lines=true",
            ]),
            0,
            "latin1.jsonl:2: skipped (not valid UTF-8",
        ),
        case(
            train(&[&format!("data.train_file={:?}", file("chat.jsonl"))]),
            1,
            "need the model's chat template, and this model has none: use a model with one, or write the data as \
             instructions ({\"instruction\", \"output\"}) or plain text ({\"text\"})",
        )
        .fixed_by(&[&with_template]),
        case(generate(&["--prompt", "t3", "--chat"]), 1, "drop --chat")
            .fixed_as(generate(&["--prompt", "t3", "--max-new-tokens", "1"])),
        // DPO: pairs without [dpo], supervised data with it, and [dpo]'s own mistakes.
        case(
            train(&[&format!(
                "data.train_file={:?}",
                data_path("dpo/pairs.jsonl").display().to_string()
            )]),
            1,
            "is DPO's data: add a [dpo] section",
        )
        .fixed_by(&["dpo.beta=0.1"])
        .then("has no EOS token"),
        case(train(&["dpo.beta=0.1"]), 1, ":1: `chosen` is missing"),
        case(
            train(&[
                "dpo.beta=0.1",
                &format!("data.train_file={:?}", file("mixed_pairs.jsonl")),
            ]),
            1,
            "mixed_pairs.jsonl:2: `rejected` must be a string",
        ),
        case(
            train(&[
                "dpo.beta=0.1",
                &format!(
                    "data.train_file={:?}",
                    data_path("dpo/pairs.jsonl").display().to_string()
                ),
            ]),
            1,
            "has no EOS token, which DPO appends to text completions: set eos_token in tokenizer_config.json",
        )
        // The same model with an `eos_token` in its tokenizer_config.json.
        .fixed_by(&[&with_template]),
        case(
            train(&["dpo.bta=0.1"]),
            1,
            "unknown key `bta` in [dpo]; did you mean `beta`?",
        )
        .fixed_as(train(&["dpo.beta=0.1"]))
        .then(":1: `chosen` is missing"),
        case(
            train(&["dpo.loss_type=\"exo\""]),
            1,
            "loss_type `exo` is not supported",
        ),
        case(
            train(&["dpo.beta=0"]),
            1,
            "[dpo]: beta = 0: must be a positive number",
        ),
        case(
            train(&["dpo.beta=0.1", "data.packing=true"]),
            1,
            "packing = true: DPO runs each pair's sequences whole (TRL has no packing for DPO); remove packing",
        )
        .fixed_by(&["data.packing=false"])
        .then(":1: `chosen` is missing"),
        case(
            train(&["dpo.beta=0.1", "training.predict_with_generate=true"]),
            1,
            "predict_with_generate = true: it answers supervised examples",
        )
        .fixed_by(&["training.predict_with_generate=false"])
        .then(":1: `chosen` is missing"),
        // Every pair's prompt fills max_length: the fix keeps the prompts' end.
        case(
            train(&[
                "dpo.beta=0.1",
                &format!("data.train_file={:?}", file("long_prompts.jsonl")),
                "data.max_length=3",
                &with_template,
            ]),
            1,
            "the prompt alone fills [data] max_length = 3, or the completions are empty): raise [data] max_length \
             above the prompts' length, or set [dpo] truncation_mode = \"keep_end\"",
        )
        .fixed_by(&["dpo.truncation_mode=\"keep_end\""]),
        case(
            estimate(&["--dpo", "--batch", "2", "--seq", "64"]),
            0,
            "DPO: 4 rows per forward",
        ),
        case(
            train(&["training.report_to=wandb"]),
            1,
            "report_to = \"wandb\" is not supported: use none, tensorboard, all",
        )
        .fixed_by(&["training.report_to=\"none\""]),
        case(
            train(&["training.report_to=[\"tensorboard\", \"mlflow\"]"]),
            1,
            "report_to = \"mlflow\" is not supported",
        ),
        case(
            train(&[&format!("model.adapter={:?}", file("no_such_adapter"))]),
            1,
            "no_such_adapter",
        ),
        case(
            eval(&[
                "--data",
                &file("with_empty.jsonl"),
                "--adapter",
                &file("foreign_adapter"),
            ]),
            1,
            "more (an adapter for another base model?)",
        ),
        // An adapter saved from a diverged run: refused by every command that reads it, naming the tensor.
        case(
            generate(&["--adapter", &file("nan_adapter"), "--prompt", "t3"]),
            1,
            "saved from a diverged run",
        ),
        case(
            eval(&[
                "--data",
                &file("with_empty.jsonl"),
                "--adapter",
                &file("nan_adapter"),
            ]),
            1,
            "lora_B.weight` holds NaN",
        ),
        case(
            strings(&[
                "merge",
                "--model",
                &model,
                "--adapter",
                &file("nan_adapter"),
                "--output",
                &file("merged_nan"),
            ]),
            1,
            "saved from a diverged run",
        ),
        case(
            strings(&["generate", "--model", &file("nan_model"), "--prompt", "t3"]),
            1,
            "tensor `model.norm.weight`",
        ),
        // Model configs that make every value NaN: refused naming the file, the key and the range.
        case(
            estimate_of("eps-0"),
            1,
            "config.json`: `rms_norm_eps` = 0: must be a positive finite number",
        ),
        case(estimate_of("theta-negative"), 1, "`rope_theta` = -1: must be a positive"),
        case(estimate_of("llama3-factor-0"), 1, "`rope_scaling.factor` = 0: must be"),
        case(
            estimate_of("llama3-band-empty"),
            1,
            "`rope_scaling.high_freq_factor` = 2 must be greater than `rope_scaling.low_freq_factor` = 2",
        ),
        case(
            estimate_of("yarn-attention-negative"),
            1,
            "`rope_scaling.attention_factor` = -1: must be a positive",
        ),
        case(estimate_of("context-0"), 1, "`max_position_embeddings` = 0: must be at least 1"),
        // Loose model folders: weights the config does not use, a head that is not there, garbage side files.
        case(
            generate_on("fewer-layers"),
            1,
            "`model.layers.1.input_layernorm.weight` in",
        ),
        case(generate_on("fewer-layers"), 1, "set num_hidden_layers = 2"),
        case(
            generate_on("no-head"),
            1,
            "Use the complete model files, or set `\"tie_word_embeddings\": true` if the model's head is its \
             embedding matrix",
        )
        // The same folder with the key set in its config.json.
        .fixed_as(generate_on("no-head-tied")),
        case(
            generate_on("layer-bias"),
            1,
            "tensor `model.layers.1.self_attn.q_proj.bias` in",
        ),
        case(
            generate_on("layer-bias"),
            1,
            "is not used by the llama model",
        ),
        case(
            generate_on("extra-part"),
            1,
            "tensor `model.vision_tower.patch_embed.weight` in",
        ),
        case(generate_on("old-rotary-buffer"), 0, "tokens in"),
        case(generate_on("other-safetensors"), 0, "tokens in"),
        case(
            generate_on("renamed-weights"),
            1,
            "only weights.safetensors: as transformers, qlora reads the model's weights from those names; rename",
        ),
        case(
            generate_on("token-not-text"),
            1,
            "tokenizer_config.json`: `eos_token` = 7: must be the token's text",
        ),
        case(
            generate_on("template-not-text"),
            1,
            "`chat_template` = 5: must be a Jinja template",
        ),
        case(
            generate_on("generation-not-json"),
            0,
            "generation_config.json is not valid JSON",
        ),
        case(
            generate_on("generation-wrong-type"),
            0,
            "generation_config.json: `max_new_tokens` = \"many\" must be a whole number",
        ),
        case(
            quantize_of(&data_path("models/tiny-qwen3/model.gguf").display().to_string()),
            1,
            "this is a GGUF file, whose weights are already quantized",
        )
        .fixed_as(strings(&[
            "generate",
            "--model",
            &data_path("models/tiny-qwen3/model.gguf").display().to_string(),
            "--quantize",
            "nf4",
            "--prompt",
            "t3",
            "--max-new-tokens",
            "1",
        ]))
        // Loaded and quantized on load; this tiny file then lacks a tokenizer (its own error, below).
        .then("(2 layers, 0.1 MiB of weights; nf4 base"),
        case(
            strings(&[
                "generate",
                "--model",
                &data_path("models/tiny-qwen3/model.gguf").display().to_string(),
                "--prompt",
                "t3",
            ]),
            1,
            "model.gguf has no tokenizer in its metadata (`tokenizer.ggml.*`); use a GGUF file written with its \
             tokenizer",
        ),
        // Data: a byte order mark is read as datasets reads it; the line of a conversation its template refuses;
        // a file whose every line or example was skipped.
        case(eval(&["--data", &changed("bom.jsonl")]), 0, "perplexity"),
        case(
            strings(&[
                "eval",
                "--model",
                &changed("alternating-template"),
                "--data",
                &changed("assistant_first.jsonl"),
            ]),
            1,
            "assistant_first.jsonl:1: tokenizer: the conversation starts with an assistant turn",
        ),
        case(
            train(&[
                &format!("data.train_file={:?}", changed("all_bad.jsonl")),
                "data.skip_bad_lines=true",
            ]),
            1,
            "all_bad.jsonl: every line was skipped as bad (2 lines",
        ),
        case(
            train(&[&format!("data.train_file={:?}", changed("all_empty.jsonl"))]),
            1,
            "all_empty.jsonl: every example is empty (all 2 have no tokens)",
        ),
        case(
            train(&["training.learning_rate=\"fast\""]),
            1,
            "learning_rate: invalid type: string \"fast\"",
        ),
        // Estimates of sizes that make no sense.
        case(estimate(&["--batch", "0"]), 1, "batch must be at least 1"),
        case(estimate(&["--seq", "0"]), 1, "seq must be at least 1"),
        case(
            estimate(&["--world-size", "0"]),
            1,
            "world_size must be at least 1",
        ),
        case(
            estimate(&["--world-size", "2"]),
            1,
            "data-parallel training runs on GPUs (one per rank); estimate it for device cuda (`--device cuda`)",
        )
        .fixed_with(&["--device", "cuda"]),
        case(
            estimate(&["--batch", "10000000", "--seq", "10000000"]),
            1,
            "too large",
        ),
        // A rank whose sizes would overflow: refused as training refuses it (it overflowed the arithmetic before).
        case(
            estimate(&["--lora-r", "18446744073709551615"]),
            1,
            "is larger than any layer",
        ),
        // gpt-oss: a damaged MXFP4 scale is named with its tensor; YaRN without its original context is refused.
        case(
            strings(&[
                "generate",
                "--model",
                &file("gpt-oss/nan-scale"),
                "--prompt",
                "t3",
            ]),
            1,
            "down_proj_blocks` in",
        ),
        case(
            strings(&["estimate", "--model", &file("gpt-oss/bad-yarn")]),
            1,
            "YaRN needs `original_max_position_embeddings`",
        ),
        // Resuming a checkpoint with other data, labels or base weights: refused, saying which changed.
        case(
            resume_changed(&["data.train_file=\"instructions_edited.jsonl\""]),
            1,
            "the checkpoint was trained on other tokens",
        ),
        case(
            resume_changed(&["data.completion_only_loss=false"]),
            1,
            "the same tokens with other labels",
        ),
        case(
            resume_changed(&["model.quantization.bnb_4bit_quant_type=\"fp4\""]),
            1,
            "the checkpoint was trained on a nf4 base",
        )
        .fixed_by(&["training.ignore_base_model_mismatch=true"]),
        // A folder a run is writing into (its lock held, see the test) is replaced by no command.
        case(
            strings(&[
                "merge",
                "--model",
                &model,
                "--adapter",
                &data_path("peft/lora_all_linear").display().to_string(),
                "--output",
                &file(RUNNING),
                "--overwrite",
            ]),
            1,
            "is the output folder of a run in progress",
        ),
        case(
            strings(&[
                "quantize",
                "--input",
                &model,
                "--output",
                &file(RUNNING),
                "--overwrite",
            ]),
            1,
            "is the output folder of a run in progress",
        ),
        case(
            train(&[&format!("training.output_dir={:?}", file(RUNNING))]),
            1,
            "is the output folder of a run in progress",
        ),
        // What transformers refuses, refused before the weights load, naming the key and what to do.
        case(
            early(&["training.eval_strategy=\"steps\""]),
            1,
            "eval_strategy = \"steps\" asks for evaluations, but the run has no evaluation data: add [data] eval_file \
             (or eval_split, the share of the training examples held out)",
        )
        .fixed_by(&["data.eval_split=0.25"]),
        case(
            early(&["training.eval_strategy=\"epoch\"", "data.eval_split=0"]),
            1,
            "no evaluation data ([data] eval_split = 0 holds none of the examples): add [data] eval_file (or a \
             larger eval_split)",
        )
        .fixed_by(&["data.eval_split=0.25"]),
        case(
            early(&["training.eval_on_start=true"]),
            1,
            "eval_on_start = true asks for evaluations",
        )
        .fixed_by(&["training.eval_on_start=false"]),
        case(
            early(&["callbacks.early_stopping_patience=2"]),
            1,
            "early_stopping_patience = 2 needs evaluations, and [training] eval_strategy is \"no\"",
        )
        .fixed_by(&["training.eval_strategy=\"steps\"", "data.eval_split=0.25"]),
        // load_best_model_at_end: transformers' rules (matching strategies, save_steps a round multiple of
        // eval_steps), evaluations at all, and a loss that is never greater-is-better.
        case(
            early(&["training.load_best_model_at_end=true"]),
            1,
            "load_best_model_at_end = true needs evaluations to pick the best checkpoint, and eval_strategy is \"no\"",
        ),
        case(
            early(&[
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"steps\"",
            ]),
            1,
            "requires the save and eval strategy to match, but found eval_strategy = \"steps\" and save_strategy",
        ),
        case(
            early(&[
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"steps\"",
                "training.save_strategy=\"steps\"",
                "training.eval_steps=2",
                "training.save_steps=3",
            ]),
            1,
            "save_steps = 3 is not a round multiple of eval_steps = 2: set save_steps = 4",
        ),
        case(
            early(&[
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"steps\"",
                "training.save_strategy=\"steps\"",
                "training.eval_steps=0.3",
                "training.save_steps=2",
            ]),
            1,
            "cannot be guaranteed when mixing a ratio of the run's steps (below 1) and a step count",
        ),
        case(
            early(&["training.greater_is_better=true"]),
            1,
            "greater_is_better = true: the metric for the best model is \"eval_loss\", a loss, where lower is better",
        )
        .fixed_by(&["training.greater_is_better=false"]),
        // Ratios transformers accepts that this run's 10 steps round to 5 and 3: refused when the run starts.
        case(
            train(&[
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"steps\"",
                "training.save_strategy=\"steps\"",
                "training.eval_steps=0.25",
                "training.save_steps=0.5",
                "training.max_steps=10",
                "data.eval_split=0.25",
            ]),
            1,
            "come to every 5 and every 3 of this run's 10 steps",
        ),
        // Accepted forms: steps (ratios that divide) and epochs.
        case(
            train(&[
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"steps\"",
                "training.save_strategy=\"steps\"",
                "training.eval_steps=0.25",
                "training.save_steps=0.5",
                "training.max_steps=4",
                "training.metric_for_best_model=\"eval_loss\"",
                "training.greater_is_better=false",
                "data.eval_split=0.25",
            ]),
            0,
            "Loading best model from",
        ),
        case(
            train(&[
                "training.load_best_model_at_end=true",
                "training.eval_strategy=\"epoch\"",
                "training.save_strategy=\"epoch\"",
                "data.eval_split=0.25",
            ]),
            0,
            // As transformers: max_steps = 1 ends the (partial) epoch, which evaluates and saves.
            "Loading best model from",
        ),
        case(
            early(&["training.per_device_train_batch_size=0"]),
            1,
            "`per_device_train_batch_size` = 0: must be at least 1",
        ),
        case(
            early(&["training.per_device_eval_batch_size=0"]),
            1,
            "`per_device_eval_batch_size` = 0: must be at least 1",
        ),
        case(
            early(&["training.gradient_accumulation_steps=0"]),
            1,
            "`gradient_accumulation_steps` = 0: must be at least 1",
        ),
        case(
            strings(&[
                "generate",
                "--model",
                &file("unreadable_weights"),
                "--prompt",
                "t3",
                "--max-new-tokens",
                "0",
            ]),
            1,
            "max_new_tokens = 0: must be at least 1",
        ),
        case(
            early(&["training.output_dir=\"\""]),
            1,
            "`output_dir` is empty",
        ),
        case(
            early(&[&format!("training.output_dir={:?}", file("a_file"))]),
            1,
            "a_file\" is a file, not a folder",
        ),
        case(
            early(&["training.num_train_epochs=inf", "training.max_steps=0"]),
            1,
            "`num_train_epochs` = inf with max_steps = 0: the run would never end",
        )
        .fixed_by(&["training.max_steps=1"]),
        case(
            early(&["training.num_train_epochs=1e300", "training.max_steps=0"]),
            1,
            "`num_train_epochs` = 1e300 with max_steps = 0",
        ),
        // `--set` values that are no TOML: named by the argument, not used as a string.
        case(
            early(&["training.learning_rate=1e-3x"]),
            1,
            "--set `training.learning_rate=1e-3x`: `1e-3x` is not a TOML value, and the key takes no string",
        )
        .fixed_as(early(&["training.learning_rate=1e-3"])),
        case(
            early(&["training.output_dir=[runs"]),
            1,
            "--set `training.output_dir=[runs`: `[runs` is not a valid TOML value",
        )
        // Quoted whole (the shell's key='"…"'): a string.
        .fixed_as(early(&["training.output_dir=\"[runs\""])),
        case(
            early(&["training.seed=99999999999999999999"]),
            1,
            "99999999999999999999 is out of range: a TOML integer is from",
        ),
        case(
            early(&["training.per_device_train_batch_size=-1"]),
            1,
            "per_device_train_batch_size: invalid value: integer `-1`, expected usize: must be an integer from 0",
        ),
        // The schedule's keyword arguments as transformers' schedule functions take them.
        case(
            early(&[
                "training.lr_scheduler_type=\"cosine\"",
                "training.lr_scheduler_kwargs={num_cycles=\"two\"}",
            ]),
            1,
            "lr_scheduler_kwargs.num_cycles = \"two\": must be a finite number (lr_scheduler_type = \"cosine\")",
        ),
        case(
            early(&["training.lr_scheduler_kwargs={power=2.0}"]),
            1,
            "`power` does not apply to this schedule, which takes none (lr_scheduler_type = \"linear\")",
        ),
        case(
            early(&[
                "training.lr_scheduler_type=\"warmup_stable_decay\"",
                "training.lr_scheduler_kwargs={num_decay_steps=2, decay_type=\"exp\"}",
            ]),
            1,
            "decay_type = \"exp\": must be one of",
        ),
        // A resume folder that is missing or is no checkpoint.
        case(
            resume(&file("out/checkpoint-7")),
            1,
            "checkpoint-7` does not exist",
        ),
        case(
            resume(&file("gpt-oss")),
            1,
            "is not a checkpoint (no trainer_state.json)",
        ),
        // Examples longer than the model's context: reported up front with the fix, which then trains.
        case(
            early(&[&format!("data.train_file={:?}", file("long.jsonl"))]),
            1,
            "the training set has 4 example(s) longer than the model's context of 256 positions",
        )
        .fixed_by(&["data.max_length=256"]),
        case(
            train(&[
                &format!("data.train_file={:?}", file("long.jsonl")),
                "data.max_length=256",
            ]),
            0,
            "4 examples truncated to 256 tokens",
        ),
        // Advice that depends on what the run does already: the flag that is on, only the fixes not yet made.
        case(
            train(&["training.fp16=true"]),
            0,
            "set fp16 = false for the fastest CPU run",
        )
        .fixed_by(&["training.fp16=false"]),
        case(
            train(&[
                "callbacks.memory_warn_fraction=0.00001",
                "training.gradient_checkpointing=true",
                "training.optim=\"paged_adamw_8bit\"",
                "training.per_device_train_batch_size=1",
                "training.tiled_mlp=true",
                "lora.lora_dropout=0.0",
            ]),
            0,
            "; to use less: a shorter [data] max_length",
        ),
        case(
            train(&[
                "training.learning_rate=1e30",
                "training.lr_scheduler_type=\"constant\"",
                "training.max_steps=4",
                "training.max_consecutive_nonfinite_losses=1",
            ]),
            1,
            "lower learning_rate (now 1e30), or check the data",
        )
        .fixed_by(&["training.learning_rate=1e-4"]),
        case(
            strings(&[
                "train",
                "--config",
                &config.display().to_string(),
                "--set",
                &format!("training.output_dir={:?}", file("finished")),
            ]),
            1,
            "holds the output of an earlier run (adapter_model.safetensors); set overwrite_output_dir = true",
        )
        .fixed_by(&["training.overwrite_output_dir=true"]),
        // A mixture's router and experts: parameters of each family's names, never listed as modules.
        case(
            train(&[&moe("tiny-gpt-oss"), "lora.target_modules=[\"router\"]"]),
            1,
            "its linear modules are q_proj, k_proj, v_proj, o_proj (e.g. model.layers.0.self_attn.q_proj) (the \
             router and the experts are parameters to PEFT: target them with target_parameters = \
             [\"mlp.router.weight\", \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"] and lora_dropout = 0)",
        )
        .fixed_by(&[
            "lora.target_parameters=[\"mlp.router.weight\", \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]",
            "lora.lora_dropout=0",
        ]),
        case(
            train(&[&moe("tiny-mixtral"), "lora.target_modules=[\"gate\"]"]),
            1,
            "target_parameters = [\"mlp.gate.weight\", \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]",
        )
        .fixed_by(&[
            "lora.target_parameters=[\"mlp.gate.weight\", \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]",
            "lora.lora_dropout=0",
        ]),
        // The example of a table is one the schedule takes.
        case(
            early(&[
                "training.lr_scheduler_type=\"polynomial\"",
                "training.lr_scheduler_kwargs=5",
            ]),
            1,
            "lr_scheduler_kwargs = 5: must be a table, e.g. { lr_end = 1e-7, power = 1.0 }",
        )
        .fixed_as(early(&[
            "training.lr_scheduler_type=\"polynomial\"",
            "training.lr_scheduler_kwargs={ lr_end = 1e-7, power = 1.0 }",
        ])),
        // A key in the wrong section is sent where it belongs, not to a look-alike of its section.
        case(
            train(&["training.max_length=64"]),
            1,
            "unknown key `max_length` in [training]; it belongs in [data] (`data.max_length`)",
        )
        .fixed_as(train(&["data.max_length=64"])),
        case(
            train(&["model.load_in_4bit=true"]),
            1,
            "it belongs in [model.quantization] (`model.quantization.load_in_4bit`)",
        )
        .fixed_as(train(&["model.quantization.load_in_4bit=true"])),
        case(
            train(&["training.max_seq_len=64"]),
            1,
            "unknown key `max_seq_len` in [training]; did you mean [data] `max_length`?",
        )
        .fixed_as(train(&["data.max_length=64"])),
    ]
    .into_iter()
    .chain(more.drain(..))
    .collect()
}

/// Launches this build cannot run, outputs that overlap their inputs, negative numbers given to flags, and messages
/// that used to name the wrong thing: each refused by the flag or key the user wrote, most with the fix applied.
fn launch_merge_and_message_cases(dir: &Path, config: &Path) -> Vec<Case> {
    let strings = |args: &[&str]| args.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let file = |name: &str| dir.join(name).display().to_string();
    let model = data_path("models/tiny-llama").display().to_string();
    let case = |args: Vec<String>, exit: i32, says: &'static str| Case {
        args,
        exit,
        says,
        fix: None,
    };
    // `qlora train` of the tiny config with `--set` overrides `sets`, then `extra` arguments.
    let train = |sets: &[&str], extra: &[&str]| {
        let mut args = strings(&["train", "--config", config.to_str().unwrap()]);
        for s in [&["training.overwrite_output_dir=true"], sets].concat() {
            args.extend(strings(&["--set", s]));
        }
        args.extend(strings(extra));
        args
    };
    let on_model = |subcommand: &str, extra: &[&str]| {
        [strings(&[subcommand, "--model", &model]), strings(extra)].concat()
    };
    let generate = |extra: &[&str]| {
        on_model(
            "generate",
            &[&["--prompt", "t3", "--max-new-tokens", "1"], extra].concat(),
        )
    };
    // Copies of the inputs a merge reads: `merge_inputs/base` and `merge_adapter`.
    let base = dir.join("merge_inputs/base");
    let adapter = dir.join("merge_adapter");
    for (from, to) in [
        ("models/tiny-llama", &base),
        ("peft/lora_all_linear", &adapter),
    ] {
        std::fs::create_dir_all(to).unwrap();
        for entry in std::fs::read_dir(data_path(from)).unwrap() {
            let path = entry.unwrap().path();
            std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
        }
    }
    let (base, adapter) = (base.display().to_string(), adapter.display().to_string());
    let merge = |output: &str, overwrite: &[&str]| {
        let args = [
            "merge",
            "--model",
            &base,
            "--adapter",
            &adapter,
            "--output",
            output,
        ];
        strings(&[&args[..], overwrite].concat())
    };
    let merged = file("merged_apart");
    let on_base = format!("model.name_or_path={base:?}");
    // Preference pairs whose `chosen` is a number, and an empty list of messages beside a conversational prompt.
    std::fs::write(
        dir.join("pair_number.jsonl"),
        "{\"prompt\": \"t3\", \"chosen\": 5, \"rejected\": \" t4\"}\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("pair_empty_chosen.jsonl"),
        "{\"prompt\": [{\"role\": \"user\", \"content\": \"t3\"}], \"chosen\": [], \
         \"rejected\": [{\"role\": \"assistant\", \"content\": \"t4\"}]}\n",
    )
    .unwrap();
    // A mixture of experts with none.
    let mut mixtral: serde_json::Value = serde_json::from_slice(
        &std::fs::read(data_path("models/tiny-mixtral/config.json")).unwrap(),
    )
    .unwrap();
    mixtral["num_local_experts"] = json!(0);
    std::fs::create_dir_all(dir.join("zero_experts")).unwrap();
    std::fs::write(dir.join("zero_experts/config.json"), mixtral.to_string()).unwrap();
    let train_file = |name: &str| format!("data.train_file={:?}", file(name));
    vec![
        // A launch this build cannot run, refused before a rank starts (a test times it); one process trains.
        case(train(&[], &["--nproc-per-node", "64"]), 1, "--nproc-per-node 64: ")
            .fixed_as(train(&[], &[])),
        // Negative numbers reach the range check and are refused by the flag, not taken for unknown flags.
        case(
            train(&[], &["--nproc-per-node", "-1"]),
            2,
            "invalid value '-1' for '--nproc-per-node <N>': -1 is out of range: give a whole number, 1 or more",
        )
        .fixed_as(train(&[], &["--nproc-per-node", "1"])),
        case(
            on_model("estimate", &["--world-size", "-2"]),
            2,
            "'--world-size <WORLD_SIZE>': -2 is out of range: give a whole number, 1 or more",
        )
        .fixed_as(on_model("estimate", &["--world-size", "1"])),
        case(
            generate(&["--temperature", "-0.5"]),
            2,
            "'--temperature <TEMPERATURE>': generation: temperature = -0.5: must be 0 (greedy) or more",
        )
        .fixed_as(generate(&["--temperature", "0.5"])),
        case(
            generate(&["--top-p", "-1"]),
            2,
            "'--top-p <TOP_P>': generation: top_p = -1: must be in (0, 1]",
        )
        .fixed_as(generate(&["--top-p", "1"])),
        // An empty --adapter would be read as the working directory.
        case(
            generate(&["--adapter", ""]),
            2,
            "invalid value '' for '--adapter <ADAPTER>': an empty path names no folder",
        )
        .fixed_as(generate(&["--adapter", &adapter])),
        case(
            strings(&["merge", "--model", &base, "--adapter", "", "--output", &merged]),
            2,
            "invalid value '' for '--adapter <ADAPTER>': an empty path names no folder",
        )
        .fixed_as(merge(&file("merged_named_adapter"), &[])),
        // Outputs that would replace or delete an input, with --overwrite too (a test checks the inputs' bytes).
        case(
            merge(&adapter, &["--overwrite"]),
            1,
            "`: writing there would replace or delete what it reads, with or without overwriting allowed; choose \
             an output apart from every input, e.g. `",
        )
        .fixed_as(merge(&merged, &[])),
        case(merge(&file("merge_inputs"), &["--overwrite"]), 1, "` contains --model `")
            .fixed_as(merge(&merged, &["--overwrite"])),
        case(
            strings(&["quantize", "--input", &base, "--output", &format!("{base}/nf4")]),
            1,
            "/nf4` is inside --input `",
        )
        .fixed_as(strings(&["quantize", "--input", &base, "--output", &file("base-nf4")])),
        case(
            train(&[&on_base, &format!("training.output_dir={:?}", base)], &[]),
            1,
            "[training] output_dir `",
        )
        .fixed_as(train(&[&on_base, &format!("training.output_dir={:?}", file("run_apart"))], &[])),
        // Messages that named the wrong thing.
        case(
            strings(&["estimate", "--model", &file("zero_experts/config.json")]),
            1,
            "`num_local_experts` = 0: a mixture of experts has at least 1 expert",
        ),
        case(
            train(&["dpo.beta=0.1", &train_file("pair_number.jsonl")], &[]),
            1,
            "pair_number.jsonl:1: `chosen` must be a string, as `rejected` is",
        ),
        case(
            train(&["dpo.beta=0.1", &train_file("pair_empty_chosen.jsonl")], &[]),
            1,
            "pair_empty_chosen.jsonl:1: `chosen` is an empty list: give at least one message, as `rejected` is a \
             list of messages",
        ),
        case(
            on_model("eval", &["--data", &data_path("dpo/pairs.jsonl").display().to_string()]),
            1,
            "qlora eval scores supervised examples (text, instructions, chat) and takes no run config: evaluate \
             pairs in a DPO run",
        )
        .fixed_as(on_model("eval", &["--data", &file("instructions.jsonl")])),
        case(
            train(&["model.adapter=\"\""], &[]),
            1,
            "[model] adapter = \"\" names no folder: set it to the adapter folder to continue, or remove adapter",
        )
        .fixed_as(train(&[], &[])),
        case(
            train(&["data.train_file=\"\""], &[]),
            1,
            "[data] train_file = \"\" names no file",
        )
        .fixed_as(train(&[], &[])),
    ]
}

/// A folder beside the inputs whose output lock the test holds, as a running `qlora train` would.
const RUNNING: &str = "running";

#[test]
fn bad_inputs_get_clear_errors_and_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let running = dir.path().join(RUNNING);
    std::fs::create_dir(&running).unwrap();
    std::fs::write(running.join("adapter_model.safetensors"), "a run's").unwrap();
    let _running = candle_qlora::files::lock::OutputLock::acquire(&running).unwrap();
    let failures = failures(dir.path(), cases(dir.path()));
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    assert_eq!(
        std::fs::read_to_string(running.join("adapter_model.safetensors")).unwrap(),
        "a run's"
    );
}

/// Runs each case's command (and its advice, applied) in `dir`, returning what went wrong, one text per failure.
pub(crate) fn failures(dir: &Path, cases: Vec<Case>) -> Vec<String> {
    let run = |args: &[String]| {
        let out = Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args(args)
            .current_dir(dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        (out.status.code().unwrap_or(-1), text)
    };
    let shown = |args: &[String]| {
        args.iter()
            .map(|a| a.chars().take(60).collect::<String>())
            .collect::<Vec<_>>()
    };
    let last_lines = |text: &str| text.lines().rev().take(4).collect::<Vec<_>>().join("\n");
    let mut failures = vec![];
    for case in cases {
        let (code, text) = run(&case.args);
        if code != case.exit || !text.contains(case.says) || text.contains("panicked") {
            failures.push(format!(
                "qlora {:?}\n  exit {code} (want {}), want the phrase {:?}; said:\n{}",
                shown(&case.args),
                case.exit,
                case.says,
                last_lines(&text)
            ));
        }
        // The advice, followed: past the error, to success or to a later stage.
        if let Some(fix) = &case.fix {
            let (code, text) = run(&fix.args);
            let later = [fix.then, Some(REACHED_THE_WEIGHTS)]
                .iter()
                .flatten()
                .any(|p| text.contains(p));
            if text.contains(case.says) || text.contains("panicked") || (code != 0 && !later) {
                failures.push(format!(
                    "the advice of {:?}, followed — qlora {:?}\n  exit {code} (want 0{}), and the phrase must be \
                     gone; said:\n{}",
                    case.says,
                    shown(&fix.args),
                    fix.then.map_or(String::new(), |t| format!(" or {t:?}")),
                    last_lines(&text)
                ));
            }
        }
    }
    failures
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The config keys and command flags that messages name exist: in the code of `src/` (comments aside), every
/// `[section] key` is a key of that section, every `set key = …` / `use key = …` a key of some section, and every
/// `--flag` one of the command's (or cargo's). A key or flag renamed or moved while a message still names it fails
/// here.
#[test]
fn messages_name_config_keys_and_flags_that_exist() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_tiny_config(dir.path(), "", "");
    let sections = [
        "model.quantization",
        "model",
        "lora",
        "data",
        "training",
        "callbacks",
        "dpo",
    ];
    // A key is one when setting it is no "unknown key" (a value of the wrong type is another error).
    let is_key = |section: &str, key: &str| {
        RunConfig::load(&config, &[format!("{section}.{key}=0")])
            .err()
            .is_none_or(|e| !e.to_string().contains("unknown key"))
    };
    let help: String = [
        "quantize", "eval", "generate", "merge", "export", "train", "estimate",
    ]
    .iter()
    .map(|sub| {
        let out = Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args([sub, "--help"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    })
    .collect();
    let flags: Vec<&str> = regex::Regex::new(r"--[a-z][a-z0-9-]*")
        .unwrap()
        .find_iter(&help)
        .map(|m| m.as_str())
        .chain(["--release", "--features"]) // cargo's, in the build advice
        .collect();
    let keyed = regex::Regex::new(&format!(
        r#"\[({})\] `?([a-z_][a-z0-9_]*)`?(?: =| \(|`|,|\)|:|;|"|\\|$)"#,
        sections.join("|").replace('.', r"\.")
    ))
    .unwrap();
    let assigned = regex::Regex::new(r"\b(?:set|use) `?([a-z][a-z0-9_]*)`? = ").unwrap();
    let flag = regex::Regex::new(r"(?:^|[^A-Za-z0-9_-])(--[a-z][a-z0-9-]*[a-z0-9])").unwrap();
    let mut files = vec![];
    rust_files(&crate::common::repo_root().join("src"), &mut files);
    let (mut checked, mut wrong) = (0, vec![]);
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        for (n, line) in text.lines().enumerate() {
            if line.trim_start().starts_with("//") {
                continue;
            }
            let at = format!("{}:{}", file.display(), n + 1);
            for c in keyed.captures_iter(line) {
                checked += 1;
                if !is_key(&c[1], &c[2]) {
                    wrong.push(format!("{at}: `{}` is no key of [{}]", &c[2], &c[1]));
                }
            }
            for c in assigned.captures_iter(line) {
                checked += 1;
                if !sections.iter().any(|s| is_key(s, &c[1])) {
                    wrong.push(format!("{at}: `{}` is no key of any section", &c[1]));
                }
            }
            for c in flag.captures_iter(line) {
                checked += 1;
                if !flags.contains(&&c[1]) {
                    wrong.push(format!("{at}: `{}` is no flag of the command", &c[1]));
                }
            }
        }
    }
    assert!(
        checked > 30,
        "only {checked} keys and flags found: the patterns went stale"
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}
