//! Packing on every family's tiny model: a packed batch gives the same loss and the same adapter gradients as its
//! examples run one by one (positions restart, attention stays inside each example — with sliding windows and
//! soft-capping too, and Phi-3's LongRoPE choosing its factors by the restarted positions), with and without
//! checkpointing. In float64, so the two sides (other shapes, so other matrix kernels and summation orders) agree to
//! float64 rounding ([`crate::common::F64_TOLERANCE`]), which no leak between examples stays under.

use candle_core::{DType, Device};
use candle_qlora::adapter::Adapters;
use candle_qlora::data::collate;
use candle_qlora::data::{pack, Example, TokenizedExample};
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::lora::{LoraConfig, TargetModules};
use candle_qlora::models::{Checkpointing, LlamaModel};

use crate::common::{assert_f64_close, assert_f64_scalar_close, data_path};

fn model_and_examples(name: &str) -> (LlamaModel, Vec<TokenizedExample>) {
    let options = LoadOptions {
        compute_dtype: DType::F64,
        ..Default::default()
    };
    let loaded = load_model(
        data_path(&format!("models/{name}")).to_str().unwrap(),
        None,
        &options,
    )
    .unwrap();
    let tok = loaded.tokenizer.clone().unwrap();
    let examples = (0..7)
        .map(|i| {
            let words: Vec<String> = (0..3 + i * 2)
                .map(|j| format!("t{}", 1 + (i * 5 + j * 3) % 40))
                .collect();
            Example::Text(words.join(" "))
                .tokenize(&tok, 64, true)
                .unwrap()
        })
        .collect();
    let mut model = loaded.model;
    let lora = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        target_modules: Some(TargetModules::AllLinear),
        init_lora_weights: candle_qlora::lora::InitLoraWeights::Gaussian,
        ..Default::default()
    };
    model.add_adapter("default", &lora, 3).unwrap();
    (model, examples)
}

/// Loss sum and adapter gradients (by name) of `rows` as one batch.
fn loss_and_grads(
    model: &LlamaModel,
    rows: &[&TokenizedExample],
    checkpointing: bool,
) -> (f64, Vec<(String, candle_core::Tensor)>) {
    let params = model.adapter_parameters("default").unwrap();
    let ck = Checkpointing {
        enabled: checkpointing,
        params: params.iter().map(|(_, v)| v.clone()).collect(),
        ..Default::default()
    };
    let batch = collate(rows, &Device::Cpu).unwrap();
    let (sum, _) = model
        .loss_sum(&batch.ids, &batch.labels, &batch.positions, &ck)
        .unwrap();
    let mut grads = sum.backward().unwrap();
    ck.sink.merge_into(&mut grads).unwrap();
    let grads = params
        .iter()
        .map(|(k, v)| (k.clone(), grads.get(v).unwrap().clone()))
        .collect();
    (
        sum.to_dtype(DType::F64).unwrap().to_scalar().unwrap(),
        grads,
    )
}

#[test]
fn packed_rows_compute_what_their_examples_compute_alone() {
    for name in crate::common::TINY_MODELS {
        packed_equals_alone(name);
    }
}

fn packed_equals_alone(name: &str) {
    let (model, examples) = model_and_examples(name);
    let rows = pack(&examples, 24);
    assert!(rows.len() < examples.len() && rows.iter().any(|r| r.segments.len() > 1));
    for checkpointing in [false, true] {
        let packed: Vec<&TokenizedExample> = rows.iter().collect();
        let (loss, grads) = loss_and_grads(&model, &packed, checkpointing);
        let mut alone_loss = 0.0;
        let mut alone: Vec<candle_core::Tensor> = vec![];
        for e in &examples {
            let (l, g) = loss_and_grads(&model, &[e], checkpointing);
            alone_loss += l;
            alone = if alone.is_empty() {
                g.into_iter().map(|(_, t)| t).collect()
            } else {
                alone
                    .iter()
                    .zip(g)
                    .map(|(a, (_, t))| (a + t).unwrap())
                    .collect()
            };
        }
        let what = format!("{name}, checkpointing {checkpointing}");
        assert_f64_scalar_close(&format!("{what}: packed loss"), loss, alone_loss);
        for ((k, g), a) in grads.iter().zip(&alone) {
            assert_f64_close(&format!("{what}: packed gradient of {k}"), g, a);
        }
    }
}
