//! FSDP's sharded base on the CPU, its ranks as threads of the test (`LocalRanks`): a model whose layers each
//! rank holds 1/N of, gathered before each layer runs (forward, and the recomputation of checkpointed layers),
//! computes what the whole model computes, bit for bit.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use candle_qlora::loading::{load_model, LoadOptions};
use candle_qlora::models::{LlamaModel, LocalRanks, Sharding};
use candle_qlora::quant::QuantConfig;

use crate::common::{data_path, embeds_loss};

fn tiny(folder: &str, quantization: Option<QuantConfig>) -> LlamaModel {
    load_tiny(folder, quantization, false)
}

/// [`tiny`], its linear weights left in their files with `defer` (as `qlora train` loads a model to shard).
fn load_tiny(folder: &str, quantization: Option<QuantConfig>, defer: bool) -> LlamaModel {
    let opts = LoadOptions {
        quantization,
        defer_linear_weights: defer,
        ..Default::default()
    };
    let dir = data_path(&format!("models/{folder}"));
    load_model(dir.to_str().unwrap(), None, &opts)
        .unwrap()
        .model
}

/// The loss's bits and its gradient with respect to the input embeddings (which flows through every frozen
/// weight), with checkpointed layers; and the logits of a plain forward.
fn loss_grad_and_logits(model: &LlamaModel, ids: &Tensor) -> (u32, Vec<u32>, Vec<u32>) {
    let bits = |t: &Tensor| -> Vec<u32> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    };
    let embeds = Var::from_tensor(&model.embed(ids).unwrap()).unwrap();
    let loss = embeds_loss(model, embeds.as_tensor(), ids, true);
    let grads = loss.backward().unwrap();
    let grad = grads.get(embeds.as_tensor()).unwrap();
    let loss_bits = loss
        .to_dtype(DType::F32)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .to_bits();
    (loss_bits, bits(grad), bits(&model.logits(ids).unwrap()))
}

/// `model` sharded over `world` ranks (threads of the test, `LocalRanks`; with `offload` the shares in host memory):
/// what `rank` returns for each rank's sharded model and its `Sharding`, in rank order.
fn on_ranks<T: Send>(
    model: &LlamaModel,
    world: usize,
    offload: bool,
    rank: impl Fn(LlamaModel, &Sharding) -> T + Sync,
) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = LocalRanks::handles(world)
            .into_iter()
            .map(|handle| {
                let (model, rank) = (model.clone(), &rank);
                s.spawn(move || {
                    let sharding = Sharding::new(handle.rank(), world, offload).unwrap();
                    sharding.attach(Arc::new(handle));
                    let model = model.to_device_sharded(&Device::Cpu, &sharding).unwrap();
                    rank(model, &sharding)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// `deferred` (its weights left in their files) sharded over `world` ranks, each reading its part of every weight
/// as it loads: every rank's model computes `expected` on `ids`, bit for bit; each reads something and at most
/// `share_bound(stored)` bytes, `stored` being the bytes the weights take in the files (returned); the parts cover
/// the weights, exactly once when `exactly_once`. `what` names the run in messages.
fn assert_ranks_read_their_parts(
    deferred: &LlamaModel,
    world: usize,
    ids: &Tensor,
    expected: &(u32, Vec<u32>, Vec<u32>),
    share_bound: impl Fn(u64) -> u64,
    exactly_once: bool,
    what: &str,
) -> u64 {
    let results = on_ranks(deferred, world, false, |model, sharding| {
        (loss_grad_and_logits(&model, ids), sharding.bytes_read())
    });
    let stored = results[0].1 .1;
    for (rank, (got, (read, whole))) in results.iter().enumerate() {
        assert!(
            got == expected,
            "{what}, rank {rank} of {world}: the model differs from the one loaded whole"
        );
        assert_eq!(*whole, stored, "{what}, rank {rank} of {world}");
        let bound = share_bound(stored);
        assert!(
            *read > 0 && *read <= bound,
            "{what}, rank {rank} of {world}: read {read} of {stored} bytes (bound {bound})"
        );
    }
    // The parts cover the weights: once each, but for the rows (or heads) that two ranks read of a file read in
    // rows.
    let total: u64 = results.iter().map(|(_, (read, _))| read).sum();
    match exactly_once {
        true => assert_eq!(total, stored, "{what}: the parts make the whole, once"),
        false => assert!(total >= stored, "{what}: read {total} of {stored} bytes"),
    }
    stored
}

/// A dense and a 4-bit Llama, a 4-bit mixture of experts and a 4-bit Gemma 2 (its head tied to the embeddings),
/// sharded over 1, 2 and 3 ranks (and 2 with the shards offloaded to host memory) — the layers' linear weights, the
/// embedding table and the head: every rank holds about 1/N of the linear weights, and its loss, input gradient
/// and logits equal the whole model's bit for bit.
#[test]
fn sharded_models_compute_what_the_whole_model_computes() {
    let ids = Tensor::new(&[[3u32, 17, 5, 9, 30, 2, 11, 4]], &Device::Cpu).unwrap();
    for (folder, quantization) in [
        ("tiny-llama", None),
        ("tiny-llama", Some(QuantConfig::nf4())),
        ("tiny-mixtral", Some(QuantConfig::nf4())),
        ("tiny-gemma2", Some(QuantConfig::nf4())),
    ] {
        let whole = tiny(folder, quantization);
        // Storage tensors of the linear weights (a 4-bit one has up to 3).
        let pieces = whole.linears().len() * 3;
        let expected = loss_grad_and_logits(&whole, &ids);
        let whole_linears: usize = whole
            .linears()
            .iter()
            .map(|(_, l)| l.base.weight.size_in_bytes())
            .sum();
        for (world, offload) in [(1, false), (2, false), (3, false), (2, true)] {
            let results = on_ranks(&whole, world, offload, |model, sharding| {
                assert_eq!(
                    model.embed_tokens.dim(0).unwrap(),
                    0,
                    "the table is sharded"
                );
                // Every sharded weight (the table and head too): 1/N, padding aside.
                let (all_held, all_whole) = model.sharded_bytes().unwrap();
                assert!(
                    all_held * world >= all_whole
                        && all_held <= all_whole / world + (pieces + 2) * 256,
                    "{folder}, rank {} of {world}: holds {all_held} of {all_whole}",
                    sharding.rank()
                );
                let held: usize = model
                    .layers
                    .iter()
                    .filter_map(|l| l.shard())
                    .map(|s| s.shard_bytes())
                    .sum();
                (loss_grad_and_logits(&model, &ids), held)
            });
            for (rank, (got, held)) in results.iter().enumerate() {
                assert!(
                    got == &expected,
                    "{folder} {quantization:?}, rank {rank} of {world} (offload {offload}): the sharded model differs"
                );
                // Each layer's buffers are padded to whole slices and aligned pieces: at most a few hundred bytes a
                // weight over the even share.
                let pieces = whole.linears().len() * 3;
                let bound = whole_linears / world + pieces * 256;
                // The nested map and offset of a 4-bit weight (1028 bytes) stay in its frame, whole.
                let kept_whole = whole.linears().len() * 1028;
                assert!(
                    *held <= bound && *held * world + kept_whole >= whole_linears,
                    "{folder}, rank {rank} of {world}: holds {held} bytes of {whole_linears} (bound {bound})"
                );
            }
        }
    }
}

/// `fsdp = "full_shard"` in one process (the trainer shards the model it is given, as rank 0 of 1): the losses and
/// the adapter equal those of the same run without it, bit for bit.
#[test]
fn a_fsdp_run_in_one_process_trains_as_without_it() {
    use candle_qlora::lora::{LoraConfig, TargetModules};
    use candle_qlora::optim::OptimizerName;
    use candle_qlora::trainer::{Trainer, TrainingArguments};
    let dir = tempfile::tempdir().unwrap();
    let run = |fsdp: Option<&str>| {
        let out = dir.path().join(fsdp.unwrap_or("whole").replace(' ', "-"));
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
            fsdp: fsdp.map(str::to_string),
            ..Default::default()
        };
        let lora = LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            target_modules: Some(TargetModules::AllLinear),
            ..Default::default()
        };
        let model = tiny("tiny-llama", Some(QuantConfig::nf4()));
        let mut trainer =
            Trainer::new(model, args, &lora, crate::trainer::examples(), vec![]).unwrap();
        let log = trainer.train(None).unwrap();
        assert_eq!(trainer.model.sharding().is_some(), fsdp.is_some());
        let losses: Vec<u64> = log
            .log_history
            .iter()
            .filter_map(|e| e.loss.map(f64::to_bits))
            .collect();
        let adapter = std::fs::read(out.join("adapter_model.safetensors")).unwrap();
        (losses, adapter)
    };
    let whole = run(None);
    assert_eq!(whole.0.len(), 3);
    assert!(
        run(Some("full_shard auto_wrap")) == whole,
        "the sharded run differs"
    );
}

/// A model loaded with its linear weights left in their files, as `qlora train` loads one to shard: each of 2 and 3
/// ranks reads its part of every weight (about 1/N of the weight's bytes, whole 4-bit blocks) and quantizes it, the
/// ranks gather the weight, and the sharded model computes what the model loaded whole computes, bit for bit —
/// dense, NF4 with and without double quantization (whose nested statistics span the whole weight).
#[test]
fn ranks_read_their_part_of_each_weight_and_compute_what_one_process_loads() {
    let ids = Tensor::new(&[[3u32, 17, 5, 9, 30, 2, 11, 4]], &Device::Cpu).unwrap();
    let single = QuantConfig {
        double_quant: false,
        ..QuantConfig::nf4()
    };
    for quantization in [None, Some(QuantConfig::nf4()), Some(single)] {
        let whole = tiny("tiny-llama", quantization);
        let expected = loss_grad_and_logits(&whole, &ids);
        // The stored weights are float32: 4 bytes an element.
        let elements: usize = whole
            .linears()
            .iter()
            .map(|(_, l)| {
                let (rows, cols) = l.base.weight.dims2().unwrap();
                rows * cols
            })
            .sum();
        let block = quantization.map_or(1, |q| q.blocksize);
        let deferred = load_tiny("tiny-llama", quantization, true);
        for world in [2, 3] {
            // A rank's part of a weight is its share rounded up to whole blocks.
            let blocks = (4 * block * whole.linears().len()) as u64;
            let what = format!("{quantization:?}");
            let bound = |stored: u64| stored / world as u64 + blocks;
            let stored = assert_ranks_read_their_parts(
                &deferred, world, &ids, &expected, bound, true, &what,
            );
            assert_eq!(stored, 4 * elements as u64, "{what}");
        }
    }
}

/// Bitsandbytes 4-bit folders (tiny-llama's and tiny-mixtral's linear weights in NF4 as bitsandbytes stores them,
/// the router aside) loaded with their weights left in their files: the model says its base is 4-bit as the one
/// loaded at once does; each of 2 and 3 ranks reads its blocks of every weight as stored (about 1/N of the codes
/// and scales) — of an expert's gate and up projections too, dequantized and quantized again as one, as loading at
/// once does — and the sharded model computes what the one loaded at once does, bit for bit.
#[test]
fn ranks_read_their_blocks_of_a_bitsandbytes_folder_as_stored() {
    use candle_qlora::adapter::base_quantization;
    use candle_qlora::files::{write_safetensors, RawTensor};
    use candle_qlora::loading::bnb::bnb_entries;
    use candle_qlora::quant::Nf4Tensor;
    for model in ["tiny-llama", "tiny-mixtral"] {
        let dir = tempfile::tempdir().unwrap();
        let source = data_path(&format!("models/{model}"));
        for file in ["config.json", "tokenizer.json"] {
            std::fs::copy(source.join(file), dir.path().join(file)).unwrap();
        }
        let tensors =
            candle_core::safetensors::load(source.join("model.safetensors"), &Device::Cpu).unwrap();
        let mut entries = Vec::new();
        for (name, t) in &tensors {
            let expert = [".w1.weight", ".w2.weight", ".w3.weight"]
                .iter()
                .any(|w| name.ends_with(w));
            if name.contains("_proj.weight") || expert {
                let q = Nf4Tensor::quantize(t, &QuantConfig::nf4()).unwrap();
                entries.extend(bnb_entries(name, &q));
            } else {
                entries.push((name.clone(), RawTensor::from_tensor(t).unwrap()));
            }
        }
        write_safetensors(&dir.path().join("model.safetensors"), entries, None).unwrap();
        let folder = dir.path().to_str().unwrap();
        let load = |defer: bool| {
            let opts = LoadOptions {
                defer_linear_weights: defer,
                ..Default::default()
            };
            load_model(folder, None, &opts).unwrap().model
        };
        let whole = load(false);
        let ids = Tensor::new(&[[3u32, 17, 5, 9, 30, 2, 11, 4]], &Device::Cpu).unwrap();
        let expected = loss_grad_and_logits(&whole, &ids);
        let deferred = load(true);
        left_in_files(&deferred, model);
        assert_eq!(base_quantization(&deferred), base_quantization(&whole));
        assert_eq!(base_quantization(&whole), Some(QuantConfig::nf4()));
        let whole_linears = whole.linears().len();
        for world in [2, 3] {
            // Codes and 8-bit scales of whole 64-element blocks: at most one block's 33 bytes a weight over 1/N.
            let bound = |stored: u64| stored / world as u64 + 33 * whole_linears as u64;
            assert_ranks_read_their_parts(&deferred, world, &ids, &expected, bound, true, model);
        }
    }
}

/// The weights of `model`'s linear layers, which are all left in their files (deferred), the routers (dense, small)
/// aside; `spec` names the model in messages.
fn left_in_files(
    model: &LlamaModel,
    spec: &str,
) -> Vec<(
    String,
    Arc<dyn candle_qlora::ops::frozen_linear::DeferredWeight>,
)> {
    use candle_qlora::ops::FrozenWeight;
    let mut out = Vec::new();
    for (name, linear) in model.linears() {
        let router = name.ends_with(".gate") || name.ends_with(".router");
        match &linear.base.weight {
            FrozenWeight::Deferred(weight) if !router => out.push((name, weight.clone())),
            _ => assert!(router, "{spec}: `{name}` is read at load"),
        }
    }
    out
}

/// GGUF file `source` written again as `out`: its tensors in the type `quantize` gives them (as stored for
/// `None`), its metadata without the keys `drop` matches, and with `extra`.
fn rewritten_gguf(
    source: &std::path::Path,
    out: &std::path::Path,
    quantize: impl Fn(&str) -> Option<candle_core::quantized::GgmlDType>,
    drop: impl Fn(&str) -> bool,
    extra: &[(&str, candle_core::quantized::gguf_file::Value)],
) {
    use candle_core::quantized::{gguf_file, QTensor};
    let mut file = std::fs::File::open(source).unwrap();
    let content = gguf_file::Content::read(&mut file).unwrap();
    let mut metadata: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .filter(|(k, _)| !drop(k))
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    metadata.extend(extra.iter().map(|(k, v)| (*k, v)));
    let tensors: Vec<(String, QTensor)> = content
        .tensor_infos
        .keys()
        .map(|name| {
            let stored = content.tensor(&mut file, name, &Device::Cpu).unwrap();
            let tensor = match quantize(name) {
                Some(dtype) => {
                    QTensor::quantize(&stored.dequantize(&Device::Cpu).unwrap(), dtype).unwrap()
                }
                None => stored,
            };
            (name.clone(), tensor)
        })
        .collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::fs::File::create(out).unwrap();
    gguf_file::write(&mut out, &metadata, &tensors).unwrap();
}

/// Mixtures of experts and GGUF files loaded with their weights left in their files: each expert is too (a run of
/// a stacked tensor's elements, or its gate projection's then its up projection's; gpt-oss's in rows, of its
/// transposed stack or of its MXFP4 codes), and so is every GGUF weight, read in rows (a whole head of a q/k
/// projection llama.cpp permuted). Over 2 and 3 ranks each rank reads its part — about 1/N of the bytes; the
/// parts cover the whole — and the sharded model computes what the model loaded whole does, bit for bit:
/// safetensors experts one a tensor (Mixtral), stacked (Qwen3-MoE) and gpt-oss's (dense and MXFP4); GGUF files in
/// float32 (Qwen2-MoE: a shared expert, its gate a vector), in `q8_0` (Mixtral: its q/k permuted, stacked experts)
/// and in k-quants (a Llama exported in `q4_k_m`: 256-element rows, 4 heads of 64 rows).
#[test]
fn ranks_read_their_part_of_experts_and_of_gguf_files() {
    use candle_core::quantized::gguf_file::Value;
    use candle_core::quantized::GgmlDType;
    use candle_qlora::export::{gguf, GgufOptions};
    let dir = tempfile::tempdir().unwrap();
    // tiny-mixtral's GGUF with its layers' weights in q8_0.
    let mixtral_q8 = dir.path().join("mixtral-q8_0.gguf");
    rewritten_gguf(
        &data_path("models/tiny-mixtral/model.gguf"),
        &mixtral_q8,
        |name| {
            let weight =
                name.starts_with("blk.") && !name.contains("norm") && !name.contains("_inp");
            weight.then_some(GgmlDType::Q8_0)
        },
        |_| false,
        &[],
    );
    // A Llama exported in q4_k_m, without the test's word-level tokenizer (which Candle builds no GGUF tokenizer
    // of).
    let kquant = crate::export::generated_model("kquant-llama", dir.path());
    let exported = dir.path().join("kquant-q4_k_m-exported.gguf");
    let source = load_model(kquant.to_str().unwrap(), None, &LoadOptions::default()).unwrap();
    let options = GgufOptions {
        quant: "q4_k_m".parse().unwrap(),
        tokenizer_pre: Some("default".into()),
        adapter_only: false,
        ollama: false,
        overwrite: false,
        progress: false,
    };
    gguf(&source.model, &kquant, &exported, &options).unwrap();
    let kquant_gguf = dir.path().join("kquant-q4_k_m.gguf");
    rewritten_gguf(
        &exported,
        &kquant_gguf,
        |_| None,
        |key| key.starts_with("tokenizer."),
        &[("llama.vocab_size", Value::U32(128))],
    );
    let ids = Tensor::new(&[[3u32, 17, 5, 9, 30, 2, 11, 4]], &Device::Cpu).unwrap();
    // Each model; whether its q/k projections are read in whole heads (llama.cpp permuted them); whether its
    // weights are read as runs of elements (else rows: GGUF, gpt-oss's experts).
    let models = [
        (data_path("models/tiny-mixtral"), false, true),
        (data_path("models/tiny-qwen3-moe"), false, true),
        (data_path("models/tiny-gpt-oss"), false, false),
        (data_path("models/tiny-gpt-oss-mxfp4"), false, false),
        (data_path("models/tiny-qwen2-moe/model.gguf"), false, false),
        (mixtral_q8, true, false),
        (kquant_gguf, true, false),
    ];
    for (model, permuted, in_elements) in models {
        let spec = model.to_str().unwrap();
        for quantization in [None, Some(QuantConfig::nf4())] {
            let load = |defer: bool| {
                let opts = LoadOptions {
                    quantization,
                    defer_linear_weights: defer,
                    ..Default::default()
                };
                load_model(spec, None, &opts).unwrap().model
            };
            let whole = load(false);
            let expected = loss_grad_and_logits(&whole, &ids);
            let deferred = load(true);
            // A rank's part of a weight is its share, and at each end the rest of a row (a 4-bit block of a
            // safetensors row at most), or of a head: `slack` adds two of those a weight.
            let mut slack = 0;
            for (name, weight) in left_in_files(&deferred, spec) {
                let (rows, cols) = weight.dims2();
                let rows_read =
                    match permuted && name.contains("self_attn.") && !name.ends_with("o_proj") {
                        true if !name.contains("v_proj") => deferred.config().head_dim,
                        _ => 1,
                    };
                slack += 2 * weight.bytes_in_file(0..rows * cols).unwrap() * rows_read / rows;
            }
            let what = format!("{spec} {quantization:?}");
            for world in [2, 3] {
                let bound = |stored: u64| stored / world as u64 + slack as u64;
                assert_ranks_read_their_parts(
                    &deferred,
                    world,
                    &ids,
                    &expected,
                    bound,
                    in_elements,
                    &what,
                );
            }
        }
    }
}

/// A NaN in a weight left in its file is refused when the weight is read, naming the tensor and the element as the
/// file stores it: here element 100 of a gpt-oss expert stack `[experts, in, out]`, read as the transposed rows of
/// expert 0.
#[test]
fn a_damaged_weight_left_in_its_file_is_named_when_read() {
    use candle_qlora::ops::FrozenWeight;
    let dir = tempfile::tempdir().unwrap();
    let source = data_path("models/tiny-gpt-oss");
    for file in ["config.json", "tokenizer.json"] {
        std::fs::copy(source.join(file), dir.path().join(file)).unwrap();
    }
    let mut tensors =
        candle_core::safetensors::load(source.join("model.safetensors"), &Device::Cpu).unwrap();
    let name = "model.layers.0.mlp.experts.down_proj";
    let stack = &tensors[name];
    let mut values: Vec<f32> = stack.flatten_all().unwrap().to_vec1().unwrap();
    values[100] = f32::NAN;
    let damaged = Tensor::from_vec(values, stack.shape(), &Device::Cpu).unwrap();
    tensors.insert(name.into(), damaged);
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    let opts = LoadOptions {
        defer_linear_weights: true,
        ..Default::default()
    };
    let model = load_model(dir.path().to_str().unwrap(), None, &opts)
        .unwrap()
        .model;
    let linears = model.linears();
    let (_, expert) = linears
        .iter()
        .find(|(n, _)| n == "model.layers.0.mlp.experts.0.down_proj")
        .unwrap();
    let FrozenWeight::Deferred(weight) = &expert.base.weight else {
        panic!("the expert is left in its file");
    };
    let err = weight.read().unwrap_err().to_string();
    assert!(
        err.contains(&format!("`{name}`")) && err.contains("holds NaN at element 100"),
        "{err}"
    );
}
