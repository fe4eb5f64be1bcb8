//! `qlora eval` and `qlora generate`, Hub ids resolved through the Hugging Face cache, and bad model input.

use std::path::Path;
use std::process::Command;

use candle_qlora::loading::{load_model, LoadOptions};

use crate::common::{data_path, test_model};

fn qlora(args: &[&str], env: &[(&str, &Path)]) -> (bool, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_qlora"));
    cmd.args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn tiny(name: &str) -> String {
    data_path(&format!("models/{name}"))
        .to_str()
        .unwrap()
        .to_string()
}

#[test]
fn eval_reports_the_token_level_mean_over_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("d.jsonl");
    // Two text examples of different lengths: the mean is over all 6 predicted tokens, not per example.
    std::fs::write(
        &data,
        "{\"text\": \"t1 t5 t9 t13\"}\n{\"text\": \"t2 t4 t6 t8 t10\"}\n",
    )
    .unwrap();
    let (ok, out, err) = qlora(
        &[
            "eval",
            "--model",
            &tiny("tiny-llama"),
            "--data",
            data.to_str().unwrap(),
            "--json",
        ],
        &[],
    );
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(report["tokens"], 7);
    assert_eq!(report["examples"], 2);

    // The same number from the library, example by example.
    let model = load_model(&tiny("tiny-llama"), None, &LoadOptions::default())
        .unwrap()
        .model;
    let mut total = 0f64;
    for ids in [vec![1u32, 5, 9, 13], vec![2, 4, 6, 8, 10]] {
        let t = candle_core::Tensor::new(ids.as_slice(), &candle_core::Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let (s, _) = crate::common::text_loss(&model, &t);
        total += s;
    }
    let loss = report["loss"].as_f64().unwrap();
    // Two float32 computations of the same losses (batched by the command, one by one here): within the float32
    // rounding bound of two passes through the decoder.
    let terms = 2 * crate::common::decoder_chain_terms(model.config(), 5);
    let bound = crate::common::float32_bound(terms, total / 7.0);
    assert!(
        (loss - total / 7.0).abs() <= bound,
        "{loss} vs {}: beyond the float32 bound {bound:.2e} of two passes",
        total / 7.0
    );
    assert!((report["perplexity"].as_f64().unwrap() - loss.exp()).abs() < 1e-6);

    // A bad line names the file and line.
    std::fs::write(&data, "{\"text\": \"t1 t2\"}\n{\"txt\": \"t3\"}\n").unwrap();
    let (ok, _, err) = qlora(
        &[
            "eval",
            "--model",
            &tiny("tiny-llama"),
            "--data",
            data.to_str().unwrap(),
        ],
        &[],
    );
    assert!(!ok && err.contains("d.jsonl:2"), "{err}");
}

#[test]
fn generate_streams_greedy_tokens_from_the_real_model() {
    let Some(model) = test_model() else { return };
    let args = [
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt",
        "What is the capital of France?",
        "--chat",
        "--max-new-tokens",
        "12",
    ];
    let (ok, out, err) = qlora(&args, &[]);
    assert!(ok, "{err}");
    assert_eq!(out.trim(), "The capital of France is Paris.");
    let (ok, out, err) = qlora(&[&args[..], &["--quantize", "nf4"]].concat(), &[]);
    assert!(ok, "{err}");
    assert!(out.contains("Paris"), "NF4 answer: {out}");
}

/// A Hub id resolves through the Hugging Face cache layout (`HF_HOME/hub/models--org--name/...`) offline.
#[test]
fn hub_ids_load_from_the_cache_and_fail_clearly_offline() {
    let home = tempfile::tempdir().unwrap();
    let repo = home.path().join("hub/models--acme--tiny-llama");
    let snapshot = repo.join("snapshots/0123456789abcdef");
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "0123456789abcdef").unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(
            data_path(&format!("models/tiny-llama/{f}")),
            snapshot.join(f),
        )
        .unwrap();
    }
    let data = home.path().join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"t1 t5 t9 t13\"}\n").unwrap();
    let offline = Path::new("1");
    let env = [("HF_HOME", home.path()), ("HF_HUB_OFFLINE", offline)];
    let (ok, out, err) = qlora(
        &[
            "eval",
            "--model",
            "acme/tiny-llama",
            "--data",
            data.to_str().unwrap(),
            "--json",
        ],
        &env,
    );
    assert!(ok, "{err}");
    assert!(out.contains("\"tokens\":3"), "{out}");

    let (ok, _, err) = qlora(
        &[
            "eval",
            "--model",
            "acme/other",
            "--data",
            data.to_str().unwrap(),
        ],
        &env,
    );
    assert!(
        !ok && err.contains("acme/other")
            && err.contains("HF_HUB_OFFLINE")
            && err.contains("local model folder"),
        "{err}"
    );
}

#[test]
fn broken_models_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["config.json", "model.safetensors", "tokenizer.json"] {
            std::fs::copy(data_path(&format!("models/tiny-llama/{f}")), d.join(f)).unwrap();
        }
        d
    };
    let load = |d: &Path| {
        load_model(d.to_str().unwrap(), None, &LoadOptions::default())
            .err()
            .expect("must fail")
            .to_string()
    };

    let d = copy("no-weights");
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    assert!(load(&d).contains(
        "no model.safetensors (or model.safetensors.index.json) in this folder; pytorch_model.bin"
    ));

    let d = copy("truncated");
    let bytes = std::fs::read(d.join("model.safetensors")).unwrap();
    std::fs::write(d.join("model.safetensors"), &bytes[..bytes.len() / 3]).unwrap();
    let err = load(&d);
    assert!(
        err.contains("model.safetensors") && err.contains("truncated"),
        "{err}"
    );

    let d = copy("missing-key");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().remove("num_hidden_layers");
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let err = load(&d);
    assert!(
        err.contains("config.json") && err.contains("missing field `num_hidden_layers`"),
        "{err}"
    );

    let d = copy("unknown-type");
    cfg["model_type"] = "bert".into();
    cfg["num_hidden_layers"] = 2.into();
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let err = load(&d);
    assert!(
        err.contains("bert") && err.contains("llama") && err.contains("qwen2"),
        "{err}"
    );

    let d = copy("wrong-shape");
    cfg["model_type"] = "llama".into();
    cfg["intermediate_size"] = 128.into();
    std::fs::write(d.join("config.json"), cfg.to_string()).unwrap();
    let err = load(&d);
    assert!(
        err.contains("gate_proj.weight") && err.contains("[160, 64]") && err.contains("[128, 64]"),
        "{err}"
    );

    let err = load_model("/nonexistent/model.gguf", None, &LoadOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"not a gguf file at all").unwrap();
    let err = load_model(junk.to_str().unwrap(), None, &LoadOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("junk.gguf") && err.contains("GGUF"), "{err}");
}
