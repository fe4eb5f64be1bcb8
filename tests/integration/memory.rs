//! Memory accounting: the NF4 model's weight bytes as predicted, the trainer's per-phase timeline and breakdown,
//! `qlora estimate`, and the run's estimate on its memory chart.

use std::path::Path;

use candle_qlora::data::{DataConfig, Dataset};
use candle_qlora::loading::{load_model, load_model_config, load_tokenizer, LoadOptions};
use candle_qlora::memory::{estimate, EstimateArgs};
use candle_qlora::quant::QuantConfig;

use crate::common::data_path;

/// `qlora train --config config` with `extra` arguments and `env`, run to its end (a failure panics with its
/// stderr): its stderr, and the memory timeline it wrote to `out_dir`.
fn train_timeline(
    config: &Path,
    extra: &[String],
    env: &[(&str, &str)],
    out_dir: &Path,
) -> (String, serde_json::Value) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(["train", "--config", config.to_str().unwrap()])
        .args(extra)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{text}");
    let timeline =
        std::fs::read_to_string(out_dir.join("memory_timeline.json")).unwrap_or_else(|e| {
            panic!("{}: {e}", out_dir.display());
        });
    (text, serde_json::from_str(&timeline).unwrap())
}

/// The NF4 SmolLM2's base-weight bytes are 4.127 bits per quantized parameter plus the unquantized tensors, and
/// the estimate predicts them with the RoPE tables to the byte.
#[test]
fn nf4_weight_bytes_match_the_prediction() {
    let Some(path) = crate::common::test_model() else {
        return;
    };
    let path = path.to_str().unwrap();
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..Default::default()
    };
    let model = load_model(path, None, &opts).unwrap().model;
    let config = load_model_config(path, None).unwrap();
    let predicted = estimate(&config, &EstimateArgs::default()).unwrap();
    assert_eq!(
        (model.weight_bytes() + model.rope_table_bytes()) as u64,
        predicted.weights_bytes
    );
    // Per parameter: 4 bits of code, 8/64 of absmax, 32/(64·256) of nested absmax = 4.127 bits; per tensor: the
    // 256-entry nested map, its offset and the 16-entry codebook (1092 bytes).
    let (mut quantized_bytes, mut quantized_params, mut tensors) = (0usize, 0usize, 0usize);
    for layer in &model.layers {
        for (_, linear) in layer.linears() {
            let (rows, cols) = linear.base.weight.dims2().unwrap();
            quantized_bytes += linear.base.weight.size_in_bytes();
            quantized_params += rows * cols;
            tensors += 1;
        }
    }
    let bits = (quantized_bytes - 1092 * tensors) as f64 * 8.0 / quantized_params as f64;
    assert!(
        (bits - 4.127).abs() < 0.001,
        "{bits} bits per quantized parameter"
    );
    let unquantized =
        (config.vocab_size + (2 * config.num_hidden_layers + 1)) * config.hidden_size * 4;
    assert_eq!(model.weight_bytes(), quantized_bytes + unquantized);
}

/// A training run writes a timeline with every phase and a breakdown whose constant parts are the model's.
#[test]
fn the_trainer_records_where_memory_goes() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("run.toml");
    std::fs::write(
        dir.path().join("train.jsonl"),
        "{\"text\": \"t1 t2 t3 t4 t5 t6\"}\n{\"text\": \"t7 t8 t9\"}\n",
    )
    .unwrap();
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {:?}\n[model.quantization]\nload_in_4bit = true\nbnb_4bit_quant_type = \"nf4\"\nbnb_4bit_use_double_quant = true\n\
             [lora]\nr = 4\ntarget_modules = \"all-linear\"\n[data]\ntrain_file = \"train.jsonl\"\n\
             [training]\noutput_dir = {:?}\nper_device_train_batch_size = 1\ngradient_accumulation_steps = 2\n\
             max_steps = 2\nsave_strategy = \"no\"\n",
            data_path("models/tiny-llama").to_str().unwrap(),
            dir.path().join("out").to_str().unwrap()
        ),
    )
    .unwrap();
    let (text, timeline) = train_timeline(&config, &[], &[], &dir.path().join("out"));
    assert!(
        text.contains("peak memory") && text.contains("activations"),
        "{text}"
    );
    assert_eq!(timeline["source"], "heap");
    let phases: Vec<&str> = timeline["samples"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["phase"].as_str().unwrap())
        .collect();
    // Two steps of two micro-batches: forward, backward, forward, backward, optimizer — twice.
    let step = ["forward", "backward", "forward", "backward", "optimizer"];
    assert_eq!(phases, [step, step].concat());
    let model = load_model(
        data_path("models/tiny-llama").to_str().unwrap(),
        None,
        &LoadOptions {
            quantization: Some(QuantConfig::nf4()),
            ..Default::default()
        },
    )
    .unwrap()
    .model;
    let breakdown = &timeline["peak"][1];
    assert_eq!(
        breakdown["base_weights"].as_u64().unwrap(),
        (model.weight_bytes() + model.rope_table_bytes()) as u64
    );
    assert!(
        breakdown["lora"].as_u64().unwrap() > 0 && breakdown["activations"].as_u64().unwrap() > 0
    );
    assert!(dir.path().join("out/memory.svg").exists());
}

/// A micro-batch's activations are freed when its backward ends: what stays live grows by no more than half of one
/// micro-batch's activations over an accumulation window of four (the logged loss once held each micro-batch's
/// graph until the optimizer step, so the window's last forward held four micro-batches' activations).
#[test]
fn micro_batches_do_not_keep_each_others_activations() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("run.toml");
    let line = format!("{{\"text\": \"{}\"}}\n", ["t1 t2 t3 t4"; 12].join(" "));
    std::fs::write(dir.path().join("train.jsonl"), line.repeat(4)).unwrap();
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {:?}\n[lora]\nr = 4\ntarget_modules = \"all-linear\"\n\
             [data]\ntrain_file = \"train.jsonl\"\n[training]\noutput_dir = {:?}\n\
             per_device_train_batch_size = 1\ngradient_accumulation_steps = 4\nmax_steps = 1\n\
             save_strategy = \"no\"\n",
            data_path("models/tiny-llama").to_str().unwrap(),
            dir.path().join("out").to_str().unwrap()
        ),
    )
    .unwrap();
    // One worker thread: the matrix kernels keep a scratch buffer per thread, made the first time a thread
    // multiplies, which on a loaded machine can be a thread that first works in a later micro-batch.
    let one_thread = [("RAYON_NUM_THREADS", "1")];
    let (_, timeline) = train_timeline(&config, &[], &one_thread, &dir.path().join("out"));
    // Live bytes at the end of micro-batch `k`'s forward.
    let live = |k: u64| {
        let samples = timeline["samples"].as_array().unwrap();
        let sample = samples
            .iter()
            .find(|s| s["phase"] == "forward" && s["micro_batch"] == k)
            .unwrap_or_else(|| panic!("no forward sample of micro-batch {k}"));
        sample["allocated"].as_f64().unwrap()
    };
    // After the first backward the gradients exist; from then on each forward's live bytes are the same model,
    // adapter and gradients, and its own graph. A graph held past its backward adds a micro-batch's activations
    // (a fifth of the live bytes of this model and length) per micro-batch; what may grow is bookkeeping (0.02%
    // here), far below 5% of them.
    let growth = live(3) - live(1);
    assert!(
        growth < 0.05 * live(1),
        "live bytes grew by {growth} from the second forward ({}) to the fourth",
        live(1)
    );
}

/// The estimate a run draws on its memory chart is what `qlora estimate` prints for the run's settings — its batch,
/// longest example, rank and target modules, optimizer, checkpointing and activation budget, NF4 base, device and
/// dtype — and the flags the run prints repeat it.
#[test]
fn the_charts_estimate_is_qlora_estimates_for_the_runs_settings() {
    let dir = tempfile::tempdir().unwrap();
    let model = data_path("models/tiny-llama");
    let model = model.to_str().unwrap();
    let train = dir.path().join("train.jsonl");
    std::fs::write(
        &train,
        "{\"text\": \"t1 t2 t3\"}\n{\"text\": \"t4 t5 t6 t7 t8 t9 t10\"}\n{\"text\": \"t11 t12\"}\n",
    )
    .unwrap();
    let config = dir.path().join("run.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {model:?}\n[model.quantization]\nload_in_4bit = true\n\
             bnb_4bit_quant_type = \"nf4\"\nbnb_4bit_use_double_quant = true\n\
             [lora]\nr = 4\ntarget_modules = [\"q_proj\", \"v_proj\"]\n[data]\ntrain_file = \"train.jsonl\"\n\
             [training]\noutput_dir = {:?}\nper_device_train_batch_size = 2\nmax_steps = 1\n\
             save_strategy = \"no\"\noptim = \"adamw_torch\"\ngradient_checkpointing = true\n\
             activation_memory_budget_mib = 0.01\n",
            dir.path().join("out").to_str().unwrap()
        ),
    )
    .unwrap();
    let (text, timeline) = train_timeline(&config, &[], &[], &dir.path().join("out"));
    let drawn = timeline["estimate"]["prediction"]["total_bytes"]
        .as_u64()
        .unwrap();
    let tokenizer = load_tokenizer(model, None).unwrap().unwrap();
    let longest = Dataset::from_jsonl(&train, &tokenizer, &DataConfig::default())
        .unwrap()
        .rows
        .iter()
        .map(|r| r.input_ids.len())
        .max()
        .unwrap();
    let estimated = |flags: &[&str]| {
        let json =
            crate::families::qlora(&[&["estimate", "--model", model, "--json"], flags].concat());
        serde_json::from_str::<serde_json::Value>(&json).unwrap()["total_bytes"]
            .as_u64()
            .unwrap()
    };
    let seq = longest.to_string();
    let settings = [
        "--batch",
        "2",
        "--seq",
        &seq,
        "--lora-r",
        "4",
        "--target-modules",
        "q_proj,v_proj",
        "--optim",
        "adamw_torch",
        "--gradient-checkpointing",
        "--activation-memory-budget-mib",
        "0.01",
        "--quantize",
        "nf4",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ];
    assert_eq!(drawn, estimated(&settings));
    // Another rank, other targets or another length are another estimate: the comparison can fail.
    for (flag, other) in [
        ("--lora-r", "8"),
        ("--target-modules", "all-linear"),
        ("--seq", "128"),
    ] {
        let i = settings.iter().position(|s| *s == flag).unwrap();
        let mut changed = settings;
        changed[i + 1] = other;
        assert_ne!(drawn, estimated(&changed), "{flag} {other}");
    }
    // The run says how to repeat its estimate.
    let printed = text
        .split("`qlora estimate --model <the base model> ")
        .nth(1)
        .and_then(|rest| rest.split('`').next())
        .unwrap_or_else(|| panic!("no estimate command in {text}"));
    let printed: Vec<&str> = printed.split(' ').collect();
    assert_eq!(printed, settings);
}

/// `qlora estimate` prints the table, or one JSON object for the configuration asked; bad input names the model;
/// `--gpu-memory` finds the longest sequence that fits.
#[test]
fn estimate_command_prints_the_table_and_json() {
    let model = data_path("models/tiny-llama/config.json");
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args(["estimate", "--model"])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let m = model.to_str().unwrap();
    let (ok, text) = run(&[m, "--batch", "2", "--seq", "64", "--gradient-checkpointing"]);
    assert!(ok, "{text}");
    for row in [
        "full fine-tune, fp32",
        "full fine-tune, mixed",
        "LoRA, bf16 base",
        "QLoRA, NF4 base",
        "this configuration",
    ] {
        assert!(text.contains(row), "{row}: {text}");
    }
    let (ok, text) = run(&[
        m,
        "--json",
        "--quantize",
        "none",
        "--device",
        "cuda",
        "--optim",
        "adamw_torch",
    ]);
    assert!(ok, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let keys = [
        "weights_bytes",
        "lora_bytes",
        "optimizer_bytes",
        "gradients_bytes",
        "activations_bytes",
        "other_bytes",
    ];
    let sum: u64 = keys.iter().map(|k| v[k].as_u64().unwrap()).sum();
    assert_eq!(v["total_bytes"].as_u64().unwrap(), sum);
    assert_eq!(
        v["optimizer_bytes"].as_u64().unwrap(),
        2 * v["lora_bytes"].as_u64().unwrap()
    );
    // Data parallel: the same per-GPU rows and the exchange of each optimizer step.
    let (ok, text) = run(&[m, "--device", "cuda", "--world-size", "8"]);
    assert!(
        ok && text.contains("per GPU of 8")
            && text.contains("data parallel over 8 GPUs, per optimizer step")
            && text.contains("all-reduced in 1 bucket(s)"),
        "{text}"
    );
    let (ok, text) = run(&[m, "--device", "cuda", "--world-size", "8", "--json"]);
    assert!(ok, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let d = &v["data_parallel"];
    assert_eq!(d["world_size"], 8);
    assert_eq!(
        d["all_reduce_bytes"].as_u64().unwrap(),
        v["gradients_bytes"].as_u64().unwrap()
    );
    let (ok, text) = run(&["no/such-folder-or-id/x"]);
    assert!(!ok && text.contains("no/such-folder-or-id/x"), "{text}");
    // --gpu-memory: the longest sequence whose peak fits 91% of it, as asked and with the MLP tiled; the next
    // token does not fit.
    let flags = [m, "--device", "cuda", "--gradient-checkpointing", "--json"];
    let (ok, text) = run(&[&flags[..], &["--gpu-memory", "1GiB"]].concat());
    assert!(ok, "{text}");
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let usable = (0.91 * (1u64 << 30) as f64) as u64;
    for (key, tiled) in [("max_seq_len", false), ("max_seq_len_tiled_mlp", true)] {
        let longest = v[key].as_u64().unwrap();
        let total = |seq: u64| {
            let seq = seq.to_string();
            let mut args = [&flags[..], &["--seq", &seq]].concat();
            if tiled {
                args.push("--tiled-mlp");
            }
            let (ok, text) = run(&args);
            assert!(ok, "{text}");
            serde_json::from_str::<serde_json::Value>(&text).unwrap()["total_bytes"]
                .as_u64()
                .unwrap()
        };
        assert!(
            total(longest) <= usable && total(longest + 1) > usable,
            "{key} {longest}"
        );
    }
    let (ok, text) = run(&[m, "--gpu-memory", "24 bananas"]);
    assert!(
        !ok && text.contains("--gpu-memory") && text.contains("unknown unit"),
        "{text}"
    );
}

/// The estimate's weight bytes follow each family's architecture table (Phi-3's fused projections, Qwen3's and
/// Gemma 3's head norms, Gemma's four norms per layer, Qwen2's biases, tied heads): to the byte of the loaded NF4
/// model, for every tiny family model.
#[test]
fn every_family_weight_bytes_match_the_prediction() {
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..Default::default()
    };
    for name in crate::common::TINY_MODELS {
        let path = data_path(&format!("models/{name}"));
        let path = path.to_str().unwrap();
        let model = load_model(path, None, &opts).unwrap().model;
        let config = load_model_config(path, None).unwrap();
        let predicted = estimate(&config, &EstimateArgs::default()).unwrap();
        assert_eq!(
            (model.weight_bytes() + model.rope_table_bytes()) as u64,
            predicted.weights_bytes,
            "{name}"
        );
    }
}

/// `qlora train` in `dir` on the tiny config for 2 steps with gradient checkpointing and `memory_snapshot`: its
/// output folder and what it printed.
pub(crate) fn train_with_memory_snapshot(dir: &Path) -> (std::path::PathBuf, String) {
    let config = crate::trainer::write_tiny_config(
        dir,
        "",
        "max_steps = 2\nsave_strategy = \"no\"\ngradient_checkpointing = true\nmemory_snapshot = true\n",
    );
    let text = crate::families::qlora(&["train", "--config", config.to_str().unwrap()]);
    (dir.join("out"), text)
}

/// `snapshot` read by PyTorch's `torch.cuda._memory_viz` (`scripts/read_memory_snapshot.py`: `segsum`, `trace`, the
/// trace replayed), checked to be read; `None` (the test skipped) where neither torch nor `$QLORA_MEMORY_VIZ` is
/// there, which CI must not be.
pub(crate) fn read_memory_snapshot(snapshot: &Path) -> Option<serde_json::Value> {
    let read = std::process::Command::new("python3")
        .arg(crate::common::repo_root().join("scripts/read_memory_snapshot.py"))
        .arg(snapshot)
        .output()
        .unwrap();
    if read.status.code() == Some(3) {
        let said = String::from_utf8_lossy(&read.stderr);
        assert!(
            std::env::var_os("CI").is_none(),
            "CI must provide PyTorch's _memory_viz.py: {said}"
        );
        eprintln!("skipped: {said} (set QLORA_MEMORY_VIZ to torch/cuda/_memory_viz.py)");
        return None;
    }
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
    let r: serde_json::Value = serde_json::from_slice(&read.stdout).unwrap();
    assert!(
        r["segsum"].as_str().unwrap().contains("total_allocated"),
        "{r}"
    );
    Some(r)
}

/// The snapshot's trace `r` (as [`read_memory_snapshot`] gives it) replays to the peak the memory timeline of the
/// run in `out` reports, within `tolerance` of it.
pub(crate) fn assert_replays_to_the_timeline_peak(
    r: &serde_json::Value,
    out: &Path,
    tolerance: f64,
) {
    let timeline: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("memory_timeline.json")).unwrap())
            .unwrap();
    let peak = timeline["peak"][0]["peak"].as_f64().unwrap();
    let replayed = r["replayed_peak"].as_f64().unwrap();
    assert!(
        (replayed - peak).abs() <= tolerance * peak,
        "replayed peak {replayed} vs the timeline's {peak}"
    );
}

/// The snapshot's frames (as memory_viz formats them in `r`) are two (the op in its layer, the phase of its step),
/// and every phase of a step appears in `snapshot`, with layers and op names.
pub(crate) fn assert_frames_name_every_phase(r: &serde_json::Value, snapshot: &Path) {
    let frames: Vec<String> = r["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect();
    assert_eq!(frames.len(), 2, "{frames:?}");
    let lines = r["trace_lines"].as_array().unwrap().len();
    let pickle = std::fs::read(snapshot).unwrap();
    let has = |s: &str| pickle.windows(s.len()).any(|w| w == s.as_bytes());
    for phase in ["forward", "recompute", "backward", "optimizer"] {
        assert!(has(phase), "no `{phase}` frame in {lines} trace lines");
    }
    assert!(has("model.layers.1") && has("step 2") && has("attention"));
}

/// `memory_snapshot = true` writes `memory_snapshot.pickle`, which PyTorch's own `torch.cuda._memory_viz` reads
/// (`segsum`, `trace`); its frames name the op, the layer, the phase and the step; the weights are in its segments
/// (recording starts before they load); and replaying its trace gives the heap peak the memory timeline reports.
#[test]
fn memory_snapshot_reads_in_pytorch_memory_viz_and_replays_to_the_peak() {
    let dir = tempfile::tempdir().unwrap();
    let (out, text) = train_with_memory_snapshot(dir.path());
    assert!(text.contains("memory snapshot:"), "{text}");
    let snapshot = out.join("memory_snapshot.pickle");
    let Some(r) = read_memory_snapshot(&snapshot) else {
        return;
    };
    assert!(r["trace_lines"].as_array().unwrap().len() > 100, "{r}");
    assert_replays_to_the_timeline_peak(&r, &out, 0.005);
    assert_frames_name_every_phase(&r, &snapshot);
}

/// `tiled_mlp` bounds the MLP's working set: a step of the tiny Llama on 4 × 250 tokens (1,000 token rows, 16
/// slices of at most 64), checkpointed or not, peaks lower in activations than the untiled step, by at least half
/// of what the untiled MLP's three `[1000, 160]` float32 intermediates hold beyond one slice's (the backward's
/// gradients of them come on top; without checkpointing every layer's are kept); the run's estimate predicts the
/// drop within 25%.
#[test]
fn tiled_mlp_lowers_the_activation_peak_at_a_longer_sequence() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("run.toml");
    let words: Vec<String> = (0..400).map(|j| format!("t{}", 1 + (j * 7) % 50)).collect();
    let line = format!("{{\"text\": \"{}\"}}\n", words.join(" "));
    std::fs::write(dir.path().join("train.jsonl"), line.repeat(4)).unwrap();
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {:?}\n[lora]\nr = 4\ntarget_modules = \"all-linear\"\n\
             [data]\ntrain_file = \"train.jsonl\"\nmax_length = 250\n[training]\noutput_dir = \"out\"\n\
             per_device_train_batch_size = 4\ngradient_accumulation_steps = 1\nmax_steps = 1\n\
             save_strategy = \"no\"\n",
            data_path("models/tiny-llama").to_str().unwrap(),
        ),
    )
    .unwrap();
    let peak = |tiled: bool, checkpointing: bool| {
        let out_dir = dir.path().join(format!("out-{tiled}-{checkpointing}"));
        let settings = [
            format!("training.tiled_mlp={tiled}"),
            format!("training.gradient_checkpointing={checkpointing}"),
            format!("training.output_dir={:?}", out_dir.to_str().unwrap()),
        ];
        let extra: Vec<String> = settings
            .into_iter()
            .flat_map(|s| ["--set".to_string(), s])
            .collect();
        let (_, timeline) = train_timeline(&config, &extra, &[], &out_dir);
        let estimated = timeline["estimate"]["prediction"]["activations_bytes"]
            .as_f64()
            .unwrap();
        let measured = timeline["peak"][1]["activations"].as_f64().unwrap();
        eprintln!(
            "tiled_mlp {tiled}, checkpointing {checkpointing}: peak {}, activations measured {measured}, \
             estimated {estimated}",
            timeline["peak"][0]
        );
        (measured, estimated)
    };
    let rows = 4.0 * 250.0;
    let beyond_one_slice = 3.0 * (rows - 64.0) * 160.0 * 4.0;
    for checkpointing in [true, false] {
        let ((plain, plain_estimate), (tiled, tiled_estimate)) =
            (peak(false, checkpointing), peak(true, checkpointing));
        assert!(
            plain - tiled >= 0.5 * beyond_one_slice,
            "checkpointing {checkpointing}: activations at the peak: untiled {plain} B, tiled {tiled} B; \
             expected a drop of at least {} B",
            0.5 * beyond_one_slice
        );
        // The estimate (the run's, drawn on its chart) predicts the drop: 4.20 MB against 3.81 measured with
        // checkpointing, 6.12 against 5.75 without.
        let (drop, predicted) = (plain - tiled, plain_estimate - tiled_estimate);
        assert!(
            (predicted - drop).abs() <= 0.25 * drop,
            "checkpointing {checkpointing}: tiling lowers the activations by {drop} B, the estimate by {predicted} B"
        );
    }
}
