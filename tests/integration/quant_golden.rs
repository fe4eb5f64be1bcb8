//! Bit-exactness against bitsandbytes: golden files from `scripts/golden_quant.py`.

use candle_core::DType;
use candle_qlora::files::{candle_float_dtype, view_to_f32, MappedSafetensors};
use candle_qlora::quant::reduce::torch_mean_f32;
use candle_qlora::quant::{
    BlockScales, BnbKernels, NestedAbsmax, Nf4Tensor, QuantConfig, QuantType,
};

use crate::common::{bytes, data_path, diff_summary, f32s, tensor_bytes};

fn case_paths() -> Vec<std::path::PathBuf> {
    let mut paths: Vec<_> = std::fs::read_dir(data_path("quant"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name.starts_with("nf4_") || name.starts_with("fp4_")) && name.ends_with(".safetensors")
        })
        .collect();
    paths.sort();
    assert!(
        paths.len() >= 13,
        "golden cases missing: run scripts/golden_quant.py generate"
    );
    paths
}

fn check_eq<T: PartialEq + std::fmt::Debug>(case: &str, what: &str, ours: &[T], theirs: &[T]) {
    if let Some((first, count)) = diff_summary(ours, theirs) {
        panic!(
            "{case}: {what} differ in {count} of {} elements; first at {first}: ours {:?} vs bitsandbytes {:?}",
            theirs.len(),
            ours.get(first),
            theirs.get(first)
        );
    }
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn quantization_is_bit_identical_to_bitsandbytes() {
    for path in case_paths() {
        let case = path.file_stem().unwrap().to_string_lossy().into_owned();
        let file = MappedSafetensors::open(&path).unwrap();
        let st = file.tensors().unwrap();
        let meta = file.metadata().unwrap().unwrap();
        let quant_type: QuantType = meta["quant_type"].parse().unwrap();
        let blocksize: usize = meta["blocksize"].parse().unwrap();
        let double_quant = meta["double_quant"] == "true";
        let input = st.tensor("input").unwrap();
        let dtype = candle_float_dtype(input.dtype()).unwrap();
        let values = view_to_f32(&input).unwrap();
        let shape = input.shape().to_vec();

        for (kernels, prefix) in [(BnbKernels::Cpu, "cpu"), (BnbKernels::Cuda, "cuda")] {
            let cfg = QuantConfig {
                quant_type,
                blocksize,
                double_quant,
                kernels,
            };
            let q = Nf4Tensor::quantize_values(&values, &shape, dtype, &cfg, &case).unwrap();
            let label = format!("{case} [{prefix}]");
            check_eq(
                &label,
                "packed codes",
                q.packed(),
                &bytes(&file, &st, &format!("{prefix}.packed")),
            );
            match q.scales() {
                BlockScales::Plain(absmax) => {
                    check_eq(
                        &label,
                        "absmax",
                        &bits(absmax),
                        &bits(&f32s(&bytes(&file, &st, &format!("{prefix}.absmax")))),
                    );
                }
                BlockScales::Nested(n) => {
                    check_eq(
                        &label,
                        "nested codes",
                        &n.codes,
                        &bytes(&file, &st, &format!("{prefix}.absmax")),
                    );
                    let theirs = f32s(&bytes(&file, &st, &format!("{prefix}.nested_absmax")));
                    check_eq(&label, "nested absmax", &bits(&n.absmax), &bits(&theirs));
                    let offset = f32s(&bytes(&file, &st, "cpu.offset"))[0];
                    assert_eq!(
                        n.offset.to_bits(),
                        offset.to_bits(),
                        "{label}: offset {} vs {offset}",
                        n.offset
                    );
                    let map = f32s(&bytes(&file, &st, "cpu.nested_quant_map"));
                    check_eq(&label, "nested quant map", &bits(&n.code), &bits(&map));
                }
            }
            if kernels == BnbKernels::Cpu {
                let deq = q.dequantize(dtype).unwrap();
                check_eq(
                    &label,
                    "dequantized values",
                    &tensor_bytes(&deq),
                    &bytes(&file, &st, "cpu.dequant"),
                );
            }
        }
    }
}

/// Dequantizing bitsandbytes' own stored state (not ours) gives their dequantized values exactly.
#[test]
fn dequantizing_their_state_is_bit_identical() {
    for path in case_paths() {
        let case = path.file_stem().unwrap().to_string_lossy().into_owned();
        let file = MappedSafetensors::open(&path).unwrap();
        let st = file.tensors().unwrap();
        let meta = file.metadata().unwrap().unwrap();
        let quant_type: QuantType = meta["quant_type"].parse().unwrap();
        let blocksize: usize = meta["blocksize"].parse().unwrap();
        let input = st.tensor("input").unwrap();
        let dtype = candle_float_dtype(input.dtype()).unwrap();
        let scales = if meta["double_quant"] == "true" {
            BlockScales::Nested(NestedAbsmax {
                codes: bytes(&file, &st, "cpu.absmax"),
                absmax: f32s(&bytes(&file, &st, "cpu.nested_absmax")),
                code: f32s(&bytes(&file, &st, "cpu.nested_quant_map")),
                offset: f32s(&bytes(&file, &st, "cpu.offset"))[0],
                blocksize: 256,
            })
        } else {
            BlockScales::Plain(f32s(&bytes(&file, &st, "cpu.absmax")))
        };
        let t = Nf4Tensor::from_parts(
            bytes(&file, &st, "cpu.packed"),
            scales,
            *quant_type.code(),
            input.shape().to_vec(),
            dtype,
            quant_type,
            blocksize,
        )
        .unwrap();
        for out_dtype in [dtype, DType::F32] {
            let ours = tensor_bytes(&t.dequantize(out_dtype).unwrap());
            if out_dtype == dtype {
                check_eq(
                    &case,
                    "dequantized values",
                    &ours,
                    &bytes(&file, &st, "cpu.dequant"),
                );
            }
        }
    }
}

#[test]
fn double_quant_offset_sums_in_torch_order() {
    let file = MappedSafetensors::open(data_path("quant/torch_mean.safetensors")).unwrap();
    let st = file.tensors().unwrap();
    for n in [1usize, 7, 8, 31, 32, 33, 1000, 4096, 70001] {
        let v = f32s(&bytes(&file, &st, &format!("v{n}")));
        let mean = f32s(&bytes(&file, &st, &format!("mean{n}")))[0];
        assert_eq!(
            torch_mean_f32(&v).to_bits(),
            mean.to_bits(),
            "n={n}: {} vs torch {mean}",
            torch_mean_f32(&v)
        );
    }
}
