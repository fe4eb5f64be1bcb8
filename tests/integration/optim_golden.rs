//! Optimizers, clipping and schedules against golden files from `scripts/golden_optim.py`: a float32 emulation
//! of bitsandbytes' CUDA 8-bit and 32-bit AdamW kernels, `torch.optim.AdamW`/`SGD`, `clip_grad_norm_`, and
//! transformers' `get_scheduler`.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_qlora::optim::adamw::adamw_bnb32_update;
use candle_qlora::optim::adamw8bit::{adamw8bit_update, Adam8bitState, Adam8bitStep};
use candle_qlora::optim::schedule::{Schedule, SchedulerType};
use candle_qlora::optim::{clip_grad_norm, Optimizer, OptimizerConfig, OptimizerName};

use crate::common::{data_path, max_abs_diff};

fn load(name: &str) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(
        data_path(&format!("optim/{name}.safetensors")),
        &Device::Cpu,
    )
    .unwrap()
}

fn f32s(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

fn map(t: &Tensor) -> [f32; 256] {
    f32s(t).try_into().unwrap()
}

#[test]
fn eight_bit_adamw_matches_the_bitsandbytes_kernel_emulation() {
    let g = load("adamw8bit");
    let (q1, q2) = (map(&g["qmap1"]), map(&g["qmap2"]));
    assert_eq!(q1, candle_qlora::quant::dynamic_map::signed_map());
    assert_eq!(q2, candle_qlora::quant::dynamic_map::unsigned_map());
    for n in [1000usize, 4096, 5000, 8448] {
        for (prefix, wd) in [("wd0", 0.0f32), ("wd001", 0.01)] {
            let mut p = f32s(&g[&format!("p0.{n}")]);
            let grads = g[&format!("grads.{n}")].to_vec2::<f32>().unwrap();
            let mut state = Adam8bitState::zeros(n);
            for (k, grad) in grads.iter().enumerate() {
                let h = Adam8bitStep {
                    step: k as u64 + 1,
                    lr: 2e-3,
                    betas: (0.9, 0.999),
                    eps: 1e-8,
                    weight_decay: wd,
                    qmap1: &q1,
                    qmap2: &q2,
                };
                adamw8bit_update(&mut p, grad, &mut state, &h);
            }
            let case = format!("{prefix} n={n}");
            let u8s = |k: &str| g[&format!("{prefix}.{k}.{n}")].to_vec1::<u8>().unwrap();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(state.state1, u8s("state1"), "{case}: state1 codes");
            assert_eq!(state.state2, u8s("state2"), "{case}: state2 codes");
            assert_eq!(
                bits(&state.absmax1),
                bits(&f32s(&g[&format!("{prefix}.absmax1.{n}")])),
                "{case}: absmax1"
            );
            assert_eq!(
                bits(&state.absmax2),
                bits(&f32s(&g[&format!("{prefix}.absmax2.{n}")])),
                "{case}: absmax2"
            );
            let expected = f32s(&g[&format!("{prefix}.p.{n}")]);
            let d = p
                .iter()
                .zip(&expected)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(d <= 1e-6, "{case}: parameters differ by {d}");
        }
    }
}

/// Through the `Optimizer` API: tensors ≥ min_8bit_size use the 8-bit kernel, smaller ones the 32-bit kernel.
#[test]
fn optimizer_api_picks_8bit_or_32bit_state_like_bitsandbytes() {
    let g8 = load("adamw8bit");
    let g32 = load("adamw32");
    for (n, expected) in [
        (5000usize, g8["wd001.p.5000"].clone()),
        (1000, g32["bnb32.p.1000"].clone()),
    ] {
        let var = Var::from_tensor(&g8[&format!("p0.{n}")]).unwrap();
        let cfg = OptimizerConfig {
            name: OptimizerName::PagedAdamW8bit,
            weight_decay: 0.01,
            ..Default::default()
        };
        let mut opt = Optimizer::new(vec![("w".into(), var.clone())], cfg).unwrap();
        let grads = g8[&format!("grads.{n}")].to_vec2::<f32>().unwrap();
        for row in grads {
            let mut store = GradStore::default();
            store.insert(&var, Tensor::from_vec(row, n, &Device::Cpu).unwrap());
            opt.step(&store, 2e-3).unwrap();
        }
        let d = max_abs_diff(var.as_tensor(), &expected);
        assert!(d <= 1e-6, "n={n}: {d}");
    }
}

#[test]
fn thirty_two_bit_kernels_match_torch_and_bitsandbytes() {
    let g8 = load("adamw8bit");
    let g = load("adamw32");
    for n in [1000usize, 5000] {
        let grads = if n == 1000 {
            g8["grads.1000"].clone()
        } else {
            g["grads_clean.5000"].clone()
        };
        let rows = grads.to_vec2::<f32>().unwrap();
        // torch.optim.AdamW through the Optimizer API.
        let var = Var::from_tensor(&g8[&format!("p0.{n}")]).unwrap();
        let cfg = OptimizerConfig {
            name: OptimizerName::AdamWTorch,
            weight_decay: 0.01,
            ..Default::default()
        };
        let mut opt = Optimizer::new(vec![("w".into(), var.clone())], cfg).unwrap();
        for row in &rows {
            let mut store = GradStore::default();
            store.insert(
                &var,
                Tensor::from_vec(row.clone(), n, &Device::Cpu).unwrap(),
            );
            opt.step(&store, 2e-3).unwrap();
        }
        let d = max_abs_diff(var.as_tensor(), &g[&format!("torch.p.{n}")]);
        assert!(d <= 1e-6, "adamw_torch n={n}: {d}");
        // bitsandbytes' 32-bit kernel.
        let mut p = f32s(&g8[&format!("p0.{n}")]);
        let (mut s1, mut s2) = (vec![0f32; n], vec![0f32; n]);
        for (k, row) in rows.iter().enumerate() {
            adamw_bnb32_update(
                &mut p,
                row,
                &mut s1,
                &mut s2,
                k as u64 + 1,
                2e-3,
                (0.9, 0.999),
                1e-8,
                0.01,
            );
        }
        let p_t = Tensor::from_vec(p, n, &Device::Cpu).unwrap();
        let d = max_abs_diff(&p_t, &g[&format!("bnb32.p.{n}")]);
        assert!(d <= 1e-6, "bnb 32-bit n={n}: {d}");
    }
}

#[test]
fn sgd_with_momentum_matches_torch() {
    let g = load("sgd");
    let var = Var::from_tensor(&g["p0"]).unwrap();
    let cfg = OptimizerConfig {
        name: OptimizerName::Sgd,
        momentum: 0.9,
        weight_decay: 0.01,
        ..Default::default()
    };
    let mut opt = Optimizer::new(vec![("w".into(), var.clone())], cfg).unwrap();
    for k in 0..20 {
        let mut store = GradStore::default();
        store.insert(&var, g["grads"].get(k).unwrap());
        opt.step(&store, 0.05).unwrap();
    }
    assert!(max_abs_diff(var.as_tensor(), &g["p"]) <= 1e-6);
}

#[test]
fn clipping_matches_clip_grad_norm() {
    let g = load("clip");
    for case in ["big", "small"] {
        let vars: Vec<Var> = (0..3)
            .map(|i| {
                Var::from_tensor(&g[&format!("{case}.grad.{i}")].zeros_like().unwrap()).unwrap()
            })
            .collect();
        let mut store = GradStore::default();
        for (i, v) in vars.iter().enumerate() {
            store.insert(v, g[&format!("{case}.grad.{i}")].clone());
        }
        let norm = clip_grad_norm(&vars, &mut store, 1.0).unwrap();
        let expected = g[&format!("{case}.total_norm_f64")]
            .to_dtype(candle_core::DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[0];
        assert!(
            (norm - expected).abs() <= 1e-9 * expected.max(1.0),
            "{case}: norm {norm} vs {expected}"
        );
        for (i, v) in vars.iter().enumerate() {
            let d = max_abs_diff(store.get(v).unwrap(), &g[&format!("{case}.clipped.{i}")]);
            assert!(d <= 1e-6, "{case} {i}: {d}");
        }
    }
}

#[test]
fn schedules_match_transformers_at_every_step() {
    let text = std::fs::read_to_string(data_path("optim/schedules.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let schedules = doc["schedules"].as_array().unwrap();
    let mut kinds = std::collections::BTreeSet::new();
    for s in schedules {
        let kind: SchedulerType = s["type"].as_str().unwrap().parse().unwrap();
        kinds.insert(s["type"].as_str().unwrap().to_string());
        let total = s["total"].as_u64().unwrap() as usize;
        let warmup =
            candle_qlora::optim::schedule::warmup_steps(s["warmup_arg"].as_f64().unwrap(), total);
        assert_eq!(warmup, s["warmup"].as_u64().unwrap() as usize, "{s}");
        let sched = Schedule::new(
            kind,
            s["base_lr"].as_f64().unwrap(),
            warmup,
            total,
            Some(&s["kwargs"]),
        )
        .unwrap();
        for (k, lr) in s["lrs"].as_array().unwrap().iter().enumerate() {
            let (ours, theirs) = (sched.lr_for_update(k + 1), lr.as_f64().unwrap());
            assert!(
                (ours - theirs).abs() <= 1e-12 * theirs.abs().max(1e-4),
                "{} {:?} update {}: {ours} vs {theirs}",
                s["type"],
                s["kwargs"],
                k + 1
            );
        }
    }
    assert_eq!(
        kinds.len(),
        9,
        "every lr_scheduler_type is covered: {kinds:?}"
    );
}
