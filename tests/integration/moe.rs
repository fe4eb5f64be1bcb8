//! The mixture-of-experts block against transformers' own (`scripts/golden_moe.py`): Mixtral, Qwen2-MoE (shared
//! expert, no renormalization) and Qwen3-MoE (renormalized top-k), built from the per-expert tensors a Hub
//! checkpoint holds; and the auxiliary load-balancing loss.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{Device, Tensor, Var};
use candle_qlora::lora::{LoraAdapter, LoraLinear};
use candle_qlora::models::{load_balancing_loss, GateUpProjections, Mlp, SharedExpert, SparseMoe};
use candle_qlora::ops::{FrozenLinear, FrozenWeight, GateActivation};

use crate::common::{data_path, max_abs_diff};

/// LoRA's scaling in these tests.
const SCALING: f64 = 2.0;

fn frozen(w: &Tensor) -> LoraLinear {
    LoraLinear::new(Arc::new(FrozenLinear::new(
        FrozenWeight::Dense(w.clone()),
        None,
    )))
}

/// `linear` with a LoRA adapter of rank 3 whose B is zero (the output is the base's; B's gradient is
/// `SCALING · dL/dW · Aᵀ`) and A a fixed pseudo-random matrix.
fn with_adapter(mut linear: LoraLinear, w: &Tensor, seed: u32) -> (LoraLinear, Var, Tensor) {
    let (out, inp) = w.dims2().unwrap();
    let a: Vec<f32> = (0..3 * inp)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 1000.0 - 0.5)
        .collect();
    let a = Tensor::from_vec(a, (3, inp), &Device::Cpu).unwrap();
    let b = Var::zeros((out, 3), candle_core::DType::F32, &Device::Cpu).unwrap();
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

/// Each family's block, loaded from its per-expert tensors (with a zero-B adapter on the router and on expert 0's
/// down projection), gives transformers' output and router logits, the input gradient, and through the adapters
/// the router's and the expert's weight gradients, to float32 rounding (1e-5 of the largest value; 1e-4 for
/// gradients).
#[test]
fn moe_blocks_match_transformers() {
    for (family, [gate, up, down]) in [
        ("mixtral", ["w1", "w3", "w2"]),
        ("qwen2_moe", ["gate_proj", "up_proj", "down_proj"]),
        ("qwen3_moe", ["gate_proj", "up_proj", "down_proj"]),
    ] {
        let g = golden(family);
        let t = &g.t;
        let mlp = |prefix: &str, down_proj: LoraLinear| {
            Mlp::new(
                GateUpProjections::Separate {
                    gate_proj: frozen(&t[&format!("{prefix}.{gate}.weight")]),
                    up_proj: frozen(&t[&format!("{prefix}.{up}.weight")]),
                },
                down_proj,
                GateActivation::Silu,
            )
        };
        let (router, router_b, router_a) =
            with_adapter(frozen(&t["gate.weight"]), &t["gate.weight"], 1);
        let down0 = &t[&format!("experts.0.{down}.weight")];
        let (down0, down0_b, down0_a) = with_adapter(frozen(down0), down0, 2);
        let mut experts = vec![mlp("experts.0", down0)];
        for e in 1..8 {
            let p = format!("experts.{e}");
            experts.push(mlp(&p, frozen(&t[&format!("{p}.{down}.weight")])));
        }
        let shared = t.contains_key("shared_expert_gate.weight").then(|| {
            let [gate, up, down] = ["gate_proj", "up_proj", "down_proj"]
                .map(|p| frozen(&t[&format!("shared_expert.{p}.weight")]));
            SharedExpert {
                mlp: Mlp::new(
                    GateUpProjections::Separate {
                        gate_proj: gate,
                        up_proj: up,
                    },
                    down,
                    GateActivation::Silu,
                ),
                gate: frozen(&t["shared_expert_gate.weight"]),
            }
        });
        assert_eq!(shared.is_some(), family == "qwen2_moe");
        let block = SparseMoe::new(router, experts, shared, g.top_k, g.norm_topk_prob).unwrap();
        let x = Var::from_tensor(&t["x"]).unwrap();
        let (out, logits) = block.forward(x.as_tensor()).unwrap();
        // Relative to the largest expected value (at least 1): the gradients reach tens here.
        let close = |what: &str, a: &Tensor, b: &Tensor, tol: f64| {
            let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
            let scale = f64::from(scale.to_scalar::<f32>().unwrap()).max(1.0);
            let d = max_abs_diff(a, b) / scale;
            assert!(
                d < tol,
                "{family}: {what} differs by {d} (relative to {scale})"
            );
        };
        close("output", &out, &t["out"], 1e-5);
        close("router logits", &logits, &t["router_logits"], 1e-5);
        let grads = (out * &t["upstream"])
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        close("input gradient", grads.get(&x).unwrap(), &t["grad_x"], 1e-4);
        // dL/dB = s · dL/dW · Aᵀ for an adapter with B = 0.
        let expected = |grad_w: &Tensor, a: &Tensor| {
            (grad_w.matmul(&a.t().unwrap()).unwrap() * SCALING).unwrap()
        };
        close(
            "router gradient",
            grads.get(&router_b).unwrap(),
            &expected(&t["grad_router"], &router_a),
            1e-4,
        );
        close(
            "expert 0 down-projection gradient",
            grads.get(&down0_b).unwrap(),
            &expected(&t["grad_expert0_down"], &down0_a),
            1e-4,
        );
        if family == "qwen2_moe" {
            assert_eq!(
                g.experts_hit, 7,
                "one expert gets no token: the block skips it"
            );
        }
    }
}

/// transformers' load-balancing loss of two layers' router logits, and its gradient.
#[test]
fn load_balancing_loss_matches_transformers() {
    let t = golden("qwen3_moe").t;
    let l0 = Var::from_tensor(&t["aux_logits_0"]).unwrap();
    let loss =
        load_balancing_loss(&[l0.as_tensor().clone(), t["aux_logits_1"].clone()], 2).unwrap();
    let expected = t["aux_loss"].flatten_all().unwrap();
    assert!(max_abs_diff(&loss.reshape(1).unwrap(), &expected) < 1e-6);
    let grads = loss.backward().unwrap();
    let d = max_abs_diff(grads.get(&l0).unwrap(), &t["grad_aux_logits_0"]);
    assert!(d < 1e-6, "gradient differs by {d}");
}
