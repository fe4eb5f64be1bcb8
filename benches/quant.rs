//! Quantize / dequantize throughput on a 4096×4096 bf16 matrix, as GB/s of bf16 data and as a ratio to a plain
//! memory copy of the same bytes measured in the same run.
//!
//! `cargo bench --bench quant` (criterion statistics first, then a side-by-side summary table).

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use candle_qlora::quant::{Nf4Tensor, QuantConfig};
use criterion::{Criterion, Throughput};

const ROWS: usize = 4096;
const COLS: usize = 4096;

fn weight() -> Tensor {
    Tensor::randn(0f32, 0.02, (ROWS, COLS), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap()
}

fn bf16_bytes() -> u64 {
    (ROWS * COLS * 2) as u64
}

fn criterion_benches(c: &mut Criterion, w: &Tensor, q: &Nf4Tensor) {
    let mut group = c.benchmark_group("nf4_4096x4096_bf16");
    group.throughput(Throughput::Bytes(bf16_bytes()));
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(8));
    let src = vec![0u8; bf16_bytes() as usize];
    let mut dst = vec![1u8; bf16_bytes() as usize];
    group.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    group.bench_function("quantize_nf4_dq", |b| {
        b.iter(|| Nf4Tensor::quantize(black_box(w), &QuantConfig::nf4()).unwrap())
    });
    group.bench_function("dequantize_to_bf16", |b| {
        b.iter(|| black_box(q).dequantize(DType::BF16).unwrap())
    });
    group.bench_function("dequantize_into_f32", |b| {
        let mut out = vec![0f32; ROWS * COLS];
        b.iter(|| black_box(q).dequantize_into(&mut out).unwrap())
    });
    group.finish();
}

/// Median wall time of `runs` calls.
fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect();
    times.sort();
    times[runs / 2]
}

fn side_by_side(w: &Tensor, q: &Nf4Tensor) {
    let bytes = bf16_bytes() as f64;
    let src = vec![0u8; bytes as usize];
    let mut dst = vec![1u8; bytes as usize];
    let mut out = vec![0f32; ROWS * COLS];
    let runs = 15;
    let memcpy = median(runs, || dst.copy_from_slice(black_box(&src)));
    let quant = median(runs, || {
        drop(black_box(
            Nf4Tensor::quantize(w, &QuantConfig::nf4()).unwrap(),
        ))
    });
    let deq = median(runs, || drop(black_box(q.dequantize(DType::BF16).unwrap())));
    let deq_f32 = median(runs, || q.dequantize_into(black_box(&mut out)).unwrap());
    println!(
        "\n4096x4096 bf16 ({:.0} MiB), median of {runs}, {} threads:",
        bytes / (1 << 20) as f64,
        rayon::current_num_threads()
    );
    println!(
        "{:<22} {:>10} {:>10} {:>16}",
        "operation", "ms", "GB/s", "time / memcpy"
    );
    for (name, t) in [
        ("memcpy", memcpy),
        ("quantize (nf4+dq)", quant),
        ("dequantize -> bf16", deq),
        ("dequantize -> f32", deq_f32),
    ] {
        println!(
            "{name:<22} {:>10.2} {:>10.2} {:>16.2}",
            t.as_secs_f64() * 1e3,
            bytes / t.as_secs_f64() / 1e9,
            t.as_secs_f64() / memcpy.as_secs_f64()
        );
    }
}

fn main() {
    let w = weight();
    let q = Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap();
    let mut c = Criterion::default().configure_from_args();
    criterion_benches(&mut c, &w, &q);
    c.final_summary();
    side_by_side(&w, &q);
}
