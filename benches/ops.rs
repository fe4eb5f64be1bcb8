//! The hot ops of a training step, forward + backward, each against a plain float32 matmul of the same FLOPs
//! measured in the same run (ratio 1.0 = the op runs at the speed of the GEMM it is made of):
//!
//! - the LoRA linear on an NF4 base (SmolLM2's gate projection: 1024 tokens × 576 → 1536, r = 16),
//! - causal GQA attention (batch 4 × 256 tokens, 9 query / 3 key-value heads of 64),
//! - the fused linear cross-entropy (1024 tokens, hidden 576, vocabulary 49 152).
//!
//! The backward is driven by `sum_all().backward()`, whose broadcast of ones into an output-sized gradient Candle
//! builds too; that costs a few milliseconds more than a real step pays, and is inside the op's time.
//! After criterion's own measurements, the summary table times op and GEMM alternately (`PAIRS` pairs) and prints
//! the medians and the median of the pairs' ratios.
//!
//! `cargo bench --bench ops`

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor, Var};
use candle_qlora::ops::attention::{causal_attention, QUERY_BLOCK};
use candle_qlora::ops::{linear_cross_entropy, FrozenLinear, FrozenWeight};
use candle_qlora::ops::{low_rank_linear, LowRank, OutputValue};
use candle_qlora::quant::{Nf4Tensor, QuantConfig};
use criterion::Criterion;

mod common;
use common::interleaved;

const TOKENS: usize = 1024;

fn randn(dims: &[usize], std: f32) -> Tensor {
    Tensor::randn(0f32, std, dims, &Device::Cpu).unwrap()
}

/// A plain GEMM `[m, 1024] × [1024, 1024]` with `m` chosen so it does `flops` floating-point operations.
fn reference_gemm(flops: f64) -> impl Fn() {
    let k = 1024usize;
    let m = (flops / (2.0 * (k * k) as f64)).round().max(1.0) as usize;
    let (a, b) = (randn(&[m, k], 1.0), randn(&[k, k], 1.0));
    move || {
        black_box(a.matmul(&b).unwrap());
    }
}

struct Case {
    name: &'static str,
    flops: f64,
    run: Box<dyn Fn()>,
}

fn lora_case() -> Case {
    let (inp, out, r) = (576, 1536, 16);
    let w = randn(&[out, inp], 0.02);
    let base = Arc::new(FrozenLinear::new(
        FrozenWeight::Nf4(Arc::new(
            Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap(),
        )),
        None,
    ));
    let x = Var::from_tensor(&randn(&[TOKENS, inp], 1.0)).unwrap();
    let a = Var::from_tensor(&randn(&[r, inp], 0.02)).unwrap();
    let b = Var::from_tensor(&randn(&[out, r], 0.02)).unwrap();
    // Forward x·Wᵀ, backward g·W; the rank-16 branch adds 2·2·n·r·(in+out) more, counted too.
    let (n, i, o, r) = (TOKENS as f64, inp as f64, out as f64, r as f64);
    let flops = 4.0 * n * i * o + 8.0 * n * r * (i + o);
    Case {
        name: "lora_linear_nf4_fwd_bwd",
        flops,
        run: Box::new(move || {
            let branch = LowRank {
                a: a.as_tensor(),
                b: b.as_tensor(),
                scaling: 2.0,
                dropout: None,
            };
            let y = low_rank_linear(&x, &base, &branch, OutputValue::Computed).unwrap();
            black_box(y.sum_all().unwrap().backward().unwrap());
        }),
    }
}

fn attention_case() -> Case {
    let (b, hq, hkv, t, d) = (4, 9, 3, 256, 64);
    let q = Var::from_tensor(&randn(&[b, hq, t, d], 1.0)).unwrap();
    let k = Var::from_tensor(&randn(&[b, hkv, t, d], 1.0)).unwrap();
    let v = Var::from_tensor(&randn(&[b, hkv, t, d], 1.0)).unwrap();
    // Per query block: scores and p·v forward, then scores again, dv, dp, dq, dk: seven matmuls of c × keys × d.
    let flops: f64 = (0..t)
        .step_by(QUERY_BLOCK)
        .map(|i0| {
            let c = QUERY_BLOCK.min(t - i0);
            7.0 * 2.0 * (b * hq * c * (i0 + c) * d) as f64
        })
        .sum();
    Case {
        name: "causal_gqa_attention_fwd_bwd",
        flops,
        run: Box::new(move || {
            let y = causal_attention(&q, &k, &v, 0.125).unwrap();
            black_box(y.sum_all().unwrap().backward().unwrap());
        }),
    }
}

fn cross_entropy_case() -> Case {
    let (h, vocab) = (576, 49_152);
    let hidden = Var::from_tensor(&randn(&[TOKENS, h], 1.0)).unwrap();
    let head = randn(&[vocab, h], 0.02);
    let labels = Tensor::from_vec(
        (0..TOKENS as i64)
            .map(|i| (i * 7919) % vocab as i64)
            .collect::<Vec<_>>(),
        TOKENS,
        &Device::Cpu,
    )
    .unwrap();
    // Logits and the hidden-state gradient (on the CPU both in the forward: the logits are never recomputed).
    let flops = 4.0 * (TOKENS * h * vocab) as f64;
    Case {
        name: "linear_cross_entropy_fwd_bwd",
        flops,
        run: Box::new(move || {
            let (sum, _) = linear_cross_entropy(&hidden, &head, &labels).unwrap();
            black_box(sum.to_dtype(DType::F32).unwrap().backward().unwrap());
        }),
    }
}

fn main() {
    let mut c = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(6))
        .configure_from_args();
    let mut summary = vec![];
    for case in [lora_case(), attention_case(), cross_entropy_case()] {
        let gemm = reference_gemm(case.flops);
        let mut group = c.benchmark_group(case.name);
        group.bench_function("op", |b| b.iter(&case.run));
        group.bench_function("same_flops_gemm", |b| b.iter(&gemm));
        group.finish();
        let (op_time, gemm_time, ratio) = interleaved(&case.run, &gemm);
        summary.push((case.name, case.flops, op_time, gemm_time, ratio));
    }
    println!("\n| op (forward + backward) | GFLOP | op ms | same-FLOPs GEMM ms | op / GEMM | op GFLOP/s |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, flops, op, gemm, ratio) in summary {
        println!(
            "| {name} | {:.2} | {:.1} | {:.1} | {ratio:.2} | {:.1} |",
            flops / 1e9,
            op * 1e3,
            gemm * 1e3,
            flops / op / 1e9
        );
    }
}
