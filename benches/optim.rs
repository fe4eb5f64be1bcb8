//! Optimizer step time on 10M parameters, `adamw_torch` (f32 state) vs `adamw_8bit` (bitsandbytes blockwise),
//! measured side by side in one run, and the state bytes per parameter.
//!
//! `cargo bench --bench optim`

use std::hint::black_box;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_core::{Device, Tensor, Var};
use candle_qlora::optim::{Optimizer, OptimizerConfig, OptimizerName};
use criterion::Criterion;

const N: usize = 10_000_000;

fn setup(name: OptimizerName) -> (Optimizer, GradStore) {
    let var = Var::randn(0f32, 0.02, N, &Device::Cpu).unwrap();
    let mut grads = GradStore::default();
    grads.insert(&var, Tensor::randn(0f32, 1e-3, N, &Device::Cpu).unwrap());
    let cfg = OptimizerConfig {
        name,
        weight_decay: 0.01,
        ..Default::default()
    };
    (Optimizer::new(vec![("w".into(), var)], cfg).unwrap(), grads)
}

fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[runs / 2]
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("optimizer_step_10M");
    group
        .sample_size(10)
        .measurement_time(Duration::from_secs(10));
    for name in [OptimizerName::AdamWTorch, OptimizerName::AdamW8bit] {
        let (mut opt, grads) = setup(name);
        group.bench_function(name.as_str(), |b| {
            b.iter(|| opt.step(black_box(&grads), 1e-3).unwrap())
        });
    }
    group.finish();
    c.final_summary();

    println!(
        "\n10M parameters, median of 7 steps, {} threads:",
        rayon::current_num_threads()
    );
    println!(
        "{:<14} {:>10} {:>18} {:>14}",
        "optim", "ms/step", "state bytes/param", "time / adamw"
    );
    let mut base = None;
    for name in [OptimizerName::AdamWTorch, OptimizerName::AdamW8bit] {
        let (mut opt, grads) = setup(name);
        opt.step(&grads, 1e-3).unwrap();
        let t = median(7, || opt.step(&grads, 1e-3).unwrap());
        let base_t = *base.get_or_insert(t);
        println!(
            "{:<14} {:>10.1} {:>18.3} {:>14.2}",
            name.as_str(),
            t.as_secs_f64() * 1e3,
            opt.state_bytes() as f64 / N as f64,
            t.as_secs_f64() / base_t.as_secs_f64()
        );
    }
}
