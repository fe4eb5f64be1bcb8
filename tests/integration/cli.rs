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
