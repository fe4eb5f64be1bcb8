//! Every model family end to end through the command: a short QLoRA run (NF4 base, every linear module adapted),
//! a merge that reproduces the adapted model, and generation with the adapter.
//!
//! With `QLORA_PEFT_CHECK_DIR=DIR` the trained adapters are also written to `DIR/trained-<family>` with the
//! logits and merged weights of a float64 model with them (`write_peft_expected`), for
//! `scripts/golden_peft.py check-ours DIR/trained-<family> tests/data/models/tiny-<family>` to compare with PEFT in
//! float64.

use std::path::Path;
use std::process::Command;

use candle_core::{Device, Tensor};
use candle_qlora::adapter::load_adapter;
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::models::LlamaModel;

use crate::common::{
    adapter_chain_terms, branch_terms, data_path, decoder_chain_terms, float32_bound, max_abs,
    max_abs_diff, merge_terms, write_peft_expected,
};

/// The families beyond Llama/Qwen2 (those have their own end-to-end tests).
const FAMILIES: [&str; 5] = [
    "tiny-qwen3",
    "tiny-gemma2",
    "tiny-gemma3",
    "tiny-phi3",
    "tiny-mistral-sw",
];

pub(crate) fn qlora(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(args)
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "qlora {args:?}: {text}");
    text
}

/// A run config for `model` on word-tokenizer text (`t1 t3 …`), 4 steps.
fn write_config(dir: &Path, model: &Path) -> std::path::PathBuf {
    let lines: Vec<String> = (0..8)
        .map(|i| {
            let words: Vec<String> = (0..12)
                .map(|j| format!("t{}", 1 + (i + 2 * j) % 100))
                .collect();
            format!("{{\"text\": \"{}\"}}", words.join(" "))
        })
        .collect();
    std::fs::write(dir.join("train.jsonl"), lines.join("\n")).unwrap();
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {:?}\n[model.quantization]\nload_in_4bit = true\nbnb_4bit_quant_type = \"nf4\"\n\
             [lora]\nr = 4\nlora_alpha = 8\ntarget_modules = \"all-linear\"\n\
             [data]\ntrain_file = \"train.jsonl\"\n\
             [training]\noutput_dir = {:?}\nper_device_train_batch_size = 4\nmax_steps = 4\nlogging_steps = 1\n\
             learning_rate = 2e-2\ngradient_checkpointing = true\nsave_strategy = \"no\"\n",
            model.to_str().unwrap(),
            dir.join("out").to_str().unwrap()
        ),
    )
    .unwrap();
    config
}

/// The `loss` of each logged step.
fn losses(log: &Path) -> Vec<f64> {
    std::fs::read_to_string(log)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("loss").and_then(|l| l.as_f64()))
        .collect()
}

#[test]
fn every_family_trains_merges_and_generates_through_the_command() {
    let check_dir = std::env::var_os("QLORA_PEFT_CHECK_DIR").map(std::path::PathBuf::from);
    for family in FAMILIES {
        let dir = tempfile::tempdir().unwrap();
        let model = data_path(&format!("models/{family}"));
        let config = write_config(dir.path(), &model);
        qlora(&["train", "--config", config.to_str().unwrap()]);
        let out = dir.path().join("out");
        let loss = losses(&out.join("log.jsonl"));
        assert!(
            loss.len() == 4 && loss[3] < loss[0],
            "{family}: the loss did not fall: {loss:?}"
        );
        // The adapter holds the family's own modules (Phi-3: the fused projections).
        let tensors =
            candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap();
        let expected: &[&str] = if family == "tiny-phi3" {
            &[
                "self_attn.qkv_proj",
                "mlp.gate_up_proj",
                "self_attn.o_proj",
                "mlp.down_proj",
            ]
        } else {
            &[
                "self_attn.q_proj",
                "self_attn.v_proj",
                "mlp.gate_proj",
                "mlp.down_proj",
            ]
        };
        for module in expected {
            assert!(
                tensors
                    .keys()
                    .any(|k| k.contains(&format!("layers.1.{module}.lora_B"))),
                "{family}: no adapter on {module}: {:?}",
                tensors.keys()
            );
        }
        // The adapted model on the float32 base, in the library.
        let ids = Tensor::new(
            &[[3u32, 17, 42, 5, 99, 23, 8, 61, 2, 77, 14, 30]],
            &Device::Cpu,
        )
        .unwrap();
        let mut adapted = load_model(model.to_str().unwrap(), None, &LoadOptions::default())
            .unwrap()
            .model;
        load_adapter(&mut adapted, &out, "default").unwrap();

        merge_and_generate(family, &model, &out, &ids, &adapted);

        if let Some(root) = &check_dir {
            let target = root.join(format!("trained-{}", family.trim_start_matches("tiny-")));
            std::fs::create_dir_all(&target).unwrap();
            for f in ["adapter_config.json", "adapter_model.safetensors"] {
                std::fs::copy(out.join(f), target.join(f)).unwrap();
            }
            write_peft_expected(&target, &model, &ids);
        }
    }
}

/// `qlora merge --dtype f32` of adapter `out` on `model` gives the logits of `adapted` (the float32 model with the
/// adapter) on `ids`, and `qlora generate` with the adapter writes four words of the tiny vocabulary.
///
/// Both are float32 computations of the same function: the adapter's branches beside the base weights, against
/// weights `W + s·B·A` summed and rounded in float32 by the command (Gemma's norms, written as the float32 `1 + w`
/// minus one, come back exactly: Sterbenz's lemma, while `1 + w` lies between ½ and 2 as in the tiny models). Each
/// is within [`float32_bound`] of the exact logits over its own chain — the decoder's sums and the adapter's
/// branches ([`branch_terms`]), or the decoder's sums and the merged weights' ([`merge_terms`]) — so they differ by
/// at most the bound of both chains together.
pub(crate) fn merge_and_generate(
    family: &str,
    model: &Path,
    out: &Path,
    ids: &Tensor,
    adapted: &LlamaModel,
) {
    let dir = tempfile::tempdir().unwrap();
    let merged = dir.path().join("merged");
    qlora(&[
        "merge",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        out.to_str().unwrap(),
        "--output",
        merged.to_str().unwrap(),
        "--dtype",
        "f32",
    ]);
    let merged_model = load_model(merged.to_str().unwrap(), None, &LoadOptions::default())
        .unwrap()
        .model;
    let adapted_logits = adapted.logits(ids).unwrap();
    let decoder = decoder_chain_terms(adapted.config(), ids.dim(1).unwrap());
    let terms = 2 * decoder
        + adapter_chain_terms(adapted, branch_terms)
        + adapter_chain_terms(adapted, merge_terms);
    let bound = float32_bound(terms, max_abs(&adapted_logits));
    let d = max_abs_diff(&merged_model.logits(ids).unwrap(), &adapted_logits);
    assert!(
        d <= bound,
        "{family}: merged logits differ by {d:.3e}, beyond the float32 bound {bound:.3e} of both chains ({terms} \
         rounded operations × 2⁻²⁴ × the largest logit)"
    );

    let text = qlora(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        out.to_str().unwrap(),
        "--prompt",
        "t3 t17 t42",
        "--max-new-tokens",
        "4",
        "--ignore-eos",
    ]);
    // Four words of the tiny vocabulary (`t1` … `t127`).
    let words: Vec<&str> = text
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert!(
        words.len() == 4 && words.iter().all(|w| w.starts_with('t')),
        "{family}: {text}"
    );
}
