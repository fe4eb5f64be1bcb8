//! The `qlora` command: `quantize` on files and model folders, and its errors.

use std::path::Path;
use std::process::Command;

use candle_qlora::files::{write_safetensors, MappedSafetensors, RawTensor};
use candle_qlora::loading::bnb::read_bnb_file;

fn qlora(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

fn write_tiny_llama_shard(path: &Path, layers: std::ops::Range<usize>, with_embeddings: bool) {
    let mut tensors = vec![];
    let f32s = |n: usize, seed: usize| -> Vec<f32> {
        (0..n)
            .map(|i| ((i * 7 + seed) as f32 * 0.01).sin() * 0.02)
            .collect()
    };
    if with_embeddings {
        tensors.push((
            "model.embed_tokens.weight".to_string(),
            RawTensor::f32(vec![32, 64], &f32s(32 * 64, 1)),
        ));
        tensors.push((
            "model.norm.weight".to_string(),
            RawTensor::f32(vec![64], &[1.0; 64]),
        ));
        tensors.push((
            "lm_head.weight".to_string(),
            RawTensor::f32(vec![32, 64], &f32s(32 * 64, 2)),
        ));
    }
    for l in layers {
        for (name, shape) in [("self_attn.q_proj", [64, 64]), ("mlp.down_proj", [64, 96])] {
            tensors.push((
                format!("model.layers.{l}.{name}.weight"),
                RawTensor::f32(shape.to_vec(), &f32s(shape[0] * shape[1], l)),
            ));
        }
        tensors.push((
            format!("model.layers.{l}.input_layernorm.weight"),
            RawTensor::f32(vec![64], &[1.0; 64]),
        ));
    }
    write_safetensors(path, tensors, None).unwrap();
}

#[test]
fn quantizes_a_safetensors_file() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("model.safetensors");
    let output = dir.path().join("model-nf4.safetensors");
    write_tiny_llama_shard(&input, 0..2, true);
    let (ok, out) = qlora(&[
        "quantize",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    assert!(out.contains("quantized 4 linear weights"), "{out}");
    let weights = read_bnb_file(&output).unwrap();
    assert_eq!(weights.len(), 4);
    assert!(weights.values().all(|w| w.is_double_quantized()));
    let file = MappedSafetensors::open(&output).unwrap();
    let st = file.tensors().unwrap();
    for kept in [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.1.input_layernorm.weight",
    ] {
        assert_eq!(
            st.tensor(kept).unwrap().dtype(),
            safetensors::Dtype::F32,
            "{kept} kept as is"
        );
    }

    // The output exists now: refusing to overwrite it, then replacing it on request.
    let (ok, out) = qlora(&[
        "quantize",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--quant-type",
        "fp4",
    ]);
    assert!(
        !ok && out.contains("already exists") && out.contains("--overwrite"),
        "{out}"
    );
    let args = [
        "quantize",
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
        "--quant-type",
        "fp4",
        "--double-quant",
        "false",
        "--overwrite",
    ];
    let (ok, out) = qlora(&args);
    assert!(ok, "{out}");
    let weights = read_bnb_file(&output).unwrap();
    assert!(weights
        .values()
        .all(|w| !w.is_double_quantized() && w.quant_type().as_str() == "fp4"));
}

#[test]
fn quantizes_a_sharded_model_folder_for_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("tiny");
    std::fs::create_dir(&model).unwrap();
    write_tiny_llama_shard(&model.join("model-00001-of-00002.safetensors"), 0..1, true);
    write_tiny_llama_shard(&model.join("model-00002-of-00002.safetensors"), 1..2, false);
    std::fs::write(
        model.join("config.json"),
        r#"{"model_type": "llama", "hidden_size": 64}"#,
    )
    .unwrap();
    let mut weight_map = serde_json::Map::new();
    for shard in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        for name in candle_core::safetensors::load(model.join(shard), &candle_core::Device::Cpu)
            .unwrap()
            .keys()
        {
            weight_map.insert(name.clone(), shard.into());
        }
    }
    std::fs::write(
        model.join("model.safetensors.index.json"),
        serde_json::json!({"metadata": {}, "weight_map": weight_map}).to_string(),
    )
    .unwrap();
    std::fs::write(model.join("tokenizer.json"), "{}").unwrap();
    let output = dir.path().join("tiny-nf4");
    let (ok, out) = qlora(&[
        "quantize",
        "--input",
        model.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(output.join("config.json")).unwrap())
            .unwrap();
    let q = &config["quantization_config"];
    assert_eq!(q["quant_method"], "bitsandbytes");
    assert_eq!(q["load_in_4bit"], true);
    assert_eq!(q["bnb_4bit_quant_type"], "nf4");
    assert_eq!(q["bnb_4bit_use_double_quant"], true);
    assert_eq!(config["model_type"], "llama");
    assert!(output.join("tokenizer.json").exists());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(output.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        index["weight_map"]["model.layers.1.mlp.down_proj.weight.absmax"],
        "model-00002-of-00002.safetensors"
    );
    assert_eq!(
        read_bnb_file(output.join("model-00002-of-00002.safetensors"))
            .unwrap()
            .len(),
        2
    );
    // No staging folder is left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(leftovers.len(), 2, "{leftovers:?}");

    // Quantizing an already-quantized folder is refused.
    let again = dir.path().join("again");
    let (ok, out) = qlora(&[
        "quantize",
        "--input",
        output.to_str().unwrap(),
        "--output",
        again.to_str().unwrap(),
    ]);
    assert!(!ok && out.contains("already quantized"), "{out}");
    assert!(!again.exists());
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("m.safetensors");
    write_tiny_llama_shard(&input, 0..1, false);
    let out_path = dir.path().join("o.safetensors");
    let o = out_path.to_str().unwrap();

    let (ok, out) = qlora(&[
        "quantize",
        "--input",
        "/nonexistent/m.safetensors",
        "--output",
        o,
    ]);
    assert!(!ok && out.contains("/nonexistent/m.safetensors"), "{out}");
    let (ok, out) = qlora(&[
        "quantize",
        "--input",
        input.to_str().unwrap(),
        "--output",
        o,
        "--blocksize",
        "100",
    ]);
    assert!(!ok && out.contains("blocksize 100 is not allowed"), "{out}");
    std::fs::write(
        dir.path().join("junk.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}",
    )
    .unwrap();
    let junk = dir.path().join("junk.safetensors");
    let (ok, out) = qlora(&["quantize", "--input", junk.to_str().unwrap(), "--output", o]);
    assert!(
        !ok && out.contains("junk.safetensors") && out.contains("not a valid safetensors"),
        "{out}"
    );
    let empty_dir = dir.path().join("empty");
    std::fs::create_dir(&empty_dir).unwrap();
    let (ok, out) = qlora(&[
        "quantize",
        "--input",
        empty_dir.to_str().unwrap(),
        "--output",
        o,
    ]);
    assert!(!ok && out.contains("config.json"), "{out}");
    assert!(!out_path.exists());
}

/// Every file under `dir` with its bytes, by path relative to `dir`.
fn snapshot(dir: &Path) -> std::collections::BTreeMap<std::path::PathBuf, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).unwrap();
                out.insert(path.strip_prefix(dir).unwrap().to_path_buf(), bytes);
            }
        }
    }
    out
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, to.join(path.file_name().unwrap())).unwrap();
        }
    }
}

/// `merge` and `quantize` refuse an output that is, is inside or contains an input — with `--overwrite`, and
/// whatever the spelling (a symlink, `..`, a folder not yet created) — before anything loads, and both inputs are
/// byte-identical afterwards; an output apart from them merges.
#[test]
fn merge_and_quantize_never_write_over_their_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    let base = root.join("inputs/base");
    let adapter = root.join("adapter");
    copy_dir(&crate::common::data_path("models/tiny-llama"), &base);
    copy_dir(&crate::common::data_path("peft/lora_all_linear"), &adapter);
    let (base_bytes, adapter_bytes) = (snapshot(&base), snapshot(&adapter));
    #[cfg(unix)]
    std::os::unix::fs::symlink(&adapter, root.join("link")).unwrap();
    let merge = |output: &Path| {
        let (b, a, o) = (
            base.to_str().unwrap(),
            adapter.to_str().unwrap(),
            output.to_str().unwrap(),
        );
        qlora(&[
            "merge",
            "--model",
            b,
            "--adapter",
            a,
            "--output",
            o,
            "--overwrite",
        ])
    };
    let mut outputs = vec![
        (adapter.clone(), "is --adapter"),
        (base.clone(), "is --model"),
        (adapter.join("merged"), "is inside --adapter"),
        (root.join("inputs"), "contains --model"),
        (root.join("missing/../adapter"), "is --adapter"),
        (root.to_path_buf(), "contains --adapter"),
    ];
    if cfg!(unix) {
        outputs.push((root.join("link"), "is --adapter"));
    }
    for (output, says) in &outputs {
        let (ok, text) = merge(output);
        assert!(!ok && text.contains(says), "{output:?}: {text}");
        assert!(
            text.contains("choose an output apart from every input"),
            "{text}"
        );
        assert!(
            !text.contains("loaded "),
            "refused only after loading: {text}"
        );
    }
    let quantize = |output: &Path| {
        let (b, o) = (base.to_str().unwrap(), output.to_str().unwrap());
        qlora(&["quantize", "--input", b, "--output", o, "--overwrite"])
    };
    for (output, says) in [
        (base.clone(), "is --input"),
        (base.join("nf4"), "is inside --input"),
        (root.join("inputs"), "contains --input"),
    ] {
        let (ok, text) = quantize(&output);
        assert!(!ok && text.contains(says), "{output:?}: {text}");
    }
    assert!(snapshot(&base) == base_bytes, "the base changed");
    assert!(snapshot(&adapter) == adapter_bytes, "the adapter changed");
    let names: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(names.len() <= 3, "left behind: {names:?}"); // inputs, adapter, link
                                                         // The advice followed: an output apart from both merges.
    let (ok, text) = merge(&root.join("merged"));
    assert!(ok, "{text}");
}

/// `train --nproc-per-node N` that this build or machine cannot run (far more ranks than GPUs, none at all, or
/// several without the `nccl` feature) exits with an error in well under a second: checked before a rank starts,
/// so no model loads (a rank's load alone takes longer) and no output folder appears.
#[test]
fn a_launch_that_cannot_run_is_refused_before_a_rank_starts() {
    let dir = tempfile::tempdir().unwrap();
    let config = crate::trainer::write_tiny_config(dir.path(), "", "max_steps = 1\n");
    for n in ["64", "0", "100000"] {
        let start = std::time::Instant::now();
        let (ok, text) = qlora(&[
            "train",
            "--config",
            config.to_str().unwrap(),
            "--nproc-per-node",
            n,
        ]);
        let took = start.elapsed();
        assert!(
            !ok && text.contains(&format!("--nproc-per-node {n}: ")),
            "{n}: {text}"
        );
        assert!(!text.contains("rank 0"), "a rank started: {text}");
        assert!(
            !dir.path().join("out").exists(),
            "a rank prepared the output folder"
        );
        // A process start and a TOML file: milliseconds; the bound leaves room for a loaded machine.
        assert!(
            took < std::time::Duration::from_secs(1),
            "{n} ranks refused after {took:?}"
        );
    }
}

/// `--device` of eval and generate: `cpu` computes in float32 on the CPU; `cuda` in a build without the `cuda`
/// feature is an error saying so, before anything loads. (The GPU suite runs `--device cuda` on a GPU.)
#[test]
fn generation_says_where_it_computes() {
    let model = crate::common::data_path("models/tiny-llama");
    let model = model.to_str().unwrap();
    let (ok, said) = qlora(&[
        "generate",
        "--model",
        model,
        "--device",
        "cpu",
        "--prompt",
        "hello",
        "--max-new-tokens",
        "2",
        "--ignore-eos",
    ]);
    assert!(ok, "{said}");
    assert!(said.contains("; on the CPU) in"), "{said}");
    assert!(said.contains("2 tokens in"), "{said}");
    if !cfg!(feature = "cuda") {
        let (ok, said) = qlora(&[
            "generate", "--model", model, "--device", "cuda", "--prompt", "hello",
        ]);
        assert!(!ok);
        assert!(
            said.contains("--device cuda: no CUDA GPU in this build"),
            "{said}"
        );
    }
}
