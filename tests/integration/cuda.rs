//! On a CUDA GPU (built with `--features cuda`; run where a GPU answers): the memory pool's statistics, 4-bit weights
//! dequantized on the GPU, training on the GPU against the same run on the CPU, and the out-of-memory report on a
//! real allocation failure of the device.

use candle_core::{DType, Device, Tensor};
use candle_qlora::data::TokenizedExample;
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::memory::{reset_device_peak, stats};
use candle_qlora::optim::OptimizerName;
use candle_qlora::precision::is_bf16_supported;
use candle_qlora::quant::{DeviceNf4, Nf4Tensor, QuantConfig};
use candle_qlora::trainer::{Trainer, TrainingArguments};
use candle_qlora::Error;

use crate::common::data_path;

/// GPU 0, opened once: every `Device::new_cuda` is a device of its own (ids, cuBLAS handle, loaded modules), and
/// tensors of two of them do not mix.
fn gpu() -> Device {
    static GPU: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    GPU.get_or_init(|| Device::new_cuda(0).expect("these tests need a CUDA GPU (cuda:0)"))
        .clone()
}

/// The half-precision dtypes GPU 0 computes in: float16 everywhere, bfloat16 where the GPU and the build have it
/// (not a T4 or its build, `CUDA_COMPUTE_CAP=75`, which the emulated device runs as such too).
fn half_dtypes() -> Vec<DType> {
    if is_bf16_supported(&gpu()) {
        vec![DType::BF16, DType::F16]
    } else {
        vec![DType::F16]
    }
}

/// The dtypes GPU 0 computes in: float32 and [`half_dtypes`].
fn gpu_dtypes() -> Vec<DType> {
    [vec![DType::F32], half_dtypes()].concat()
}

/// The dtype a QLoRA user of GPU 0 trains in: bfloat16, or float16 where it has none.
fn training_half() -> DType {
    half_dtypes()[0]
}

/// `args` set to train in [`training_half`] (`bf16` or `fp16`).
fn in_training_half(args: TrainingArguments) -> TrainingArguments {
    TrainingArguments {
        bf16: training_half() == DType::BF16,
        fp16: training_half() == DType::F16,
        ..args
    }
}

#[test]
fn pool_statistics_follow_allocations() {
    let dev = gpu();
    let before = stats(&dev);
    assert_eq!(before.device, "cuda:0");
    let (total, free) = (before.total.unwrap(), before.available.unwrap());
    assert!(total > 1 << 30 && free <= total, "{before:?}");

    let gib = 1usize << 30;
    let t = Tensor::zeros(gib / 4, DType::F32, &dev).unwrap();
    let during = stats(&dev);
    let grown = during.allocated.unwrap() - before.allocated.unwrap();
    assert!(grown >= gib as u64, "1 GiB tensor, pool grew by {grown}");
    assert!(during.peak_allocated.unwrap() >= during.allocated.unwrap());
    assert!(during.reserved.unwrap() >= during.allocated.unwrap());
    assert!(during.available.unwrap() + (gib as u64) <= free + (64 << 20));

    drop(t);
    let after = stats(&dev);
    assert!(
        after.allocated.unwrap() < during.allocated.unwrap() - gib as u64 / 2,
        "freed: {after:?}"
    );
    assert!(after.peak_allocated.unwrap() >= during.allocated.unwrap());
    assert!(reset_device_peak(&dev, false));
    let reset = stats(&dev);
    assert!(
        reset.peak_allocated.unwrap() < during.allocated.unwrap(),
        "peak after reset: {reset:?}"
    );
}

/// Float32 bits of a tensor (any float dtype, any device), for bit-for-bit comparisons.
fn bits(t: &Tensor) -> Vec<u32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// The dequantization kernel equals the CPU kernel bit for bit: NF4 and FP4, plain and nested scales, element
/// counts that end in a partial block and a half byte, every output dtype.
#[test]
fn four_bit_weights_dequantize_on_the_gpu_bit_for_bit() {
    use candle_qlora::quant::QuantType;
    let dev = gpu();
    for (quant_type, double_quant, shape) in [
        (QuantType::Nf4, true, (576, 1536)),
        (QuantType::Nf4, false, (3, 333)),
        (QuantType::Fp4, true, (7, 4097)),
        (QuantType::Fp4, false, (1, 64)),
    ] {
        let w = Tensor::randn(0f32, 1.0, shape, &Device::Cpu).unwrap();
        let config = QuantConfig {
            quant_type,
            double_quant,
            ..QuantConfig::nf4()
        };
        let q = Nf4Tensor::quantize(&w, &config).unwrap();
        let on_gpu = DeviceNf4::new(&q, &dev).unwrap();
        for dtype in gpu_dtypes() {
            let got = on_gpu.dequantize(dtype).unwrap();
            assert!(got.device().is_cuda() && got.dtype() == dtype);
            assert_eq!(
                bits(&got),
                bits(&q.dequantize(dtype).unwrap()),
                "{quant_type:?} double={double_quant} {shape:?} {dtype:?}"
            );
        }
    }
}

/// The quantization kernel (what a rank of a sharded load quantizes its part of a weight with) gives the CPU
/// kernel's codes and absmax bit for bit: NF4 and FP4 with bitsandbytes' CUDA and CPU arithmetic, blocksizes 64
/// and 128, float32 / bfloat16 / float16 values, counts that end in a partial block and a half byte, an all-zero
/// block (its scaling divides by 0), values at the thresholds; a NaN or an infinity is refused naming its element.
#[test]
fn four_bit_blocks_quantize_on_the_gpu_bit_for_bit() {
    use candle_qlora::quant::{quantize_blocks_on, BnbKernels, QuantType};
    let dev = gpu();
    let mut values = Tensor::randn(0f32, 1.0, 1000, &Device::Cpu)
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    values[128..192].fill(0.0);
    // A block of values on NF4's thresholds (its absmax 1: scaling leaves them there), either sign.
    let pivots = candle_qlora::quant::nf4::NF4_PIVOTS;
    for (i, v) in values[192..256].iter_mut().enumerate() {
        *v = pivots[i % 15] * if i % 2 == 0 { 1.0 } else { -1.0 };
    }
    values[255] = 1.0;
    let values = Tensor::new(values, &Device::Cpu).unwrap();
    for quant_type in [QuantType::Nf4, QuantType::Fp4] {
        for kernels in [BnbKernels::Cuda, BnbKernels::Cpu] {
            for blocksize in [64, 128] {
                let config = QuantConfig {
                    quant_type,
                    kernels,
                    blocksize,
                    ..QuantConfig::nf4()
                };
                for dtype in gpu_dtypes() {
                    for n in [1, 63, 64, 129, 333, 1000] {
                        let part = values.narrow(0, 0, n).unwrap().to_dtype(dtype).unwrap();
                        let (packed, absmax) =
                            quantize_blocks_on(&part, &dev, &config, "w").unwrap();
                        assert!(packed.device().is_cuda() && absmax.device().is_cuda());
                        let (want_packed, want_absmax) =
                            Nf4Tensor::quantize_blocks(&part, &config, "w").unwrap();
                        let what = format!("{quant_type:?} {kernels:?} {blocksize} {dtype:?} {n}");
                        assert_eq!(
                            packed
                                .to_device(&Device::Cpu)
                                .unwrap()
                                .to_vec1::<u8>()
                                .unwrap(),
                            want_packed,
                            "{what}: codes"
                        );
                        let absmax = absmax
                            .to_device(&Device::Cpu)
                            .unwrap()
                            .to_vec1::<f32>()
                            .unwrap();
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(bits(&absmax), bits(&want_absmax), "{what}: absmax");
                    }
                }
            }
        }
    }
    let mut bad = vec![0.5f32; 300];
    bad[250] = f32::INFINITY;
    bad[70] = f32::NAN;
    let bad = Tensor::new(bad, &Device::Cpu).unwrap();
    let err = quantize_blocks_on(
        &bad,
        &dev,
        &QuantConfig::nf4(),
        "model.layers.0.mlp.up_proj.weight",
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`model.layers.0.mlp.up_proj.weight`") && err.contains("element 70 is NaN"),
        "{err}"
    );
}

/// Dropout masks made on the GPU equal the CPU's bit for bit, so a checkpointed layer or a resumed run replays
/// the same masks on either device.
#[test]
fn dropout_masks_are_made_on_the_gpu_bit_for_bit() {
    use candle_qlora::ops::low_rank_linear::dropout_mask;
    let dev = gpu();
    for (seed, p) in [(7u64, 0.05), (0x1234_5678_9abc, 0.5), (u64::MAX, 0.1)] {
        for dtype in gpu_dtypes() {
            let dims = [3, 1001];
            let cpu = dropout_mask(seed, p, &dims, dtype, &Device::Cpu).unwrap();
            let gpu_mask = dropout_mask(seed, p, &dims, dtype, &dev).unwrap();
            assert!(gpu_mask.device().is_cuda());
            assert_eq!(bits(&gpu_mask), bits(&cpu), "seed {seed} p {p} {dtype:?}");
        }
    }
}

/// An input of an op comparison: its values (float32, on the CPU), its dtype on the GPU, and whether it is trained.
struct Input {
    values: Tensor,
    gpu_dtype: DType,
    trained: bool,
}

fn input(values: Tensor, gpu_dtype: DType, trained: bool) -> Input {
    Input {
        values,
        gpu_dtype,
        trained,
    }
}

/// Runs `op` on the CPU in float32 and on the GPU (each input in its GPU dtype), and requires the outputs and the
/// gradients of the trained inputs (of `Σ y · r` for a fixed random `r`) to agree within `tol` relative to the
/// largest CPU value — the GPU runs bf16/f16 math, so `tol` is that dtype's precision, not a reduction-order noise.
fn compare_op(
    name: &str,
    op: impl Fn(&[Tensor]) -> candle_core::Result<Tensor>,
    inputs: &[Input],
    tol: f64,
) {
    let dev = gpu();
    // One set of random output weights for both devices, shaped by a first CPU forward.
    let cpu_inputs: Vec<Tensor> = inputs.iter().map(|i| i.values.clone()).collect();
    let r = Tensor::randn(0f32, 1.0, op(&cpu_inputs).unwrap().dims(), &Device::Cpu).unwrap();
    let run = |device: &Device| {
        let vars: Vec<candle_core::Var> = inputs
            .iter()
            .map(|i| {
                let dtype = if device.is_cpu() {
                    DType::F32
                } else {
                    i.gpu_dtype
                };
                candle_core::Var::from_tensor(
                    &i.values.to_device(device).unwrap().to_dtype(dtype).unwrap(),
                )
                .unwrap()
            })
            .collect();
        let xs: Vec<Tensor> = vars
            .iter()
            .zip(inputs)
            .map(|(v, i)| {
                if i.trained {
                    v.as_tensor().clone()
                } else {
                    v.as_detached_tensor()
                }
            })
            .collect();
        let y = op(&xs).unwrap();
        let weights = r.to_device(device).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * weights)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let gradients: Vec<Option<Tensor>> = vars
            .iter()
            .zip(inputs)
            .map(|(v, i)| i.trained.then(|| grads.get(v).expect("a gradient").clone()))
            .collect();
        (y, gradients)
    };
    let (cpu_y, cpu_g) = run(&Device::Cpu);
    let (gpu_y, gpu_g) = run(&dev);
    let close = |what: &str, cpu: &Tensor, gpu: &Tensor| {
        assert!(
            gpu.device().is_cuda(),
            "{name} {what}: not computed on the GPU"
        );
        let gpu = gpu
            .to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        let scale = cpu
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .max(1e-6) as f64;
        let diff = crate::common::max_abs_diff(cpu, &gpu);
        assert!(
            diff <= tol * scale,
            "{name} {what}: differs by {diff} (largest value {scale})"
        );
    };
    close("output", &cpu_y, &gpu_y);
    for (k, (c, g)) in cpu_g.iter().zip(&gpu_g).enumerate() {
        if let (Some(c), Some(g)) = (c, g) {
            close(&format!("gradient {k}"), c, g);
        }
    }
}

fn randn(dims: &[usize], std: f32) -> Tensor {
    Tensor::randn(0f32, std, dims, &Device::Cpu).unwrap()
}

/// RMSNorm, SwiGLU, RoPE and the head moves by their kernels against the CPU ops, in bf16 and f16.
#[test]
fn elementwise_kernels_match_the_cpu_ops() {
    use candle_qlora::ops::{
        merge_heads, rms_norm, rope, rope_split_heads, split_heads, swiglu, RopeTables,
    };
    for dtype in half_dtypes() {
        let w = (randn(&[576], 0.1) + 1.0).unwrap();
        let x = randn(&[2, 9, 576], 1.0);
        compare_op(
            "rms_norm",
            |xs| rms_norm(&xs[0], &xs[1], 1e-5),
            &[input(x.clone(), dtype, true), input(w, DType::F32, false)],
            2e-2,
        );
        compare_op(
            "swiglu",
            |xs| swiglu(&xs[0], &xs[1]),
            &[
                input(randn(&[3, 1537], 2.0), dtype, true),
                input(randn(&[3, 1537], 1.0), dtype, true),
            ],
            2e-2,
        );
        let tables = RopeTables::new(64, 32, 10000.0, None, &Device::Cpu).unwrap();
        let positions = Tensor::new(
            &[
                [0u32, 1, 2, 3, 0, 1, 2, 3, 4],
                [5, 6, 7, 8, 9, 10, 11, 12, 13],
            ],
            &Device::Cpu,
        )
        .unwrap();
        for (cos, sin) in [
            tables.range(3, 9).unwrap(),
            tables.gather(&positions).unwrap(),
        ] {
            let on_gpu = |t: &Tensor| t.to_device(&gpu()).unwrap();
            let (gc, gs) = (on_gpu(&cos), on_gpu(&sin));
            let pick = |xs: &[Tensor]| {
                if xs[0].device().is_cuda() {
                    (gc.clone(), gs.clone())
                } else {
                    (cos.clone(), sin.clone())
                }
            };
            compare_op(
                "rope",
                |xs| {
                    let (c, s) = pick(xs);
                    rope(&xs[0], &c, &s)
                },
                &[input(randn(&[2, 3, 9, 64], 1.0), dtype, true)],
                2e-2,
            );
            compare_op(
                "rope_split_heads",
                |xs| {
                    let (c, s) = pick(xs);
                    rope_split_heads(&xs[0], 3, &c, &s)
                },
                &[input(randn(&[2, 9, 192], 1.0), dtype, true)],
                2e-2,
            );
        }
        compare_op(
            "split_heads",
            |xs| split_heads(&xs[0], 3),
            &[input(randn(&[2, 9, 192], 1.0), dtype, true)],
            1e-2,
        );
        compare_op(
            "merge_heads",
            |xs| merge_heads(&xs[0]),
            &[input(randn(&[2, 3, 9, 64], 1.0), dtype, true)],
            1e-2,
        );
    }
}

/// The fused linear cross-entropy (bf16 head, float32 logits in blocks, gradient in the forward) against the CPU.
#[test]
fn cross_entropy_kernel_matches_the_cpu_op() {
    use candle_qlora::ops::linear_cross_entropy;
    let labels: Vec<i64> = (0..300)
        .map(|i| {
            if i % 7 == 0 {
                -100
            } else {
                (i * 37 % 1000) as i64
            }
        })
        .collect();
    for dtype in half_dtypes() {
        let labels = labels.clone();
        compare_op(
            "linear_cross_entropy",
            move |xs| {
                let l = Tensor::new(labels.as_slice(), xs[0].device())?;
                Ok(linear_cross_entropy(&xs[0], &xs[1], &l)?.0)
            },
            &[
                input(randn(&[300, 64], 1.0), dtype, true),
                input(randn(&[1000, 64], 0.5), dtype, false),
            ],
            2e-2,
        );
    }
}

/// The LoRA projection (NF4 or dense base, cuBLAS GEMMs, device dropout, the update added with beta = 1) against
/// the CPU op: output and the gradients of x, A and B.
#[test]
fn low_rank_linear_kernel_matches_the_cpu_op() {
    use candle_qlora::ops::{
        low_rank_linear, BranchDropout, FrozenLinear, FrozenWeight, LowRank, OutputValue,
    };
    use std::sync::Arc;
    let w = randn(&[192, 128], 0.05);
    let q = Arc::new(Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap());
    let bases = [FrozenWeight::Nf4(q), FrozenWeight::Dense(w.clone())];
    for base in bases {
        for dropout in [None, Some(BranchDropout { p: 0.1, seed: 11 })] {
            for dtype in half_dtypes() {
                let cpu_base = Arc::new(FrozenLinear::new(base.clone(), Some(randn(&[192], 0.1))));
                let gpu_base = Arc::new(cpu_base.to_device(&gpu()).unwrap());
                compare_op(
                    "low_rank_linear",
                    |xs| {
                        let layer = if xs[0].device().is_cuda() {
                            &gpu_base
                        } else {
                            &cpu_base
                        };
                        let branch = LowRank {
                            a: &xs[1],
                            b: &xs[2],
                            scaling: 2.0,
                            dropout,
                        };
                        low_rank_linear(&xs[0], layer, &branch, OutputValue::Computed)
                    },
                    &[
                        input(randn(&[2, 9, 128], 1.0), dtype, true),
                        input(randn(&[8, 128], 0.1), DType::F32, true),
                        input(randn(&[192, 8], 0.1), DType::F32, true),
                    ],
                    3e-2,
                );
            }
        }
    }
}

/// The projection's fused forms on the GPU (one op each: the output moved into rotated heads, heads merged into
/// the input, a residual accumulated) against the CPU ops, forward and every gradient, with dropout.
#[test]
fn low_rank_linear_head_and_residual_forms_match_the_cpu_ops() {
    use candle_qlora::ops::{
        low_rank_linear_from_heads, low_rank_linear_plus, low_rank_linear_to_heads, BranchDropout,
        FrozenLinear, FrozenWeight, LowRank, OutputValue, RopeTables,
    };
    use std::sync::Arc;
    let w = randn(&[192, 128], 0.05);
    let q = Arc::new(Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap());
    let cpu_base = Arc::new(FrozenLinear::new(FrozenWeight::Nf4(q), None));
    let gpu_base = Arc::new(cpu_base.to_device(&gpu()).unwrap());
    let layer = |x: &Tensor| {
        if x.device().is_cuda() {
            &gpu_base
        } else {
            &cpu_base
        }
    };
    fn branch(xs: &[Tensor]) -> LowRank<'_> {
        LowRank {
            a: &xs[1],
            b: &xs[2],
            scaling: 2.0,
            dropout: Some(BranchDropout { p: 0.1, seed: 5 }),
        }
    }
    let factors = |inp: usize, out: usize| {
        [
            input(randn(&[8, inp], 0.1), DType::F32, true),
            input(randn(&[out, 8], 0.1), DType::F32, true),
        ]
    };
    let tables = |device: &Device| {
        RopeTables::new(64, 64, 10_000.0, None, device)
            .unwrap()
            .range(3, 9)
            .unwrap()
    };
    for dtype in half_dtypes() {
        let [a, b] = factors(128, 192);
        compare_op(
            "low_rank_linear_to_heads",
            |xs| {
                let (cos, sin) = tables(xs[0].device());
                low_rank_linear_to_heads(&xs[0], layer(&xs[0]), &branch(xs), 3, Some((&cos, &sin)))
            },
            &[input(randn(&[2, 9, 128], 1.0), dtype, true), a, b],
            3e-2,
        );
        let [a, b] = factors(128, 192);
        compare_op(
            "low_rank_linear_plus",
            |xs| {
                let output = OutputValue::Computed;
                low_rank_linear_plus(&xs[0], layer(&xs[0]), &branch(xs), output, &xs[3])
            },
            &[
                input(randn(&[2, 9, 128], 1.0), dtype, true),
                a,
                b,
                input(randn(&[2, 9, 192], 1.0), dtype, true),
            ],
            3e-2,
        );
        let [a, b] = factors(128, 192);
        compare_op(
            "low_rank_linear_from_heads",
            |xs| low_rank_linear_from_heads(&xs[0], layer(&xs[0]), &branch(xs), Some(&xs[3])),
            &[
                input(randn(&[2, 2, 9, 64], 1.0), dtype, true),
                a,
                b,
                input(randn(&[2, 9, 192], 1.0), dtype, true),
            ],
            3e-2,
        );
    }
}

/// Attention on tensor cores against the CPU op: grouped-query heads of 64 and 128, sequences across several
/// tiles, queries after cached keys, and packed rows; the backward in one launch, and one launch per kv head (as a
/// long sequence's float32 dQ is made).
#[test]
fn attention_kernels_match_the_cpu_op() {
    use candle_qlora::ops::attention::set_cuda_dq_bytes;
    use candle_qlora::ops::{causal_attention, packed_causal_attention, Segments};
    for (dtype, dq_bytes) in half_dtypes()
        .into_iter()
        .flat_map(|t| [(t, None), (t, Some(1))])
    {
        let before = dq_bytes.map(set_cuda_dq_bytes);
        for (d, t, s) in [(64, 77, 77), (128, 130, 130), (64, 5, 70)] {
            compare_op(
                "causal_attention",
                |xs| causal_attention(&xs[0], &xs[1], &xs[2], 1.0 / (d as f64).sqrt()),
                &[
                    input(randn(&[2, 8, t, d], 1.0), dtype, true),
                    input(randn(&[2, 2, s, d], 1.0), dtype, true),
                    input(randn(&[2, 2, s, d], 1.0), dtype, true),
                ],
                3e-2,
            );
        }
        let positions: Vec<u32> = (0..2 * 70).map(|i| (i % 70 % 23) as u32).collect();
        let positions = Tensor::from_vec(positions, (2, 70), &Device::Cpu).unwrap();
        let cpu_segments = Segments::from_positions(&positions).unwrap();
        let gpu_segments = Segments::from_positions(&positions.to_device(&gpu()).unwrap()).unwrap();
        compare_op(
            "packed_causal_attention",
            |xs| {
                let segments = if xs[0].device().is_cuda() {
                    &gpu_segments
                } else {
                    &cpu_segments
                };
                packed_causal_attention(&xs[0], &xs[1], &xs[2], 0.125, segments)
            },
            &[
                input(randn(&[2, 4, 70, 64], 1.0), dtype, true),
                input(randn(&[2, 2, 70, 64], 1.0), dtype, true),
                input(randn(&[2, 2, 70, 64], 1.0), dtype, true),
            ],
            3e-2,
        );
        if let Some(bytes) = before {
            set_cuda_dq_bytes(bytes);
        }
    }
}

/// The ops the newer families add, on the GPU against the CPU ops: attention with a sliding window shorter than the
/// keys, with soft-capped scores, both, and a window with sinks (also after cached keys) — bf16 on the tensor-core
/// kernels, f32 on the composed path; GeGLU (its kernel); the soft-capped fused cross-entropy (composed).
#[test]
fn family_ops_match_the_cpu_ops() {
    use candle_qlora::ops::{
        attention, geglu_tanh, linear_cross_entropy_capped, AttentionSinks, AttentionSpec,
    };
    let labels: Vec<i64> = (0..120)
        .map(|i| {
            if i % 9 == 0 {
                -100
            } else {
                (i * 31 % 500) as i64
            }
        })
        .collect();
    for dtype in [training_half(), DType::F32] {
        compare_op(
            "geglu_tanh",
            |xs| geglu_tanh(&xs[0], &xs[1]),
            &[
                input(randn(&[3, 1537], 2.0), dtype, true),
                input(randn(&[3, 1537], 1.0), dtype, true),
            ],
            2e-2,
        );
        let causal = AttentionSpec::causal(0.125);
        // Sinks around the scores' scale (some above a row's largest score, some far below), one per query head.
        let sinks = AttentionSinks::new(vec![0.5, -1.0, 2.5, 0.0, -6.0, 1.5, 3.0, -0.5]);
        for spec in [
            causal.clone().with_sliding_window(9),
            causal.clone().with_softcap(5.0),
            causal.clone().with_sliding_window(20).with_softcap(2.0),
            causal.with_sliding_window(20).with_sinks(sinks),
        ] {
            for (t, s) in [(77, 77), (5, 70)] {
                let spec = spec.clone();
                compare_op(
                    "attention",
                    move |xs| attention(&xs[0], &xs[1], &xs[2], &spec, None),
                    &[
                        input(randn(&[2, 8, t, 64], 1.0), dtype, true),
                        input(randn(&[2, 2, s, 64], 1.0), dtype, true),
                        input(randn(&[2, 2, s, 64], 1.0), dtype, true),
                    ],
                    3e-2,
                );
            }
        }
        let labels = labels.clone();
        compare_op(
            "linear_cross_entropy_capped",
            move |xs| {
                let l = Tensor::new(labels.as_slice(), xs[0].device())?;
                Ok(linear_cross_entropy_capped(&xs[0], &xs[1], &l, Some(3.0))?.0)
            },
            &[
                input(randn(&[120, 64], 1.0), dtype, true),
                input(randn(&[500, 64], 0.5), dtype, false),
            ],
            2e-2,
        );
    }
}

/// Every family's tiny model on the GPU: float32 logits equal transformers' (to reduction-order noise), NF4 logits
/// equal transformers + bitsandbytes', and decoding with the KV cache equals full forwards.
#[test]
fn every_family_on_the_gpu_matches_transformers() {
    for name in crate::common::TINY_MODELS {
        let golden = candle_core::safetensors::load(
            data_path(&format!("models/{name}/golden.safetensors")),
            &Device::Cpu,
        )
        .unwrap();
        let load = |quantization| {
            let opts = LoadOptions {
                quantization,
                compute_dtype: DType::F32,
                ..Default::default()
            };
            load_model(
                data_path(&format!("models/{name}")).to_str().unwrap(),
                None,
                &opts,
            )
            .unwrap()
            .model
            .to_device(&gpu())
            .unwrap()
        };
        let ids = golden["input_ids"]
            .to_dtype(DType::U32)
            .unwrap()
            .to_device(&gpu())
            .unwrap();
        for (model, key) in [
            (load(None), "logits"),
            // The golden NF4 logits are of weights quantized as bitsandbytes' CPU backend rounds them.
            (
                load(Some(QuantConfig {
                    kernels: candle_qlora::quant::BnbKernels::Cpu,
                    ..QuantConfig::nf4()
                })),
                "logits_nf4",
            ),
        ] {
            let logits = model.logits(&ids).unwrap();
            let d =
                crate::common::max_abs_diff(&logits.to_device(&Device::Cpu).unwrap(), &golden[key]);
            assert!(d <= 1e-4, "{name} {key}: differs from transformers by {d}");
        }
        let model = load(None);
        let prompt = ids.narrow(1, 0, 12).unwrap();
        let full = model.logits(&prompt).unwrap();
        let mut cache = candle_qlora::models::KvCache::default();
        model
            .forward_cached(&prompt.narrow(1, 0, 8).unwrap(), &mut cache)
            .unwrap();
        for t in 8..12 {
            let step = model
                .forward_cached(&prompt.narrow(1, t, 1).unwrap(), &mut cache)
                .unwrap();
            let expected = full.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
            let d = crate::common::max_abs_diff(
                &step.to_device(&Device::Cpu).unwrap(),
                &expected.to_device(&Device::Cpu).unwrap(),
            );
            assert!(d <= 1e-4, "{name}: cached logits at {t} differ by {d}");
        }
    }
}

/// The optimizers' device kernels keep the parameters and states of the host updates bit for bit — torch AdamW,
/// bitsandbytes' 32-bit and 8-bit AdamW, resident and paged (with a tensor below `min_8bit_size` on the 32-bit
/// kernel, a partial absmax block, weight decay, a non-finite gradient element on the 8-bit kernel) — and a state
/// saved on the GPU resumes on the CPU.
/// The mixture-of-experts models on the GPU (tokens grouped by expert with Candle's indexed ops, each expert's
/// product by cuBLAS or our 4-bit kernels; gpt-oss's sinks and clamped SwiGLU on the composed paths): float32
/// logits equal transformers', also with PEFT's adapters on the
/// router and every expert; the training loss with the auxiliary loss and its input gradients, under
/// checkpointing, equal transformers'; an NF4 model computing in half precision gives the CPU's NF4 loss.
#[test]
fn mixture_of_experts_models_on_the_gpu_match_transformers() {
    use crate::moe::{model_golden, moe_loss, GPT_OSS, MOE_MODELS};
    use candle_core::Var;
    for name in MOE_MODELS.into_iter().chain([GPT_OSS]) {
        let g = model_golden(name);
        let dir = data_path(&format!("models/{name}"));
        let load = |quantization, device: &Device| {
            let opts = LoadOptions {
                quantization,
                compute_dtype: DType::F32,
                ..Default::default()
            };
            load_model(dir.to_str().unwrap(), None, &opts)
                .unwrap()
                .model
                .to_device(device)
                .unwrap()
        };
        let ids = g["input_ids"].to_dtype(DType::U32).unwrap();
        let on_gpu = ids.to_device(&gpu()).unwrap();
        let cpu = |t: &Tensor| t.to_device(&Device::Cpu).unwrap();
        let mut model = load(None, &gpu());
        let d = crate::common::max_abs_diff(&cpu(&model.logits(&on_gpu).unwrap()), &g["logits"]);
        assert!(
            d <= 1e-4,
            "{name}: GPU logits differ from transformers by {d}"
        );

        let embeds = Var::from_tensor(&model.embed(&on_gpu).unwrap()).unwrap();
        let (loss, _) = moe_loss(&model, embeds.as_tensor(), &on_gpu, true);
        let expected = g["loss"].to_vec1::<f32>().unwrap()[0];
        let value = loss.to_scalar::<f32>().unwrap();
        assert!(
            (value - expected).abs() <= 1e-4,
            "{name}: GPU loss {value} vs {expected}"
        );
        let grads = loss.backward().unwrap();
        let d = crate::common::max_abs_diff(
            &cpu(grads.get(&embeds).unwrap()),
            &g["grad_inputs_embeds"],
        );
        assert!(d <= 1e-5, "{name}: GPU input gradient differs by {d}");

        candle_qlora::adapter::load_adapter(&mut model, &dir.join("adapter"), "default").unwrap();
        let d = crate::common::max_abs_diff(
            &cpu(&model.logits(&on_gpu).unwrap()),
            &g["logits_adapter"],
        );
        assert!(
            d <= 1e-4,
            "{name}: GPU logits with PEFT's adapter differ by {d}"
        );

        let nf4_loss = |device: &Device, dtype: DType| {
            let mut model = load(Some(QuantConfig::nf4()), device);
            model.set_compute_dtype(dtype).unwrap();
            let ids = ids.to_device(device).unwrap();
            let embeds = model.embed(&ids).unwrap();
            let (loss, _) = moe_loss(&model, &embeds, &ids, true);
            loss.to_dtype(DType::F32)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let reference = nf4_loss(&Device::Cpu, DType::F32);
        let half = nf4_loss(&gpu(), training_half());
        assert!(
            (half - reference).abs() <= 2e-2 * reference.abs(),
            "{name}: NF4 loss in {:?} on the GPU {half} vs the CPU's {reference}",
            training_half()
        );
    }
}

#[test]
fn optimizer_updates_on_the_gpu_match_the_cpu_bit_for_bit() {
    use candle_core::backprop::GradStore;
    use candle_core::Var;
    use candle_qlora::optim::{Optimizer, OptimizerConfig};
    let dev = gpu();
    let sizes = [
        ("big.weight", 5000usize),
        ("small.weight", 300),
        ("x.bias", 4099),
    ];
    for name in [
        OptimizerName::AdamWTorch,
        OptimizerName::PagedAdamW32bit,
        OptimizerName::AdamW8bit,
        OptimizerName::PagedAdamW8bit,
    ] {
        let config = OptimizerConfig {
            name,
            weight_decay: 0.01,
            ..Default::default()
        };
        let make = |device: &Device| -> (Vec<Var>, Optimizer) {
            let vars: Vec<Var> = sizes
                .iter()
                .enumerate()
                .map(|(k, (_, n))| {
                    let init: Vec<f32> = (0..*n).map(|i| ((i + k) as f32 * 0.37).sin()).collect();
                    Var::from_vec(init, *n, device).unwrap()
                })
                .collect();
            let named = sizes
                .iter()
                .zip(&vars)
                .map(|((s, _), v)| (s.to_string(), v.clone()))
                .collect();
            (vars, Optimizer::new(named, config.clone()).unwrap())
        };
        let step = |vars: &[Var], opt: &mut Optimizer, k: usize| {
            let mut grads = GradStore::default();
            for (v, (_, n)) in vars.iter().zip(&sizes) {
                let mut g: Vec<f32> = (0..*n)
                    .map(|i| ((i as f32 + k as f32) * 1.3).cos() * 0.1)
                    .collect();
                // The 8-bit kernel skips a non-finite gradient element (the others would carry NaN, whose bits
                // differ between devices).
                if k == 2 && name.is_8bit() && *n >= config.min_8bit_size {
                    g[17] = f32::NAN;
                }
                grads.insert(v, Tensor::from_vec(g, *n, v.device()).unwrap());
            }
            opt.step(&grads, 1e-3).unwrap();
        };
        let (cpu_vars, mut cpu_opt) = make(&Device::Cpu);
        let (gpu_vars, mut gpu_opt) = make(&dev);
        for k in 1..=4 {
            step(&cpu_vars, &mut cpu_opt, k);
            step(&gpu_vars, &mut gpu_opt, k);
        }
        for ((s, _), (c, g)) in sizes.iter().zip(cpu_vars.iter().zip(&gpu_vars)) {
            assert!(g.device().is_cuda());
            assert_eq!(bits(g.as_tensor()), bits(c.as_tensor()), "{name:?} {s}");
            assert_eq!(
                gpu_opt.state(s).unwrap(),
                cpu_opt.state(s).unwrap(),
                "{name:?} {s} state"
            );
        }
        assert_eq!(gpu_opt.state_bytes(), cpu_opt.state_bytes());
        // Saved from the GPU, resumed on the CPU: the next step agrees with the CPU's own.
        let dir = tempfile::tempdir().unwrap();
        gpu_opt.save(dir.path()).unwrap();
        let (resumed_vars, mut resumed) = make(&Device::Cpu);
        for (r, g) in resumed_vars.iter().zip(&gpu_vars) {
            r.set(&g.as_tensor().to_device(&Device::Cpu).unwrap())
                .unwrap();
        }
        resumed.load(dir.path()).unwrap();
        step(&cpu_vars, &mut cpu_opt, 5);
        step(&resumed_vars, &mut resumed, 5);
        for (c, r) in cpu_vars.iter().zip(&resumed_vars) {
            assert_eq!(bits(r.as_tensor()), bits(c.as_tensor()), "{name:?} resumed");
        }
    }
}

/// The tiny Llama in NF4 with LoRA r=4 (and `lora_dropout`) on `device`, trained with `edit` applied to its
/// arguments.
fn tiny_trainer(
    device: &Device,
    output_dir: &std::path::Path,
    data: Vec<TokenizedExample>,
    lora_dropout: f64,
    edit: impl Fn(&mut TrainingArguments),
) -> Trainer {
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..Default::default()
    };
    let model = load_model(
        data_path("models/tiny-llama").to_str().unwrap(),
        None,
        &opts,
    )
    .unwrap()
    .model
    .to_device(device)
    .unwrap();
    let mut args = TrainingArguments {
        output_dir: output_dir.display().to_string(),
        per_device_train_batch_size: 2,
        gradient_accumulation_steps: 2,
        learning_rate: 5e-3,
        max_steps: 6,
        logging_steps: 1.0,
        save_steps: 100.0,
        optim: OptimizerName::AdamWTorch,
        gradient_checkpointing: true,
        ..Default::default()
    };
    edit(&mut args);
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    let mut trainer = Trainer::new(model, args, &lora, data, vec![]).unwrap();
    trainer.set_base_model_name("tiny-llama");
    trainer
}

/// Float32 compute on both devices, with LoRA dropout and NEFTune noise (both made on the GPU from the same
/// generator): the same losses (to float32 reduction-order noise) and the same adapter.
/// Both CUDA paths are checked: the crate's fused kernels (the default) and Candle's composed ops
/// (`use_liger_kernel = false`).
#[test]
fn training_on_the_gpu_matches_the_cpu() {
    for fused in [true, false] {
        training_on_the_gpu_matches_the_cpu_with(fused);
    }
    candle_qlora::ops::set_fused_kernels(true);
}

fn training_on_the_gpu_matches_the_cpu_with(fused: bool) {
    let dir = tempfile::tempdir().unwrap();
    let run = |device: &Device, name: &str| {
        let out = dir.path().join(name);
        let edit = |a: &mut TrainingArguments| {
            a.neftune_noise_alpha = Some(5.0);
            a.use_liger_kernel = fused;
        };
        let log = tiny_trainer(device, &out, crate::trainer::examples(), 0.1, edit)
            .train(None)
            .unwrap();
        let losses: Vec<f64> = log.log_history.iter().filter_map(|e| e.loss).collect();
        let adapter =
            candle_core::safetensors::load(out.join("adapter_model.safetensors"), &Device::Cpu)
                .unwrap();
        (losses, adapter, out)
    };
    let (cpu_losses, cpu_adapter, _) = run(&Device::Cpu, "cpu");
    let (gpu_losses, gpu_adapter, gpu_out) = run(&gpu(), "gpu");
    assert_eq!(cpu_losses.len(), 6);
    assert_runs_agree(
        &format!("fused kernels {fused}"),
        (&cpu_losses, &cpu_adapter),
        (&gpu_losses, &gpu_adapter),
        1e-4,
        1e-3,
    );
    // The memory timeline of the GPU run reads the device's pool.
    let timeline = std::fs::read_to_string(gpu_out.join("memory_timeline.json")).unwrap();
    assert!(timeline.contains("device pool"), "{timeline}");
}

/// The DPO golden's tiny chat Llama with an NF4 base, on `device`.
fn tiny_chat_nf4(device: &Device) -> candle_qlora::models::LlamaModel {
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..Default::default()
    };
    load_model(
        data_path("dpo/tiny-llama-chat").to_str().unwrap(),
        None,
        &opts,
    )
    .unwrap()
    .model
    .to_device(device)
    .unwrap()
}

/// DPO from a PEFT adapter (its frozen copy the reference, computed per batch) on the 4-bit tiny model with
/// checkpointed layers, float32 compute on both devices: the losses, reward metrics and trained adapter agree.
#[test]
fn preference_training_on_the_gpu_matches_the_cpu() {
    use candle_qlora::adapter::load_adapter;
    use candle_qlora::data::{DataConfig, PreferenceDataset, TruncationMode};
    use candle_qlora::trainer::DpoConfig;
    let dir = tempfile::tempdir().unwrap();
    let model_dir = data_path("dpo/tiny-llama-chat");
    let tokenizer = candle_qlora::loading::load_tokenizer(model_dir.to_str().unwrap(), None)
        .unwrap()
        .unwrap();
    let pairs = PreferenceDataset::from_jsonl(
        &data_path("dpo/pairs-chat.jsonl"),
        &tokenizer,
        &DataConfig::default(),
        TruncationMode::KeepStart,
    )
    .unwrap();
    let run = |device: &Device, name: &str| {
        let out = dir.path().join(name);
        let mut model = tiny_chat_nf4(device);
        let lora = load_adapter(&mut model, &data_path("dpo/adapter"), "default").unwrap();
        let args = TrainingArguments {
            output_dir: out.display().to_string(),
            per_device_train_batch_size: 2,
            gradient_accumulation_steps: 2,
            learning_rate: 5e-3,
            max_steps: 3,
            logging_steps: 1.0,
            save_steps: 100.0,
            optim: OptimizerName::AdamWTorch,
            gradient_checkpointing: true,
            // The adapter is loaded where the model is: the trainer must not move it.
            use_cpu: device.is_cpu(),
            ..Default::default()
        };
        let log = Trainer::new_dpo(
            model,
            args,
            &lora,
            DpoConfig::default(),
            pairs.clone(),
            pairs.clone(),
        )
        .unwrap()
        .train(None)
        .unwrap();
        let figures: Vec<f64> = log
            .log_history
            .iter()
            .filter(|e| e.loss.is_some())
            .flat_map(|e| std::iter::once(e.loss.unwrap()).chain(e.metrics.values().copied()))
            .collect();
        (figures, read_adapter(&out))
    };
    let (cpu_figures, cpu_adapter) = run(&Device::Cpu, "cpu");
    let (gpu_figures, gpu_adapter) = run(&gpu(), "gpu");
    assert_eq!(cpu_figures.len(), 3 * 7);
    assert_runs_agree(
        "DPO",
        (&cpu_figures, &cpu_adapter),
        (&gpu_figures, &gpu_adapter),
        1e-4,
        1e-3,
    );
}

/// A GPU nearly full (a ballast tensor leaves 2 GiB, 256 MiB on the emulated device) and a micro-batch that needs more: training stops with the
/// out-of-memory report (step, phase, live memory by category, the fixes cheapest first) and, with
/// `memory_snapshot`, the snapshot written next to it; the device is usable afterwards.
#[test]
fn out_of_memory_stops_training_with_the_report() {
    let dev = gpu();
    let dir = tempfile::tempdir().unwrap();
    // The emulated device computes on one CPU core: there 256 MiB are left and the micro-batch is smaller, so the
    // forward reaches the failure in seconds.
    let emulated = emulator_counters().is_some();
    let headroom = if emulated { 256 << 20 } else { 2 << 30 };
    let free = stats(&dev).available.unwrap() as usize;
    let ballast = Tensor::zeros((free - headroom) / 4, DType::F32, &dev).unwrap();
    let row = TokenizedExample {
        input_ids: (0..256u32).map(|i| 3 + i % 100).collect(),
        labels: (0..256i64).map(|i| 3 + i % 100).collect(),
        truncated: false,
        segments: vec![],
    };
    let batch = if emulated { 256 } else { 2048 };
    let data = vec![row; batch];
    // No dropout: its masks, drawn on the host, would take longer than reaching the failure.
    let out = dir.path().join("oom");
    let mut trainer = tiny_trainer(&dev, &out, data, 0.0, |a| {
        a.per_device_train_batch_size = batch;
        a.gradient_accumulation_steps = 1;
        a.gradient_checkpointing = false;
        a.max_steps = 1;
        a.memory_snapshot = true;
    });
    let err = trainer.train(None).unwrap_err();
    let Error::OutOfMemory(report) = &err else {
        panic!("expected the out-of-memory report, got: {err}");
    };
    eprintln!("{report}");
    assert!(report.contains("out of memory at step 1"), "{report}");
    // What the forward held when it failed: activations of the memory left, not what was left after unwinding.
    let activations = report
        .lines()
        .find(|l| l.trim_start().starts_with("activations"))
        .unwrap();
    assert!(
        activations.contains(if emulated { "MiB" } else { "GiB" }),
        "{report}"
    );
    assert!(
        report.contains(&format!("per_device_train_batch_size = {}", batch / 2)),
        "{report}"
    );
    assert!(report.contains("gradient_checkpointing = true"), "{report}");
    assert!(report.contains("the device said"), "{report}");
    // The snapshot is dumped next to the report, its trace ending in the refused allocation.
    let snapshot = out.join("memory_snapshot.pickle");
    assert!(
        report.contains(&format!(
            "memory snapshot up to the failure: {}",
            snapshot.display()
        )),
        "{report}"
    );
    if let Some(r) = crate::memory::read_memory_snapshot(&snapshot) {
        let ooms = r["ooms"].as_array().unwrap();
        assert!(!ooms.is_empty(), "{}", r["allocator_settings"]);
        let last = &ooms[ooms.len() - 1];
        assert!(
            last["size"].as_u64() > last["device_free"].as_u64(),
            "{last}"
        );
        let trace = r["trace_lines"].as_array().unwrap();
        assert!(
            trace
                .iter()
                .any(|l| l.as_str().unwrap().contains("OutOfMemoryError")),
            "{r}"
        );
    }
    drop(trainer);
    drop(ballast);
    // The failed step's memory went back to the pool: the GPU still computes.
    let x = Tensor::ones((1024, 1024), DType::F32, &dev).unwrap();
    assert_eq!(x.sum_all().unwrap().to_scalar::<f32>().unwrap(), 1048576.0);
}

/// `memory_snapshot = true` on the GPU records its pool's allocations (Candle's buffers, seen as the driver is
/// called): `qlora train` writes a snapshot that PyTorch's memory_viz reads, whose trace replays to the pool's peak
/// in the memory timeline (within the pool's rounding of each allocation) and whose frames name the op, the layer,
/// the phase and the step.
#[test]
fn memory_snapshot_of_the_gpu_pool_replays_to_its_peak() {
    let dir = tempfile::tempdir().unwrap();
    let (out, text) = crate::memory::train_with_memory_snapshot(dir.path());
    assert!(text.contains("(device pool)"), "{text}");
    let snapshot = out.join("memory_snapshot.pickle");
    let Some(r) = crate::memory::read_memory_snapshot(&snapshot) else {
        return;
    };
    assert!(
        r["allocator_settings"]["source"]
            .as_str()
            .unwrap()
            .contains("CUDA pool"),
        "{r}"
    );
    crate::memory::assert_replays_to_the_timeline_peak(&r, &out, 0.02);
    crate::memory::assert_frames_name_every_phase(&r, &snapshot);
}

/// The widths of a random Llama (heads of 64).
struct LlamaWidths {
    hidden: usize,
    intermediate: usize,
    heads: usize,
    kv_heads: usize,
    vocab: usize,
    /// `max_position_embeddings`: the RoPE tables cover that many positions.
    positions: usize,
}

/// SmolLM2-135M's.
const SMOLLM2: LlamaWidths = LlamaWidths {
    hidden: 576,
    intermediate: 1536,
    heads: 9,
    kv_heads: 3,
    vocab: 49152,
    positions: 8192,
};

/// A SmolLM2-135M-shaped Llama with random bf16 weights and `layers` layers (the real model has 30), written as a
/// Hugging Face folder in `dir`.
fn random_smollm2(dir: &std::path::Path, layers: usize) -> std::path::PathBuf {
    random_llama(dir, layers, &SMOLLM2)
}

/// A Llama of widths `w` with random bf16 weights and `layers` layers, written as a Hugging Face folder in `dir`.
fn random_llama(dir: &std::path::Path, layers: usize, w: &LlamaWidths) -> std::path::PathBuf {
    let (h, kv) = (w.hidden, w.kv_heads * 64);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
        "intermediate_size": w.intermediate, "num_hidden_layers": layers, "num_attention_heads": w.heads,
        "num_key_value_heads": w.kv_heads, "head_dim": 64, "vocab_size": w.vocab,
        "max_position_embeddings": w.positions,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": true, "hidden_act": "silu",
        "attention_bias": false, "mlp_bias": false, "bos_token_id": 1, "eos_token_id": 2,
    });
    let folder = dir.join(format!("random-llama-{h}-{layers}"));
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(folder.join("config.json"), config.to_string()).unwrap();
    let cpu = Device::Cpu;
    let random = |shape: &[usize]| {
        Tensor::randn(0f32, 0.02, shape, &cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap()
    };
    let mut tensors = std::collections::HashMap::new();
    tensors.insert(
        "model.embed_tokens.weight".to_string(),
        random(&[w.vocab, h]),
    );
    tensors.insert(
        "model.norm.weight".to_string(),
        Tensor::ones(h, DType::BF16, &cpu).unwrap(),
    );
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for (name, shape) in [
            ("self_attn.q_proj", [h, h]),
            ("self_attn.k_proj", [kv, h]),
            ("self_attn.v_proj", [kv, h]),
            ("self_attn.o_proj", [h, h]),
            ("mlp.gate_proj", [w.intermediate, h]),
            ("mlp.up_proj", [w.intermediate, h]),
            ("mlp.down_proj", [h, w.intermediate]),
        ] {
            tensors.insert(format!("{p}.{name}.weight"), random(&shape));
        }
        for norm in ["input_layernorm", "post_attention_layernorm"] {
            tensors.insert(
                format!("{p}.{norm}.weight"),
                Tensor::ones(h, DType::BF16, &cpu).unwrap(),
            );
        }
    }
    candle_core::safetensors::save(&tensors, folder.join("model.safetensors")).unwrap();
    folder
}

/// The tiny Llama's tokenizer in `folder` (a random model's): its words `t1`, `t2`, … are what the tests' rows use.
fn add_tiny_tokenizer(folder: &std::path::Path) {
    std::fs::copy(
        data_path("models/tiny-llama/tokenizer.json"),
        folder.join("tokenizer.json"),
    )
    .unwrap();
}

/// `rows` JSONL rows of text in `path`, row `i` of `words(i)` words `t{1 + (i · stride + 3 j) mod vocab}`.
fn write_word_rows(
    path: &std::path::Path,
    rows: usize,
    words: impl Fn(usize) -> usize,
    stride: usize,
    vocab: usize,
) {
    let text: String = (0..rows)
        .map(|i| {
            let line: Vec<String> = (0..words(i))
                .map(|j| format!("t{}", 1 + (i * stride + j * 3) % vocab))
                .collect();
            format!("{{\"text\": \"{}\"}}\n", line.join(" "))
        })
        .collect();
    std::fs::write(path, text).unwrap();
}

/// The model in `folder`, NF4 on load, computing in [`training_half`], on GPU 0.
fn nf4_model_on_gpu(folder: &std::path::Path) -> candle_qlora::models::LlamaModel {
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        compute_dtype: training_half(),
        ..Default::default()
    };
    load_model(folder.to_str().unwrap(), None, &opts)
        .unwrap()
        .model
        .to_device(&gpu())
        .unwrap()
}

/// `count` rows of `seq` distinct-looking token ids (labels = ids) for the SmolLM2-shaped model's vocabulary.
fn synthetic_rows(count: usize, seq: usize) -> Vec<TokenizedExample> {
    synthetic_rows_in(count, seq, SMOLLM2.vocab)
}

/// `count` rows of `seq` distinct-looking token ids (labels = ids) below `vocab`, past the special tokens.
fn synthetic_rows_in(count: usize, seq: usize, vocab: usize) -> Vec<TokenizedExample> {
    (0..count)
        .map(|b| {
            let ids: Vec<u32> = (0..seq)
                .map(|i| ((i * 7919 + b * 104729) % (vocab - 152)) as u32 + 3)
                .collect();
            TokenizedExample::learning_every_token(ids)
        })
        .collect()
}

/// `memory::estimate` for CUDA against the memory pool's measured peak of one training step of a SmolLM2-sized
/// model (NF4 base, bf16 compute, LoRA r=16 on all linears), with and without checkpointing. The pool holds the
/// weights, adapter, gradients and activations (the optimizer's state lives in host memory, the CUDA context
/// outside the pool), so those four terms are compared.
#[test]
fn the_estimate_predicts_the_gpu_peak() {
    use candle_qlora::memory::{estimate, DeviceKind, EstimateArgs};
    let dir = tempfile::tempdir().unwrap();
    // The emulated device computes on one CPU core: there the model has 2 layers and the steps are short, which
    // still checks every term against the pool (the layers' terms scale with their count).
    let emulated = emulator_counters().is_some();
    let folder = random_smollm2(dir.path(), if emulated { 2 } else { 30 });
    let config = candle_qlora::loading::load_model_config(folder.to_str().unwrap(), None).unwrap();
    let mut rows = Vec::new();
    let configs: &[(usize, usize, bool)] = if emulated {
        &[(2, 128, true), (2, 128, false), (1, 64, false)]
    } else {
        &[
            (4, 512, true),
            (4, 512, false),
            (1, 256, false),
            (2, 1024, true),
            (8, 512, true),
        ]
    };
    for &(batch, seq, checkpointing) in configs {
        let model = nf4_model_on_gpu(&folder);
        let data = synthetic_rows(batch, seq);
        let out = dir
            .path()
            .join(format!("run-{batch}-{seq}-{checkpointing}"));
        let args = in_training_half(TrainingArguments {
            output_dir: out.display().to_string(),
            per_device_train_batch_size: batch,
            max_steps: 1,
            save_strategy: candle_qlora::trainer::IntervalStrategy::No,
            gradient_checkpointing: checkpointing,
            optim: OptimizerName::PagedAdamW8bit,
            ..Default::default()
        });
        let lora = LoraConfig {
            lora_dropout: 0.05,
            ..all_linear_lora()
        };
        Trainer::new(model, args, &lora, data, vec![])
            .unwrap()
            .train(None)
            .unwrap();
        let timeline = read_timeline(&out);
        assert_eq!(timeline["source"], "device pool");
        let measured = timeline_peak(&timeline) as f64;
        let e = estimate(
            &config,
            &EstimateArgs {
                batch,
                seq,
                lora_r: 16,
                optim: OptimizerName::PagedAdamW8bit,
                gradient_checkpointing: checkpointing,
                activation_memory_budget_mib: None,
                quantize: true,
                device: DeviceKind::Cuda,
                ..Default::default()
            },
        )
        .unwrap();
        let predicted = pool_share(&e) as f64;
        rows.push((batch, seq, checkpointing, predicted, measured));
    }
    let mib = |b: f64| b / (1 << 20) as f64;
    eprintln!("batch  seq  checkpointing  predicted MiB  measured MiB  ratio");
    for (b, s, c, p, m) in &rows {
        eprintln!(
            "{b:>5} {s:>4} {c:>14} {:>14.1} {:>13.1} {:>6.3}",
            mib(*p),
            mib(*m),
            p / m
        );
    }
    for (b, s, c, p, m) in &rows {
        assert!(
            (p / m - 1.0).abs() <= 0.15,
            "batch {b} seq {s} checkpointing {c}: {p} vs {m}"
        );
    }
}

/// Activation offload on the GPU: the same losses and adapter as the run without it, bit for bit (on a real GPU,
/// within the noise of its attention backward's atomics); the inputs of
/// every layer and the final norm's go to pinned host memory (the bytes `memory_timeline.json` reports and the
/// estimate predicts) and come back, one copy each way per layer and micro-batch; the pool's peak drops, and the
/// estimate (weights, adapter, gradients, activations) is within 10% of it at every length. On the emulated device
/// the counters also show that the copies add no host synchronization: the streams wait on events.
#[test]
fn activation_offloading_on_the_gpu_matches_and_moves_the_layer_inputs() {
    use candle_qlora::memory::estimate;
    let dir = tempfile::tempdir().unwrap();
    let emulated = emulator_counters().is_some();
    let layers = if emulated { 6 } else { 30 };
    let folder = random_smollm2(dir.path(), layers);
    let config = candle_qlora::loading::load_model_config(folder.to_str().unwrap(), None).unwrap();
    let lengths: &[usize] = if emulated { &[64, 192] } else { &[1024, 4096] };
    let hidden = 576u64;
    let e = training_half().size_in_bytes() as u64;
    let lora = all_linear_lora();
    for &seq in lengths {
        let run = |activation_offloading: bool, name: &str| {
            let model = nf4_model_on_gpu(&folder);
            let out = dir.path().join(format!("{name}-{seq}"));
            let args = TrainingArguments {
                max_steps: 2,
                logging_steps: 1.0,
                ..offload_test_args(&out, activation_offloading)
            };
            let mut trainer =
                Trainer::new(model, args, &lora, synthetic_rows(2, seq), vec![]).unwrap();
            let snapshots = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
            trainer.add_callback(Box::new(CounterSnapshots(snapshots.clone())));
            let log = trainer.train(None).unwrap();
            let losses: Vec<f64> = log.log_history.iter().filter_map(|e| e.loss).collect();
            let norms: Vec<f64> = log.log_history.iter().filter_map(|e| e.grad_norm).collect();
            let timeline = read_timeline(&out);
            let snapshots = snapshots.lock().unwrap().clone();
            (losses, read_adapter(&out), timeline, snapshots, norms)
        };
        let (plain, offloaded) = (run(false, "plain"), run(true, "offloaded"));
        assert_eq!(plain.0.len(), 2);
        let adapter_diff =
            |a: &std::collections::HashMap<String, Tensor>,
             b: &std::collections::HashMap<String, Tensor>| {
                a.iter()
                    .map(|(k, t)| crate::common::max_abs_diff(t, &b[k]))
                    .fold(0.0, f64::max)
            };
        if emulated {
            assert_eq!(plain.0, offloaded.0, "losses at {seq} tokens");
            assert_eq!(plain.4, offloaded.4, "gradient norms at {seq} tokens");
            assert_eq!(
                adapter_diff(&plain.1, &offloaded.1),
                0.0,
                "adapter at {seq} tokens"
            );
        } else {
            // A real GPU's attention backward adds dQ into float32 atomically, in the order its blocks run, so two
            // plain runs differ too once a query sees several key tiles (an H200 at 4,096 tokens: step 1's
            // gradient norm 0.34671 against 0.34699, step 2's loss 1.3e-5 apart). The forward is deterministic:
            // step 1's loss is the same bit for bit; the rest is held to 10 times that noise, for a repeat of
            // the plain run as for the offloaded one (an input brought back wrong moves the norm by far more).
            let again = run(false, "again");
            eprintln!(
                "{seq} tokens: losses {:?} / again {:?} / offloaded {:?}; grad norms {:?} / {:?} / {:?}; adapter \
                 max diff again {:e}, offloaded {:e}",
                plain.0,
                again.0,
                offloaded.0,
                plain.4,
                again.4,
                offloaded.4,
                adapter_diff(&plain.1, &again.1),
                adapter_diff(&plain.1, &offloaded.1)
            );
            let relative = |a: &[f64], b: &[f64]| {
                a.iter()
                    .zip(b)
                    .map(|(x, y)| (x - y).abs() / y.abs())
                    .fold(0.0, f64::max)
            };
            for (name, other) in [("a repeat", &again), ("the offloaded run", &offloaded)] {
                assert_eq!(
                    plain.0[0], other.0[0],
                    "{name}'s first loss at {seq} tokens"
                );
                assert!(
                    relative(&other.0, &plain.0) <= 1e-4,
                    "{name}'s losses at {seq} tokens"
                );
                assert!(
                    relative(&other.4, &plain.4) <= 1e-2,
                    "{name}'s gradient norms at {seq} tokens"
                );
            }
        }
        let input_bytes = seq as u64 * hidden * e;
        let pinned = offloaded.2["host_pinned_bytes"].as_u64().unwrap();
        assert_eq!(pinned, (layers as u64 + 1) * input_bytes);
        assert!(plain.2.get("host_pinned_bytes").is_none());
        let predicted = estimate(&config, &offload_test_estimate(seq, &lora, true)).unwrap();
        assert_eq!(predicted.host_bytes, pinned);
        let (plain_peak, offloaded_peak) = (timeline_peak(&plain.2), timeline_peak(&offloaded.2));
        let counted = pool_share(&predicted) as f64;
        eprintln!(
            "{seq} tokens, {layers} layers: pool peak {plain_peak} -> {offloaded_peak} bytes offloaded (estimate \
             {counted}, ratio {:.3}); {pinned} bytes pinned",
            counted / offloaded_peak as f64
        );
        assert!(
            offloaded_peak < plain_peak,
            "{plain_peak} -> {offloaded_peak}"
        );
        assert!(
            (counted / offloaded_peak as f64 - 1.0).abs() <= 0.10,
            "estimate {counted} vs the pool's peak {offloaded_peak}"
        );
        if emulated {
            // The second step (buffers pinned in the first): what offloading adds to the copies and the waits.
            let delta = |snapshots: &[serde_json::Value], path: &[&str]| {
                let at =
                    |s: &serde_json::Value| path.iter().fold(s, |v, k| &v[*k]).as_u64().unwrap();
                at(&snapshots[1]) - at(&snapshots[0])
            };
            let added = |path: &[&str]| delta(&offloaded.3, path) - delta(&plain.3, path);
            let copies = layers as u64 + 1;
            for direction in ["device_to_host", "host_to_device"] {
                assert_eq!(
                    added(&["copies", direction, "count"]),
                    copies,
                    "{direction}"
                );
                assert_eq!(
                    added(&["copies", direction, "bytes"]),
                    copies * input_bytes,
                    "{direction}"
                );
            }
            assert_eq!(
                delta(&offloaded.3, &["waits", "host"]),
                delta(&plain.3, &["waits", "host"]),
                "the copies add no host synchronization"
            );
            assert!(added(&["waits", "stream"]) >= 4 * copies);
        }
    }
}

/// LoRA r = 16, alpha 32 on every linear layer: the adapter of the memory tests.
fn all_linear_lora() -> LoraConfig {
    LoraConfig {
        r: 16,
        lora_alpha: 32.0,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    }
}

/// A run's `memory_timeline.json` in `out`.
fn read_timeline(out: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(out.join("memory_timeline.json")).unwrap())
        .unwrap()
}

/// The pool's highest peak in a memory timeline.
fn timeline_peak(timeline: &serde_json::Value) -> u64 {
    timeline["peak"][0]["peak"].as_u64().unwrap()
}

/// What the memory pool holds at the peak by an estimate: weights, adapter, gradients and activations (the CUDA
/// context and the optimizer's state live outside it or come after it).
fn pool_share(e: &candle_qlora::memory::Estimate) -> u64 {
    e.weights_bytes + e.lora_bytes + e.gradients_bytes + e.activations_bytes
}

/// The offload tests' runs: one step of batch 1 into `out`, no checkpoint saved, checkpointing, paged 8-bit AdamW, in
/// [`training_half`].
fn offload_test_args(out: &std::path::Path, activation_offloading: bool) -> TrainingArguments {
    in_training_half(TrainingArguments {
        output_dir: out.display().to_string(),
        per_device_train_batch_size: 1,
        max_steps: 1,
        save_strategy: candle_qlora::trainer::IntervalStrategy::No,
        gradient_checkpointing: true,
        activation_offloading,
        optim: OptimizerName::PagedAdamW8bit,
        ..Default::default()
    })
}

/// The estimate's arguments for the offload tests' runs: one row of `seq` tokens, NF4, `lora`, paged 8-bit AdamW,
/// checkpointing, on CUDA in [`training_half`].
fn offload_test_estimate(
    seq: usize,
    lora: &LoraConfig,
    activation_offloading: bool,
) -> candle_qlora::memory::EstimateArgs {
    candle_qlora::memory::EstimateArgs {
        batch: 1,
        seq,
        lora_r: lora.r,
        target_modules: lora.target_modules.clone(),
        optim: OptimizerName::PagedAdamW8bit,
        gradient_checkpointing: true,
        activation_offloading,
        quantize: true,
        device: candle_qlora::memory::DeviceKind::Cuda,
        dtype: Some(candle_qlora::precision::TorchDtype::of(training_half())),
        ..Default::default()
    }
}

/// A GPU whose memory lies between the offloaded and the plain run's estimates (a ballast tensor leaves that much):
/// with `activation_offloading` the run trains, without it it stops with the out-of-memory report. On the emulated
/// device only, whose pool counts every byte as allocated: a real GPU's allocator rounds and caches, and its
/// context lives outside the pool. A narrow, deep Llama (64 layers of width 128, LoRA on q/v) so that the layer
/// inputs offload saves are most of the peak: the estimates lie about 25% either side of the capacity, beyond
/// their 10% accuracy (the offloaded run's pool use came 12% above its estimate here).
#[test]
fn a_gpu_between_the_estimates_trains_offloaded_and_runs_out_of_memory_without() {
    use candle_qlora::memory::estimate;
    if emulator_counters().is_none() {
        eprintln!("skipped: a real GPU's free memory is not the pool's (this test runs on the emulated device)");
        return;
    }
    let dev = gpu();
    let dir = tempfile::tempdir().unwrap();
    let (layers, seq) = (64, 512);
    let widths = LlamaWidths {
        hidden: 128,
        intermediate: 256,
        heads: 2,
        kv_heads: 1,
        vocab: 512,
        positions: seq,
    };
    let folder = random_llama(dir.path(), layers, &widths);
    let config = candle_qlora::loading::load_model_config(folder.to_str().unwrap(), None).unwrap();
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: Some(TargetModules::List(vec!["q_proj".into(), "v_proj".into()])),
        ..Default::default()
    };
    let pool_peak = |activation_offloading| {
        pool_share(
            &estimate(
                &config,
                &offload_test_estimate(seq, &lora, activation_offloading),
            )
            .unwrap(),
        )
    };
    let (plain, offloaded) = (pool_peak(false), pool_peak(true));
    let capacity = (plain + offloaded) / 2;
    eprintln!(
        "estimates: {offloaded} bytes offloaded, {plain} plain; the GPU left with {capacity}"
    );
    assert!(
        capacity as f64 >= 1.2 * offloaded as f64 && plain as f64 >= 1.2 * capacity as f64,
        "the estimates are too close for the check: {offloaded} and {plain}"
    );
    let free = stats(&dev).available.unwrap();
    let ballast_bytes = (free - capacity) / 4 * 4;
    let _ballast = Tensor::zeros((ballast_bytes / 4) as usize, DType::F32, &dev).unwrap();
    let train = |activation_offloading: bool| {
        let out = dir
            .path()
            .join(format!("offloaded-{activation_offloading}"));
        let args = offload_test_args(&out, activation_offloading);
        let rows = synthetic_rows_in(1, seq, widths.vocab);
        Trainer::new(nf4_model_on_gpu(&folder), args, &lora, rows, vec![])
            .and_then(|mut trainer| trainer.train(None))
    };
    let log = train(true).expect("the offloaded run fits");
    assert_eq!(log.global_step, 1);
    let peak = timeline_peak(&read_timeline(&dir.path().join("offloaded-true")));
    eprintln!(
        "the offloaded run's pool peak: {} bytes beside the ballast",
        peak - ballast_bytes
    );
    let err = train(false).expect_err("the plain run does not fit");
    let Error::OutOfMemory(report) = &err else {
        panic!("expected the out-of-memory report, got: {err}");
    };
    assert!(report.contains("out of memory at step 1"), "{report}");
    assert!(report.contains("activation_offloading = true"), "{report}");
}

/// The emulated device's counters (tools/cuda-emu exports `cuemu_counters`), or `None` on a real GPU, whose
/// transfers `scripts/count_transfers.c` counts through CUPTI instead.
fn emulator_counters() -> Option<serde_json::Value> {
    let name = std::ffi::CString::new("cuemu_counters").unwrap();
    // SAFETY: dlsym with RTLD_DEFAULT only looks the name up in the loaded objects.
    let symbol = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    if symbol.is_null() {
        return None;
    }
    // SAFETY: the emulator exports `const char *cuemu_counters(void)`, a JSON string valid until the next call.
    let json = unsafe {
        let counters: extern "C" fn() -> *const std::ffi::c_char = std::mem::transmute(symbol);
        std::ffi::CStr::from_ptr(counters())
            .to_string_lossy()
            .into_owned()
    };
    Some(serde_json::from_str(&json).unwrap())
}

/// Snapshots of the emulator's counters at the end of every optimizer step.
struct CounterSnapshots(std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>);

impl candle_qlora::trainer::TrainerCallback for CounterSnapshots {
    fn name(&self) -> &str {
        "CounterSnapshots"
    }
    fn on_step_end(
        &mut self,
        _: &TrainingArguments,
        _: &candle_qlora::trainer::TrainerState,
        _: &mut candle_qlora::trainer::TrainerControl,
    ) -> candle_qlora::Result<()> {
        self.0.lock().unwrap().extend(emulator_counters());
        Ok(())
    }
}

/// A training step on the GPU moves nothing between host and device but the micro-batch in (token ids and
/// labels) and one small read out (the loss and the gradient norm): weights, adapter, gradients and optimizer state
/// stay on the device. Counted by the emulated device between the ends of two steady-state steps of a QLoRA run as
/// users run it (a SmolLM2-shaped model, NF4, bf16, LoRA on every linear, 8-bit AdamW, checkpointing), so the
/// crate's kernels are the path measured.
#[test]
fn a_training_step_copies_only_the_batch_in_and_one_small_read_out() {
    if emulator_counters().is_none() {
        eprintln!(
            "skipped: a real GPU's transfers are counted by scripts/count_transfers.c (CUPTI), not this test"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let folder = random_smollm2(dir.path(), 2);
    let model = nf4_model_on_gpu(&folder);
    let (rows, seq) = (2, 32);
    let data = synthetic_rows(8, seq);
    let args = in_training_half(TrainingArguments {
        output_dir: dir.path().join("run").display().to_string(),
        per_device_train_batch_size: rows,
        max_steps: 4,
        save_strategy: candle_qlora::trainer::IntervalStrategy::No,
        gradient_checkpointing: true,
        optim: OptimizerName::AdamW8bit,
        ..Default::default()
    });
    let lora = LoraConfig {
        r: 8,
        lora_alpha: 16.0,
        target_modules: Some(TargetModules::AllLinear),
        ..Default::default()
    };
    let mut trainer = Trainer::new(model, args, &lora, data, vec![]).unwrap();
    let snapshots = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    trainer.add_callback(Box::new(CounterSnapshots(snapshots.clone())));
    trainer.train(None).unwrap();
    let snapshots = snapshots.lock().unwrap();
    assert_eq!(snapshots.len(), 4);
    let delta = |direction: &str, what: &str| {
        snapshots[2]["copies"][direction][what].as_u64().unwrap()
            - snapshots[1]["copies"][direction][what].as_u64().unwrap()
    };
    let (h2d, h2d_bytes) = (
        delta("host_to_device", "count"),
        delta("host_to_device", "bytes"),
    );
    let (d2h, d2h_bytes) = (
        delta("device_to_host", "count"),
        delta("device_to_host", "bytes"),
    );
    eprintln!("step 3: {h2d} copies in ({h2d_bytes} bytes), {d2h} out ({d2h_bytes} bytes)");
    let batch_bytes = (rows * seq * (4 + 8)) as u64; // ids (u32) and labels (i64)
    assert!(
        h2d <= 2 && h2d_bytes <= batch_bytes,
        "{h2d} copies in ({h2d_bytes} bytes; the batch is {batch_bytes})"
    );
    assert!(
        d2h == 1 && d2h_bytes <= 16,
        "{d2h} copies out, {d2h_bytes} bytes"
    );
}

/// Greedy generation with a trained adapter (LoRA B non-zero) on the GPU — the 4-bit decoding product and the
/// LoRA decoding path — gives the CPU's tokens, and the same logits to float32 noise.
#[test]
fn generation_with_an_adapter_on_the_gpu_matches_the_cpu() {
    use candle_qlora::adapter::Adapters;
    use candle_qlora::models::{generate, GenerationConfig};
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("trained");
    tiny_trainer(&Device::Cpu, &out, crate::trainer::examples(), 0.0, |a| {
        a.max_steps = 3;
        a.learning_rate = 2e-2;
    })
    .train(None)
    .unwrap();
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..Default::default()
    };
    let load = |device: &Device| {
        let mut model = load_model(
            data_path("models/tiny-llama").to_str().unwrap(),
            None,
            &opts,
        )
        .unwrap()
        .model
        .to_device(device)
        .unwrap();
        candle_qlora::adapter::load_adapter(&mut model, &out, "trained").unwrap();
        model.set_adapter("trained").unwrap();
        model
    };
    let (cpu, gpu_model) = (load(&Device::Cpu), load(&gpu()));
    let prompt = [1u32, 15, 27, 3, 44, 9];
    let config = GenerationConfig {
        eos_token_ids: Some(vec![]),
        ..GenerationConfig::greedy(12)
    };
    let on_cpu = generate(&cpu, &prompt, &config, |_| Ok(())).unwrap();
    let on_gpu = generate(&gpu_model, &prompt, &config, |_| Ok(())).unwrap();
    assert_eq!(on_cpu.len(), 12);
    assert_eq!(on_gpu, on_cpu);
    // The adapter changes what is generated, so the adapter's decoding path was exercised.
    let mut base = load(&gpu());
    base.disable_adapters();
    let without = generate(&base, &prompt, &config, |_| Ok(())).unwrap();
    assert_ne!(
        without, on_gpu,
        "the trained adapter should change greedy decoding"
    );
}

/// The decoding product straight from 4-bit codes equals `x · dequantize(W)ᵀ` on the CPU (to float32 summation
/// order), for NF4 and FP4, plain and nested scales, 1 to 8 rows, every dtype, including the fallback when fused
/// kernels are off.
#[test]
fn four_bit_decoding_product_matches_the_cpu() {
    use candle_qlora::quant::QuantType;
    let dev = gpu();
    for (quant_type, double_quant, (out, inp)) in [
        (QuantType::Nf4, true, (1536, 576)),
        (QuantType::Nf4, false, (33, 320)),
        (QuantType::Fp4, true, (7, 4160)),
    ] {
        let w = Tensor::randn(0f32, 1.0, (out, inp), &Device::Cpu).unwrap();
        let config = QuantConfig {
            quant_type,
            double_quant,
            ..QuantConfig::nf4()
        };
        let q = Nf4Tensor::quantize(&w, &config).unwrap();
        let on_gpu = DeviceNf4::new(&q, &dev).unwrap();
        for rows in [1, 3, DeviceNf4::MATVEC_MAX_ROWS] {
            let x = Tensor::randn(0f32, 1.0, (rows, inp), &Device::Cpu).unwrap();
            let want = x
                .matmul(&q.dequantize(DType::F32).unwrap().t().unwrap())
                .unwrap();
            for dtype in gpu_dtypes() {
                let xd = x.to_dtype(dtype).unwrap();
                let want = xd
                    .to_dtype(DType::F32)
                    .unwrap()
                    .matmul(&q.dequantize(DType::F32).unwrap().t().unwrap())
                    .unwrap();
                let got = on_gpu.matvec(&xd.to_device(&dev).unwrap()).unwrap();
                assert_eq!(got.dims(), &[rows, out]);
                assert_eq!(got.dtype(), dtype);
                let got = got
                    .to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap();
                let scale = want.abs().unwrap().max_keepdim(1).unwrap().max(0).unwrap();
                let scale = scale.flatten_all().unwrap().to_vec1::<f32>().unwrap()[0] as f64;
                let tolerance = match dtype {
                    DType::F32 => 1e-5,
                    DType::BF16 => 1e-2,
                    _ => 2e-3,
                } * scale.max(1.0);
                let d = crate::common::max_abs_diff(&got, &want);
                assert!(
                    d <= tolerance,
                    "{quant_type:?} double={double_quant} {rows}×{inp} {dtype:?}: {d} > {tolerance}"
                );
            }
            drop(want);
        }
    }
}

/// A run checkpointed on one device resumes on the other, GPU → CPU and CPU → GPU, to the uninterrupted run's
/// losses and adapter (to float32 noise): the checkpoint holds the 8-bit paged optimizer state (in pinned host
/// memory on the GPU), the RNG and the data position, not where they were computed.
#[test]
fn runs_resume_across_devices() {
    let dir = tempfile::tempdir().unwrap();
    let edit = |a: &mut TrainingArguments| {
        a.max_steps = 4;
        a.save_steps = 2.0;
        a.optim = OptimizerName::PagedAdamW8bit;
    };
    let read = |d: &std::path::Path| {
        candle_core::safetensors::load(d.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
    };
    let losses = |log: &candle_qlora::trainer::TrainOutput| -> Vec<f64> {
        log.log_history.iter().filter_map(|e| e.loss).collect()
    };
    for (first, second, name) in [
        (gpu(), Device::Cpu, "gpu-cpu"),
        (Device::Cpu, gpu(), "cpu-gpu"),
    ] {
        let whole = dir.path().join(format!("{name}-whole"));
        let log = tiny_trainer(&first, &whole, crate::trainer::examples(), 0.1, edit)
            .train(None)
            .unwrap();
        let resumed = dir.path().join(format!("{name}-resumed"));
        let log2 = tiny_trainer(&second, &resumed, crate::trainer::examples(), 0.1, edit)
            .train(Some(&whole.join("checkpoint-2")))
            .unwrap();
        let (a, b) = (losses(&log), losses(&log2));
        assert_eq!(a.len(), 4);
        assert_eq!(
            a[..2],
            b[..2],
            "{name}: the resumed log keeps the first run's losses"
        );
        for (x, y) in a.iter().zip(&b) {
            assert!(
                (x - y).abs() <= 1e-4 * x.abs().max(1.0),
                "{name}: {a:?} vs {b:?}"
            );
        }
        let (fa, fb) = (read(&whole), read(&resumed));
        for (k, t) in &fa {
            let d = crate::common::max_abs_diff(t, &fb[k]);
            assert!(d < 1e-3, "{name} {k}: {d}");
        }
    }
}

/// The real test model (SmolLM2-135M) in NF4 trained for a few short steps on the GPU: its losses and adapter
/// match the same run on the CPU (losses within 1e-3 relative, adapter within 2e-3 absolute: float32 compute on
/// both, reduction orders differ).
#[test]
fn smollm2_qlora_on_the_gpu_matches_the_cpu() {
    let Some(path) = crate::common::test_model() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let opts = LoadOptions {
        quantization: Some(QuantConfig::nf4()),
        ..Default::default()
    };
    let loaded = load_model(path.to_str().unwrap(), None, &opts).unwrap();
    let tokenizer = loaded.tokenizer.clone().unwrap();
    let data: Vec<TokenizedExample> = [
        "The capital of France is Paris.",
        "Water boils at one hundred degrees.",
        "Rust is a systems programming language.",
        "A QLoRA adapter is small.",
    ]
    .iter()
    .map(|t| {
        candle_qlora::data::Example::Text(t.to_string())
            .tokenize(&tokenizer, 16, false)
            .unwrap()
    })
    .collect();
    let run = |device: &Device, name: &str| {
        let out = dir.path().join(name);
        let model = load_model(path.to_str().unwrap(), None, &opts)
            .unwrap()
            .model
            .to_device(device)
            .unwrap();
        let args = TrainingArguments {
            output_dir: out.display().to_string(),
            per_device_train_batch_size: 2,
            max_steps: 2,
            learning_rate: 1e-3,
            logging_steps: 1.0,
            save_strategy: candle_qlora::trainer::IntervalStrategy::No,
            optim: OptimizerName::PagedAdamW8bit,
            ..Default::default()
        };
        let lora = LoraConfig {
            r: 8,
            lora_alpha: 16.0,
            target_modules: Some(TargetModules::AllLinear),
            ..Default::default()
        };
        let log = Trainer::new(model, args, &lora, data.clone(), vec![])
            .unwrap()
            .train(None)
            .unwrap();
        let losses: Vec<f64> = log.log_history.iter().filter_map(|e| e.loss).collect();
        (losses, read_adapter(&out))
    };
    let (cpu_losses, cpu_adapter) = run(&Device::Cpu, "cpu");
    let (gpu_losses, gpu_adapter) = run(&gpu(), "gpu");
    assert_eq!(cpu_losses.len(), 2);
    assert_runs_agree(
        "SmolLM2 cpu vs gpu",
        (&cpu_losses, &cpu_adapter),
        (&gpu_losses, &gpu_adapter),
        1e-3,
        2e-3,
    );
}

/// Asserts that two runs agree: each loss within `loss_tol` relative (to at least 1), every adapter tensor within
/// `adapter_tol` absolute.
fn assert_runs_agree(
    what: &str,
    (a_losses, a_adapter): (&[f64], &std::collections::HashMap<String, Tensor>),
    (b_losses, b_adapter): (&[f64], &std::collections::HashMap<String, Tensor>),
    loss_tol: f64,
    adapter_tol: f64,
) {
    assert_eq!(a_losses.len(), b_losses.len(), "{what}");
    for (a, b) in a_losses.iter().zip(b_losses) {
        assert!(
            (a - b).abs() <= loss_tol * a.abs().max(1.0),
            "{what}: {a_losses:?} vs {b_losses:?}"
        );
    }
    for (k, t) in a_adapter {
        let d = crate::common::max_abs_diff(t, &b_adapter[k]);
        assert!(d < adapter_tol, "{what}: {k} differs by {d}");
    }
}

fn read_adapter(dir: &std::path::Path) -> std::collections::HashMap<String, Tensor> {
    candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
}

/// The start-time checks of the device against the build: the `cuda` `qlora` run on a GPU of a lower compute
/// capability than the build's kernels, or under a driver older than the build's toolkit, stops before any kernel
/// with an error saying what to rebuild or update. (Which dtypes a GPU and a build can compute in is unit-tested
/// in `precision.rs`.) The emulated device reports the capability and driver version its environment
/// gives it; on a real GPU the test is skipped.
#[test]
fn the_device_is_checked_against_the_build_at_start() {
    if emulator_counters().is_none() {
        eprintln!("skipped: needs the emulated device (its compute capability and driver are set by variables)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("run.toml");
    let data = dir.path().join("train.jsonl");
    std::fs::write(
        &data,
        "{\"text\": \"t1 t2 t3 t4\"}\n{\"text\": \"t5 t6 t7\"}\n",
    )
    .unwrap();
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {:?}\n[lora]\nr = 4\n[data]\ntrain_file = {:?}\n[training]\n\
             output_dir = {:?}\nmax_steps = 1\noverwrite_output_dir = true\n",
            data_path("models/tiny-llama").display().to_string(),
            data.display().to_string(),
            dir.path().join("out").display().to_string(),
        ),
    )
    .unwrap();
    let train = |env: &[(&str, &str)]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args(["train", "--config", config.to_str().unwrap()])
            .envs(env.iter().copied())
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, err) = train(&[("CUDA_EMU_COMPUTE_CAP", "7.0")]);
    assert!(
        !ok && err.contains("compute capability 7.0") && err.contains("CUDA_COMPUTE_CAP=70"),
        "{err}"
    );
    let (ok, err) = train(&[("CUDA_EMU_DRIVER_VERSION", "12020")]);
    assert!(
        !ok && err.contains("supports CUDA 12.2") && err.contains("driver"),
        "{err}"
    );
    // The same configuration runs where the device can.
    let (ok, err) = train(&[("CUDA_EMU_COMPUTE_CAP", "8.6")]);
    assert!(ok, "{err}");
}

/// The emulated device's fast mode (kernels without the access instrumentation, WMMA tiles worked by one lane,
/// blocks on several host threads) computes what its race-check mode does: on one host thread the blocks run in the
/// same order and no two warps of a block add into the same element, so two steps of bf16 QLoRA training of a Llama
/// whose attention runs on the tensor-core kernels (head dim 64, two key tiles) log the same losses and write the
/// same adapter, bit for bit, in both modes. (On a real GPU there are no modes: skipped.)
#[test]
fn the_fast_emulated_mode_trains_as_the_race_check_mode_does() {
    if emulator_counters().is_none() {
        eprintln!("skipped: compares the emulated device's two modes");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let widths = LlamaWidths {
        hidden: 128,
        intermediate: 256,
        heads: 2,
        kv_heads: 1,
        vocab: 128,
        positions: 256,
    };
    let folder = random_llama(dir.path(), 2, &widths);
    add_tiny_tokenizer(&folder);
    let data = dir.path().join("train.jsonl");
    write_word_rows(&data, 4, |_| 120, 5, 40);
    let train = |mode: &str, env: &[(&str, &str)]| {
        let out = dir.path().join(mode);
        let config = dir.path().join(format!("{mode}.toml"));
        std::fs::write(
            &config,
            format!(
                "[model]\nname_or_path = {:?}\n[model.quantization]\nload_in_4bit = true\n\
                 bnb_4bit_compute_dtype = \"bfloat16\"\n[lora]\nr = 4\nlora_alpha = 8\nlora_dropout = 0.0\n\
                 target_modules = \"all-linear\"\n[data]\ntrain_file = {:?}\nformat = \"text\"\nmax_length = 128\n\
                 [training]\noutput_dir = {:?}\nper_device_train_batch_size = 2\nmax_steps = 2\n\
                 learning_rate = 0.005\noptim = \"adamw_torch\"\ngradient_checkpointing = true\nbf16 = true\n\
                 logging_steps = 1\nsave_strategy = \"no\"\nseed = 7\ndisable_tqdm = true\n",
                folder.display().to_string(),
                data.display().to_string(),
                out.display().to_string(),
            ),
        )
        .unwrap();
        let run = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args(["train", "--config", config.to_str().unwrap()])
            .env_remove("CUDA_EMU_FAST")
            .env_remove("CUDA_EMU_RACECHECK")
            .envs(env.iter().copied())
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{mode}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
        let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
        let losses: Vec<u64> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"].as_f64())
            .map(f64::to_bits)
            .collect();
        let adapter = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
        (losses, adapter)
    };
    let (fast_losses, fast_adapter) =
        train("fast", &[("CUDA_EMU_FAST", "1"), ("CUDA_EMU_THREADS", "1")]);
    let (checked_losses, checked_adapter) = train("race-check", &[("CUDA_EMU_RACECHECK", "1")]);
    assert_eq!(fast_losses.len(), 2, "a loss per step");
    assert_eq!(fast_losses, checked_losses, "losses (as bits)");
    assert!(fast_adapter == checked_adapter, "the adapters differ");
}

/// Runs this binary's test `name` as `world` processes (ranks) with torchrun's environment and `scenario`, and
/// returns each rank's success and standard error. The test, started so, plays its rank (see [`rank_role`]).
#[cfg(feature = "nccl")]
fn spawn_ranks(name: &str, world: usize, scenario: &str) -> Vec<(bool, String)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let children: Vec<_> = (0..world)
        .map(|rank| {
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([name, "--exact", "--test-threads", "1", "--nocapture"])
                .envs([
                    ("RANK", rank.to_string()),
                    ("WORLD_SIZE", world.to_string()),
                    ("LOCAL_RANK", rank.to_string()),
                    ("LOCAL_WORLD_SIZE", world.to_string()),
                    ("MASTER_ADDR", "127.0.0.1".into()),
                    ("MASTER_PORT", port.to_string()),
                    ("QLORA_TEST_RANK_OF", name.into()),
                    ("QLORA_TEST_SCENARIO", scenario.into()),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            (
                out.status.success(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            )
        })
        .collect()
}

/// The rank this process plays in [`spawn_ranks`]'s test `name` and its scenario, or `None` in the test's own run.
#[cfg(feature = "nccl")]
fn rank_role(name: &str) -> Option<(candle_qlora::distributed::WorldEnv, String)> {
    if std::env::var("QLORA_TEST_RANK_OF").ok()? != name {
        return None;
    }
    let env = candle_qlora::distributed::WorldEnv::from_env()
        .unwrap()
        .unwrap();
    Some((env, std::env::var("QLORA_TEST_SCENARIO").unwrap()))
}

/// NCCL across processes (the emulated libnccl's ranks): three ranks sum f32 and bf16 tensors exactly; a rank that
/// exits stops the others at once with an error naming it; a rank that hangs stops the others at `ddp_timeout`, and
/// itself, arriving late, learns that they left.
#[cfg(feature = "nccl")]
#[test]
fn nccl_ranks_sum_tensors_and_stop_on_a_dead_or_hung_rank() {
    use candle_qlora::distributed::{Communicator, Reduce};
    use std::time::{Duration, Instant};
    const NAME: &str = "cuda::nccl_ranks_sum_tensors_and_stop_on_a_dead_or_hung_rank";
    if let Some((env, scenario)) = rank_role(NAME) {
        let dev = gpu();
        let cuda = dev.as_cuda_device().unwrap();
        let timeout = Duration::from_secs(if scenario == "hangs" { 1 } else { 60 });
        let comm = Communicator::new(cuda, &env, timeout).unwrap();
        let mine = Tensor::full((env.rank + 1) as f32, (3, 1000), &dev).unwrap();
        match (scenario.as_str(), env.rank) {
            ("sums", _) => {
                for dtype in [DType::F32, DType::BF16] {
                    let sum = comm
                        .all_reduce(&mine.to_dtype(dtype).unwrap(), Reduce::Sum, "a test tensor")
                        .unwrap();
                    assert_eq!(sum.dtype(), dtype);
                    let values = sum.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                    assert!(values.to_vec1::<f32>().unwrap().iter().all(|v| *v == 6.0));
                }
            }
            ("dies", 1) => std::process::exit(0),
            ("hangs", 1) => {
                std::thread::sleep(Duration::from_secs(3));
                let err = comm
                    .all_reduce(&mine, Reduce::Sum, "step 1's gradients")
                    .unwrap_err();
                assert!(err.to_string().contains("rank 0 aborted"), "{err}");
            }
            (_, _) => {
                let start = Instant::now();
                let err = comm
                    .all_reduce(&mine, Reduce::Sum, "step 1's gradients")
                    .unwrap_err();
                eprintln!(
                    "RANK-ERROR {err} after {:.1} s",
                    start.elapsed().as_secs_f64()
                );
            }
        }
        return;
    }
    for (ok, err) in spawn_ranks(NAME, 3, "sums") {
        assert!(ok, "{err}");
    }
    let dies = spawn_ranks(NAME, 2, "dies");
    let (ok, err) = &dies[0];
    assert!(*ok, "{err}");
    assert!(
        err.contains("RANK-ERROR distributed training: rank 0 stopped in the all-reduce of step 1's gradients")
            && err.contains("rank 1 exited"),
        "{err}"
    );
    let hangs = spawn_ranks(NAME, 2, "hangs");
    assert!(hangs.iter().all(|(ok, _)| *ok), "{hangs:?}");
    assert!(
        hangs[0].1.contains(
            "RANK-ERROR distributed training: rank 0: the all-reduce of step 1's gradients did not finish within \
             ddp_timeout (1 s)"
        ),
        "{}",
        hangs[0].1
    );
}

/// A run config of the tiny Llama for the distributed tests — NF4 base, LoRA r=4 on every linear without dropout,
/// float32 compute, batches of 2, `accumulation` micro-batches a step, `steps` steps, a checkpoint every
/// `save_steps` — over 16 examples of varied length, written in `dir`; its output folder is `dir/out`.
#[cfg(feature = "nccl")]
fn ddp_config(
    dir: &std::path::Path,
    accumulation: usize,
    steps: usize,
    save_steps: usize,
) -> std::path::PathBuf {
    let data = dir.join("train.jsonl");
    write_word_rows(&data, 16, |i| 5 + i % 6, 5, 40);
    let config = dir.join("run.toml");
    std::fs::write(
        &config,
        format!(
            "[model]\nname_or_path = {:?}\n[model.quantization]\nload_in_4bit = true\n\
             bnb_4bit_compute_dtype = \"float32\"\n[lora]\nr = 4\nlora_alpha = 8\nlora_dropout = 0.0\n\
             target_modules = \"all-linear\"\n[data]\ntrain_file = {:?}\nmax_length = 32\n[training]\n\
             output_dir = {:?}\nper_device_train_batch_size = 2\ngradient_accumulation_steps = {accumulation}\n\
             max_steps = {steps}\nlearning_rate = 0.005\nlogging_steps = 1\nsave_steps = {save_steps}\nseed = 7\n\
             ddp_timeout = 60\ndisable_tqdm = true\n",
            data_path("models/tiny-llama").display().to_string(),
            data.display().to_string(),
            dir.join("out").display().to_string(),
        ),
    )
    .unwrap();
    config
}

/// Where a process started from torchrun's variables stands: rank `rank` of `world`, on a node of `per_node`
/// ranks (its `LOCAL_RANK` is `rank % per_node`), meeting the others on `port`.
#[cfg(feature = "nccl")]
#[derive(Clone, Copy)]
struct RankEnv {
    rank: usize,
    world: usize,
    per_node: usize,
    port: u16,
}

/// `qlora train --config config` with `args`, as the rank `rank` says when given (torchrun's variables), its
/// standard error going to `stderr`. The emulated machine has 4 GPUs.
#[cfg(feature = "nccl")]
fn qlora_train(
    config: &std::path::Path,
    args: &[&str],
    rank: Option<RankEnv>,
    stderr: &std::path::Path,
) -> std::process::Child {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"));
    cmd.args(["train", "--config", config.to_str().unwrap()])
        .args(args)
        .env("CUDA_EMU_DEVICES", "4")
        .env("CUDA_EMU_MEMORY", "2GiB")
        // On the emulated device each process writes its counters beside its standard error (`rank_counters`).
        .env(
            "CUDA_EMU_COUNTERS",
            stderr.with_file_name("emu-counters-%p.json"),
        )
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(stderr).unwrap());
    for v in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        cmd.env_remove(v);
    }
    if let Some(r) = rank {
        cmd.envs([
            ("RANK", r.rank.to_string()),
            ("LOCAL_RANK", (r.rank % r.per_node).to_string()),
            ("WORLD_SIZE", r.world.to_string()),
            ("LOCAL_WORLD_SIZE", r.per_node.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", r.port.to_string()),
        ]);
    }
    cmd.spawn().unwrap()
}

/// The values of `key` in a run's log, in order.
#[cfg(feature = "nccl")]
fn logged(out: &std::path::Path, key: &str) -> Vec<f64> {
    let log = std::fs::read_to_string(out.join("log.jsonl")).unwrap();
    log.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()[key].as_f64())
        .collect()
}

/// The losses of a run's log and its adapter.
#[cfg(feature = "nccl")]
fn run_outcome(out: &std::path::Path) -> (Vec<f64>, std::collections::HashMap<String, Tensor>) {
    (logged(out, "loss"), read_adapter(out))
}

/// Waits until rank 0 of the run in `dir` has logged `steps` steps (its standard error is `dir/stderr-0`, or
/// `dir/stderr` for a launcher), failing after 5 minutes.
#[cfg(feature = "nccl")]
fn wait_for_steps(dir: &std::path::Path, steps: usize) {
    let started = std::time::Instant::now();
    while std::fs::read_to_string(dir.join("out/log.jsonl"))
        .map_or(true, |l| l.lines().count() < steps)
    {
        let stderr = ["stderr-0", "stderr"]
            .iter()
            .find_map(|f| std::fs::read_to_string(dir.join(f)).ok())
            .unwrap_or_default();
        assert!(
            started.elapsed().as_secs() < 300,
            "rank 0 logged no step: {stderr}"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

#[cfg(feature = "nccl")]
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Data-parallel training with the launcher (`--nproc-per-node`) on 2 and 4 emulated GPUs gives the loss curve and
/// adapter of one process whose accumulation is 4 (the same 8 examples a step, the ranks' gradients summed): equal
/// to float32 reduction-order noise (losses 1e-5 relative, adapter 1e-4), across an epoch's end. The evaluation
/// after each step, sharded over the ranks (3 batches: on 4 ranks one has none), gives one process's loss (1e-6
/// relative: the same batches, summed in another order).
#[cfg(feature = "nccl")]
#[test]
fn ddp_on_2_and_4_ranks_equals_one_process_accumulating_as_much() {
    let root = tempfile::tempdir().unwrap();
    let eval_file = write_eval_rows(root.path());
    let run = |name: &str, accumulation: usize, nproc: Option<usize>| {
        evaluated_run(root.path(), name, &eval_file, accumulation, nproc, &[])
    };
    let (single_losses, single, single_eval, _) = run("single", 4, None);
    assert_eq!((single_losses.len(), single_eval.len()), (3, 3));
    for (name, accumulation, nproc) in [("two", 2, 2), ("four", 1, 4)] {
        let (losses, adapter, eval, _) = run(name, accumulation, Some(nproc));
        assert_runs_agree(
            name,
            (&single_losses, &single),
            (&losses, &adapter),
            1e-5,
            1e-4,
        );
        assert_eq!(eval.len(), 3, "{name}");
        for (a, b) in single_eval.iter().zip(&eval) {
            assert!(
                (a - b).abs() <= 1e-6 * a.abs(),
                "{name}: {single_eval:?} vs {eval:?}"
            );
        }
    }
}

/// Six short evaluation rows in `dir/eval.jsonl` (three batches of two: uneven over 2 and 4 ranks), and the
/// `--set` that names them.
#[cfg(feature = "nccl")]
fn write_eval_rows(dir: &std::path::Path) -> String {
    let eval = dir.join("eval.jsonl");
    let rows: String = (0..6)
        .map(|i| {
            format!(
                "{{\"text\": \"t{} t{} t{} t{}\"}}\n",
                i + 2,
                3 * i + 1,
                i + 9,
                40 - i
            )
        })
        .collect();
    std::fs::write(&eval, rows).unwrap();
    format!("data.eval_file={:?}", eval.display().to_string())
}

/// What a sharded rank says in its standard error (`fsdp: rank r of n holds … (X B) of the sharded weights' …
/// (Y B) — …; the host heap peaked … (Z B) above its start while loading`), one per rank.
#[cfg(feature = "nccl")]
struct FsdpReport {
    /// Bytes of the sharded weights the rank holds.
    held: u64,
    /// Bytes of the whole weights.
    whole: u64,
    /// How far its host heap rose while loading.
    loading_heap: u64,
    /// Bytes of the files it read for the weights it read in parts, and their whole stored bytes (`(0, 0)` alone).
    read: (u64, u64),
}

#[cfg(feature = "nccl")]
fn fsdp_reports(stderr: &str) -> Vec<FsdpReport> {
    stderr
        .lines()
        .filter(|l| l.contains("fsdp: rank") && l.contains(" holds "))
        .map(|l| {
            // Every `(N B)` of the line, in order.
            let bytes: Vec<u64> = l
                .split(" B)")
                .filter_map(|part| part.rsplit_once('(')?.1.parse().ok())
                .collect();
            let read = match bytes.len() {
                3 => (0, 0),
                5 => (bytes[2], bytes[3]),
                _ => panic!("{l}"),
            };
            FsdpReport {
                held: bytes[0],
                whole: bytes[1],
                loading_heap: bytes[bytes.len() - 1],
                read,
            }
        })
        .collect()
}

/// Each rank's all-gathers as it says at the end of training: `(started, started ahead of use)`.
#[cfg(feature = "nccl")]
fn fsdp_gather_reports(stderr: &str) -> Vec<(u64, u64)> {
    stderr
        .lines()
        .filter_map(|l| {
            let rest = l.split_once("fsdp: rank ")?.1.split_once(" started ")?.1;
            let (ahead, rest) = rest.split_once(" of its ")?;
            let all = rest.split_once(' ')?.0;
            Some((all.parse().ok()?, ahead.parse().ok()?))
        })
        .collect()
}

/// The emulator's counters of each process of a `qlora_train` run whose standard error went to `dir/…` that ran
/// a collective (its ranks), as they wrote them at exit; none on a real GPU.
#[cfg(feature = "nccl")]
fn rank_counters(dir: &std::path::Path) -> Vec<serde_json::Value> {
    process_counters(dir)
        .into_iter()
        .filter(|c: &serde_json::Value| c["collectives"]["count"].as_u64() > Some(0))
        .collect()
}

/// The emulated device's counters of every process of the run in `dir` (none on a real GPU).
#[cfg(feature = "nccl")]
fn process_counters(dir: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let path = e.unwrap().path();
            let name = path.file_name()?.to_str()?.to_string();
            name.starts_with("emu-counters-").then_some(path)
        })
        .map(|path| serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap())
        .collect()
}

/// One `qlora train` of `ddp_config(root/name, accumulation, 3 steps)` with an evaluation every step on `eval_file`
/// (`write_eval_rows`), on `nproc` ranks through the launcher (one process without), with `extra` flags: its losses,
/// adapter, evaluation losses and standard error.
#[cfg(feature = "nccl")]
fn evaluated_run(
    root: &std::path::Path,
    name: &str,
    eval_file: &str,
    accumulation: usize,
    nproc: Option<usize>,
    extra: &[&str],
) -> (
    Vec<f64>,
    std::collections::HashMap<String, Tensor>,
    Vec<f64>,
    String,
) {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    let config = ddp_config(&dir, accumulation, 3, 100);
    let n = nproc.map(|n| n.to_string());
    let mut args: Vec<&str> = vec![
        "--set",
        eval_file,
        "--set",
        "training.eval_strategy=\"steps\"",
        "--set",
        "training.per_device_eval_batch_size=2",
    ];
    args.extend(extra);
    if let Some(n) = &n {
        args.extend(["--nproc-per-node", n]);
    }
    let status = qlora_train(&config, &args, None, &dir.join("stderr"))
        .wait()
        .unwrap();
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
    assert!(status.success(), "{name}: {err}");
    let (losses, adapter) = run_outcome(&dir.join("out"));
    (losses, adapter, logged(&dir.join("out"), "eval_loss"), err)
}

/// FSDP (`fsdp = "full_shard"`) on 2 and 4 emulated GPUs over NCCL, each rank holding 1/N of every layer's 4-bit
/// weights and gathering the rest per layer (forward and recomputation): the 2-rank run, with its shards on the GPU
/// or offloaded to host memory, equals the data-parallel run on 2 ranks bit for bit (losses and adapter); the runs
/// equal one process accumulating as much, and so do the sharded evaluations — whose 3 batches leave a rank short,
/// which then runs a padding pass so the gathers pair up. Each rank says it holds 1/N of the sharded weights (within
/// the padding of its buffers). The runs prefetch the next layer in the forward and the backward (2 ranks), in the
/// backward (offloaded) or not at all (4 ranks): each gather started ahead of use is one the emulated device saw
/// overlap the compute stream's kernels. One process with its shares offloaded (copied back on a stream of their
/// own) equals the plain one-process run bit for bit.
#[cfg(feature = "nccl")]
#[test]
fn fsdp_on_2_and_4_ranks_equals_data_parallel_and_one_process() {
    let root = tempfile::tempdir().unwrap();
    let eval_file = write_eval_rows(root.path());
    let run = |name: &str,
               accumulation: usize,
               nproc: Option<usize>,
               fsdp: Option<&str>,
               fsdp_config: Option<&str>| {
        let fsdp = fsdp.map(|f| format!("training.fsdp={f:?}"));
        let mut extra = vec!["--set", "training.gradient_checkpointing=true"];
        for set in fsdp.as_deref().into_iter().chain(fsdp_config) {
            extra.extend(["--set", set]);
        }
        let (losses, adapter, eval, err) =
            evaluated_run(root.path(), name, &eval_file, accumulation, nproc, &extra);
        (losses, adapter, eval, err)
    };
    let (single_losses, single, single_eval, _) = run("single", 4, None, None, None);
    assert_eq!((single_losses.len(), single_eval.len()), (3, 3));
    // One process, its shares offloaded: each layer comes back from pinned memory on a stream of its own (with
    // both prefetches the next layer's copy runs beside this layer's compute): the plain run, bit for bit.
    let (losses, adapter, eval, _) = run(
        "fsdp-one-offload",
        4,
        None,
        Some("full_shard offload"),
        Some("training.fsdp_config={forward_prefetch=true}"),
    );
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&losses), bits(&single_losses), "offloaded: losses");
    assert_eq!(bits(&eval), bits(&single_eval), "offloaded: evaluations");
    for (key, t) in &single {
        assert_eq!(
            crate::common::tensor_bytes(t),
            crate::common::tensor_bytes(&adapter[key]),
            "offloaded: {key}"
        );
    }
    // On the emulated device, some of the shares' copies overlapped the compute stream's kernels (the prefetched
    // ones; the plain run's copies never do).
    for (name, overlapping) in [("fsdp-one-offload", true), ("single", false)] {
        let counters = process_counters(&root.path().join(name));
        assert!(counters.len() <= 1, "{name}: one process");
        if let [counters] = counters.as_slice() {
            let uploads = &counters["async_uploads"];
            eprintln!("{name}: asynchronous uploads {uploads}");
            let overlapped = uploads["overlapped"].as_u64().unwrap();
            assert_eq!(overlapped > 0, overlapping, "{name}: {uploads}");
        }
    }
    let (ddp_losses, ddp, ddp_eval, _) = run("ddp-two", 2, Some(2), None, None);
    let ddp_counters = rank_counters(&root.path().join("ddp-two"));
    // The three ways of prefetching: forward and backward, backward only (the default), none.
    for (name, accumulation, nproc, fsdp, prefetch) in [
        (
            "fsdp-two",
            2,
            2,
            "full_shard auto_wrap",
            "training.fsdp_config={forward_prefetch=true}",
        ),
        ("fsdp-two-offload", 2, 2, "full_shard offload", ""),
        (
            "fsdp-four",
            1,
            4,
            "full_shard",
            "training.fsdp_config={backward_prefetch=\"no_prefetch\"}",
        ),
    ] {
        let prefetch = Some(prefetch).filter(|p| !p.is_empty());
        let (losses, adapter, eval, held) =
            run(name, accumulation, Some(nproc), Some(fsdp), prefetch);
        if nproc == 2 {
            assert_eq!(
                bits(&losses),
                bits(&ddp_losses),
                "{name}: losses against data-parallel"
            );
            assert_eq!(
                bits(&eval),
                bits(&ddp_eval),
                "{name}: evaluations against data-parallel"
            );
            for (key, t) in &ddp {
                assert_eq!(
                    crate::common::tensor_bytes(t),
                    crate::common::tensor_bytes(&adapter[key]),
                    "{name}: {key} against data-parallel"
                );
            }
        }
        assert_runs_agree(
            name,
            (&single_losses, &single),
            (&losses, &adapter),
            1e-5,
            1e-4,
        );
        for (a, b) in single_eval.iter().zip(&eval) {
            assert!(
                (a - b).abs() <= 1e-6 * a.abs(),
                "{name}: {single_eval:?} vs {eval:?}"
            );
        }
        // Every rank reports; its share is 1/N of the whole, plus at most an aligned piece a tensor of padding (7
        // linears of 3 pieces in each of 2 layers; the table and the head).
        let (gathers, err) = (fsdp_gather_reports(&held), held);
        let held = fsdp_reports(&err);
        assert_eq!(held.len(), nproc, "{name}");
        for FsdpReport { held, whole, .. } in &held {
            let (nproc, padding) = (nproc as u64, (7 * 2 * 3 + 2) * 256);
            assert!(
                held * nproc >= *whole && *held <= whole / nproc + padding,
                "{name}: a rank holds {held} of {whole} bytes"
            );
        }
        // Gathers started ahead of use: with both prefetches half of the layers' gathers (2 layers: the second in
        // the forward, the first in the recomputation), fewer with the backward's alone, none without.
        assert_eq!(gathers.len(), nproc, "{name}: {err}");
        let (all, ahead) = gathers
            .iter()
            .fold((0, 0), |(a, b), (all, ahead)| (a + all, b + ahead));
        match prefetch {
            None => assert!(ahead > 0 && 3 * ahead < all, "{name}: {gathers:?}"),
            Some(p) if p.contains("forward") => {
                assert!(3 * ahead >= all && 2 * ahead < all, "{name}: {gathers:?}")
            }
            Some(_) => assert_eq!(ahead, 0, "{name}: {gathers:?}"),
        }
        // On the emulated device: every gather started ahead, and no other, overlapped kernels of the compute
        // stream (queued there before anything waited for it), and the gathers added no host synchronization.
        let counters = rank_counters(&root.path().join(name));
        if !counters.is_empty() {
            let total = |cs: &[serde_json::Value], key: &[&str]| -> u64 {
                cs.iter()
                    .map(|c| key.iter().fold(c, |v, k| &v[k]).as_u64().unwrap())
                    .sum()
            };
            assert_eq!(counters.len(), nproc, "{name}");
            assert_eq!(
                total(&counters, &["collectives", "overlapped"]),
                ahead,
                "{name}: {counters:?}"
            );
            // The data-parallel run's steps, and one synchronization more: making the communicator's stream
            // (the same steps: the 2-rank run; offloaded, the shares' copies to the host add some at the start).
            let per_rank =
                |cs: &[serde_json::Value]| total(cs, &["waits", "host"]) / cs.len() as u64;
            if name == "fsdp-two" {
                assert_eq!(
                    per_rank(&counters),
                    per_rank(&ddp_counters) + 1,
                    "{name}: {all} all-gathers"
                );
            }
        }
    }
}

/// FSDP's memory on 1, 2 and 4 emulated GPUs, one step of a SmolLM2-wide model (4 layers, NF4, bf16, LoRA r=16 on
/// every linear, paged 8-bit AdamW, checkpointing): rank 0's pool peaks within 10% of the run's own estimate, and
/// the base weights it holds (the timeline's breakdown at the peak) are the whole model's less (N − 1)/N of the
/// sharded weights (the layers' linear weights, the embedding table); offloaded, less all of them (they wait in
/// host memory).
#[cfg(feature = "nccl")]
#[test]
fn fsdp_ranks_peak_at_their_estimate_holding_their_share() {
    let root = tempfile::tempdir().unwrap();
    let folder = random_smollm2(root.path(), 4);
    add_tiny_tokenizer(&folder);
    let data = root.path().join("train.jsonl");
    write_word_rows(&data, 8, |_| 120, 7, 50);
    let run = |name: &str, nproc: usize, fsdp: &str| {
        let dir = root.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("run.toml");
        std::fs::write(
            &config,
            format!(
                "[model]\nname_or_path = {:?}\n[model.quantization]\nload_in_4bit = true\n\
                 bnb_4bit_compute_dtype = \"bfloat16\"\n[lora]\nr = 16\nlora_alpha = 16\nlora_dropout = 0.0\n\
                 target_modules = \"all-linear\"\n[data]\ntrain_file = {:?}\nmax_length = 128\n[training]\n\
                 output_dir = {:?}\nper_device_train_batch_size = 2\nmax_steps = 1\nbf16 = true\n\
                 gradient_checkpointing = true\noptim = \"paged_adamw_8bit\"\nsave_strategy = \"no\"\n\
                 logging_steps = 1\ndisable_tqdm = true\nfsdp = {fsdp:?}\nddp_timeout = 60\n",
                folder.display().to_string(),
                data.display().to_string(),
                dir.join("out").display().to_string(),
            ),
        )
        .unwrap();
        let n = nproc.to_string();
        let args: Vec<&str> = match nproc {
            1 => vec![],
            _ => vec!["--nproc-per-node", &n],
        };
        let status = qlora_train(&config, &args, None, &dir.join("stderr"))
            .wait()
            .unwrap();
        let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
        assert!(status.success(), "{name}: {err}");
        let timeline = read_timeline(&dir.join("out"));
        // The estimate's pool share, as `pool_share` counts it.
        let e = &timeline["estimate"]["prediction"];
        let predicted: u64 = [
            "weights_bytes",
            "lora_bytes",
            "gradients_bytes",
            "activations_bytes",
        ]
        .iter()
        .map(|k| e[k].as_u64().unwrap())
        .sum();
        let reports = fsdp_reports(&err);
        assert_eq!(reports.len(), nproc, "{err}");
        (
            timeline_peak(&timeline),
            timeline["peak"][1]["base_weights"].as_u64().unwrap(),
            predicted,
            (reports[0].held, reports[0].whole),
            reports.iter().map(|r| r.loading_heap).max().unwrap(),
        )
    };
    let mut rows = Vec::new();
    for (name, nproc, fsdp) in [
        ("one", 1, "full_shard"),
        ("two", 2, "full_shard"),
        ("four", 4, "full_shard"),
        ("two-offload", 2, "full_shard offload"),
    ] {
        rows.push((
            name,
            nproc,
            fsdp.contains("offload"),
            run(name, nproc, fsdp),
        ));
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "run          measured MiB  estimate MiB  ratio  base weights MiB  sharded MiB of whole"
    );
    for (name, _, _, (peak, base, predicted, (held, whole), heap)) in &rows {
        eprintln!(
            "{name:<12} {:>12.1} {:>13.1} {:>6.3} {:>17.1} {:>9.1} of {:.1}   heap while loading {:.1}",
            mib(*peak),
            mib(*predicted),
            *predicted as f64 / *peak as f64,
            mib(*base),
            mib(*held),
            mib(*whole),
            mib(*heap)
        );
    }
    // What is not the layers' linear weights: embeddings, norms, RoPE tables.
    let (_, _, _, (_, base_one, _, (held_one, _), _)) = rows[0];
    let rest = base_one - held_one;
    for (name, nproc, offload, (peak, base, predicted, (held, _), _)) in &rows {
        assert!(
            (*predicted as f64 / *peak as f64 - 1.0).abs() <= 0.10,
            "{name}: estimate {predicted} vs pool peak {peak}"
        );
        let expected = match offload {
            true => rest,
            false => rest + *held,
        };
        assert_eq!(*base, expected, "{name} ({nproc} ranks): base weights");
    }
}

/// Loading a sharded model streams it: each rank's linear weights stay in their files until their layer moves to
/// its GPU, where each rank reads and quantizes its half of every weight and the ranks gather it, so a rank's host
/// heap while loading does not grow with the model's layers. Two models of 2 and 10 layers (tiny vocabulary, so the
/// layers are most of the weights) on 2 emulated GPUs: each rank read half the weights' bytes, and the larger
/// model's loading peak is within one layer's 4-bit weights of the smaller one's (a whole load would hold 8 more).
#[cfg(feature = "nccl")]
#[test]
fn fsdp_loading_holds_one_tensor_on_the_host_not_the_model() {
    let root = tempfile::tempdir().unwrap();
    let widths = LlamaWidths {
        hidden: 256,
        intermediate: 1024,
        heads: 4,
        kv_heads: 2,
        vocab: 512,
        positions: 512,
    };
    let h = widths.hidden;
    let layer_params = 2 * h * h + 2 * h * (2 * 64) + 3 * h * widths.intermediate;
    let loading_heap = |layers: usize| {
        let dir = root.path().join(format!("layers-{layers}"));
        std::fs::create_dir_all(&dir).unwrap();
        let folder = random_llama(&dir, layers, &widths);
        add_tiny_tokenizer(&folder);
        let config = ddp_config(&dir, 1, 1, 100);
        let text = std::fs::read_to_string(&config).unwrap().replace(
            &format!("{:?}", data_path("models/tiny-llama").display().to_string()),
            &format!("{:?}", folder.display().to_string()),
        );
        std::fs::write(&config, text).unwrap();
        let args = [
            "--nproc-per-node",
            "2",
            "--set",
            "training.fsdp=\"full_shard\"",
            "--set",
            "training.gradient_checkpointing=true",
        ];
        let status = qlora_train(&config, &args, None, &dir.join("stderr"))
            .wait()
            .unwrap();
        let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
        assert!(status.success(), "{err}");
        let reports = fsdp_reports(&err);
        assert_eq!(reports.len(), 2, "{err}");
        // Each rank read its half of every linear weight's bytes (whole 64-element blocks of bfloat16), no more.
        let stored = reports[0].read.1;
        assert_eq!(stored, (2 * layer_params * layers) as u64, "{err}");
        let weights = 7 * layers as u64;
        for r in &reports {
            assert_eq!(r.read.1, stored, "{err}");
            assert!(r.read.0 <= stored / 2 + weights * 64 * 2, "{err}");
        }
        assert_eq!(reports[0].read.0 + reports[1].read.0, stored, "{err}");
        reports.iter().map(|r| r.loading_heap).max().unwrap()
    };
    let (small, large) = (loading_heap(2), loading_heap(10));
    // NF4 with double quantization: half a byte a parameter and a byte per 64-parameter block, about.
    let layer_nf4 = layer_params / 2 + layer_params / 64;
    eprintln!("host heap while loading: 2 layers {small} B, 10 layers {large} B; one layer's 4-bit weights {layer_nf4} B");
    assert!(
        large <= small + layer_nf4 as u64,
        "the host heap grew by {} B for 8 more layers (one layer: {layer_nf4} B)",
        large.saturating_sub(small)
    );
}

/// Ctrl-C reaches the launcher alone (a SIGINT to its pid; a terminal's goes to the launcher's process group, and
/// the ranks run in one of their own): it passes it to every rank, they agree to stop after the same step, rank 0
/// writes that step's checkpoint and says how to resume on as many ranks, and the launcher exits with 130.
#[cfg(feature = "nccl")]
#[test]
fn ddp_launcher_passes_ctrl_c_to_every_rank_which_stop_at_one_checkpoint() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    let config = ddp_config(dir, 1, 500, 1000);
    let mut launcher = qlora_train(
        &config,
        &["--nproc-per-node", "2"],
        None,
        &dir.join("stderr"),
    );
    wait_for_steps(dir, 2);
    // SAFETY: kill(2) on our own child, not yet reaped.
    let sent = unsafe { libc::kill(launcher.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(sent, 0);
    let status = launcher.wait().unwrap();
    let err = std::fs::read_to_string(dir.join("stderr")).unwrap();
    assert_eq!(status.code(), Some(130), "{err}");
    let steps = logged(&dir.join("out"), "loss").len();
    let checkpoints: Vec<String> = std::fs::read_dir(dir.join("out"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("checkpoint-"))
        .collect();
    assert_eq!(checkpoints, [format!("checkpoint-{steps}")], "{err}");
    assert_eq!(
        err.matches("stopped by Ctrl-C after step").count(),
        1,
        "rank 0 alone reports: {err}"
    );
    assert!(
        err.contains(&format!("stopped by Ctrl-C after step {steps};"))
            && err.contains("--nproc-per-node 2"),
        "{err}"
    );
}

/// Ranks started from torchrun's variables, without the launcher, as two nodes of one GPU each (both ranks on their
/// node's GPU 0, as a multi-node job places them): a 2-rank run's checkpoint resumes on 2 ranks to the
/// uninterrupted adapter bit for bit; and a rank killed mid-run stops the other at once (well within
/// `ddp_timeout`) with an error naming it.
#[cfg(feature = "nccl")]
#[test]
fn ddp_ranks_from_torchrun_variables_resume_exactly_and_stop_when_one_dies() {
    torchrun_ranks_resume_exactly_and_stop_when_one_dies(&[]);
}

/// The same with `fsdp = "full_shard"`: the checkpoint (the adapter and optimizer, nothing of the shards) resumes on
/// 2 ranks bit-identically and on 1 process, and a killed rank stops the other in whichever collective it waits
/// (a layer's all-gather, most likely), named.
#[cfg(feature = "nccl")]
#[test]
fn fsdp_ranks_resume_exactly_and_stop_when_one_dies() {
    torchrun_ranks_resume_exactly_and_stop_when_one_dies(&[
        "--set",
        "training.fsdp=\"full_shard\"",
        "--set",
        "training.gradient_checkpointing=true",
    ]);
}

/// Two ranks from torchrun's variables with `extra` flags: a checkpoint resumes bit-identically, and a killed rank
/// stops the other at once, named.
#[cfg(feature = "nccl")]
fn torchrun_ranks_resume_exactly_and_stop_when_one_dies(extra: &[&str]) {
    let root = tempfile::tempdir().unwrap();
    let ranks = |dir: &std::path::Path,
                 config: &std::path::Path,
                 args: &[&str]|
     -> Vec<std::process::Child> {
        let port = free_port();
        (0..2)
            .map(|rank| {
                let env = RankEnv {
                    rank,
                    world: 2,
                    per_node: 1,
                    port,
                };
                let args: Vec<&str> = args.iter().chain(extra).copied().collect();
                qlora_train(
                    config,
                    &args,
                    Some(env),
                    &dir.join(format!("stderr-{rank}")),
                )
            })
            .collect()
    };
    let stderr = |dir: &std::path::Path, r: usize| {
        std::fs::read_to_string(dir.join(format!("stderr-{r}"))).unwrap()
    };
    let whole = root.path().join("whole");
    std::fs::create_dir_all(&whole).unwrap();
    let config = ddp_config(&whole, 1, 4, 2);
    for (r, mut child) in ranks(&whole, &config, &[]).into_iter().enumerate() {
        assert!(
            child.wait().unwrap().success(),
            "rank {r}: {}",
            stderr(&whole, r)
        );
    }
    assert!(whole.join("out/checkpoint-2").is_dir() && whole.join("out/checkpoint-4").is_dir());

    let resumed = root.path().join("resumed");
    std::fs::create_dir_all(resumed.join("out")).unwrap();
    let config = ddp_config(&resumed, 1, 4, 2);
    let copy = std::process::Command::new("cp")
        .args([
            "-r",
            whole.join("out/checkpoint-2").to_str().unwrap(),
            resumed.join("out").to_str().unwrap(),
        ])
        .status()
        .unwrap();
    assert!(copy.success());
    let checkpoint = resumed.join("out/checkpoint-2");
    for (r, mut child) in ranks(
        &resumed,
        &config,
        &["--resume", checkpoint.to_str().unwrap()],
    )
    .into_iter()
    .enumerate()
    {
        assert!(
            child.wait().unwrap().success(),
            "rank {r}: {}",
            stderr(&resumed, r)
        );
    }
    let (whole_adapter, resumed_adapter) = (
        read_adapter(&whole.join("out")),
        read_adapter(&resumed.join("out")),
    );
    for (k, t) in &whole_adapter {
        assert_eq!(bits(t), bits(&resumed_adapter[k]), "{k}");
    }
    // On one process: it goes on from step 2 (the data dealt anew) to step 4.
    let alone = root.path().join("alone");
    std::fs::create_dir_all(alone.join("out")).unwrap();
    let config = ddp_config(&alone, 1, 4, 2);
    let copied = std::process::Command::new("cp")
        .args([
            "-r",
            checkpoint.to_str().unwrap(),
            alone.join("out").to_str().unwrap(),
        ])
        .status()
        .unwrap();
    assert!(copied.success());
    let resume = alone.join("out/checkpoint-2");
    let args: Vec<&str> = ["--resume", resume.to_str().unwrap()]
        .iter()
        .chain(extra)
        .copied()
        .collect();
    let status = qlora_train(&config, &args, None, &alone.join("stderr"))
        .wait()
        .unwrap();
    let err = std::fs::read_to_string(alone.join("stderr")).unwrap();
    assert!(status.success(), "{err}");
    assert_eq!(logged(&alone.join("out"), "loss").len(), 4, "{err}");

    let killed = root.path().join("killed");
    std::fs::create_dir_all(&killed).unwrap();
    let config = ddp_config(&killed, 1, 500, 1000);
    let mut children = ranks(&killed, &config, &[]);
    wait_for_steps(&killed, 2);
    children[1].kill().unwrap();
    let killed_at = std::time::Instant::now();
    let status = children[0].wait().unwrap();
    let waited = killed_at.elapsed().as_secs_f64();
    children[1].wait().unwrap();
    let err = stderr(&killed, 0);
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("rank 0 stopped in the all-") && err.contains("rank 1 exited"),
        "{err}"
    );
    assert!(waited < 30.0, "rank 0 took {waited:.1} s to stop");
}

/// `qlora generate --device cuda` loads the model onto the GPU in bf16 (fp16 on a GPU without it), as a GPU
/// training run computes, and generates there; `--device auto` picks the GPU too.
#[test]
fn the_command_generates_on_the_gpu() {
    let model = data_path("models/tiny-llama");
    let dtype = match candle_qlora::precision::is_bf16_supported(&gpu()) {
        true => "BF16",
        false => "F16",
    };
    for device in ["cuda", "auto"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_qlora"))
            .args([
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--device",
                device,
            ])
            .args(["--prompt", "hello", "--max-new-tokens", "3", "--ignore-eos"])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{said}");
        assert!(
            said.contains(&format!("; on the GPU, {dtype} compute) in")),
            "{said}"
        );
        assert!(said.contains("3 tokens in"), "{said}");
    }
}

/// Long context on a Llama with Llama-3.1-8B's proportions (hidden 256 = 4 query heads of 64, one kv head, an
/// intermediate 3.5 times as wide), offloaded and tiled, at two lengths: the pinned host bytes are the estimate's
/// and the pool's peak is within 10% of it. Here the tokens outnumber the width 2 and 4 to 1 (at 128k the 8B's
/// are 32 to 1), so a slice of the tiled MLP weighs more than it would there.
#[test]
fn a_long_context_run_offloaded_and_tiled_peaks_at_its_estimate() {
    use candle_qlora::memory::estimate;
    let dir = tempfile::tempdir().unwrap();
    let layers = 4;
    let lengths: &[usize] = if emulator_counters().is_some() {
        &[512, 1024]
    } else {
        &[4096, 16384]
    };
    let lora = all_linear_lora();
    for &seq in lengths {
        let widths = LlamaWidths {
            hidden: 256,
            intermediate: 896,
            heads: 4,
            kv_heads: 1,
            vocab: 512,
            positions: seq,
        };
        let folder = random_llama(&dir.path().join(seq.to_string()), layers, &widths);
        let config =
            candle_qlora::loading::load_model_config(folder.to_str().unwrap(), None).unwrap();
        let out = dir.path().join(format!("out-{seq}"));
        let args = TrainingArguments {
            tiled_mlp: true,
            ..offload_test_args(&out, true)
        };
        let rows = synthetic_rows_in(1, seq, widths.vocab);
        let mut trainer =
            Trainer::new(nf4_model_on_gpu(&folder), args, &lora, rows, vec![]).unwrap();
        trainer.train(None).unwrap();
        let timeline = read_timeline(&out);
        let predicted = estimate(
            &config,
            &candle_qlora::memory::EstimateArgs {
                tiled_mlp: true,
                ..offload_test_estimate(seq, &lora, true)
            },
        )
        .unwrap();
        let pinned = timeline["host_pinned_bytes"].as_u64().unwrap();
        assert_eq!(pinned, predicted.host_bytes, "pinned bytes at {seq} tokens");
        let peak = timeline_peak(&timeline);
        let counted = pool_share(&predicted) as f64;
        eprintln!(
            "{seq} tokens: pool peak {peak} bytes, estimate {counted} (ratio {:.3}); {pinned} bytes pinned",
            counted / peak as f64
        );
        assert!(
            (counted / peak as f64 - 1.0).abs() <= 0.10,
            "estimate {counted} vs the pool's peak {peak} at {seq} tokens"
        );
    }
}

/// GRPO on the GPU (NF4 base): training on the golden rollouts agrees with the CPU run (loss, metrics, adapter), and
/// the batched group sampler on the GPU, with top-k 1, gives the CPU's completions.
#[test]
fn grpo_on_the_gpu_matches_the_cpu() {
    use candle_qlora::adapter::load_adapter;
    use candle_qlora::data::PromptDataset;
    use candle_qlora::models::generate::generate_group;
    use candle_qlora::models::sampling::SamplingConfig;
    use candle_qlora::trainer::grpo::Reward;
    use candle_qlora::trainer::GrpoConfig;
    let dir = tempfile::tempdir().unwrap();
    let model_dir = data_path("dpo/tiny-llama-chat");
    let tokenizer = candle_qlora::loading::load_tokenizer(model_dir.to_str().unwrap(), None)
        .unwrap()
        .unwrap();
    let rollouts = PromptDataset::from_jsonl(
        &data_path("grpo/rollouts.jsonl"),
        &tokenizer,
        true,
        false,
        64,
    )
    .unwrap();
    let run = |device: &Device, name: &str| {
        let out = dir.path().join(name);
        let mut model = tiny_chat_nf4(device);
        let lora = load_adapter(&mut model, &data_path("dpo/adapter"), "default").unwrap();
        let args = TrainingArguments {
            output_dir: out.display().to_string(),
            per_device_train_batch_size: 4,
            gradient_accumulation_steps: 2,
            learning_rate: 5e-3,
            max_steps: 3,
            logging_steps: 1.0,
            save_steps: 100.0,
            optim: OptimizerName::AdamWTorch,
            gradient_checkpointing: true,
            use_cpu: device.is_cpu(),
            ..Default::default()
        };
        let grpo = GrpoConfig {
            num_generations: 4,
            max_completion_length: 6,
            beta: 0.04,
            num_iterations: 2,
            ..Default::default()
        };
        let log = Trainer::new_grpo(
            model,
            args,
            &lora,
            grpo,
            rollouts.clone(),
            PromptDataset::default(),
            Vec::<Reward>::new(),
            tokenizer.clone(),
        )
        .unwrap()
        .train(None)
        .unwrap();
        let figures: Vec<f64> = log
            .log_history
            .iter()
            .filter(|e| e.loss.is_some())
            .flat_map(|e| {
                let kept = ["kl", "entropy", "clip_ratio/region_mean", "reward"];
                std::iter::once(e.loss.unwrap()).chain(
                    e.metrics
                        .iter()
                        .filter(move |(k, _)| kept.contains(&k.as_str()))
                        .map(|(_, v)| *v),
                )
            })
            .collect();
        (figures, read_adapter(&out))
    };
    let (cpu_figures, cpu_adapter) = run(&Device::Cpu, "cpu");
    let (gpu_figures, gpu_adapter) = run(&gpu(), "gpu");
    assert_eq!(cpu_figures.len(), 3 + 3 * 3 + 2, "{cpu_figures:?}");
    assert_runs_agree(
        "GRPO",
        (&cpu_figures, &cpu_adapter),
        (&gpu_figures, &gpu_adapter),
        1e-4,
        1e-3,
    );
    let greedy = SamplingConfig {
        top_k: 1,
        ..Default::default()
    };
    let prompt = &rollouts.prompts[0].ids;
    let sample = |device: &Device| {
        let model = tiny_chat_nf4(device);
        generate_group(&model, prompt, 3, 8, &greedy, &[2], 7).unwrap()
    };
    assert_eq!(sample(&gpu()), sample(&Device::Cpu));
}
