//! bitsandbytes' safetensors layout: their files load in ours, ours are byte-identical to theirs.

use std::collections::HashMap;

use candle_core::DType;
use candle_qlora::files::{view_to_f32, write_safetensors, MappedSafetensors, RawTensor};
use candle_qlora::loading::bnb::{bnb_entries, read_bnb_file, write_bnb_file};
use candle_qlora::quant::{BnbKernels, Nf4Tensor, QuantConfig, QuantType};

use crate::common::{bytes, data_path, tensor_bytes};

const WEIGHT: &str = "model.layers.0.mlp.up_proj.weight";

#[test]
fn a_bitsandbytes_linear4bit_checkpoint_loads_and_dequantizes_exactly() {
    for qt in ["nf4", "fp4"] {
        let path = data_path(&format!("quant/bnb_linear4bit_{qt}.safetensors"));
        let weights = read_bnb_file(&path).unwrap();
        assert_eq!(
            weights.keys().collect::<Vec<_>>(),
            vec![WEIGHT],
            "only the weight is quantized"
        );
        let w = &weights[WEIGHT];
        assert_eq!(w.shape(), &[64, 96]);
        assert_eq!(w.dtype(), DType::BF16);
        assert_eq!(w.is_double_quantized(), qt == "nf4");
        let file = MappedSafetensors::open(&path).unwrap();
        let st = file.tensors().unwrap();
        let ours = tensor_bytes(&w.dequantize(DType::BF16).unwrap());
        let theirs = bytes(&file, &st, "expected.dequant");
        assert_eq!(crate::common::diff_summary(&ours, &theirs), None, "{qt}");
    }
}

/// Quantizing the same weight writes exactly the tensors (names, dtypes, shapes, bytes, JSON) bitsandbytes wrote.
#[test]
fn our_entries_are_byte_identical_to_bitsandbytes_state_dict() {
    for qt in ["nf4", "fp4"] {
        let path = data_path(&format!("quant/bnb_linear4bit_{qt}.safetensors"));
        let file = MappedSafetensors::open(&path).unwrap();
        let st = file.tensors().unwrap();
        let input = st.tensor("expected.input").unwrap();
        let cfg = QuantConfig {
            quant_type: qt.parse::<QuantType>().unwrap(),
            blocksize: 64,
            double_quant: qt == "nf4",
            kernels: BnbKernels::Cpu,
        };
        let q = Nf4Tensor::quantize_values(
            &view_to_f32(&input).unwrap(),
            input.shape(),
            DType::BF16,
            &cfg,
            WEIGHT,
        )
        .unwrap();
        let ours: HashMap<String, RawTensor<'_>> = bnb_entries(WEIGHT, &q).into_iter().collect();
        let theirs: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|k| k.starts_with(WEIGHT))
            .collect();
        assert_eq!(
            ours.len(),
            theirs.len(),
            "{qt}: keys {:?} vs {theirs:?}",
            ours.keys().collect::<Vec<_>>()
        );
        for key in theirs {
            let t = st.tensor(key).unwrap();
            let o = ours
                .get(key)
                .unwrap_or_else(|| panic!("{qt}: we do not write `{key}`"));
            assert_eq!(o.dtype, t.dtype(), "{key}");
            assert_eq!(o.shape, t.shape(), "{key}");
            assert_eq!(
                o.data.as_ref(),
                t.data(),
                "{key}: {:?} vs {:?}",
                String::from_utf8_lossy(&o.data),
                String::from_utf8_lossy(t.data())
            );
        }
    }
}

#[test]
fn our_file_round_trips_through_our_loader() {
    let dir = tempfile::tempdir().unwrap();
    let values: Vec<f32> = (0..130 * 70)
        .map(|i| ((i as f32) * 0.013).cos() * 0.03)
        .collect();
    for cfg in [
        QuantConfig::nf4(),
        QuantConfig {
            double_quant: false,
            ..QuantConfig::fp4()
        },
    ] {
        let q = Nf4Tensor::quantize_values(&values, &[130, 70], DType::F16, &cfg, "w").unwrap();
        let path = dir.path().join("w.safetensors");
        write_bnb_file(&path, [("a.weight", &q)]).unwrap();
        let back = read_bnb_file(&path).unwrap();
        assert_eq!(back["a.weight"], q);
    }
}

fn write_with(path: &std::path::Path, replace: &str, with: Option<RawTensor<'static>>) {
    let q = Nf4Tensor::quantize_values(&[0.5; 128], &[2, 64], DType::F32, &QuantConfig::nf4(), "w")
        .unwrap();
    let entries = bnb_entries("l.weight", &q)
        .into_iter()
        .filter_map(|(k, v)| {
            if k == replace {
                with.clone().map(|w| (k, w))
            } else {
                Some((k, v))
            }
        });
    write_safetensors(path, entries, None).unwrap();
}

#[test]
fn broken_checkpoints_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.safetensors");
    let state = "l.weight.quant_state.bitsandbytes__nf4";

    write_with(
        &path,
        state,
        Some(RawTensor::u8(vec![8], b"not json".to_vec())),
    );
    let err = read_bnb_file(&path).unwrap_err().to_string();
    assert!(
        err.contains("l.weight") && err.contains("not the expected JSON"),
        "{err}"
    );

    write_with(&path, "l.weight.absmax", None);
    let err = read_bnb_file(&path).unwrap_err().to_string();
    assert!(err.contains("`l.weight.absmax` is missing"), "{err}");

    let json = br#"{"quant_type": "nf4", "blocksize": 48, "dtype": "float32", "shape": [2, 64], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.5}"#;
    write_with(
        &path,
        state,
        Some(RawTensor::u8(vec![json.len()], json.to_vec())),
    );
    let err = read_bnb_file(&path).unwrap_err().to_string();
    assert!(err.contains("blocksize 48"), "{err}");

    let json = br#"{"quant_type": "nf4", "blocksize": 64, "dtype": "float32", "shape": [3, 64], "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.5}"#;
    write_with(
        &path,
        state,
        Some(RawTensor::u8(vec![json.len()], json.to_vec())),
    );
    let err = read_bnb_file(&path).unwrap_err().to_string();
    assert!(err.contains("packed bytes for shape [3, 64]"), "{err}");

    // An unknown quant type in the key.
    let q = Nf4Tensor::quantize_values(&[0.5; 128], &[2, 64], DType::F32, &QuantConfig::nf4(), "w")
        .unwrap();
    let entries = bnb_entries("l.weight", &q)
        .into_iter()
        .map(|(k, v)| (k.replace("bitsandbytes__nf4", "bitsandbytes__int4"), v));
    write_safetensors(&path, entries, None).unwrap();
    let err = read_bnb_file(&path).unwrap_err().to_string();
    assert!(err.contains("int4"), "{err}");

    // A truncated file.
    let full = std::fs::read(&path).unwrap();
    std::fs::write(&path, &full[..full.len() / 2]).unwrap();
    let err = read_bnb_file(&path).err().unwrap().to_string();
    assert!(err.contains("truncated"), "{err}");
}
