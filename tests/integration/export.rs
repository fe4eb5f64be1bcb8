//! `qlora export --format gguf`: against llama.cpp's own converter (golden files of `scripts/golden_gguf.py`), and
//! the exported file loaded back — an adapter merged in, a GGUF base re-encoded.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{Device, Tensor};
use candle_qlora::adapter::{effective_weight, Adapters};
use candle_qlora::export::gguf_writer::{GgufWriter, TensorRecord};
use candle_qlora::export::{gguf, GgmlType, GgufOptions, Quantization};
use candle_qlora::loading::gguf::GgufFile;
use candle_qlora::loading::{load_model, load_model_config, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::ops::rope::inverse_frequencies;
use candle_qlora::ops::FrozenWeight;
use candle_qlora::quant::QuantConfig;
use sha2::{Digest, Sha256};

use crate::common::{
    adapter_chain_terms, branch_terms, data_path, decoder_chain_terms, float32_bound, max_abs,
    max_abs_diff, merge_terms, test_model,
};

fn options(quant: impl Into<Quantization>) -> GgufOptions {
    GgufOptions {
        quant: quant.into(),
        tokenizer_pre: Some("default".into()),
        adapter_only: false,
        ollama: false,
        overwrite: false,
        progress: false,
    }
}

/// A GGUF file's header, and the bytes of each tensor by name.
fn read_gguf(path: &Path) -> (Content, HashMap<String, Vec<u8>>) {
    let bytes = std::fs::read(path).unwrap();
    let content = Content::read(&mut std::io::Cursor::new(&bytes)).unwrap();
    let data = content
        .tensor_infos
        .iter()
        .map(|(name, info)| {
            let start = (content.tensor_data_offset + info.offset) as usize;
            let n = info.shape.elem_count() / info.ggml_dtype.block_size()
                * info.ggml_dtype.type_size();
            (name.clone(), bytes[start..start + n].to_vec())
        })
        .collect();
    (content, data)
}

/// A file's tensors in the order of their data, with their dimensions (outermost first).
fn tensor_order(c: &Content) -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<(u64, String, Vec<usize>)> = c
        .tensor_infos
        .iter()
        .map(|(n, i)| (i.offset, n.clone(), i.shape.dims().to_vec()))
        .collect();
    v.sort();
    v.into_iter().map(|(_, n, d)| (n, d)).collect()
}

/// Asserts that `content` carries every metadata value of `original` but `general.file_type`, which is
/// `file_type` when given.
fn assert_carries(what: &str, content: &Content, original: &Content, file_type: Option<u32>) {
    for (k, v) in &original.metadata {
        match (k.as_str(), file_type) {
            ("general.file_type", Some(t)) => {
                assert_eq!(content.metadata[k].to_u32().unwrap(), t, "{what}")
            }
            _ => assert_eq!(
                format!("{:?}", content.metadata[k]),
                format!("{v:?}"),
                "{what}: {k}"
            ),
        }
    }
}

/// A metadata value as the golden file writes it: its types (gguf-py's names) and value.
fn golden_form(v: &Value) -> (Vec<String>, serde_json::Value) {
    let name = |v: &Value| {
        match v {
            Value::U8(_) => "UINT8",
            Value::I8(_) => "INT8",
            Value::U16(_) => "UINT16",
            Value::I16(_) => "INT16",
            Value::U32(_) => "UINT32",
            Value::I32(_) => "INT32",
            Value::U64(_) => "UINT64",
            Value::I64(_) => "INT64",
            Value::F32(_) => "FLOAT32",
            Value::F64(_) => "FLOAT64",
            Value::Bool(_) => "BOOL",
            Value::String(_) => "STRING",
            Value::Array(_) => "ARRAY",
        }
        .to_string()
    };
    let scalar = |v: &Value| match v {
        Value::U8(x) => serde_json::json!(x),
        Value::I8(x) => serde_json::json!(x),
        Value::U16(x) => serde_json::json!(x),
        Value::I16(x) => serde_json::json!(x),
        Value::U32(x) => serde_json::json!(x),
        Value::I32(x) => serde_json::json!(x),
        Value::U64(x) => serde_json::json!(x),
        Value::I64(x) => serde_json::json!(x),
        Value::F32(x) => serde_json::json!(*x as f64),
        Value::F64(x) => serde_json::json!(x),
        Value::Bool(x) => serde_json::json!(x),
        Value::String(x) => serde_json::json!(x),
        Value::Array(_) => unreachable!("no nested arrays"),
    };
    match v {
        Value::Array(items) => {
            let mut types = vec![name(v)];
            types.extend(items.first().map(name));
            (types, items.iter().map(scalar).collect())
        }
        _ => (vec![name(v)], scalar(v)),
    }
}

/// Asserts that the GGUF file `out` is the converter's file `expected` describes (a `files` entry of
/// tests/data/gguf/NAME.json): every metadata key in its order with its type and value — but
/// `general.name` and `general.size_label`, which the converter derives from the folder's name and parameter
/// count — and every tensor in its order with its dimensions, type and bytes (sha256).
fn assert_is_the_converters(what: &str, out: &Path, expected: &serde_json::Value) {
    let (content, data) = read_gguf(out);
    let want: Vec<(String, Vec<String>, serde_json::Value)> = expected["metadata"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let types = m["type"].as_array().unwrap().iter();
            let types = types.map(|t| t.as_str().unwrap().to_string()).collect();
            (
                m["key"].as_str().unwrap().to_string(),
                types,
                m["value"].clone(),
            )
        })
        .filter(|(k, _, _)| k != "general.name" && k != "general.size_label")
        .collect();
    // Candle's reader keeps no order: the order is checked on the file's bytes below.
    let got: Vec<(String, Vec<String>, serde_json::Value)> = want
        .iter()
        .map(|(k, _, _)| {
            let v = content
                .metadata
                .get(k)
                .unwrap_or_else(|| panic!("{what}: `{k}` is missing"));
            let (types, value) = golden_form(v);
            (k.clone(), types, value)
        })
        .collect();
    assert_eq!(got, want, "{what}: metadata");
    assert_eq!(content.metadata.len(), want.len(), "{what}: no other keys");
    let bytes = std::fs::read(out).unwrap();
    let positions: Vec<usize> = want
        .iter()
        .map(|(k, _, _)| {
            let mut needle = (k.len() as u64).to_le_bytes().to_vec();
            needle.extend_from_slice(k.as_bytes());
            bytes
                .windows(needle.len())
                .position(|w| w == needle)
                .unwrap()
        })
        .collect();
    assert!(
        positions.windows(2).all(|p| p[0] < p[1]),
        "{what}: the keys' order"
    );
    let tensors = expected["tensors"].as_array().unwrap();
    let order: Vec<&str> = tensors
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        tensor_order(&content)
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        order,
        "{what}: tensor order"
    );
    for t in tensors {
        let name = t["name"].as_str().unwrap();
        let info = &content.tensor_infos[name];
        let mut ne: Vec<u64> = info.shape.dims().iter().map(|d| *d as u64).collect();
        ne.reverse();
        let want_ne: Vec<u64> = t["ne"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        assert_eq!(ne, want_ne, "{what}: {name} dimensions");
        // Candle's names of the types are gguf-py's, less the underscore of the k-quants' (`Q4K`, `Q4_K`).
        assert_eq!(
            format!("{:?}", info.ggml_dtype),
            t["type"].as_str().unwrap().replace("_K", "K"),
            "{what}: {name} type"
        );
        let digest: String = Sha256::digest(&data[name])
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            digest,
            t["sha256"].as_str().unwrap(),
            "{what}: {name} bytes"
        );
    }
}

/// The tiny Llama, Qwen 2 and Qwen 3 exported in each type the golden files hold are the converter's files (the
/// Llama's q/k permutation and `rope_freqs` of Llama 3's scaling, Qwen 2's biases, Qwen 3's q/k norms, the
/// float16/bfloat16 rounding and the q8_0 blocks included), and their LoRA adapters exported alone are
/// `convert_lora_to_gguf.py`'s (`B`'s q/k rows permuted for the Llama, `alpha`, float16 where `r` does not divide
/// into q8_0 blocks).
#[test]
fn the_export_of_a_folder_equals_llama_cpp_converters_files() {
    let dir = tempfile::tempdir().unwrap();
    for name in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-mixtral",
        "tiny-qwen2-moe",
        "tiny-phi3",
        "tiny-qwen3-moe-sparse",
    ] {
        let golden: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(data_path(&format!("gguf/{name}.json"))).unwrap(),
        )
        .unwrap();
        let folder = data_path(&format!("models/{name}"));
        let mut model = load_model(folder.to_str().unwrap(), None, &LoadOptions::default())
            .unwrap()
            .model;
        let types = |files: &serde_json::Value| -> Vec<GgmlType> {
            let files = files.as_object().unwrap();
            files.keys().map(|t| t.parse().unwrap()).collect()
        };
        for quant in types(&golden["files"]) {
            let out = dir.path().join(format!("{name}-{}.gguf", quant.name()));
            gguf(&model, &folder, &out, &options(quant)).unwrap();
            let expected = &golden["files"][quant.name()];
            assert_is_the_converters(&format!("{name} in {quant:?}"), &out, expected);
        }
        let Some(adapter) = golden["adapter"].as_str() else {
            continue;
        };
        candle_qlora::adapter::load_adapter(
            &mut model,
            &data_path(&format!("peft/{adapter}")),
            "default",
        )
        .unwrap();
        for quant in types(&golden["adapter_files"]) {
            let out = dir.path().join(format!("{adapter}-{}.gguf", quant.name()));
            let adapter_only = GgufOptions {
                adapter_only: true,
                ..options(quant)
            };
            gguf(&model, &folder, &out, &adapter_only).unwrap();
            let expected = &golden["adapter_files"][quant.name()];
            assert_is_the_converters(&format!("{adapter} in {quant:?}"), &out, expected);
        }
    }
}

/// An adapter trained on the 4-bit base, exported merged into the weights training saw (float32), reads back —
/// through our GGUF reader, q/k un-permuted — as exactly the merged weights, embeddings and norms, under a
/// configuration with the same shapes and RoPE (Llama 3's scaling come back from `rope_freqs`).
#[test]
fn an_exported_merge_holds_the_merged_weights() {
    let folder = data_path("models/tiny-llama");
    let nf4 = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..LoadOptions::default()
    };
    let mut adapted = load_model(folder.to_str().unwrap(), None, &nf4)
        .unwrap()
        .model;
    candle_qlora::adapter::load_adapter(
        &mut adapted,
        &data_path("peft/lora_all_linear"),
        "default",
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("merged.gguf");
    let report = gguf(&adapted, &folder, &out, &options(GgmlType::F32)).unwrap();
    assert_eq!(report.adapted_modules, adapted.linears().len());
    let file = GgufFile::open(&out).unwrap();
    let c = adapted.config();
    let read = |name: &str| {
        file.tensor(name, c.num_attention_heads, c.num_key_value_heads)
            .unwrap()
    };
    for (name, linear) in adapted.linears() {
        let merged = effective_weight(linear).unwrap();
        assert_eq!(
            max_abs_diff(&read(&format!("{name}.weight")), &merged),
            0.0,
            "{name}"
        );
    }
    assert_eq!(
        max_abs_diff(&read("model.embed_tokens.weight"), &adapted.embed_tokens),
        0.0
    );
    assert_eq!(
        max_abs_diff(&read("lm_head.weight"), &adapted.head_weight().unwrap()),
        0.0
    );
    assert_eq!(max_abs_diff(&read("model.norm.weight"), &adapted.norm), 0.0);
    // The adapter alone, applied as llama.cpp applies it — W + (alpha / r)·B·A on the file's (permuted) rows of
    // the base without the adapter — gives the merged file's weights, within the float32 rounding of the r-term
    // sums, the scaling and the addition (the merge's own chain and this one's).
    let lora = dir.path().join("lora.gguf");
    let adapter_only = GgufOptions {
        adapter_only: true,
        ..options(GgmlType::F32)
    };
    gguf(&adapted, &folder, &lora, &adapter_only).unwrap();
    let base = dir.path().join("base.gguf");
    let unadapted = load_model(folder.to_str().unwrap(), None, &nf4)
        .unwrap()
        .model;
    gguf(&unadapted, &folder, &base, &options(GgmlType::F32)).unwrap();
    let (lora_content, _) = read_gguf(&lora);
    let alpha = lora_content.metadata["adapter.lora.alpha"]
        .to_f32()
        .unwrap() as f64;
    let read = |file: &Path, name: &str| {
        let (content, _) = read_gguf(file);
        let mut f = std::fs::File::open(file).unwrap();
        content
            .tensor(&mut f, name, &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
    };
    let mut applied_modules = 0;
    for name in lora_content
        .tensor_infos
        .keys()
        .filter_map(|n| n.strip_suffix(".lora_a"))
    {
        let a = read(&lora, &format!("{name}.lora_a"));
        let b = read(&lora, &format!("{name}.lora_b"));
        let r = a.dim(0).unwrap();
        let delta = (b.matmul(&a).unwrap() * (alpha / r as f64)).unwrap();
        let applied = (read(&base, name) + delta).unwrap();
        let merged = read(&out, name);
        let bound = float32_bound(2 * (r + 2), max_abs(&merged));
        let d = max_abs_diff(&applied, &merged);
        assert!(
            d <= bound,
            "{name}: the adapter applied differs from the merge by {d:.3e} (bound {bound:.3e})"
        );
        applied_modules += 1;
    }
    assert_eq!(applied_modules, adapted.linears().len());

    let back = load_model_config(out.to_str().unwrap(), None).unwrap();
    assert_eq!(
        (
            back.hidden_size,
            back.num_hidden_layers,
            back.num_attention_heads,
            back.num_key_value_heads
        ),
        (
            c.hidden_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads
        )
    );
    assert_eq!(
        (back.head_dim, back.intermediate_size, back.vocab_size),
        (c.head_dim, c.intermediate_size, c.vocab_size)
    );
    assert_eq!(
        (back.rope_theta, back.rms_norm_eps as f32),
        (c.rope_theta, c.rms_norm_eps as f32)
    );
    // transformers' Llama 3 frequencies against the file's divisors applied to the plain ones (float32 each).
    let frequencies = |cfg: &candle_qlora::models::ModelConfig| {
        inverse_frequencies(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling.as_ref())
    };
    for (a, b) in frequencies(&back).iter().zip(frequencies(c)) {
        assert!(
            (a - b).abs() <= 2.0 * f32::EPSILON as f64 * b.abs(),
            "{a} vs {b}"
        );
    }
}

/// `exported` (a float32 export of `adapted` with its adapter merged in) gives `adapted`'s logits on `ids`, within
/// the float32 bound of both chains: the decoder twice, the adapter's branches, the merged weights' sums.
fn assert_gives_the_adapted_logits(
    what: &str,
    exported: &candle_qlora::models::LlamaModel,
    adapted: &candle_qlora::models::LlamaModel,
    ids: &Tensor,
) {
    let expected = adapted.logits(ids).unwrap();
    let terms = 2 * decoder_chain_terms(adapted.config(), ids.dim(1).unwrap())
        + adapter_chain_terms(adapted, branch_terms)
        + adapter_chain_terms(adapted, merge_terms);
    let bound = float32_bound(terms, max_abs(&expected));
    let d = max_abs_diff(&exported.logits(ids).unwrap(), &expected);
    eprintln!(
        "{what} with an adapter, exported in f32: logits differ by {d:.3e} (bound {bound:.3e})"
    );
    assert!(
        d <= bound,
        "{what}: logits differ by {d:.3e}, beyond {bound:.3e}"
    );
}

/// Every family written from a folder — the tiny Llama, Qwen 2, Qwen 3, Mixtral, Qwen 2-MoE, Qwen 3-MoE and Phi-3 —
/// with a random adapter on every linear layer (experts, router and shared expert included) exported in float32
/// loads back as its llama.cpp architecture, and gives the logits of the model running the adapter unmerged, within
/// the float32 bound of both chains: Llama's q/k rows permuted and back, Qwen 2's biases, the experts stacked from
/// the merged weights with each expert's gate and up projections split apart again, Phi-3's fused projections and
/// LongRoPE factors.
#[test]
fn every_family_exported_with_its_adapter_merged_gives_the_adapted_logits() {
    let dir = tempfile::tempdir().unwrap();
    for (name, arch) in [
        ("tiny-llama", "llama"),
        ("tiny-qwen2", "qwen2"),
        ("tiny-qwen3", "qwen3"),
        ("tiny-mixtral", "llama"),
        ("tiny-qwen2-moe", "qwen2moe"),
        ("tiny-qwen3-moe-sparse", "qwen3moe"),
        ("tiny-phi3", "phi3"),
    ] {
        let moe = name.contains("moe") || name.contains("mixtral");
        let folder = data_path(&format!("models/{name}"));
        let mut adapted = load_model(folder.to_str().unwrap(), None, &LoadOptions::default())
            .unwrap()
            .model;
        let lora = LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            target_modules: Some(TargetModules::AllLinear),
            target_parameters: moe.then(|| {
                [
                    "mlp.gate.weight",
                    "mlp.experts.gate_up_proj",
                    "mlp.experts.down_proj",
                ]
                .map(String::from)
                .to_vec()
            }),
            ..Default::default()
        };
        adapted.add_adapter("default", &lora, 7).unwrap();
        let mut experts = 0;
        for (param, var) in adapted.adapter_parameters("default").unwrap() {
            if param.contains("lora_B") {
                experts += param.contains(".experts.") as usize;
                var.set(&Tensor::randn(0f32, 0.05, var.shape(), &Device::Cpu).unwrap())
                    .unwrap();
            }
        }
        assert_eq!(experts > 0, moe, "{name}: the adapter reaches the experts");
        let out = dir.path().join(format!("{name}.gguf"));
        let report = gguf(&adapted, &folder, &out, &options(GgmlType::F32)).unwrap();
        assert_eq!(report.architecture, arch);
        // The test tokenizer (word-level, no merges) is not one Candle's GGUF tokenizer builds: the copy loaded
        // has no tokenizer keys, and its vocabulary's size in their place.
        let (content, data) = read_gguf(&out);
        let mut metadata: Vec<(String, Value)> = content
            .metadata
            .iter()
            .filter(|(k, _)| !k.starts_with("tokenizer."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let vocab_size = format!("{arch}.vocab_size");
        if !content.metadata.contains_key(&vocab_size) {
            let vocab = adapted.config().vocab_size as u32;
            metadata.push((vocab_size, Value::U32(vocab)));
        }
        let records: Vec<TensorRecord> = tensor_order(&content)
            .into_iter()
            .map(|(name, shape)| {
                let dtype = content.tensor_infos[&name].ggml_dtype;
                assert_eq!(dtype, candle_core::quantized::GgmlDType::F32, "{name}");
                TensorRecord {
                    name,
                    shape,
                    ggml_type: GgmlType::F32,
                }
            })
            .collect();
        let copy = dir.path().join(format!("{name}-no-tokenizer.gguf"));
        let mut writer = GgufWriter::start(
            std::fs::File::create(&copy).unwrap(),
            &metadata,
            records.clone(),
        )
        .unwrap();
        for record in &records {
            writer.write_tensor(&data[&record.name]).unwrap();
        }
        writer.finish().unwrap();
        let exported = load_model(copy.to_str().unwrap(), None, &LoadOptions::default()).unwrap();
        let ids = Tensor::new(&[[1u32, 5, 9, 14, 3, 77, 20, 2]], &Device::Cpu).unwrap();
        assert_gives_the_adapted_logits(name, &exported.model, &adapted, &ids);
    }
}

/// A model whose linear weights stay in their files until written (`defer_linear_weights`, what `qlora export`
/// loads) exports the same bytes as the model loaded at once: dense, and 4-bit as a QLoRA adapter's base (each
/// weight read, quantized and dequantized at its turn), with an adapter merged in; a mixture of experts too (its
/// experts left in their files), and a GGUF base (Qwen2-MoE, its experts stacked).
#[test]
fn a_model_left_in_its_files_exports_as_one_loaded_at_once() {
    let dir = tempfile::tempdir().unwrap();
    // Each model, and the adapter merged into it.
    let models = [
        ("models/tiny-llama", Some("peft/lora_all_linear")),
        ("models/tiny-mixtral", None),
        ("models/tiny-qwen2-moe/model.gguf", None),
    ];
    for (m, (source, adapter)) in models.into_iter().enumerate() {
        let source = data_path(source);
        for (i, quantization) in [None, Some(QuantConfig::nf4())].into_iter().enumerate() {
            let mut files = Vec::new();
            for defer_linear_weights in [false, true] {
                let opts = LoadOptions {
                    quantization,
                    defer_linear_weights,
                    ..Default::default()
                };
                let mut model = load_model(source.to_str().unwrap(), None, &opts)
                    .unwrap()
                    .model;
                let deferred = model
                    .linears()
                    .iter()
                    .filter(|(_, l)| matches!(l.base.weight, FrozenWeight::Deferred(_)))
                    .count();
                assert_eq!(deferred > 0, defer_linear_weights);
                if let Some(adapter) = adapter {
                    candle_qlora::adapter::load_adapter(&mut model, &data_path(adapter), "default")
                        .unwrap();
                }
                let out = dir
                    .path()
                    .join(format!("{m}-{i}-{defer_linear_weights}.gguf"));
                gguf(&model, &source, &out, &options(GgmlType::F32)).unwrap();
                files.push(std::fs::read(&out).unwrap());
            }
            assert!(
                files[0] == files[1],
                "{}, {quantization:?}: the files differ",
                source.display()
            );
        }
    }
}

/// A GGUF base (the real SmolLM2-135M, Q4_1) with an adapter exported in float32 keeps its file's metadata —
/// tokenizer, chat template, names — but the file type, and its tensors in their order; loaded back, it gives the
/// logits of the base running the adapter unmerged, within the float32 bound of both chains (the decoder twice,
/// the adapter's branches, the merged weights' sums). In q8_0 each matrix is within half a q8_0 step (plus its
/// float16 scale's rounding) of the float32 export.
#[test]
fn a_gguf_base_exports_back_to_its_own_architecture() {
    let Some(source) = test_model() else {
        return;
    };
    let mut adapted = load_model(source.to_str().unwrap(), None, &LoadOptions::default())
        .unwrap()
        .model;
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    adapted.add_adapter("default", &lora, 7).unwrap();
    // B starts at zero (the adapter a no-op): random values make the merge change every weight.
    let mut randomized = 0;
    for (name, var) in adapted.adapter_parameters("default").unwrap() {
        if name.contains("lora_B") {
            var.set(&Tensor::randn(0f32, 0.02, var.shape(), &Device::Cpu).unwrap())
                .unwrap();
            randomized += 1;
        }
    }
    assert_eq!(randomized, adapted.linears().len());
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("smollm2-f32.gguf");
    gguf(&adapted, &source, &out, &options(GgmlType::F32)).unwrap();
    let (original, _) = read_gguf(&source);
    let (content, _) = read_gguf(&out);
    assert_carries("SmolLM2", &content, &original, Some(0));
    assert_eq!(content.metadata.len(), original.metadata.len());
    assert_eq!(tensor_order(&content), tensor_order(&original));
    let exported = load_model(out.to_str().unwrap(), None, &LoadOptions::default()).unwrap();
    let ids = exported
        .tokenizer()
        .unwrap()
        .encode("The capital of France is", true)
        .unwrap();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    assert_gives_the_adapted_logits("SmolLM2", &exported.model, &adapted, &ids);

    let q8 = dir.path().join("smollm2-q8_0.gguf");
    gguf(&exported.model, &out, &q8, &options(GgmlType::Q8_0)).unwrap();
    let (q8_content, _) = read_gguf(&q8);
    let mut f32_reader = std::fs::File::open(&out).unwrap();
    let mut q8_reader = std::fs::File::open(&q8).unwrap();
    for name in [
        "blk.0.attn_q.weight",
        "blk.7.ffn_down.weight",
        "token_embd.weight",
    ] {
        let read = |c: &Content, r: &mut std::fs::File| -> Vec<f32> {
            c.tensor(r, name, &Device::Cpu)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        let (exact, quantized) = (
            read(&content, &mut f32_reader),
            read(&q8_content, &mut q8_reader),
        );
        assert_eq!(
            q8_content.tensor_infos[name].ggml_dtype,
            candle_core::quantized::GgmlDType::Q8_0
        );
        for (block, back) in exact.chunks(32).zip(quantized.chunks(32)) {
            let d = block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            for (x, y) in block.iter().zip(back) {
                assert!(
                    (x - y).abs() <= d * (0.5 + 127.0 / 2048.0),
                    "{name}: {x} vs {y}"
                );
            }
        }
    }
}

/// `qlora export` writes the merged model and says what it wrote; it refuses, naming the fix, an existing output
/// (without --overwrite), a family it does not write, a type it does not know, a tokenizer whose pre-tokenizer it
/// cannot name, and an output that is its own input.
#[test]
fn the_command_exports_and_refuses_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("tiny.gguf");
    let qlora = |args: &[&str]| {
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
            .arg("export")
            .args(args)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&run.stdout).into_owned()
            + &String::from_utf8_lossy(&run.stderr);
        (run.status.success(), text)
    };
    let tiny = data_path("models/tiny-llama").display().to_string();
    let adapter = data_path("peft/lora_all_linear").display().to_string();
    let out_s = out.display().to_string();
    let base = ["--model", &tiny, "--format", "gguf", "--output", &out_s];
    let with = |extra: &[&'static str]| -> Vec<String> {
        base.iter()
            .map(|s| s.to_string())
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let run = |args: Vec<String>| qlora(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let mut merged = with(&["--quant", "q8_0", "--tokenizer-pre", "default", "--adapter"]);
    merged.push(adapter.clone());
    let (ok, text) = run(merged.clone());
    assert!(
        ok && text.contains("wrote") && text.contains("q8_0") && text.contains("14 modules"),
        "{text}"
    );
    let file = GgufFile::open(&out).unwrap();
    assert_eq!(file.metadata()["general.file_type"].to_u32().unwrap(), 7);
    let (ok, text) = run(merged);
    assert!(
        !ok && text.contains("already exists") && text.contains("--overwrite"),
        "{text}"
    );
    let (ok, text) = run(with(&["--overwrite"]));
    assert!(
        !ok && text.contains("pre-tokenizer") && text.contains("--tokenizer-pre"),
        "{text}"
    );
    let (ok, text) = run(with(&["--quant", "q4_k_s", "--overwrite"]));
    assert!(
        !ok && text.contains("q4_k_s")
            && text.contains("known: f32, f16, q4_0")
            && text.contains("q4_k_m"),
        "{text}"
    );
    let (ok, text) = run(with(&[
        "--quant",
        "Q4_K_M",
        "--tokenizer-pre",
        "default",
        "--overwrite",
    ]));
    assert!(ok && text.contains("q4_k_m"), "{text}");
    let file = GgufFile::open(&out).unwrap();
    assert_eq!(file.metadata()["general.file_type"].to_u32().unwrap(), 15);
    let qwen = data_path("models/tiny-gemma2").display().to_string();
    let (ok, text) = qlora(&[
        "--model",
        &qwen,
        "--format",
        "gguf",
        "--output",
        &out_s,
        "--overwrite",
    ]);
    assert!(
        !ok && text.contains("`qwen3moe` architectures so far") && text.contains("gemma2"),
        "{text}"
    );
    let (ok, text) = qlora(&[
        "--model",
        &out_s,
        "--format",
        "gguf",
        "--output",
        &out_s,
        "--overwrite",
    ]);
    assert!(!ok && text.contains("--output"), "{text}");
    for (adapter, says) in [("dora", "DoRA"), ("modules_to_save", "modules_to_save")] {
        let adapter = data_path(&format!("peft/{adapter}")).display().to_string();
        let mut args = with(&["--adapter-only", "--overwrite", "--adapter"]);
        args.push(adapter);
        let (ok, text) = run(args);
        assert!(
            !ok && text.contains(says) && text.contains("without --adapter-only"),
            "{text}"
        );
    }
}

/// With `ollama`, a Modelfile beside the file: `FROM` the exported model, or for an adapter alone `FROM` the base
/// (absolute) and `ADAPTER` the file; the end-of-sequence tokens of `tokenizer_config.json` and
/// `generation_config.json` as stops; its sampling defaults under Ollama's names.
#[test]
fn an_ollama_modelfile_names_the_files_stops_and_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().join("tiny llama");
    std::fs::create_dir(&base).unwrap();
    for f in ["config.json", "model.safetensors", "tokenizer.json"] {
        std::fs::copy(data_path("models/tiny-llama").join(f), base.join(f)).unwrap();
    }
    std::fs::write(base.join("tokenizer_config.json"), r#"{"eos_token": "t7"}"#).unwrap();
    std::fs::write(
        base.join("generation_config.json"),
        r#"{"do_sample": true, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.1, "eos_token_id": [2, 7, 5]}"#,
    )
    .unwrap();
    let mut model = load_model(base.to_str().unwrap(), None, &LoadOptions::default())
        .unwrap()
        .model;
    candle_qlora::adapter::load_adapter(&mut model, &data_path("peft/lora_all_linear"), "default")
        .unwrap();
    let stops = "PARAMETER stop \"t7\"\nPARAMETER stop \"t2\"\nPARAMETER stop \"t5\"\n";
    let sampling = "PARAMETER temperature 0.6\nPARAMETER top_p 0.9\nPARAMETER repeat_penalty 1.1\n";
    for adapter_only in [false, true] {
        let out = dir.path().join(format!("out-{adapter_only}.gguf"));
        let opts = GgufOptions {
            adapter_only,
            ollama: true,
            ..options(GgmlType::F16)
        };
        let report = gguf(&model, &base, &out, &opts).unwrap();
        let modelfile = report.modelfile.unwrap();
        assert_eq!(
            modelfile,
            dir.path().join(format!("out-{adapter_only}.Modelfile"))
        );
        let text = std::fs::read_to_string(&modelfile).unwrap();
        let body: String = text.lines().skip(1).map(|l| format!("{l}\n")).collect();
        let from = match adapter_only {
            false => format!("FROM ./out-{adapter_only}.gguf\n"),
            true => format!(
                "FROM \"{}\"\nADAPTER ./out-{adapter_only}.gguf\n",
                std::fs::canonicalize(&base).unwrap().display()
            ),
        };
        assert_eq!(body, format!("{from}{stops}{sampling}"), "{text}");
        let err = gguf(
            &model,
            &base,
            &out,
            &GgufOptions {
                overwrite: false,
                ..opts
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("already exists"), "{err}");
    }
}

/// The rows of `key` in tests/data/gguf/quants.json.
fn golden_rows(golden: &serde_json::Value, key: &str) -> Vec<Vec<f32>> {
    golden[key]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            r.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap() as f32)
                .collect()
        })
        .collect()
}

/// Each of `rows` encoded as `quant` equals the golden bytes (`golden[quant]`, hex); returns the rows as Candle's
/// GGUF reader dequantizes them from a file of them.
fn encode_as_golden(
    golden: &serde_json::Value,
    quant: GgmlType,
    rows: &[Vec<f32>],
) -> Vec<Vec<f32>> {
    let dir = tempfile::tempdir().unwrap();
    let mut records = Vec::new();
    let mut encoded_rows = Vec::new();
    for (i, row) in rows.iter().enumerate() {
        let mut encoded = Vec::new();
        quant.encode(row, &mut encoded);
        let hex: String = encoded.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            golden[quant.name()][i].as_str().unwrap(),
            "{quant:?}, row {i}"
        );
        records.push(TensorRecord {
            name: format!("row{i}"),
            shape: vec![row.len()],
            ggml_type: quant,
        });
        encoded_rows.push(encoded);
    }
    let path = dir.path().join(format!("{}.gguf", quant.name()));
    let mut writer =
        GgufWriter::start(std::fs::File::create(&path).unwrap(), &[], records).unwrap();
    for encoded in &encoded_rows {
        writer.write_tensor(encoded).unwrap();
    }
    writer.finish().unwrap();
    let (content, _) = read_gguf(&path);
    let mut file = std::fs::File::open(&path).unwrap();
    (0..rows.len())
        .map(|i| {
            content
                .tensor(&mut file, &format!("row{i}"), &Device::Cpu)
                .unwrap()
                .dequantize(&Device::Cpu)
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect()
}

fn quants_golden() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(data_path("gguf/quants.json")).unwrap()).unwrap()
}

/// Every block type's bytes equal the `gguf` package's quantizer's (tests/data/gguf/quants.json, from
/// `scripts/golden_gguf.py`) on random rows at four scales and on edge cases (a zero block, a constant one, a lone
/// spike, a negative extreme); read back by Candle's GGUF reader, each value is within half a step of its block's
/// scale (a whole step at the clamped end of q4_0 and q5_0), plus the float16 rounding of the scale (2⁻¹¹ relative,
/// times the largest code) and of the minimum.
#[test]
fn block_quantizers_equal_the_gguf_packages() {
    let golden = quants_golden();
    let rows = golden_rows(&golden, "inputs");
    for quant in GgmlType::ALL.into_iter().filter(|t| t.block_len() == 32) {
        let back = encode_as_golden(&golden, quant, &rows);
        // The codes' range in steps of the scale, and whether a minimum is stored: q8_0 and q4_0/q5_0 scale by
        // the value of largest magnitude (q4_0/q5_0 clamp the other end of the range by up to a whole step).
        let (levels, clamped, offset) = match quant {
            GgmlType::Q8_0 => (127.0, false, false),
            GgmlType::Q4_0 => (8.0, true, false),
            GgmlType::Q5_0 => (16.0, true, false),
            GgmlType::Q4_1 => (15.0, false, true),
            _ => (31.0, false, true),
        };
        for (i, (row, back)) in rows.iter().zip(&back).enumerate() {
            for (block, back) in row.chunks(32).zip(back.chunks(32)) {
                let (min, max) = block
                    .iter()
                    .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
                let step = match offset {
                    true => (max - min) / levels,
                    false => min.abs().max(max.abs()) / levels,
                };
                let rounding = if clamped { 1.0 } else { 0.5 };
                let bound =
                    step * (rounding + levels / 2048.0) + min.abs() / 2048.0 * offset as u8 as f32;
                for (x, y) in block.iter().zip(back) {
                    assert!(
                        (x - y).abs() <= bound * 1.0001,
                        "{quant:?}, row {i}: {x} vs {y} (bound {bound})"
                    );
                }
            }
        }
    }
}

/// The k-quants' super-blocks equal the bytes of ggml's own reference quantizers (`quantize_row_q*_K_ref`, what
/// llama-quantize runs without an importance matrix) on random rows at four scales, heavy tails, zero and constant
/// sub-blocks, rows of one sign, zeros and values below ggml's zero threshold. Read back by Candle's reader, each
/// value is within one code step of the coarsest sub-block — the super-block's largest magnitude `m` over the
/// codes' reach (2m/3 for q2_k's four codes over a range up to 2m, m/4 for q3_k's ±4, 2m/15, 2m/31, m/32 for q6_k's
/// ±32) — plus the float16 rounding of the super-block scales (2⁻²⁵ absolute, below float16's normal range) times
/// the largest scale code times the largest code.
#[test]
fn k_quantizers_equal_ggmls() {
    let golden = quants_golden();
    let rows = golden_rows(&golden, "k_inputs");
    for quant in GgmlType::ALL.into_iter().filter(|t| t.block_len() == 256) {
        let back = encode_as_golden(&golden, quant, &rows);
        let (step, largest_product) = match quant {
            GgmlType::Q2K => (2.0 / 3.0, 15.0 * 3.0 + 15.0),
            GgmlType::Q3K => (1.0 / 4.0, 32.0 * 4.0),
            GgmlType::Q4K => (2.0 / 15.0, 63.0 * 15.0 + 63.0),
            GgmlType::Q5K => (2.0 / 31.0, 63.0 * 31.0 + 63.0),
            _ => (1.0 / 32.0, 128.0 * 32.0),
        };
        for (i, (row, back)) in rows.iter().zip(&back).enumerate() {
            let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
            let bound = step * amax + largest_product * 2f32.powi(-25);
            for (x, y) in row.iter().zip(back) {
                assert!(
                    (x - y).abs() <= bound,
                    "{quant:?}, row {i}: {x} vs {y} (bound {bound})"
                );
            }
        }
    }
}

/// `scripts/golden_gguf.py`'s 32-bit hash (`lowbias32`).
fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The generated Llama `name` (tests/data/models/NAME: config and tokenizer files) with the weights of
/// `scripts/golden_gguf.py`'s `kquant_weights`, bit for bit, as a folder under `dir`.
pub(crate) fn generated_model(name: &str, dir: &Path) -> std::path::PathBuf {
    let source = data_path(&format!("models/{name}"));
    let folder = dir.join(name);
    std::fs::create_dir_all(&folder).unwrap();
    for file in std::fs::read_dir(&source).unwrap() {
        let file = file.unwrap().path();
        std::fs::copy(&file, folder.join(file.file_name().unwrap())).unwrap();
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(source.join("config.json")).unwrap())
            .unwrap();
    let dim = |key: &str| config[key].as_u64().unwrap() as usize;
    let (h, i, vocab) = (
        dim("hidden_size"),
        dim("intermediate_size"),
        dim("vocab_size"),
    );
    let q = dim("num_attention_heads") * dim("head_dim");
    let kv = dim("num_key_value_heads") * dim("head_dim");
    let mut shapes = std::collections::BTreeMap::new();
    shapes.insert("model.embed_tokens.weight".to_string(), vec![vocab, h]);
    shapes.insert("model.norm.weight".to_string(), vec![h]);
    if !config["tie_word_embeddings"].as_bool().unwrap() {
        shapes.insert("lm_head.weight".to_string(), vec![vocab, h]);
    }
    for layer in 0..dim("num_hidden_layers") {
        for (module, shape) in [
            ("input_layernorm", vec![h]),
            ("post_attention_layernorm", vec![h]),
            ("self_attn.q_proj", vec![q, h]),
            ("self_attn.k_proj", vec![kv, h]),
            ("self_attn.v_proj", vec![kv, h]),
            ("self_attn.o_proj", vec![h, q]),
            ("mlp.gate_proj", vec![i, h]),
            ("mlp.up_proj", vec![i, h]),
            ("mlp.down_proj", vec![h, i]),
        ] {
            shapes.insert(format!("model.layers.{layer}.{module}.weight"), shape);
        }
    }
    let mut tensors = HashMap::new();
    for (k, (name, shape)) in shapes.into_iter().enumerate() {
        let n: usize = shape.iter().product();
        let values: Vec<f32> = (0..n)
            .map(|idx| {
                let key = (k as u64 * 2_654_435_761 + idx as u64) as u32;
                let u = (lowbias32(key) >> 8) as f32 * 2f32.powi(-24) - 0.5;
                let cube = u * u * u * 4.0;
                let v = u + cube;
                match shape.len() {
                    1 => 1.0 + v * 0.125,
                    _ => v * (2f32.powi(-((idx / shape[1] % 5) as i32)) / 16.0),
                }
            })
            .collect();
        tensors.insert(name, Tensor::from_vec(values, shape, &Device::Cpu).unwrap());
    }
    candle_core::safetensors::save(&tensors, folder.join("model.safetensors")).unwrap();
    folder
}

/// Two generated Llamas — 256-wide rows, 8 layers and a head of its own; 320-wide rows (most falling back to
/// 32-blocks) and tied embeddings — exported in each k-quant type alone and in the mixes `q4_k_m` and `q5_k_m`
/// are the files `llama-quantize` makes of the converter's float32 file (`--pure` for one type): every tensor's
/// type (the head and embeddings, the value and down projections that the mixes give more bits, the fallbacks)
/// and bytes, the metadata and the order.
#[test]
fn k_quant_exports_equal_llama_quantizes_files() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["kquant-llama", "kquant-llama-tied"] {
        let golden: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(data_path(&format!("gguf/{name}.json"))).unwrap(),
        )
        .unwrap();
        let folder = generated_model(name, dir.path());
        let model = load_model(folder.to_str().unwrap(), None, &LoadOptions::default())
            .unwrap()
            .model;
        for (quant, expected) in golden["files"].as_object().unwrap() {
            let quantization: Quantization = quant.parse().unwrap();
            let out = dir.path().join(format!("{name}-{quant}.gguf"));
            gguf(&model, &folder, &out, &options(quantization)).unwrap();
            assert_is_the_converters(&format!("{name} in {quant}"), &out, expected);
        }
    }
}

/// A Llama with a SentencePiece tokenizer (tests/data/models/tiny-llama-spm: a BPE `tokenizer.model` with byte
/// fallback, control, user-defined and byte pieces, as Llama 2's and Mistral's) exports in f32 and q8_0 as the
/// converter writes it: the `llama` vocabulary's tokens, scores and types, the special tokens, and whether they
/// are added (the pair template's separator too). Without its `tokenizer.model` it is refused, naming the file.
#[test]
fn a_sentencepiece_vocabulary_is_written_as_the_converter_writes_it() {
    let dir = tempfile::tempdir().unwrap();
    let golden: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(data_path("gguf/tiny-llama-spm.json")).unwrap(),
    )
    .unwrap();
    let folder = generated_model("tiny-llama-spm", dir.path());
    let model = load_model(folder.to_str().unwrap(), None, &LoadOptions::default())
        .unwrap()
        .model;
    for (quant, expected) in golden["files"].as_object().unwrap() {
        let out = dir.path().join(format!("spm-{quant}.gguf"));
        let quant: GgmlType = quant.parse().unwrap();
        let opts = GgufOptions {
            tokenizer_pre: None,
            ..options(quant)
        };
        gguf(&model, &folder, &out, &opts).unwrap();
        assert_is_the_converters(&format!("tiny-llama-spm in {quant:?}"), &out, expected);
    }
    // Without its tokenizer.model the vocabulary (byte fallback in tokenizer.json) is refused, naming the file.
    std::fs::remove_file(folder.join("tokenizer.model")).unwrap();
    let out = dir.path().join("spm-without-model.gguf");
    let err = gguf(&model, &folder, &out, &options(GgmlType::F32)).unwrap_err();
    assert!(
        err.to_string().contains("SentencePiece") && err.to_string().contains("tokenizer.model"),
        "{err}"
    );
    assert!(!out.exists());
}

/// Gemma 2 and 3 and Phi-3 GGUF files (tests/data/models/tiny-gemma*-gguf, tiny-phi3) export back in float32 to the
/// same file: every tensor's bytes (Gemma's norms as llama.cpp stores them, the scale plus one; Phi-3's LongRoPE
/// factors), the metadata carried over (the quantization version added), the tensor order kept.
#[test]
fn gguf_files_export_back_to_themselves() {
    let dir = tempfile::tempdir().unwrap();
    for (name, file) in [
        ("tiny-gemma2-gguf", "models/tiny-gemma2-gguf/model.gguf"),
        ("tiny-gemma3-gguf", "models/tiny-gemma3-gguf/model.gguf"),
        ("tiny-phi3", "models/tiny-phi3/model.gguf"),
    ] {
        let source = data_path(file);
        let model = load_model(source.to_str().unwrap(), None, &LoadOptions::default())
            .unwrap()
            .model;
        let out = dir.path().join(format!("{name}.gguf"));
        gguf(&model, &source, &out, &options(GgmlType::F32)).unwrap();
        let (original, original_data) = read_gguf(&source);
        let (content, data) = read_gguf(&out);
        assert_carries(name, &content, &original, None);
        assert_eq!(
            content.metadata.len(),
            original.metadata.len() + 1,
            "{name}: the version added"
        );
        assert_eq!(
            tensor_order(&content),
            tensor_order(&original),
            "{name}: tensor order"
        );
        for (tensor, bytes) in &original_data {
            assert!(data[tensor] == *bytes, "{name}: {tensor}");
        }
    }
}
