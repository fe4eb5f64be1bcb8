//! Adapters against PEFT: golden files from `scripts/golden_peft.py` (PEFT 0.21.2) on the tiny Llama, and one
//! all-linear LoRA per other family (on its tiny model). Both sides compare in float64 from end to end
//! ([`F64_TOLERANCE`]); our float32 path, and the float32 files `qlora merge` writes, within a float32 rounding
//! bound derived from their chain of sums.
//!
//! [`F64_TOLERANCE`]: crate::common::F64_TOLERANCE

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use candle_qlora::adapter::merge::merged_weight;
use candle_qlora::adapter::Adapters;
use candle_qlora::adapter::{load_adapter, save_adapter};
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::models::LlamaModel;

use crate::common::{
    adapter_chain_terms, assert_f64_close, branch_terms, data_path, decoder_chain_terms,
    float32_bound, max_abs, max_abs_diff, merge_terms, write_peft_expected,
};

fn base() -> LlamaModel {
    load_base("tests/data/models/tiny-llama")
}

/// The model at `relative` (to the repository root).
fn load_base(relative: &str) -> LlamaModel {
    load_base_in(relative, DType::F32)
}

/// The model at `relative` computing in `compute_dtype` (float64: the parity runs against PEFT's float64 goldens).
fn load_base_in(relative: &str, compute_dtype: DType) -> LlamaModel {
    let dir = data_path(relative.strip_prefix("tests/data/").unwrap());
    let opts = LoadOptions {
        compute_dtype,
        ..Default::default()
    };
    load_model(dir.to_str().unwrap(), None, &opts)
        .unwrap()
        .model
}

/// Asserts that float32 `got` is within the float32 rounding bound of the float64 reference `expected`:
/// [`float32_bound`] over `terms` rounded operations along the chain of each value, explained by `derivation`.
fn assert_f32_within_bound(
    what: &str,
    (terms, derivation): (usize, &str),
    got: &Tensor,
    expected: &Tensor,
) {
    let bound = float32_bound(terms, max_abs(expected));
    let d = max_abs_diff(got, expected);
    assert!(
        d <= bound,
        "{what}: the float32 result differs by {d:.3e}, beyond the float32 rounding bound {bound:.3e} ({terms} \
         rounded operations along the chain — {derivation} — × 2⁻²⁴ × the largest magnitude)"
    );
}

/// The chain behind a logit of `model` with its active adapter over `seq` positions, for
/// [`assert_f32_within_bound`]: the decoder's sums ([`decoder_chain_terms`]) and the adapter's branches
/// ([`branch_terms`] per projection along the chain).
fn adapted_chain(model: &LlamaModel, seq: usize) -> (usize, &'static str) {
    let terms = decoder_chain_terms(model.config(), seq) + adapter_chain_terms(model, branch_terms);
    (terms, "the decoder's sums and the adapter's branches")
}

/// Every PEFT case, with its base model (relative to the repository root, as its adapter_config.json names it).
const CASES: [&str; 9] = [
    "lora_all_linear",
    "lora_patterns",
    "dora",
    "modules_to_save",
    "qwen3_lora",
    "gemma2_lora",
    "gemma3_lora",
    "phi3_lora",
    "mistral_sw_lora",
];

/// The base model a case's adapter was made for.
fn base_of(case: &str) -> String {
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(data_path(&format!("peft/{case}/adapter_config.json"))).unwrap(),
    )
    .unwrap();
    config["base_model_name_or_path"]
        .as_str()
        .unwrap()
        .to_string()
}

fn golden(case: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        data_path(&format!("peft/{case}/golden.safetensors")),
        &Device::Cpu,
    )
    .unwrap()
}

/// Every case's logits (adapter active, then disabled, then active again) and merged weights equal PEFT's, both in
/// float64 ([`F64_TOLERANCE`](crate::common::F64_TOLERANCE)); our float32 logits and merged weights are within
/// float32 rounding of them.
#[test]
fn peft_adapters_give_peft_logits_and_merged_weights() {
    for case in CASES {
        let g = golden(case);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let seq = ids.dim(1).unwrap();
        let mut model = load_base_in(&base_of(case), DType::F64);
        load_adapter(&mut model, &data_path(&format!("peft/{case}")), "default").unwrap();
        let logits = model.logits(&ids).unwrap();
        assert_f64_close(&format!("{case}: logits"), &logits, &g["logits_f64"]);

        let mut compared = 0;
        for (name, lin) in model.linears() {
            if let Some(expected) = g.get(&format!("merged.{name}.weight_f64")) {
                let adapter = lin.active_adapter().expect("PEFT adapted this module");
                let ours = merged_weight(lin, adapter).unwrap();
                let what = format!("{case}: merged {name} (merge_and_unload)");
                assert_f64_close(&what, &ours, expected);
                compared += 1;
            }
        }
        if let Some(head) = g.get("merged.lm_head.weight_f64") {
            assert_eq!(
                max_abs_diff(&model.head_weight().unwrap(), head),
                0.0,
                "{case}: trained lm_head"
            );
            compared += 1;
        }
        assert!(
            compared >= 4,
            "{case}: only {compared} merged weights compared"
        );

        model.disable_adapters();
        let what = format!("{case}: logits with the adapter disabled");
        assert_f64_close(&what, &model.logits(&ids).unwrap(), &g["logits_base_f64"]);
        model.set_adapter("default").unwrap();
        let what = format!("{case}: logits with the adapter active again");
        assert_f64_close(&what, &model.logits(&ids).unwrap(), &g["logits_f64"]);

        let mut model = load_base(&base_of(case));
        load_adapter(&mut model, &data_path(&format!("peft/{case}")), "default").unwrap();
        let what = format!("{case}: float32 logits");
        let got = model.logits(&ids).unwrap();
        assert_f32_within_bound(&what, adapted_chain(&model, seq), &got, &g["logits_f64"]);
        for (name, lin) in model.linears() {
            if let Some(expected) = g.get(&format!("merged.{name}.weight_f64")) {
                let adapter = lin.active_adapter().unwrap();
                let ours = merged_weight(lin, adapter).unwrap();
                let what = format!("{case}: float32 merged {name}");
                let chain = (merge_terms(adapter), "the merge's sums");
                assert_f32_within_bound(&what, chain, &ours, expected);
            }
        }
    }
}

/// Also writes, with `QLORA_PEFT_CHECK_DIR=DIR`, our saved adapters plus `expected.safetensors` (a float64 model's
/// logits and merged weights: [`write_peft_expected`]) there, for `scripts/golden_peft.py check-ours DIR/<case>`
/// to load in PEFT.
#[test]
fn saved_adapters_round_trip_bit_identically_with_all_peft_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var_os("QLORA_PEFT_CHECK_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or(tmp.path().to_path_buf());
    for case in CASES {
        let base_path = base_of(case);
        let mut model = load_base(&base_path);
        let src = data_path(&format!("peft/{case}"));
        let config = load_adapter(&mut model, &src, "default").unwrap();
        let out = root.join(case);
        save_adapter(&model, "default", &out, Some(&base_path)).unwrap();
        if std::env::var_os("QLORA_PEFT_CHECK_DIR").is_some() {
            let base_dir = data_path(base_path.strip_prefix("tests/data/").unwrap());
            write_peft_expected(&out, &base_dir, &golden(case)["input_ids"]);
        }

        // Same tensors, bit for bit.
        let theirs =
            candle_core::safetensors::load(src.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap();
        let ours =
            candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap();
        assert_eq!(ours.len(), theirs.len(), "{case}");
        for (k, t) in &theirs {
            assert_eq!(max_abs_diff(&ours[k], t), 0.0, "{case}: {k}");
            assert_eq!(ours[k].dtype(), DType::F32);
        }
        // Every key PEFT writes, sorted, indent 2; same values as PEFT's own file.
        let ours_json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let theirs_json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(src.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let keys =
            |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&ours_json), keys(&theirs_json), "{case}: config keys");
        for k in [
            "r",
            "lora_alpha",
            "use_rslora",
            "use_dora",
            "rank_pattern",
            "alpha_pattern",
            "bias",
            "peft_type",
            "base_model_name_or_path",
        ] {
            assert_eq!(ours_json[k], theirs_json[k], "{case}: {k}");
        }
        let text = std::fs::read_to_string(out.join("adapter_config.json")).unwrap();
        assert!(
            text.starts_with("{\n  \"alora_invocation_tokens\": null,"),
            "{text}"
        );

        // Reloading ours gives the same model output, and PEFT's in float64.
        let g = golden(case);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let mut again = load_base(&base_path);
        let reloaded = load_adapter(&mut again, &out, "x").unwrap();
        assert_eq!(
            reloaded.target_modules.is_some(),
            config.target_modules.is_some()
        );
        assert_eq!(
            max_abs_diff(&again.logits(&ids).unwrap(), &model.logits(&ids).unwrap()),
            0.0,
            "{case}: reloaded logits"
        );
        let mut again = load_base_in(&base_path, DType::F64);
        load_adapter(&mut again, &out, "x").unwrap();
        let what = format!("{case}: reloaded logits in float64");
        assert_f64_close(&what, &again.logits(&ids).unwrap(), &g["logits_f64"]);
    }
}

/// Two adapters on one (float64) model: each gives PEFT's float64 logits when active, and none is active once the
/// active one is deleted.
#[test]
fn several_adapters_switch_and_unload() {
    let g1 = golden("lora_all_linear");
    let g2 = golden("dora");
    let ids = g1["input_ids"].to_dtype(DType::U32).unwrap();
    let ids2 = g2["input_ids"].to_dtype(DType::U32).unwrap();
    let mut model = load_base_in("tests/data/models/tiny-llama", DType::F64);
    load_adapter(&mut model, &data_path("peft/lora_all_linear"), "a").unwrap();
    load_adapter(&mut model, &data_path("peft/dora"), "b").unwrap();
    assert_eq!(model.adapter_names(), vec!["a", "b"]);
    let logits = model.logits(&ids2).unwrap();
    assert_f64_close("the last loaded is active", &logits, &g2["logits_f64"]);
    model.set_adapter("a").unwrap();
    let logits = model.logits(&ids).unwrap();
    assert_f64_close("adapter a active", &logits, &g1["logits_f64"]);
    model.delete_adapter("a").unwrap();
    let logits = model.logits(&ids).unwrap();
    let what = "nothing active after unloading";
    assert_f64_close(what, &logits, &g1["logits_base_f64"]);
    assert!(model.set_adapter("a").is_err());
    let err = load_adapter(&mut model, &data_path("peft/dora"), "b")
        .unwrap_err()
        .to_string();
    assert!(err.contains("already loaded"), "{err}");
}

#[test]
fn mismatched_or_broken_adapters_are_clear_errors_and_load_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let copy = |name: &str| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(data_path(&format!("peft/lora_all_linear/{f}")), d.join(f)).unwrap();
        }
        d
    };
    let edit_config = |d: &std::path::Path, f: &dyn Fn(&mut serde_json::Value)| {
        let p = d.join("adapter_config.json");
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        f(&mut v);
        std::fs::write(&p, v.to_string()).unwrap();
    };
    let try_load = |d: &std::path::Path| {
        let mut model = base();
        let err = load_adapter(&mut model, d, "default")
            .unwrap_err()
            .to_string();
        assert!(model.adapter_names().is_empty(), "nothing loads half-way");
        assert!(model.linears().iter().all(|(_, l)| l.adapters.is_empty()));
        err
    };

    let d = copy("other-rank");
    edit_config(&d, &|v| v["r"] = 16.into());
    let err = try_load(&d);
    assert!(
        err.contains("lora_A.weight") && err.contains("[8, 64]") && err.contains("[16, 64]"),
        "{err}"
    );

    let d = copy("no-such-module");
    edit_config(&d, &|v| {
        v["target_modules"] = serde_json::json!(["query_key_value"])
    });
    let err = try_load(&d);
    assert!(
        err.contains("query_key_value") && err.contains("match no module"),
        "{err}"
    );

    let d = copy("fewer-modules");
    edit_config(&d, &|v| v["target_modules"] = serde_json::json!(["q_proj"]));
    let err = try_load(&d);
    assert!(
        err.contains("unexpected tensors") && err.contains("down_proj.lora_A.weight"),
        "{err}"
    );

    let d = copy("truncated");
    let p = d.join("adapter_model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() / 2]).unwrap();
    let err = try_load(&d);
    assert!(
        err.contains("adapter_model.safetensors") && err.contains("truncated"),
        "{err}"
    );

    let d = copy("unknown-keys");
    edit_config(&d, &|v| v["some_future_option"] = 3.into());
    let mut model = base();
    load_adapter(&mut model, &d, "default").expect("unknown config keys are tolerated");

    let d = copy("bias");
    edit_config(&d, &|v| v["bias"] = "all".into());
    let err = try_load(&d);
    assert!(err.contains("bias") && err.contains("none"), "{err}");
}

fn qlora(args: &[&str]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qlora {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `qlora merge` writes a folder that loads (in our loader, and in transformers: see the closing note) with the
/// merged model's logits; `--requantize nf4` writes a bitsandbytes folder; `eval --adapter` sees the adapter.
///
/// The merged folder holds float32 weights, each `W + s·B·A` summed and rounded in float32 by the command: read by a
/// float64 model, its logits differ from PEFT's float64 `merge_and_unload()` by those roundings alone, bounded by
/// [`merge_terms`] per merged weight along the chain. The command's evaluations run in float32, the adapter's
/// branches against the merged weights: their losses differ within the float32 bound of both chains.
#[test]
fn merge_command_writes_a_loadable_folder() {
    let dir = tempfile::tempdir().unwrap();
    let g = golden("lora_all_linear");
    let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
    let base = data_path("models/tiny-llama");
    let adapter = data_path("peft/lora_all_linear");
    let out = dir.path().join("merged");
    let (b, a, o) = (
        base.to_str().unwrap(),
        adapter.to_str().unwrap(),
        out.to_str().unwrap(),
    );
    let text = qlora(&[
        "merge",
        "--model",
        b,
        "--adapter",
        a,
        "--output",
        o,
        "--dtype",
        "f32",
    ]);
    assert!(
        text.contains("merged the adapter into 14 modules"),
        "{text}"
    );
    let change: f64 = text
        .split("change ")
        .nth(1)
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(change > 1e-3, "{text}");
    let opts = LoadOptions {
        compute_dtype: DType::F64,
        ..Default::default()
    };
    let merged = load_model(o, None, &opts).unwrap().model;
    let mut adapted = load_base_in("tests/data/models/tiny-llama", DType::F64);
    load_adapter(&mut adapted, &adapter, "default").unwrap();
    let merge_chain = adapter_chain_terms(&adapted, merge_terms);
    assert_f32_within_bound(
        "the merged folder's logits against PEFT's merge_and_unload()",
        (merge_chain, "the float32 sums of each merged weight"),
        &merged.logits(&ids).unwrap(),
        &g["merged_logits_f64"],
    );
    assert!(out.join("tokenizer.json").exists());

    let q = dir.path().join("merged-nf4");
    qlora(&[
        "merge",
        "--model",
        b,
        "--adapter",
        a,
        "--output",
        q.to_str().unwrap(),
        "--requantize",
        "nf4",
    ]);
    let qm = load_model(q.to_str().unwrap(), None, &LoadOptions::default())
        .unwrap()
        .model;
    assert!(matches!(
        qm.layers[0].linears()[0].1.base.weight,
        candle_qlora::ops::FrozenWeight::Nf4(_)
    ));
    // The same as quantizing the dense bf16 merge on load.
    let bf16 = dir.path().join("merged-bf16");
    qlora(&[
        "merge",
        "--model",
        b,
        "--adapter",
        a,
        "--output",
        bf16.to_str().unwrap(),
    ]);
    let opts = LoadOptions {
        quantization: Some(candle_qlora::quant::QuantConfig::nf4()),
        compute_dtype: DType::F32,
        ..Default::default()
    };
    let on_load = load_model(bf16.to_str().unwrap(), None, &opts)
        .unwrap()
        .model;
    assert_eq!(
        max_abs_diff(&qm.logits(&ids).unwrap(), &on_load.logits(&ids).unwrap()),
        0.0
    );

    let data = dir.path().join("d.jsonl");
    std::fs::write(&data, "{\"text\": \"t1 t5 t9 t13 t20 t40\"}\n").unwrap();
    let with = qlora(&[
        "eval",
        "--model",
        b,
        "--adapter",
        a,
        "--data",
        data.to_str().unwrap(),
        "--json",
    ]);
    let merged_eval = qlora(&[
        "eval",
        "--model",
        o,
        "--data",
        data.to_str().unwrap(),
        "--json",
    ]);
    let without = qlora(&[
        "eval",
        "--model",
        b,
        "--data",
        data.to_str().unwrap(),
        "--json",
    ]);
    let loss = |s: &str| {
        serde_json::from_str::<serde_json::Value>(s.trim()).unwrap()["loss"]
            .as_f64()
            .unwrap()
    };
    // Two float32 chains, each the decoder over the line's tokens, the adapter's branches or the merged weights'
    // sums, and the loss: a log-sum-exp over the vocabulary (its sum, the logarithm, the subtraction) and the mean
    // over the predicted tokens.
    let predicted = serde_json::from_str::<serde_json::Value>(with.trim()).unwrap()["tokens"]
        .as_u64()
        .unwrap() as usize;
    let loss_terms = adapted.config().vocab_size + 2 + predicted;
    let decoder = decoder_chain_terms(adapted.config(), predicted + 1) + loss_terms;
    let terms = 2 * decoder + adapter_chain_terms(&adapted, branch_terms) + merge_chain;
    let bound = float32_bound(terms, loss(&with));
    let d = (loss(&with) - loss(&merged_eval)).abs();
    assert!(
        d <= bound,
        "eval with the adapter and of the merged folder differ by {d:.3e}, beyond the float32 bound {bound:.3e} of \
         {terms} rounded operations"
    );
    assert!((loss(&with) - loss(&without)).abs() > 10.0 * bound);
}

/// On the real model: an adapter saved and reloaded has bit-identical tensors and the identical loss, and
/// generation with the adapter unmerged (NF4 base + LoRA) equals generation with the merged f32 folder.
#[test]
fn smollm2_adapter_round_trip_and_merged_generation() {
    use candle_qlora::lora::{InitLoraWeights, LoraConfig, TargetModules};
    use candle_qlora::models::{generate, GenerationConfig};
    let Some(path) = crate::common::test_model() else {
        return;
    };
    let path = path.to_str().unwrap();
    let nf4 = LoadOptions {
        quantization: Some(candle_qlora::quant::QuantConfig::nf4()),
        compute_dtype: DType::F32,
        ..Default::default()
    };
    let loaded = load_model(path, None, &nf4).unwrap();
    let tok = loaded.tokenizer.clone().unwrap();
    let mut model = loaded.model;
    let config = LoraConfig {
        r: 4,
        lora_alpha: 1.0,
        target_modules: Some(TargetModules::AllLinear),
        init_lora_weights: InitLoraWeights::Random,
        ..Default::default()
    };
    model.add_adapter("default", &config, 7).unwrap();
    let ids = tok
        .encode(
            "Rivers shape the land they cross, carving valleys over many years.",
            true,
        )
        .unwrap();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let loss = |m: &LlamaModel| {
        let (s, n) = crate::common::text_loss(m, &ids);
        s / n as f64
    };
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("adapter");
    save_adapter(&model, "default", &saved, Some(path)).unwrap();

    let mut again = load_model(path, None, &nf4).unwrap().model;
    load_adapter(&mut again, &saved, "default").unwrap();
    let (p1, p2) = (
        model.adapter_parameters("default").unwrap(),
        again.adapter_parameters("default").unwrap(),
    );
    assert_eq!(p1.len(), 30 * 7 * 2);
    for ((k1, v1), (k2, v2)) in p1.iter().zip(&p2) {
        assert_eq!(k1, k2);
        assert_eq!(max_abs_diff(v1.as_tensor(), v2.as_tensor()), 0.0, "{k1}");
    }
    assert_eq!(
        loss(&model),
        loss(&again),
        "identical eval loss after the round trip"
    );

    let msgs = [candle_qlora::models::ChatMessage {
        role: "user".into(),
        content: "What is the capital of France?".into(),
    }];
    let prompt = tok
        .encode(&tok.apply_chat_template(&msgs, true).unwrap(), false)
        .unwrap();
    let unmerged = generate(&again, &prompt, &GenerationConfig::greedy(12), |_| Ok(())).unwrap();
    let out = dir.path().join("merged");
    let opts = candle_qlora::adapter::merge::MergeOptions {
        dtype: DType::F32,
        requantize: None,
        overwrite: false,
    };
    candle_qlora::adapter::merge::merge_to_folder(&again, Some(&tok), None, &out, &opts).unwrap();
    let merged = load_model(out.to_str().unwrap(), None, &LoadOptions::default()).unwrap();
    assert_eq!(
        merged
            .tokenizer
            .as_ref()
            .unwrap()
            .encode("Hello there", true)
            .unwrap(),
        tok.encode("Hello there", true).unwrap()
    );
    let merged_tokens = generate(
        &merged.model,
        &prompt,
        &GenerationConfig::greedy(12),
        |_| Ok(()),
    )
    .unwrap();
    assert_eq!(unmerged, merged_tokens, "greedy output unmerged vs merged");
}

#[test]
fn default_init_is_peft_kaiming_uniform_and_zero_b() {
    use candle_qlora::lora::{InitLoraWeights, LoraConfig};
    for init in [InitLoraWeights::Default, InitLoraWeights::Gaussian] {
        let mut model = base();
        let g = golden("lora_all_linear");
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let before = model.logits(&ids).unwrap();
        let cfg = LoraConfig {
            r: 8,
            init_lora_weights: init,
            ..Default::default()
        };
        model.add_adapter("default", &cfg, 1).unwrap();
        // B = 0: the fresh adapter leaves the model unchanged.
        assert_eq!(max_abs_diff(&model.logits(&ids).unwrap(), &before), 0.0);
        for (name, v) in model.adapter_parameters("default").unwrap() {
            let t = v
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            if name.ends_with("lora_B.weight") {
                assert!(t.iter().all(|x| *x == 0.0));
            } else if init == InitLoraWeights::Default {
                let bound = 1.0 / (v.dim(1).unwrap() as f32).sqrt();
                assert!(
                    t.iter().all(|x| x.abs() <= bound) && t.iter().any(|x| x.abs() > bound * 0.9),
                    "{name}"
                );
            } else {
                let std = (t.iter().map(|x| x * x).sum::<f32>() / t.len() as f32).sqrt();
                assert!((std - 1.0 / 8.0).abs() < 0.03, "{name}: std {std}");
            }
        }
    }
}

/// `modules_to_save = ["embed_tokens", "lm_head"]`: trainable full copies that save, reload and get gradients.
#[test]
fn modules_to_save_train_save_and_reload() {
    use candle_qlora::lora::LoraConfig;
    use candle_qlora::models::{Checkpointing, Positions};
    let mut model = base();
    let cfg = LoraConfig {
        modules_to_save: Some(vec!["embed_tokens".into(), "lm_head".into()]),
        ..Default::default()
    };
    model.add_adapter("default", &cfg, 3).unwrap();
    let params = model.adapter_parameters("default").unwrap();
    let keys: Vec<&str> = params.iter().map(|(k, _)| k.as_str()).collect();
    assert!(
        keys.contains(&"base_model.model.lm_head.weight")
            && keys.contains(&"base_model.model.model.embed_tokens.weight")
    );
    let ids = Tensor::new(&[[1u32, 5, 9, 13, 2]], &Device::Cpu).unwrap();
    let (loss, _) = model
        .loss_sum(
            &ids,
            &ids.to_dtype(DType::I64).unwrap(),
            &Positions::Range(0),
            &Checkpointing::default(),
        )
        .unwrap();
    let grads = loss.backward().unwrap();
    for (k, v) in &params {
        if k.contains("lm_head") || k.contains("embed_tokens") {
            let g = grads
                .get(v)
                .unwrap_or_else(|| panic!("no gradient for {k}"));
            assert!(
                g.abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    > 0.0,
                "{k}"
            );
        }
    }
    let dir = tempfile::tempdir().unwrap();
    save_adapter(&model, "default", dir.path(), Some("tiny")).unwrap();
    let mut again = base();
    load_adapter(&mut again, dir.path(), "default").unwrap();
    assert_eq!(
        again.adapter_parameters("default").unwrap().len(),
        params.len()
    );
}

/// The pieces together: a few QLoRA steps (NF4 base, LoRA on every linear, dropout, checkpointed layers,
/// 8-bit AdamW, clipping, cosine schedule) lower the loss, and checkpointing gives the same updates, bit for bit.
#[test]
fn qlora_steps_lower_the_loss_with_and_without_checkpointing() {
    use candle_qlora::prelude::*;
    let ids = Tensor::new(
        &[
            [1u32, 5, 9, 13, 17, 21, 25, 29, 33, 37],
            [2, 4, 6, 8, 10, 12, 14, 16, 18, 20],
        ],
        &Device::Cpu,
    )
    .unwrap();
    let labels = ids.to_dtype(DType::I64).unwrap();
    let mut finals = vec![];
    for enabled in [false, true] {
        let opts = LoadOptions {
            quantization: Some(QuantConfig::nf4()),
            compute_dtype: DType::F32,
            ..Default::default()
        };
        let mut model = load_model(
            data_path("models/tiny-llama").to_str().unwrap(),
            None,
            &opts,
        )
        .unwrap()
        .model;
        let lora = LoraConfig {
            r: 8,
            lora_alpha: 16.0,
            lora_dropout: 0.1,
            target_modules: Some(TargetModules::AllLinear),
            ..Default::default()
        };
        model.add_adapter("default", &lora, 42).unwrap();
        model.lora_runtime.set_training(true);
        let params = model.adapter_parameters("default").unwrap();
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        let cfg = OptimizerConfig {
            name: OptimizerName::PagedAdamW8bit,
            weight_decay: 0.01,
            min_8bit_size: 256,
            ..Default::default()
        };
        let mut opt = Optimizer::new(params, cfg).unwrap();
        let sched = Schedule::new(SchedulerType::Cosine, 5e-3, 0, 12, None).unwrap();
        let mut losses = vec![];
        for step in 1..=12 {
            model.lora_runtime.set_step_seed(step);
            let ck = Checkpointing {
                enabled,
                params: vars.clone(),
                ..Default::default()
            };
            let (sum, n) = model
                .loss_sum(&ids, &labels, &Positions::Range(0), &ck)
                .unwrap();
            let loss = (sum / n as f64).unwrap();
            losses.push(loss.to_scalar::<f32>().unwrap());
            let mut grads = loss.backward().unwrap();
            ck.sink.merge_into(&mut grads).unwrap();
            clip_grad_norm(&vars, &mut grads, 1.0).unwrap();
            opt.step(&grads, sched.lr_for_update(step as usize))
                .unwrap();
        }
        assert!(
            losses[11] < losses[0] - 0.5,
            "checkpointing {enabled}: {losses:?}"
        );
        finals.push(losses);
    }
    // Ours against ours on one machine, the same operations in the same order: a checkpointed layer recomputes
    // its forward (the same dropout masks) and each adapter weight is used in one layer only, so its gradient is
    // one contribution either way. Bit-identical.
    assert_eq!(finals[0], finals[1], "plain vs checkpointed losses");
}

/// An adapter that diverged (a NaN in one weight) is not saved: the error names the adapter and the tensor and
/// says what to do, and no adapter file is written where none was.
#[test]
fn a_diverged_adapter_is_not_saved() {
    let mut model = base();
    load_adapter(&mut model, &data_path("peft/lora_all_linear"), "default").unwrap();
    let (key, var) = model
        .adapter_parameters("default")
        .unwrap()
        .into_iter()
        .find(|(k, _)| k.contains("lora_B"))
        .unwrap();
    let nan = Tensor::full(f32::NAN, var.shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(var.dtype())
        .unwrap();
    var.set(&nan).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("adapter");
    let err = save_adapter(&model, "default", &out, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("holds NaN") && err.contains(&key) && err.contains("lower learning_rate"),
        "{err}"
    );
    assert!(!out.join("adapter_model.safetensors").exists());
}
