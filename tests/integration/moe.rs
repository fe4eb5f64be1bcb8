//! The mixture-of-experts block against transformers' own (`scripts/golden_moe.py`): Mixtral, Qwen2-MoE (shared
//! expert, no renormalization) and Qwen3-MoE (renormalized top-k), built from the per-expert tensors a Hub
//! checkpoint holds; the auxiliary load-balancing loss; and tiny whole models of every sparse family, also from
//! GGUF and MXFP4 files, with PEFT's adapters, merged, and quantized to NF4.
//!
//! Compared in float64 on both sides (the goldens' `*_f64` tensors, transformers run in float64 from end to end) at
//! [`F64_TOLERANCE`], where neither side's float32 rounding nor the CPU's matrix kernels decide a result; our
//! float32 path within the float32 rounding bound of its chain of sums ([`float32_bound`]).

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_qlora::adapter::Adapters;
use candle_qlora::adapter::{
    load_adapter, merge_to_folder, save_adapter, MergeOptions, ADAPTER_WEIGHTS,
};
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::lora::{LoraAdapter, LoraConfig, LoraLinear, TargetModules};
use candle_qlora::models::{
    load_balancing_loss, Checkpointing, GateUpProjections, LlamaModel, Mlp, Positions,
    RouterLogits, SharedExpert, SparseMoe,
};
use candle_qlora::ops::{FrozenLinear, FrozenWeight, GateActivation};
use candle_qlora::quant::{BnbKernels, QuantConfig};

use crate::common::{
    assert_f32_within_bound, assert_f32_within_terms, assert_f64_close, assert_f64_scalar_close,
    data_path, max_abs_diff,
};
use crate::families::{merge_and_generate, qlora};

/// LoRA's scaling in these tests.
const SCALING: f64 = 2.0;

fn frozen(w: &Tensor) -> LoraLinear {
    LoraLinear::new(Arc::new(FrozenLinear::new(
        FrozenWeight::Dense(w.clone()),
        None,
    )))
}

/// `linear` with a LoRA adapter of rank 3 in `w`'s dtype whose B is zero (the output is the base's; B's gradient is
/// `SCALING · dL/dW · Aᵀ`) and A a fixed pseudo-random matrix (float32 values, exact in float64).
fn with_adapter(mut linear: LoraLinear, w: &Tensor, seed: u32) -> (LoraLinear, Var, Tensor) {
    let (out, inp) = w.dims2().unwrap();
    let a: Vec<f32> = (0..3 * inp)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let a = Tensor::from_vec(a, (3, inp), &Device::Cpu)
        .unwrap()
        .to_dtype(w.dtype())
        .unwrap();
    let b = Var::zeros((out, 3), w.dtype(), &Device::Cpu).unwrap();
    let adapter = LoraAdapter {
        a: Var::from_tensor(&a).unwrap(),
        b: b.clone(),
        scaling: SCALING,
        dropout: 0.0,
        magnitude: None,
        module_id: seed as u64,
        runtime: Arc::default(),
    };
    linear.adapters.insert("default".into(), Arc::new(adapter));
    linear.active = Some("default".into());
    (linear, b, a)
}

struct Golden {
    t: HashMap<String, Tensor>,
    top_k: usize,
    norm_topk_prob: bool,
    experts_hit: usize,
}

fn golden(family: &str) -> Golden {
    let path = data_path(&format!("moe/{family}.safetensors"));
    let bytes = std::fs::read(&path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let meta = meta.metadata().clone().unwrap();
    Golden {
        t: candle_core::safetensors::load(&path, &Device::Cpu).unwrap(),
        top_k: meta["top_k"].parse().unwrap(),
        norm_topk_prob: meta["norm_topk_prob"] == "true",
        experts_hit: meta["experts_hit"].parse().unwrap(),
    }
}

/// Asserts that `got` (computed in `dtype`) equals the float64 reference `expected`: at [`F64_TOLERANCE`] in
/// float64, within the float32 rounding bound of `f32_terms` rounded additions in float32.
fn assert_close(what: &str, dtype: DType, f32_terms: usize, got: &Tensor, expected: &Tensor) {
    match dtype {
        DType::F64 => assert_f64_close(what, got, expected),
        _ => assert_f32_within_terms(what, f32_terms, got, expected),
    }
}

/// Each family's block, loaded from its per-expert tensors (with a zero-B adapter on the router and on expert 0's
/// down projection), gives transformers' output and router logits, the input gradient, and through the adapters
/// the router's and the expert's weight gradients. In float64 at [`F64_TOLERANCE`]; in float32 within the float32
/// bound of the block's chain — the router (hidden) with its softmax (experts) and renormalization (top-k), an
/// expert's gate/up (hidden) and down (its width) projections, the sum of the token's experts and the shared one
/// (top-k + 1, the shared gate: hidden) — once for the forward, twice for gradients (the backward runs the chain
/// again), plus for a weight's gradient through the adapter its sum over the tokens and the product with A (the
/// projection's input width).
#[test]
fn moe_blocks_match_transformers() {
    for (family, [gate, up, down]) in [
        ("mixtral", ["w1", "w3", "w2"]),
        ("qwen2_moe", ["gate_proj", "up_proj", "down_proj"]),
        ("qwen3_moe", ["gate_proj", "up_proj", "down_proj"]),
    ] {
        let g = golden(family);
        let reference = |name: &str| &g.t[&format!("{name}_f64")];
        for dtype in [DType::F64, DType::F32] {
            let t = |name: &str| g.t[name].to_dtype(dtype).unwrap();
            let mlp = |prefix: &str, down_proj: LoraLinear| {
                Mlp::new(
                    GateUpProjections::Separate {
                        gate_proj: frozen(&t(&format!("{prefix}.{gate}.weight"))),
                        up_proj: frozen(&t(&format!("{prefix}.{up}.weight"))),
                    },
                    down_proj,
                    GateActivation::Silu,
                )
            };
            let router_w = t("gate.weight");
            let (router, router_b, router_a) = with_adapter(frozen(&router_w), &router_w, 1);
            let down0_w = t(&format!("experts.0.{down}.weight"));
            let (down0, down0_b, down0_a) = with_adapter(frozen(&down0_w), &down0_w, 2);
            let mut experts = vec![mlp("experts.0", down0)];
            for e in 1..8 {
                let p = format!("experts.{e}");
                experts.push(mlp(&p, frozen(&t(&format!("{p}.{down}.weight")))));
            }
            let shared = g.t.contains_key("shared_expert_gate.weight").then(|| {
                let [gate, up, down] = ["gate_proj", "up_proj", "down_proj"]
                    .map(|p| frozen(&t(&format!("shared_expert.{p}.weight"))));
                SharedExpert {
                    mlp: Mlp::new(
                        GateUpProjections::Separate {
                            gate_proj: gate,
                            up_proj: up,
                        },
                        down,
                        GateActivation::Silu,
                    ),
                    gate: frozen(&t("shared_expert_gate.weight")),
                }
            });
            assert_eq!(shared.is_some(), family == "qwen2_moe");
            let (experts_n, hidden) = router_w.dims2().unwrap();
            let shared_width =
                g.t.get("shared_expert.down_proj.weight")
                    .map_or(0, |w| w.dim(1).unwrap());
            let width = down0_w.dim(1).unwrap().max(shared_width);
            let chain = 3 * hidden + experts_n + 2 * g.top_k + width + 1;
            let block = SparseMoe::new(router, experts, shared, g.top_k, g.norm_topk_prob).unwrap();
            let x = Var::from_tensor(&t("x")).unwrap();
            let (out, logits) = block.forward(x.as_tensor()).unwrap();
            let what = |w: &str| format!("{family} ({dtype:?}): {w}");
            assert_close(&what("output"), dtype, chain, &out, reference("out"));
            let router_logits = reference("router_logits");
            assert_close(
                &what("router logits"),
                dtype,
                hidden,
                &logits,
                router_logits,
            );
            let grads = (out * t("upstream"))
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let grad_x = grads.get(&x).unwrap();
            assert_close(
                &what("input gradient"),
                dtype,
                2 * chain,
                grad_x,
                reference("grad_x"),
            );
            // dL/dB = s · dL/dW · Aᵀ for an adapter with B = 0 (formed in float64 from the reference).
            let expected = |grad_w: &Tensor, a: &Tensor| {
                let a = a.to_dtype(DType::F64).unwrap();
                (grad_w.matmul(&a.t().unwrap()).unwrap() * SCALING).unwrap()
            };
            let tokens = x.dims()[..2].iter().product::<usize>();
            assert_close(
                &what("router gradient"),
                dtype,
                2 * chain + tokens + hidden,
                grads.get(&router_b).unwrap(),
                &expected(reference("grad_router"), &router_a),
            );
            assert_close(
                &what("expert 0 down-projection gradient"),
                dtype,
                2 * chain + tokens + width,
                grads.get(&down0_b).unwrap(),
                &expected(reference("grad_expert0_down"), &down0_a),
            );
        }
        if family == "qwen2_moe" {
            assert_eq!(
                g.experts_hit, 7,
                "one expert gets no token: the block skips it"
            );
        }
    }
}

/// transformers' load-balancing loss of two layers' router logits (14 tokens each, 8 experts), and its gradient: in
/// float64 at [`F64_TOLERANCE`]; in float32 within the float32 bound of its chain — each token's softmax (experts),
/// the mean over both layers' tokens, the sum over experts — once for the loss, twice for the gradient.
#[test]
fn load_balancing_loss_matches_transformers() {
    let t = golden("qwen3_moe").t;
    let (tokens, experts) = t["aux_logits_0"].dims2().unwrap();
    let chain = experts + 2 * tokens + experts;
    for dtype in [DType::F64, DType::F32] {
        let l0 = Var::from_tensor(&t["aux_logits_0"].to_dtype(dtype).unwrap()).unwrap();
        let l1 = t["aux_logits_1"].to_dtype(dtype).unwrap();
        let loss = load_balancing_loss(&[l0.as_tensor().clone(), l1], 2).unwrap();
        let what = |w: &str| format!("{dtype:?}: {w}");
        let got = loss.reshape(1).unwrap();
        assert_close(
            &what("auxiliary loss"),
            dtype,
            chain,
            &got,
            &t["aux_loss_f64"],
        );
        let grads = loss.backward().unwrap();
        let grad = grads.get(&l0).unwrap();
        let expected = &t["grad_aux_logits_0_f64"];
        assert_close(&what("its gradient"), dtype, 2 * chain, grad, expected);
    }
}

/// The tiny whole models of `scripts/golden_moe.py models`.
pub(crate) const MOE_MODELS: [&str; 3] = ["tiny-mixtral", "tiny-qwen2-moe", "tiny-qwen3-moe"];
/// The tiny gpt-oss (`scripts/golden_moe.py gpt-oss`).
pub(crate) const GPT_OSS: &str = "tiny-gpt-oss";

pub(crate) fn model_golden(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        data_path(&format!("models/{name}/golden.safetensors")),
        &Device::Cpu,
    )
    .unwrap()
}

/// The one number of a golden tensor `[1]`, as f64.
fn scalar(t: &Tensor) -> f64 {
    t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap()[0]
}

/// Whether projection `name` of `model` holds an NF4 weight.
fn is_nf4(model: &LlamaModel, name: &str) -> bool {
    let linears = model.linears();
    let (_, l) = linears.iter().find(|(n, _)| n == name).unwrap();
    matches!(l.base.weight, FrozenWeight::Nf4(_))
}

fn load_moe(name: &str, quantization: Option<QuantConfig>) -> LlamaModel {
    load_moe_in(name, quantization, DType::F32)
}

/// `tests/data/models/{name}` computing in `compute_dtype` (float64: against the float64 goldens).
fn load_moe_in(name: &str, quantization: Option<QuantConfig>, compute_dtype: DType) -> LlamaModel {
    let dir = data_path(&format!("models/{name}"));
    let options = LoadOptions {
        quantization,
        compute_dtype,
        ..Default::default()
    };
    load_model(dir.to_str().unwrap(), None, &options)
        .unwrap()
        .model
}

/// NF4 quantized as bitsandbytes' CPU kernels choose the codes (the goldens' NF4 weights are quantized on the CPU).
fn nf4_like_bitsandbytes_cpu() -> QuantConfig {
    QuantConfig {
        kernels: BnbKernels::Cpu,
        ..QuantConfig::nf4()
    }
}

/// transformers' training loss of embeddings `embeds` with labels `ids`: the mean token loss, plus
/// `router_aux_loss_coef` times the load-balancing loss when the config sets `output_router_logits`; and the
/// load-balancing loss itself.
pub(crate) fn moe_loss(
    model: &LlamaModel,
    embeds: &Tensor,
    ids: &Tensor,
    checkpointing: bool,
) -> (Tensor, f64) {
    let ck = Checkpointing {
        enabled: checkpointing,
        ..Default::default()
    };
    let router = RouterLogits::new();
    let h = model
        .forward_embeds_routed(embeds, &Positions::Range(0), &ck, Some(&router))
        .unwrap();
    let (sum, n) = model
        .loss_from_hidden(&h, &ids.to_dtype(DType::I64).unwrap())
        .unwrap();
    let moe = model.config().moe.clone().unwrap();
    let coef = if moe.output_router_logits {
        moe.router_aux_loss_coef
    } else {
        0.0
    };
    let aux = router
        .aux_loss(moe.num_experts_per_tok, None, coef)
        .unwrap()
        .unwrap();
    let total = ((sum / n as f64).unwrap() + (&aux * coef).unwrap()).unwrap();
    (total, scalar(&aux.reshape(1).unwrap()))
}

/// Mixtral (Hub layout), Qwen2-MoE (shared expert; the loss includes the auxiliary loss), Qwen3-MoE (a dense
/// layer among sparse ones; transformers 5's fused 3-D layout) and gpt-oss (attention sinks and biases, a sliding
/// layer shorter than the sequence, YaRN, a router with a bias, interleaved experts with biases and a clamp the
/// activations reach): logits, loss, auxiliary loss and the input gradients with and without checkpointing equal
/// transformers'. In float64 at [`F64_TOLERANCE`]; in float32 within the float32 bound of the decoder's chain (a
/// backward runs it twice).
#[test]
fn tiny_moe_models_match_transformers() {
    for name in MOE_MODELS.into_iter().chain([GPT_OSS]) {
        let g = model_golden(name);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        for dtype in [DType::F64, DType::F32] {
            let model = load_moe_in(name, None, dtype);
            let check = |what: &str, chains: usize, got: &Tensor, expected: &Tensor| {
                let what = format!("{name} ({dtype:?}): {what}");
                match dtype {
                    DType::F64 => assert_f64_close(&what, got, expected),
                    _ => assert_f32_within_bound(&what, &model, (19, chains), got, expected),
                }
            };
            check("logits", 1, &model.logits(&ids).unwrap(), &g["logits_f64"]);
            let embeds = Var::from_tensor(&model.embed(&ids).unwrap()).unwrap();
            for checkpointing in [false, true] {
                let (loss, aux) = moe_loss(&model, embeds.as_tensor(), &ids, checkpointing);
                let what = |w: &str| format!("{w} (checkpointing {checkpointing})");
                let got = loss.reshape(1).unwrap();
                check(&what("loss"), 1, &got, &g["loss_f64"]);
                let got = Tensor::new(&[aux], &Device::Cpu).unwrap();
                check(&what("auxiliary loss"), 1, &got, &g["aux_loss_f64"]);
                let grads = loss.backward().unwrap();
                let got = grads.get(&embeds).unwrap();
                check(
                    &what("input gradient"),
                    2,
                    got,
                    &g["grad_inputs_embeds_f64"],
                );
            }
        }
    }
}

/// GGUF mixtures of experts as llama.cpp writes them (`qwen2moe` with the shared expert, `qwen3moe`, Mixtral as
/// `llama` with experts and permuted q/k; experts stacked in `ffn_{gate,up,down}_exps`, `scripts/golden_moe.py
/// gguf`): the configuration from the metadata and the logits equal transformers' (which loads the Qwen files into
/// the HF models bit for bit; the Mixtral file holds the HF folder's tensors under transformers' un-permutation) —
/// computed in float64 at [`F64_TOLERANCE`]: the files hold the folders' float32 values exactly (their epsilon
/// rounded to float32 moves the logits by ~1e-12); quantized on load, the experts are NF4, the router stays dense,
/// and the model equals the one quantized from the HF folder.
#[test]
fn gguf_mixtures_of_experts_match_transformers() {
    for (golden_of, file, model_type) in [
        ("tiny-mixtral", "models/tiny-mixtral/model.gguf", "mixtral"),
        (
            "tiny-qwen2-moe",
            "models/tiny-qwen2-moe/model.gguf",
            "qwen2_moe",
        ),
        (
            "tiny-qwen3-moe-gguf",
            "models/tiny-qwen3-moe-gguf/model.gguf",
            "qwen3_moe",
        ),
    ] {
        let g = model_golden(golden_of);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let path = data_path(file).display().to_string();
        let f64_options = LoadOptions {
            compute_dtype: DType::F64,
            ..Default::default()
        };
        let model = load_model(&path, None, &f64_options).unwrap().model;
        let moe = model.config().moe.clone().unwrap();
        assert_eq!((moe.num_experts, moe.num_experts_per_tok), (4, 2), "{file}");
        assert_eq!(moe.norm_topk_prob, !golden_of.contains("qwen2"), "{file}");
        assert_eq!(
            model.config().architecture.model_type(),
            model_type,
            "{file}"
        );
        let got = model.logits(&ids).unwrap();
        assert_f64_close(&format!("{file}: logits"), &got, &g["logits_f64"]);

        let nf4 = LoadOptions {
            quantization: Some(QuantConfig::nf4()),
            ..Default::default()
        };
        let quantized = load_model(&path, None, &nf4).unwrap().model;
        assert!(
            is_nf4(&quantized, "model.layers.1.mlp.experts.2.gate_up_proj"),
            "{file}"
        );
        assert!(
            !is_nf4(&quantized, "model.layers.0.mlp.gate"),
            "{file}: the router stays dense"
        );
        if golden_of != "tiny-qwen3-moe-gguf" {
            // The same float32 weights quantized the same way as from the model's folder.
            let folder = load_moe(golden_of, Some(QuantConfig::nf4()));
            let d = max_abs_diff(
                &quantized.logits(&ids).unwrap(),
                &folder.logits(&ids).unwrap(),
            );
            assert!(
                d <= 1e-6,
                "{file}: NF4 logits differ from the folder's by {d}"
            );
        }
    }
}

/// PEFT's adapters on the router, every expert (`target_parameters`; gpt-oss's interleaved ones too) and the
/// linear modules load with PEFT's logits, save back to PEFT's exact tensors, and merge (through the command's
/// library call) into a folder transformers reads (gpt-oss: its 3-D expert layout), with PEFT's merged logits.
/// Computed in float64: the adapted logits at [`F64_TOLERANCE`]; the merged folder stores its weights as float32
/// (the merge's output dtype), one float32 rounding of every weight, so its logits within the float32 bound of one
/// pass of the decoder.
#[test]
fn peft_expert_adapters_load_save_and_merge() {
    for name in MOE_MODELS.into_iter().chain([GPT_OSS]) {
        let g = model_golden(name);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let peft_dir = data_path(&format!("models/{name}/adapter"));
        let mut model = load_moe_in(name, None, DType::F64);
        load_adapter(&mut model, &peft_dir, "default").unwrap();
        let got = model.logits(&ids).unwrap();
        let what = format!("{name}: logits with PEFT's adapter");
        assert_f64_close(&what, &got, &g["logits_adapter_f64"]);

        let dir = tempfile::tempdir().unwrap();
        save_adapter(&model, "default", dir.path(), None).unwrap();
        let ours =
            candle_core::safetensors::load(dir.path().join(ADAPTER_WEIGHTS), &Device::Cpu).unwrap();
        let theirs =
            candle_core::safetensors::load(peft_dir.join(ADAPTER_WEIGHTS), &Device::Cpu).unwrap();
        let mut keys: Vec<&String> = ours.keys().collect();
        keys.sort();
        let mut expected: Vec<&String> = theirs.keys().collect();
        expected.sort();
        assert_eq!(keys, expected, "{name}: saved keys");
        for (k, t) in &theirs {
            assert_eq!(
                max_abs_diff(&ours[k], t),
                0.0,
                "{name}: `{k}` changed on the round trip"
            );
        }

        let merged = dir.path().join("merged");
        let options = MergeOptions {
            dtype: DType::F32,
            requantize: None,
            overwrite: false,
        };
        let source = data_path(&format!("models/{name}"));
        merge_to_folder(&model, None, Some(&source), &merged, &options).unwrap();
        let f64_options = LoadOptions {
            compute_dtype: DType::F64,
            ..Default::default()
        };
        let merged_model = load_model(merged.to_str().unwrap(), None, &f64_options)
            .unwrap()
            .model;
        let got = merged_model.logits(&ids).unwrap();
        let what = format!("{name}: merged logits (float32 weights) against PEFT's merge");
        assert_f32_within_bound(&what, &merged_model, (19, 1), &got, &g["logits_merged_f64"]);
    }
}

/// Target modules that match nothing in a mixture get advice that works: the linear modules it lists are ones
/// `target_modules` adapts (never the router or the experts, parameters to PEFT), and the `target_parameters` it
/// gives — with the family's router name (gpt-oss: `mlp.router`) — adapt the router and the experts of every
/// sparse layer.
#[test]
fn the_advice_for_targets_that_match_nothing_adapts_what_it_names() {
    for name in MOE_MODELS.into_iter().chain([GPT_OSS]) {
        let model = load_moe(name, None);
        let config = |targets: &[&str], parameters: Option<Vec<String>>| LoraConfig {
            target_modules: Some(TargetModules::List(
                targets.iter().map(|t| t.to_string()).collect(),
            )),
            target_parameters: parameters,
            ..Default::default()
        };
        let err = model
            .adapter_slots(&config(&["nothing"], None))
            .unwrap_err()
            .to_string();
        // Each listed module, alone, is adapted.
        let listed = err
            .split("its linear modules are ")
            .nth(1)
            .and_then(|rest| rest.split(" (e.g.").next())
            .unwrap_or_else(|| panic!("{name}: no module list in {err}"));
        for module in listed.split(", ") {
            let slots = model.adapter_slots(&config(&[module], None));
            assert!(
                slots.is_ok_and(|s| !s.is_empty()),
                "{name}: `{module}` is listed but adapts nothing: {err}"
            );
        }
        // The advised parameters adapt the router and both expert projections of every sparse layer.
        let advised = err
            .split("target_parameters = ")
            .nth(1)
            .and_then(|rest| rest.split(']').next())
            .unwrap_or_else(|| panic!("{name}: no target_parameters in {err}"));
        let parameters: Vec<String> = serde_json::from_str(&format!("{advised}]")).unwrap();
        let slots = model
            .adapter_slots(&config(&["nothing"], Some(parameters)))
            .unwrap();
        let router = match name {
            GPT_OSS => "mlp.router",
            _ => "mlp.gate",
        };
        let moe = model.config().moe.clone().unwrap();
        let sparse = (0..model.config().num_hidden_layers).filter(|&l| moe.sparse_layers[l]);
        for layer in sparse {
            for part in [
                router,
                "mlp.experts.0.gate_up_proj",
                "mlp.experts.0.down_proj",
            ] {
                let module = format!("model.layers.{layer}.{part}");
                assert!(
                    slots.iter().any(|s| s.module == module),
                    "{name}: the advice {advised}] leaves `{module}` out"
                );
            }
        }
    }
}

/// gpt-oss's MXFP4 checkpoint (`*_blocks` / `*_scales`) loads with the logits of transformers' own dequantization
/// of its bytes (exact values: compared in float64 at [`F64_TOLERANCE`]), and in 4 bits with NF4 experts and a dense
/// router.
#[test]
fn gpt_oss_mxfp4_checkpoints_match_transformers() {
    let mxfp4 = "tiny-gpt-oss-mxfp4";
    let golden = model_golden(mxfp4);
    let ids = golden["input_ids"].to_dtype(DType::U32).unwrap();
    let model = load_moe_in(mxfp4, None, DType::F64);
    let got = model.logits(&ids).unwrap();
    assert_f64_close("MXFP4 logits", &got, &golden["logits_f64"]);
    let quantized = load_moe_in(mxfp4, Some(QuantConfig::nf4()), DType::F64);
    assert!(is_nf4(
        &quantized,
        "model.layers.1.mlp.experts.3.gate_up_proj"
    ));
    assert!(
        !is_nf4(&quantized, "model.layers.0.mlp.router"),
        "the router stays dense"
    );
    let loss_of = |m: &LlamaModel| {
        let (loss, _) = moe_loss(m, &m.embed(&ids).unwrap(), &ids, false);
        scalar(&loss.reshape(1).unwrap())
    };
    let (nf4, dense) = (loss_of(&quantized), loss_of(&model));
    // The loss includes 0.1 × the auxiliary loss, which steps when rounding moves a token to another expert.
    assert!(
        (nf4 - dense).abs() < 0.1,
        "NF4 loss {nf4} vs the MXFP4 weights' {dense}"
    );
}

/// Loaded in 4 bits, every expert is NF4 on its own and the router stays dense (as transformers keeps it): the
/// logits and the loss (with the auxiliary loss where the config asks) equal transformers' model on bitsandbytes'
/// NF4 of the same weights (each expert's gate/up and down quantized on their own, by its CPU kernels), both in
/// float64 at [`F64_TOLERANCE`]; and the model still computes nearly the unquantized loss.
#[test]
fn experts_quantize_on_load_and_the_router_stays_dense() {
    for name in MOE_MODELS {
        let g = model_golden(name);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let model = load_moe_in(name, Some(nf4_like_bitsandbytes_cpu()), DType::F64);
        let kind = |n: &str| is_nf4(&model, n);
        let moe = model.config().moe.clone().unwrap();
        for layer in 0..model.config().num_hidden_layers {
            let p = format!("model.layers.{layer}");
            if moe.sparse_layers[layer] {
                assert!(kind(&format!("{p}.mlp.experts.3.gate_up_proj")), "{name}");
                assert!(kind(&format!("{p}.mlp.experts.0.down_proj")), "{name}");
                assert!(
                    !kind(&format!("{p}.mlp.gate")),
                    "{name}: the router stays dense"
                );
            } else {
                assert!(
                    kind(&format!("{p}.mlp.gate_proj")),
                    "{name}: the dense layer's MLP"
                );
            }
        }
        let got = model.logits(&ids).unwrap();
        assert_f64_close(&format!("{name}: NF4 logits"), &got, &g["logits_nf4_f64"]);
        let (loss, _) = moe_loss(&model, &model.embed(&ids).unwrap(), &ids, false);
        let loss = scalar(&loss.reshape(1).unwrap());
        let what = format!("{name}: NF4 loss");
        assert_f64_scalar_close(&what, loss, scalar(&g["loss_nf4_f64"]));
        let unquantized = scalar(&g["loss_f64"]);
        assert!(
            (loss - unquantized).abs() < 0.05,
            "{name}: NF4 loss {loss} vs unquantized {unquantized}"
        );
    }
}

/// A bitsandbytes 4-bit folder of each mixture (as `qlora quantize` writes it: every expert in 4 bits, the router
/// left as stored) loads with NF4 experts and a dense router, as close to the unquantized model as quantizing on
/// load (per-expert 4-bit tensors are dequantized and each expert's gate and up quantized again as one tensor, which
/// adds at most one more rounding). Both computed in float64 and measured against transformers' float64 logits, so
/// only the quantization differs.
#[test]
fn bitsandbytes_folders_of_mixtures_load_with_4_bit_experts() {
    use candle_qlora::loading::bnb::{quantize_path, QuantizeOptions};
    for name in MOE_MODELS {
        let g = model_golden(name);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let bnb = dir.path().join("bnb");
        quantize_path(
            &data_path(&format!("models/{name}")),
            &bnb,
            &QuantizeOptions::default(),
        )
        .unwrap();
        let stored =
            candle_core::safetensors::load(bnb.join("model.safetensors"), &Device::Cpu).unwrap();
        assert!(
            stored.keys().all(|k| !k.contains(".gate.weight.absmax")),
            "{name}: a router was quantized"
        );
        // As `qlora train` loads it (`load_in_4bit`): 4-bit tensors as stored, the others (transformers 5's fused
        // 3-D experts, which bitsandbytes leaves alone) quantized on load.
        let options = LoadOptions {
            quantization: Some(QuantConfig::nf4()),
            compute_dtype: DType::F64,
            ..Default::default()
        };
        let from_folder = load_model(bnb.to_str().unwrap(), None, &options)
            .unwrap()
            .model;
        let linears = from_folder.linears();
        for (n, l) in &linears {
            let four_bit = matches!(l.base.weight, FrozenWeight::Nf4(_));
            assert_eq!(four_bit, !n.ends_with(".mlp.gate"), "{name}: {n}");
        }
        let on_load = load_moe_in(name, Some(QuantConfig::nf4()), DType::F64);
        let error = |m: &LlamaModel| max_abs_diff(&m.logits(&ids).unwrap(), &g["logits_f64"]);
        let (folder, quantized_on_load) = (error(&from_folder), error(&on_load));
        assert!(
            folder <= 2.0 * quantized_on_load,
            "{name}: the 4-bit folder's logits are {folder} from the unquantized model's, quantizing on load {quantized_on_load}"
        );
    }
}

/// `qlora train` on Qwen2-MoE and on gpt-oss straight from its MXFP4 checkpoint (NF4 experts, checkpointed layers,
/// the auxiliary loss on) with adapters on the attention, Qwen2-MoE's shared expert, the router and every expert:
/// the loss falls, `aux_loss` is logged, the adapter is in PEFT's layout, `qlora merge` reproduces the adapted model
/// and `qlora generate` runs with it. With `QLORA_PEFT_CHECK_DIR=DIR` each adapter and our float32 logits are
/// copied to `DIR/trained-<model>` for `scripts/golden_moe.py check-ours`.
#[test]
fn mixtures_train_and_merge_through_the_command() {
    let qwen2_keys = [
        "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight",
        "base_model.model.model.layers.1.mlp.experts.lora_B.weight",
        "base_model.model.model.layers.1.mlp.gate.lora_A.weight",
        "base_model.model.model.layers.1.mlp.shared_expert_gate.lora_B.weight",
    ];
    let gpt_oss_keys = [
        "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight",
        "base_model.model.model.layers.1.mlp.experts.lora_B.weight",
        "base_model.model.model.layers.1.mlp.router.lora_A.weight",
        "base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight",
    ];
    for (name, router, keys) in [
        ("tiny-qwen2-moe", "mlp.gate", qwen2_keys),
        ("tiny-gpt-oss-mxfp4", "mlp.router", gpt_oss_keys),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let model = data_path(&format!("models/{name}"));
        let lines: Vec<String> = (0..8)
            .map(|i| {
                let words: Vec<String> = (0..(8 + i))
                    .map(|j| format!("t{}", 1 + (i + 2 * j) % 100))
                    .collect();
                format!("{{\"text\": \"{}\"}}", words.join(" "))
            })
            .collect();
        std::fs::write(dir.path().join("train.jsonl"), lines.join("\n")).unwrap();
        let out = dir.path().join("out");
        let config = dir.path().join("run.toml");
        std::fs::write(
            &config,
            format!(
                "[model]\nname_or_path = {:?}\n[model.quantization]\nload_in_4bit = true\n\
                 [lora]\nr = 4\nlora_alpha = 8\ntarget_modules = \"all-linear\"\n\
                 target_parameters = [\"{router}.weight\", \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]\n\
                 [data]\ntrain_file = \"train.jsonl\"\n\
                 [training]\noutput_dir = {:?}\nper_device_train_batch_size = 4\nmax_steps = 4\nlogging_steps = 1\n\
                 learning_rate = 2e-2\ngradient_checkpointing = true\nsave_strategy = \"no\"\n",
                model.to_str().unwrap(),
                out.to_str().unwrap()
            ),
        )
        .unwrap();
        qlora(&["train", "--config", config.to_str().unwrap()]);
        let entries: Vec<serde_json::Value> = std::fs::read_to_string(out.join("log.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .filter(|v: &serde_json::Value| v.get("loss").is_some())
            .collect();
        let loss: Vec<f64> = entries
            .iter()
            .map(|v| v["loss"].as_f64().unwrap())
            .collect();
        assert!(
            loss.len() == 4 && loss[3] < loss[0],
            "{name}: the loss did not fall: {loss:?}"
        );
        assert!(
            entries
                .iter()
                .all(|v| v["aux_loss"].as_f64().is_some_and(|a| a > 0.0)),
            "{name}: aux_loss is logged at every step: {entries:?}"
        );
        let tensors =
            candle_core::safetensors::load(out.join(ADAPTER_WEIGHTS), &Device::Cpu).unwrap();
        for key in keys {
            assert!(
                tensors.contains_key(key),
                "{name}: no `{key}` in {:?}",
                tensors.keys()
            );
        }
        let g = model_golden(name);
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let mut adapted = load_moe(name, None);
        load_adapter(&mut adapted, &out, "default").unwrap();
        let logits = adapted.logits(&ids).unwrap();
        merge_and_generate(name, &model, &out, &ids, &adapted);
        if let Some(check) = std::env::var_os("QLORA_PEFT_CHECK_DIR") {
            let target = std::path::Path::new(&check).join(format!("trained-{name}"));
            save_adapter(&adapted, "default", &target, None).unwrap();
            candle_core::safetensors::save(
                &HashMap::from([("logits".to_string(), logits)]),
                target.join("logits.safetensors"),
            )
            .unwrap();
        }
    }
}
