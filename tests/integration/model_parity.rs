//! The Llama-family model against transformers (golden files from `scripts/golden_model.py`) and against a
//! composite-ops reference for whole-model gradients.

use candle_core::{DType, Device, Tensor, Var, D};
use candle_qlora::adapter::Adapters;
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::models::{generate, Checkpointing, GenerationConfig, LlamaModel, Positions};
use candle_qlora::ops::rope::RopeScaling;
use candle_qlora::ops::FrozenWeight;
use candle_qlora::quant::{BnbKernels, QuantConfig};
use serde_json::Value;

use crate::common::{
    assert_f32_within_bound, assert_f64_close, assert_f64_scalar_close, data_path, embeds_loss,
    ids_of, max_abs_diff, test_model, text_loss, TINY_MODELS,
};

fn golden(name: &str) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(
        data_path(&format!("models/{name}/golden.safetensors")),
        &Device::Cpu,
    )
    .unwrap()
}

fn load_tiny(name: &str, quant: Option<QuantConfig>) -> LlamaModel {
    load_tiny_in(name, quant, DType::F32)
}

/// A tiny model computing in `compute_dtype` (float64: the parity runs against transformers' float64 goldens).
fn load_tiny_in(name: &str, quant: Option<QuantConfig>, compute_dtype: DType) -> LlamaModel {
    let dir = data_path(&format!("models/{name}"));
    load_model(
        dir.to_str().unwrap(),
        None,
        &LoadOptions {
            quantization: quant,
            compute_dtype,
            ..Default::default()
        },
    )
    .unwrap()
    .model
}

fn nf4_like_bitsandbytes_cpu() -> QuantConfig {
    QuantConfig {
        kernels: BnbKernels::Cpu,
        ..QuantConfig::nf4()
    }
}

/// Every family's logits, loss and NF4 logits equal transformers' (and bitsandbytes' dequantized weights), both
/// sides in float64 from end to end ([`F64_TOLERANCE`]); our float32 path is within float32 rounding of them.
#[test]
fn tiny_models_of_every_family_match_transformers_logits() {
    for name in TINY_MODELS {
        let g = golden(name);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let model = load_tiny_in(name, None, DType::F64);
        let logits = model.logits(&ids).unwrap();
        assert_f64_close(&format!("{name}: logits"), &logits, &g["logits_f64"]);
        // Phi-3's LongRoPE switches factors by sequence length: a short input uses the short ones.
        if let Some(short) = g.get("input_ids_short") {
            let short = short.to_dtype(DType::U32).unwrap();
            let got = model.logits(&short).unwrap();
            assert_f64_close(
                &format!("{name}: short-input logits"),
                &got,
                &g["logits_short_f64"],
            );
        }
        let (sum, n) = text_loss(&model, &ids);
        let expected = g["loss_f64"].to_vec1::<f64>().unwrap()[0];
        assert_f64_scalar_close(&format!("{name}: loss"), sum / n as f64, expected);
        let q = load_tiny_in(name, Some(nf4_like_bitsandbytes_cpu()), DType::F64);
        let got = q.logits(&ids).unwrap();
        assert_f64_close(&format!("{name}: NF4 logits"), &got, &g["logits_nf4_f64"]);

        let model = load_tiny(name, None);
        let got = model.logits(&ids).unwrap();
        let what = format!("{name}: logits");
        assert_f32_within_bound(&what, &model, (19, 1), &got, &g["logits_f64"]);
        let q = load_tiny(name, Some(nf4_like_bitsandbytes_cpu()));
        let got = q.logits(&ids).unwrap();
        let what = format!("{name}: NF4 logits");
        assert_f32_within_bound(&what, &q, (19, 1), &got, &g["logits_nf4_f64"]);
    }
}

/// The gradient of the loss with respect to the input embeddings equals transformers', with and without
/// checkpointed layers: in float64 at [`F64_TOLERANCE`], in float32 within float32 rounding.
#[test]
fn input_gradients_match_transformers() {
    for name in TINY_MODELS {
        let g = golden(name);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let expected = &g["grad_inputs_embeds_f64"];
        for dtype in [DType::F64, DType::F32] {
            let model = load_tiny_in(name, None, dtype);
            let embeds = Var::from_tensor(&model.embed(&ids).unwrap()).unwrap();
            for enabled in [false, true] {
                let grads = embeds_loss(&model, embeds.as_tensor(), &ids, enabled)
                    .backward()
                    .unwrap();
                let got = grads.get(&embeds).unwrap();
                let what = format!("{name} (checkpointing {enabled}): input gradient");
                if dtype == DType::F64 {
                    assert_f64_close(&what, got, expected);
                } else {
                    assert_f32_within_bound(&what, &model, (19, 2), got, expected);
                }
            }
        }
    }
}

/// The same model written with Candle's differentiable primitives only (composite ops, repeated kv heads, full
/// logits), as the reference for whole-model gradients.
fn composite_loss(model: &LlamaModel, embeds: &Tensor, labels: &[u32]) -> Tensor {
    use candle_qlora::ops::rope::{inverse_frequencies, inverse_frequencies_f64};
    let cfg = model.config().clone();
    let dtype = model.compute_dtype();
    let dense = |w: &FrozenWeight| w.to_dense(dtype).unwrap();
    let (b, t, _) = embeds.dims3().unwrap();
    let scaling = cfg.rope_scaling.as_ref();
    // The model's angles: float32 products of float32 frequencies, or float64 throughout for a float64 model.
    let angles = if dtype == DType::F64 {
        let inv = inverse_frequencies_f64(cfg.head_dim, cfg.rope_theta, scaling);
        let angles: Vec<f64> = (0..t)
            .flat_map(|p| inv.iter().map(move |f| p as f64 * f))
            .collect();
        Tensor::from_vec(angles, (t, cfg.head_dim / 2), &Device::Cpu).unwrap()
    } else {
        let inv = inverse_frequencies(cfg.head_dim, cfg.rope_theta, scaling);
        let angles: Vec<f32> = (0..t)
            .flat_map(|p| inv.iter().map(move |f| p as f32 * *f as f32))
            .collect();
        Tensor::from_vec(angles, (t, cfg.head_dim / 2), &Device::Cpu).unwrap()
    };
    let (cos, sin) = (angles.cos().unwrap(), angles.sin().unwrap());
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap();
    let lin = |x: &Tensor, l: &candle_qlora::models::llama::Linear| -> Tensor {
        let y = x
            .broadcast_matmul(&dense(&l.base.weight).t().unwrap())
            .unwrap();
        match &l.base.bias {
            Some(bias) => y.broadcast_add(&bias.to_dtype(dtype).unwrap()).unwrap(),
            None => y,
        }
    };
    let norm = |x: &Tensor, w: &Tensor| {
        candle_nn::ops::rms_norm_slow(x, &w.to_dtype(dtype).unwrap(), cfg.rms_norm_eps as f32)
            .unwrap()
    };
    let heads = |x: Tensor, n: usize| {
        x.reshape((b, t, n, cfg.head_dim))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let repeat = |x: Tensor| {
        let g = cfg.num_attention_heads / cfg.num_key_value_heads;
        let (b, h, s, d) = x.dims4().unwrap();
        Tensor::cat(&vec![&x; g], 2)
            .unwrap()
            .reshape((b, h * g, s, d))
            .unwrap()
    };
    let mut x = embeds.clone();
    for layer in &model.layers {
        let h = norm(&x, &layer.input_layernorm);
        let linears = layer.linears();
        let proj = |name: &str| {
            linears
                .iter()
                .find(|(n, _)| n.ends_with(name))
                .map(|(_, l)| *l)
                .unwrap()
        };
        let q = candle_nn::rotary_emb::rope_slow(
            &heads(lin(&h, proj("q_proj")), cfg.num_attention_heads),
            &cos,
            &sin,
        )
        .unwrap();
        let k = candle_nn::rotary_emb::rope_slow(
            &heads(lin(&h, proj("k_proj")), cfg.num_key_value_heads),
            &cos,
            &sin,
        )
        .unwrap();
        let v = heads(lin(&h, proj("v_proj")), cfg.num_key_value_heads);
        let scores =
            (q.matmul(&repeat(k).t().unwrap()).unwrap() / (cfg.head_dim as f64).sqrt()).unwrap();
        let p = candle_nn::ops::softmax(&scores.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
        let o = p
            .matmul(&repeat(v))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .reshape((b, t, cfg.num_attention_heads * cfg.head_dim))
            .unwrap();
        x = (x + lin(&o, proj("o_proj"))).unwrap();
        let h = norm(&x, &layer.post_attention_layernorm);
        let act = (lin(&h, proj("gate_proj")).silu().unwrap() * lin(&h, proj("up_proj"))).unwrap();
        x = (x + lin(&act, proj("down_proj"))).unwrap();
    }
    let h = norm(&x, &model.norm);
    let logits = h
        .broadcast_matmul(&dense(&model.lm_head.weight).t().unwrap())
        .unwrap();
    let logits = logits
        .narrow(1, 0, t - 1)
        .unwrap()
        .reshape((b * (t - 1), cfg.vocab_size))
        .unwrap();
    let targets = Tensor::from_vec(labels.to_vec(), b * (t - 1), &Device::Cpu).unwrap();
    candle_nn::loss::cross_entropy(&logits, &targets).unwrap()
}

/// Whole-model loss and input gradients of our ops equal Candle's composite primitives', with and without
/// checkpointing, dense and NF4: in float64 to [`F64_TOLERANCE`] (the composite's RMSNorm takes its epsilon as
/// float32, a change of 1e-12 relative here), in float32 within twice the float32 bound (two float32 computations).
#[test]
fn whole_model_gradients_match_a_composite_reference_with_and_without_checkpointing() {
    let g = golden("tiny-llama");
    let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
    for dtype in [DType::F64, DType::F32] {
        for quant in [None, Some(QuantConfig::nf4())] {
            let model = load_tiny_in("tiny-llama", quant, dtype);
            let embeds = Var::from_tensor(&model.embed(&ids).unwrap()).unwrap();
            let shifted: Vec<u32> = ids
                .narrow(1, 1, 18)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let reference = composite_loss(&model, embeds.as_tensor(), &shifted);
            let g_ref = reference.backward().unwrap();
            let expected_grad = g_ref.get(&embeds).unwrap();
            for enabled in [false, true] {
                let loss = embeds_loss(&model, embeds.as_tensor(), &ids, enabled);
                let grads = loss.backward().unwrap();
                let got_grad = grads.get(&embeds).unwrap();
                let what = format!("{dtype:?}, quant {quant:?}, checkpointing {enabled}");
                if dtype == DType::F64 {
                    let loss = loss.reshape(1).unwrap();
                    let expected = reference.reshape(1).unwrap();
                    assert_f64_close(&format!("{what}: loss"), &loss, &expected);
                    assert_f64_close(&format!("{what}: gradient"), got_grad, expected_grad);
                } else {
                    let (loss, expected) =
                        (loss.reshape(1).unwrap(), reference.reshape(1).unwrap());
                    assert_f32_within_bound(&what, &model, (19, 2), &loss, &expected);
                    assert_f32_within_bound(&what, &model, (19, 4), got_grad, expected_grad);
                }
            }
        }
    }
}

fn smollm2_golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(data_path("models/smollm2_golden.json")).unwrap())
        .unwrap()
}

/// SmolLM2 from its GGUF: tokenizer and chat template as transformers builds them; loss, NF4 loss and greedy tokens
/// as transformers computes them in float64 ([`F64_TOLERANCE`]; where two tokens nearly tie, float32 rounding could
/// pick either); our float32 loss within float32 rounding of it.
#[test]
fn smollm2_gguf_matches_transformers() {
    let Some(path) = test_model() else { return };
    let path = path.to_str().unwrap();
    let g = smollm2_golden();
    let f64_options = LoadOptions {
        compute_dtype: DType::F64,
        ..Default::default()
    };
    let loaded = load_model(path, None, &f64_options).unwrap();
    let tok = loaded.tokenizer.as_ref().unwrap();

    // Tokenizer and chat template from the GGUF metadata, as transformers builds them.
    let text_ids = ids_of(&g["text_ids"]);
    assert_eq!(
        tok.encode(g["text"].as_str().unwrap(), true).unwrap(),
        text_ids
    );
    let msgs = [candle_qlora::models::ChatMessage {
        role: "user".into(),
        content: g["prompt"].as_str().unwrap().into(),
    }];
    let prompt_text = tok.apply_chat_template(&msgs, true).unwrap();
    assert_eq!(prompt_text, g["prompt_text"].as_str().unwrap());
    let prompt_ids = tok.encode(&prompt_text, false).unwrap();
    assert_eq!(prompt_ids, ids_of(&g["prompt_ids"]));

    // Mean loss over the text, unquantized.
    let ids = Tensor::new(text_ids.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let mean_loss = |m: &LlamaModel| {
        let (s, n) = text_loss(m, &ids);
        s / n as f64
    };
    let expected = g["loss_f64"].as_f64().unwrap();
    assert_f64_scalar_close("loss", mean_loss(&loaded.model), expected);

    // 20 greedy tokens (ignoring EOS) identical to transformers'.
    let mut cfg = GenerationConfig::greedy(20);
    cfg.eos_token_ids = Some(vec![]);
    let out = generate(&loaded.model, &prompt_ids, &cfg, |_| Ok(())).unwrap();
    assert_eq!(out, ids_of(&g["greedy_ids_20_ignoring_eos_f64"]));
    // By default generation stops at the model's end-of-sequence token, as transformers does.
    cfg.eos_token_ids = None;
    let out = generate(&loaded.model, &prompt_ids, &cfg, |_| Ok(())).unwrap();
    let mut expected = ids_of(&g["greedy_ids_f64"]);
    expected.pop(); // the EOS itself is not returned
    assert_eq!(out, expected);
    assert_eq!(
        tok.decode(&out, true).unwrap(),
        "The capital of France is Paris."
    );
    drop(loaded);

    // Quantized on load to NF4 like bitsandbytes on CPU.
    let opts = LoadOptions {
        quantization: Some(nf4_like_bitsandbytes_cpu()),
        compute_dtype: DType::F64,
        ..Default::default()
    };
    let q = load_model(path, None, &opts).unwrap();
    let expected = g["loss_nf4_f64"].as_f64().unwrap();
    assert_f64_scalar_close("NF4 loss", mean_loss(&q.model), expected);
    drop(q);

    let model = load_model(path, None, &LoadOptions::default())
        .unwrap()
        .model;
    let t = |x: f64| Tensor::new(&[x], &Device::Cpu).unwrap();
    let (got, expected) = (t(mean_loss(&model)), t(g["loss_f64"].as_f64().unwrap()));
    assert_f32_within_bound("loss", &model, (text_ids.len(), 1), &got, &expected);
}

/// bf16 autocast: base matmuls in bf16, norms/softmax/loss in f32; close to the f32 model, gradients flow.
#[test]
fn bf16_compute_tracks_f32_and_trains() {
    let g = golden("tiny-llama");
    let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
    let dir = data_path("models/tiny-llama");
    for compute_dtype in [DType::BF16, DType::F16] {
        let opts = LoadOptions {
            quantization: Some(QuantConfig::nf4()),
            compute_dtype,
            ..Default::default()
        };
        let model = load_model(dir.to_str().unwrap(), None, &opts)
            .unwrap()
            .model;
        let embeds = Var::from_tensor(&model.embed(&ids).unwrap()).unwrap();
        assert_eq!(embeds.dtype(), compute_dtype);
        let ck = Checkpointing {
            enabled: true,
            ..Default::default()
        };
        let h = model
            .forward_embeds(embeds.as_tensor(), &Positions::Range(0), &ck)
            .unwrap();
        assert_eq!(h.dtype(), compute_dtype);
        let (sum, n) = model
            .loss_from_hidden(&h, &ids.to_dtype(DType::I64).unwrap())
            .unwrap();
        assert_eq!(sum.dtype(), DType::F32, "the loss is accumulated in f32");
        let loss = sum.to_scalar::<f32>().unwrap() / n as f32;
        let f32_nf4 = {
            let m = load_tiny("tiny-llama", Some(QuantConfig::nf4()));
            let (s, n) = text_loss(&m, &ids);
            (s / n as f64) as f32
        };
        assert!(
            (loss - f32_nf4).abs() < 0.05,
            "{compute_dtype:?} loss {loss} vs f32 {f32_nf4}"
        );
        let grads = (sum / n as f64).unwrap().backward().unwrap();
        let gx = grads.get(&embeds).unwrap();
        assert_eq!(gx.dtype(), compute_dtype);
        assert!(
            gx.to_dtype(DType::F32)
                .unwrap()
                .abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }
}

/// A sharded folder (index + two files) loads like the single file; a folder written by `qlora quantize` in
/// bitsandbytes' layout loads without re-quantizing and gives transformers + bitsandbytes' NF4 logits.
#[test]
fn sharded_and_bitsandbytes_folders_load() {
    use candle_qlora::files::{write_safetensors, MappedSafetensors, RawTensor};
    let g = golden("tiny-llama");
    let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
    let src = data_path("models/tiny-llama");
    let dir = tempfile::tempdir().unwrap();
    let sharded = dir.path().join("sharded");
    std::fs::create_dir(&sharded).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(src.join(f), sharded.join(f)).unwrap();
    }
    let file = MappedSafetensors::open(src.join("model.safetensors")).unwrap();
    let st = file.tensors().unwrap();
    let mut names: Vec<&str> = st.names();
    names.sort();
    let mut map = serde_json::Map::new();
    for (i, part) in names.chunks(names.len() / 2 + 1).enumerate() {
        let shard = format!("model-0000{}-of-00002.safetensors", i + 1);
        let tensors = part
            .iter()
            .map(|n| (n.to_string(), RawTensor::from_view(&st.tensor(n).unwrap())));
        write_safetensors(&sharded.join(&shard), tensors, None).unwrap();
        for n in part {
            map.insert(n.to_string(), shard.clone().into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(
        sharded.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    let f64_options = LoadOptions {
        compute_dtype: DType::F64,
        ..Default::default()
    };
    let model = load_model(sharded.to_str().unwrap(), None, &f64_options)
        .unwrap()
        .model;
    assert_f64_close(
        "sharded logits",
        &model.logits(&ids).unwrap(),
        &g["logits_f64"],
    );

    let bnb = dir.path().join("bnb");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
        .args([
            "quantize",
            "--input",
            sharded.to_str().unwrap(),
            "--output",
            bnb.to_str().unwrap(),
            "--kernels",
            "cpu",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // No quantization requested: the 4-bit weights are used as stored.
    let model = load_model(bnb.to_str().unwrap(), None, &f64_options)
        .unwrap()
        .model;
    let linears = model.linears();
    let (_, down) = linears
        .iter()
        .find(|(n, _)| n == "model.layers.0.mlp.down_proj")
        .unwrap();
    assert!(matches!(down.base.weight, FrozenWeight::Nf4(_)));
    let got = model.logits(&ids).unwrap();
    assert_f64_close("bitsandbytes folder logits", &got, &g["logits_nf4_f64"]);
}

/// Memory-aware checkpointing (the last layer keeps its activations, the first is recomputed) gives the plain run's
/// loss, input gradient and LoRA gradients, as full checkpointing does.
#[test]
fn partial_checkpointing_gives_the_plain_gradients() {
    use candle_qlora::lora::{InitLoraWeights, LoraConfig, TargetModules};
    let g = golden("tiny-llama");
    let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
    let labels = ids.to_dtype(DType::I64).unwrap();
    let mut model = load_tiny("tiny-llama", Some(QuantConfig::nf4()));
    assert_eq!(model.layers.len(), 2);
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: Some(TargetModules::AllLinear),
        init_lora_weights: InitLoraWeights::Random,
        ..Default::default()
    };
    model.add_adapter("default", &lora, 7).unwrap();
    let vars: Vec<candle_core::Var> = model
        .adapter_parameters("default")
        .unwrap()
        .into_iter()
        .map(|(_, v)| v)
        .collect();
    let embeds = Var::from_tensor(&model.embed(&ids).unwrap()).unwrap();
    let run = |enabled: bool, kept_layers: usize| -> (f32, Vec<Tensor>) {
        let ck = Checkpointing {
            enabled,
            kept_layers,
            params: vars.clone(),
            ..Default::default()
        };
        let h = model
            .forward_embeds(embeds.as_tensor(), &Positions::Range(0), &ck)
            .unwrap();
        let (sum, n) = model.loss_from_hidden(&h, &labels).unwrap();
        let loss = (sum / n as f64).unwrap();
        let mut grads = loss.backward().unwrap();
        ck.sink.merge_into(&mut grads).unwrap();
        let mut all = vec![grads.get(&embeds).unwrap().clone()];
        all.extend(vars.iter().map(|v| grads.get(v).unwrap().clone()));
        (loss.to_scalar::<f32>().unwrap(), all)
    };
    let (plain_loss, plain) = run(false, 0);
    for kept in [0, 1] {
        let (loss, grads) = run(true, kept);
        assert_eq!(loss, plain_loss, "kept {kept}");
        for (i, (a, b)) in plain.iter().zip(&grads).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(d <= 1e-7, "kept {kept}, gradient {i}: {d}");
        }
    }
}

/// Decoding with the KV cache (a prompt, then one token at a time) gives the full forward's logits in every
/// family: sliding windows over cached keys, per-layer RoPE tables, fused projections, soft-capped logits. In
/// float64 to [`F64_TOLERANCE`]; in float32 within the float32 bound of two float32 forwards (the cached steps
/// multiply other shapes, so other kernels sum in other orders).
#[test]
fn cached_decoding_of_every_family_equals_full_forwards() {
    for name in TINY_MODELS {
        let g = golden(name);
        // 12 positions: longer than every window, within Phi-3's original context (its short RoPE factors).
        let ids = g["input_ids"]
            .to_dtype(DType::U32)
            .unwrap()
            .narrow(1, 0, 12)
            .unwrap();
        for dtype in [DType::F64, DType::F32] {
            let model = load_tiny_in(name, None, dtype);
            let full = model.logits(&ids).unwrap();
            let mut cache = candle_qlora::models::KvCache::default();
            let prompt = 4;
            let mut steps = vec![model
                .forward_cached(&ids.narrow(1, 0, prompt).unwrap(), &mut cache)
                .unwrap()];
            for t in prompt..12 {
                steps.push(
                    model
                        .forward_cached(&ids.narrow(1, t, 1).unwrap(), &mut cache)
                        .unwrap(),
                );
            }
            for (i, step) in steps.iter().enumerate() {
                let position = prompt - 1 + i;
                let expected = full.narrow(1, position, 1).unwrap().squeeze(1).unwrap();
                let what = format!("{name}: cached logits at position {position}");
                if dtype == DType::F64 {
                    assert_f64_close(&what, step, &expected);
                } else {
                    assert_f32_within_bound(&what, &model, (12, 2), step, &expected);
                }
            }
        }
    }
}

/// `tests/data/models/{name}/model.gguf`, computing in `compute_dtype`.
fn load_gguf_in(
    name: &str,
    quantization: Option<QuantConfig>,
    compute_dtype: DType,
) -> candle_qlora::loading::LoadedModel {
    let gguf = data_path(&format!("models/{name}/model.gguf"));
    load_model(
        gguf.to_str().unwrap(),
        None,
        &LoadOptions {
            quantization,
            compute_dtype,
            ..Default::default()
        },
    )
    .unwrap()
}

/// GGUF files written with llama.cpp's conventions (Qwen3's head norms and `key_length`; Phi-3's fused tensors,
/// partial rotary, sliding window and LongRoPE factors stored as tensors) give the folders' transformers logits,
/// dense and quantized to NF4 on load. Computed in float64: Qwen3's file holds the folder's values (its epsilon
/// rounded to float32 moves the logits by 1e-12), so it matches to [`F64_TOLERANCE`]; Phi-3's stores its LongRoPE
/// factors and attention factor as float32, one float32 rounding of the frequencies, so it matches within the
/// float32 bound of one pass.
#[test]
fn gguf_files_of_qwen3_and_phi3_match_transformers() {
    for name in ["tiny-qwen3", "tiny-phi3"] {
        let g = golden(name);
        let loaded = load_gguf_in(name, None, DType::F64);
        assert!(
            loaded.tokenizer.is_none(),
            "{name}: the file has no tokenizer"
        );
        let folder = load_tiny(name, None);
        // The same configuration, but for what GGUF stores differently: epsilon in float32, token ids with the
        // tokenizer (which these files lack).
        let mut from_gguf = loaded.model.config().clone();
        assert_eq!(
            from_gguf.rms_norm_eps as f32,
            folder.config().rms_norm_eps as f32
        );
        from_gguf.rms_norm_eps = folder.config().rms_norm_eps;
        from_gguf.bos_token_id = folder.config().bos_token_id;
        from_gguf.eos_token_ids = folder.config().eos_token_ids.clone();
        // LongRoPE factors are float32 tensors there.
        if let (Some(RopeScaling::LongRope(a)), Some(RopeScaling::LongRope(b))) =
            (&from_gguf.rope_scaling, &folder.config().rope_scaling)
        {
            let f32s = |v: &[f64]| v.iter().map(|x| *x as f32).collect::<Vec<_>>();
            assert_eq!(f32s(&a.short_factor), f32s(&b.short_factor));
            assert_eq!(f32s(&a.long_factor), f32s(&b.long_factor));
            assert_eq!(a.attention_factor as f32, b.attention_factor as f32);
            from_gguf.rope_scaling = folder.config().rope_scaling.clone();
        }
        assert_eq!(&from_gguf, folder.config(), "{name}");
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let float32_factors = name == "tiny-phi3";
        let check = |what: &str, model: &LlamaModel, ids: &Tensor, expected: &Tensor| {
            let got = model.logits(ids).unwrap();
            let what = format!("{name}: {what}");
            if float32_factors {
                assert_f32_within_bound(&what, model, (ids.dim(1).unwrap(), 1), &got, expected);
            } else {
                assert_f64_close(&what, &got, expected);
            }
        };
        check("GGUF logits", &loaded.model, &ids, &g["logits_f64"]);
        if let Some(short) = g.get("input_ids_short") {
            let short = short.to_dtype(DType::U32).unwrap();
            check(
                "GGUF short-input logits",
                &loaded.model,
                &short,
                &g["logits_short_f64"],
            );
        }
        let nf4 = Some(nf4_like_bitsandbytes_cpu());
        let q = load_gguf_in(name, nf4, DType::F64).model;
        check("GGUF → NF4 logits", &q, &ids, &g["logits_nf4_f64"]);
    }
}

/// A Llama 3 GGUF as llama.cpp's `convert_hf_to_gguf.py` writes one — its `rope_type = "llama3"` scaling as the
/// `rope_freqs` tensor of per-frequency divisors, no scaling metadata; q/k rows permuted — gives the tiny Llama's
/// transformers logits (its config scales RoPE with llama3). Written here from the folder's weights.
#[test]
fn llama3_gguf_scales_rope_by_its_frequency_tensor() {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let name = "tiny-llama";
    let folder = data_path(&format!("models/{name}"));
    let cfg = load_tiny(name, None).config().clone();
    let Some(RopeScaling::Llama3(llama3)) = &cfg.rope_scaling else {
        panic!("{name} is expected to scale RoPE as Llama 3");
    };
    // The converter's factors (LlamaModel.generate_extra_tensors), from float32 frequencies.
    let old = llama3.original_max_position_embeddings as f64;
    let (low, high) = (old / llama3.low_freq_factor, old / llama3.high_freq_factor);
    let factors: Vec<f32> = (0..cfg.head_dim / 2)
        .map(|i| {
            let freq = 1.0 / (cfg.rope_theta as f32).powf((2 * i) as f32 / cfg.head_dim as f32);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            if wavelen < high {
                1.0
            } else if wavelen > low {
                llama3.factor as f32
            } else {
                let smooth = (old / wavelen - llama3.low_freq_factor)
                    / (llama3.high_freq_factor - llama3.low_freq_factor);
                (1.0 / ((1.0 - smooth) / llama3.factor + smooth)) as f32
            }
        })
        .collect();
    assert!(
        factors.iter().any(|f| *f != 1.0),
        "the scaling must change some frequency"
    );
    // llama.cpp's permute of q/k rows for its interleaved RoPE.
    let permute = |w: &Tensor, heads: usize| {
        let (out, inp) = w.dims2().unwrap();
        w.reshape((heads, 2, out / heads / 2, inp))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape((out, inp))
            .unwrap()
    };
    let weights =
        candle_core::safetensors::load(folder.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut tensors = vec![(
        "rope_freqs.weight".to_string(),
        Tensor::new(factors.as_slice(), &Device::Cpu).unwrap(),
    )];
    for (hf, w) in &weights {
        let w = if hf.contains("q_proj") {
            permute(w, cfg.num_attention_heads)
        } else if hf.contains("k_proj") {
            permute(w, cfg.num_key_value_heads)
        } else {
            w.clone()
        };
        let gguf = candle_qlora::loading::gguf::gguf_name(hf, "llama")
            .unwrap_or_else(|| panic!("no llama.cpp name for {hf}"));
        tensors.push((gguf, w));
    }
    let tensors: Vec<(String, QTensor)> = tensors
        .into_iter()
        .map(|(n, t)| (n, QTensor::quantize(&t, GgmlDType::F32).unwrap()))
        .collect();
    use gguf_file::Value as V;
    let metadata = [
        ("general.architecture", V::String("llama".into())),
        ("llama.block_count", V::U32(cfg.num_hidden_layers as u32)),
        (
            "llama.context_length",
            V::U32(cfg.max_position_embeddings as u32),
        ),
        ("llama.embedding_length", V::U32(cfg.hidden_size as u32)),
        (
            "llama.feed_forward_length",
            V::U32(cfg.intermediate_size as u32),
        ),
        (
            "llama.attention.head_count",
            V::U32(cfg.num_attention_heads as u32),
        ),
        (
            "llama.attention.head_count_kv",
            V::U32(cfg.num_key_value_heads as u32),
        ),
        ("llama.rope.dimension_count", V::U32(cfg.head_dim as u32)),
        ("llama.rope.freq_base", V::F32(cfg.rope_theta as f32)),
        (
            "llama.attention.layer_norm_rms_epsilon",
            V::F32(cfg.rms_norm_eps as f32),
        ),
        ("llama.vocab_size", V::U32(cfg.vocab_size as u32)),
    ];
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("llama3.gguf");
    let mut file = std::fs::File::create(&path).unwrap();
    gguf_file::write(
        &mut file,
        &metadata.iter().map(|(k, v)| (*k, v)).collect::<Vec<_>>(),
        &tensors
            .iter()
            .map(|(n, t)| (n.as_str(), t))
            .collect::<Vec<_>>(),
    )
    .unwrap();
    drop(file);

    let loaded = load_model(path.to_str().unwrap(), None, &LoadOptions::default()).unwrap();
    let Some(RopeScaling::LongRope(scaling)) = &loaded.model.config().rope_scaling else {
        panic!("the rope_freqs tensor must scale RoPE");
    };
    assert_eq!(scaling.attention_factor, 1.0);
    let g = golden(name);
    let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
    // The file's divisors are float32 (from float32 frequencies, as the converter writes them), so even a float64
    // run carries float32 rounding in its frequencies: compared in float32, within the bound of two float32 passes
    // (the computation, and the frequencies' own rounding).
    let got = loaded.model.logits(&ids).unwrap();
    let what = "Llama 3 GGUF logits";
    assert_f32_within_bound(what, &loaded.model, (19, 2), &got, &g["logits_f64"]);
}

/// Gemma 2 / 3 GGUF files in llama.cpp's conventions (norms stored as `1 + w`; `post_attention_norm`, `ffn_norm`
/// and `post_ffw_norm` around the blocks; soft-caps, window and `key_length` as keys; scores scaled by
/// 1/√key_length; Gemma 2's layers alternating sliding-first, Gemma 3's five sliding then one full, its sliding
/// layers at RoPE base 10⁴ unscaled and its full ones at `rope.freq_base` with linear scaling) give transformers'
/// logits for the configs such a file can express, dense and quantized to NF4 on load. Computed in float64, but the
/// file stores each norm's scale `1 + w` rounded to float32 (transformers computes it from `w` exactly in float64):
/// one float32 rounding of the norms, so within the float32 bound of one pass.
#[test]
fn gemma_gguf_files_match_transformers() {
    let cases: [(&str, &[Option<usize>]); 2] = [
        ("tiny-gemma2-gguf", &[Some(6), None]),
        (
            "tiny-gemma3-gguf",
            &[Some(6), Some(6), Some(6), Some(6), Some(6), None],
        ),
    ];
    for (name, windows) in cases {
        let g = golden(name);
        let loaded = load_gguf_in(name, None, DType::F64);
        assert!(
            loaded.tokenizer.is_none(),
            "{name}: the file has no tokenizer"
        );
        let model = loaded.model;
        let got: Vec<_> = (0..windows.len())
            .map(|i| model.config().window_of(i))
            .collect();
        assert_eq!(got, windows, "{name}: sliding window per layer");
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let within = |what: &str, model: &LlamaModel, got: &Tensor, expected: &Tensor| {
            let what = format!("{name}: {what}");
            assert_f32_within_bound(&what, model, (19, 1), got, expected);
        };
        within(
            "GGUF logits",
            &model,
            &model.logits(&ids).unwrap(),
            &g["logits_f64"],
        );
        let (sum, n) = text_loss(&model, &ids);
        let loss = Tensor::new(&[sum / n as f64], &Device::Cpu).unwrap();
        within("loss", &model, &loss, &g["loss_f64"]);
        let nf4 = Some(nf4_like_bitsandbytes_cpu());
        let q = load_gguf_in(name, nf4, DType::F64).model;
        within(
            "GGUF → NF4 logits",
            &q,
            &q.logits(&ids).unwrap(),
            &g["logits_nf4_f64"],
        );
    }
}
