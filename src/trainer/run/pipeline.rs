//! From a run config to a ready `Trainer`: the device and compute dtype, the model (quantized on load), the
//! tokenized data of the method it asks for, and the callbacks it asks for — what `qlora train` does before
//! training.

use std::path::Path;
use std::sync::Arc;

use candle_core::Device;

#[cfg(feature = "nccl")]
use super::ddp::Ddp;
use super::fits::{check_memory_fits, RunShape};
use super::trainer::{Prepared, Trainer, ADAPTER};
use crate::adapter::{load_adapter, ADAPTER_CONFIG};
use crate::distributed::{RanksFrom, WorldEnv};
use crate::error::{Error, Result};
use crate::loading::model::no_tokenizer;
use crate::loading::{load_model, load_model_config, load_tokenizer, LoadOptions};
use crate::lora::LoraConfig;
use crate::memory::heap::reset_heap_peak;
use crate::memory::{allocated, human_bytes, process_memory};
use crate::models::{LlamaModel, Sharding};
use crate::precision::Precision;
use crate::trainer::methods;
use crate::trainer::reporting::callbacks::{EarlyStoppingCallback, MemoryMonitorCallback};
use crate::trainer::reporting::memory::start_memory_snapshot;
use crate::trainer::settings::config::RunConfig;
use crate::trainer::settings::preflight::check_before_loading;
use crate::trainer::storage::manifest::verify_checkpoint_files;
use crate::trainer::storage::output_dir::prepare_output_dir;

impl Trainer {
    /// A trainer for `config`: loads its model on the device `[training]` selects (computing in the dtype its
    /// `bf16`/`fp16` flags and `bnb_4bit_compute_dtype` select) with the adapter `[model] adapter` names, tokenizes
    /// its data (printing what was skipped, truncated or packed; preference pairs with `[dpo]`), and adds the
    /// callbacks of `[callbacks]`. Resume with
    /// `train(config.training.resume_checkpoint()?.as_deref())`.
    pub fn from_run_config(config: &RunConfig) -> Result<Self> {
        // Everything cheap first (tokenizer, chat template, data, the run against its data and the model's config,
        // output folder, resume checkpoint), so a mistake is reported in seconds, not after loading the weights.
        let args = &config.training;
        // A rank of a job this build, machine or config cannot run stops before anything loads.
        let world = WorldEnv::from_env()?;
        if let Some(world) = &world {
            config.check_ranks(
                world.world_size,
                world.local_world_size,
                RanksFrom::Environment,
            )?;
        }
        let model_name = &config.model.name_or_path;
        let revision = config.model.revision.as_deref();
        // Training needs one to read the data.
        let tokenizer =
            load_tokenizer(model_name, revision)?.ok_or_else(|| no_tokenizer(model_name))?;
        let (method, notes) = methods::from_run_config(config, &tokenizer)?;
        check_before_loading(config, &method.data_facts())?;
        let resume = args.resume_checkpoint()?;
        let checkpoint = match resume {
            Some(ckpt) => {
                let manifest = verify_checkpoint_files(&ckpt)?;
                Some((ckpt, manifest))
            }
            None => None,
        };
        let lock = prepare_output_dir(args, Path::new(&args.output_dir), checkpoint.is_some())?;
        for note in &notes {
            eprintln!("{note}");
        }
        let device = args.device()?;
        let quant_compute = config.quant_compute_dtype().map(|d| d.dtype());
        let precision = Precision::from_flags(args.bf16, args.fp16, quant_compute, &device)?;
        let quantization = config.quant_config()?;
        if let Some(longest) = method.train_lengths().into_iter().max() {
            let lora = match &config.model.adapter {
                Some(dir) => LoraConfig::from_file(&dir.join(ADAPTER_CONFIG))?,
                None => config.lora.clone(),
            };
            let run = RunShape {
                args,
                lora: &lora,
                longest,
                quantize: quantization.is_some(),
                device: &device,
                compute_dtype: precision.compute_dtype,
                world_size: world.as_ref().map_or(1, |w| w.world_size),
                preference: method.runs_pairs(),
                grpo_generations: method.completions_per_prompt(),
            };
            let model_config = load_model_config(model_name, revision)?;
            check_memory_fits(&model_config, &run, &config.path.display().to_string())?;
        }
        let fsdp = args.fsdp_plan().map_err(Error::InvalidInput)?;
        // The ranks of a sharded job read each weight in parts and gather it, so they join before loading.
        #[cfg(feature = "nccl")]
        let communicator = match (fsdp, &world) {
            (Some(_), Some(w)) if w.world_size > 1 => Some(Ddp::connect(&device, w, args)?),
            _ => None,
        };
        let options = LoadOptions {
            quantization,
            compute_dtype: precision.compute_dtype,
            // Sharded, the linear weights of a safetensors folder stay in their files until their layer moves to
            // the GPU and is sharded: the host holds one tensor at a time, never the model.
            defer_linear_weights: fsdp.is_some(),
        };
        // A sharded rank reports how far its host heap rose while loading (`shard_onto`).
        let heap_before = fsdp.and_then(|_| {
            reset_heap_peak();
            allocated().map(|(now, _)| now)
        });
        // A memory snapshot records from before the load, so the weights are in it.
        let recording = args
            .memory_snapshot
            .then(|| start_memory_snapshot(&device, args))
            .transpose()?;
        let started = std::time::Instant::now();
        let loaded = load_model(model_name, revision, &options)?;
        // Nothing before the load holds much, so the process' peak so far is the load's.
        let peak = process_memory()
            .peak_rss
            .map(|b| format!("; peak resident while loading {}", human_bytes(b)))
            .unwrap_or_default();
        eprintln!(
            "loaded {} ({} of weights) in {:.1} s{peak}",
            loaded.source,
            human_bytes(loaded.model.weight_bytes() as u64),
            started.elapsed().as_secs_f64()
        );
        let mut model = match fsdp {
            Some(plan) => {
                let (rank, world_size) = world.as_ref().map_or((0, 1), |w| (w.rank, w.world_size));
                let sharding = plan.sharding(rank, world_size)?;
                #[cfg(feature = "nccl")]
                if let Some(c) = &communicator {
                    sharding.attach(c.clone());
                }
                shard_onto(loaded.model, &device, &sharding, heap_before)?
            }
            None => loaded.model.to_device(&device)?,
        };
        if let Some(dir) = &config.model.adapter {
            load_adapter(&mut model, dir, ADAPTER)?;
            eprintln!("continuing adapter {}", dir.display());
        }
        let mut trainer = Trainer::with_method(model, args.clone(), &config.lora, method)?;
        trainer.set_prepared(Prepared {
            lock,
            checkpoint,
            recording,
            #[cfg(feature = "nccl")]
            communicator,
        });
        trainer.set_base_model_name(model_name);
        trainer.set_run_config(config.resolved.clone());
        let callbacks = &config.callbacks;
        if let Some(patience) = callbacks.early_stopping_patience {
            trainer.add_callback(Box::new(EarlyStoppingCallback::new(
                patience,
                callbacks.early_stopping_threshold,
            )));
        }
        if callbacks.memory_monitor {
            trainer.add_callback(Box::new(
                MemoryMonitorCallback::new(callbacks.memory_warn_fraction)
                    .on_device(trainer.model.device()),
            ));
        }
        Ok(trainer)
    }
}

/// `model` on `device` with its layers sharded by `sharding`, saying what the rank holds, what it read of the
/// files, and, when the heap is tracked, how far above `heap_before` (its bytes before the load) the host's heap
/// went while loading and sharding.
fn shard_onto(
    model: LlamaModel,
    device: &Device,
    sharding: &Arc<Sharding>,
    heap_before: Option<u64>,
) -> Result<LlamaModel> {
    let (rank, world_size) = (sharding.rank(), sharding.world_size());
    let model = model.to_device_sharded(device, sharding)?;
    let heap = match (heap_before, allocated()) {
        (Some(before), Some((_, peak))) => {
            let above = peak.saturating_sub(before);
            format!(
                "; the host heap peaked {} ({above} B) above its start while loading",
                human_bytes(above)
            )
        }
        _ => String::new(),
    };
    let read = match sharding.bytes_read() {
        (_, 0) => String::new(),
        (read, stored) => format!(
            "; it read {} ({read} B) of the {} ({stored} B) its layers' weights take in the files",
            human_bytes(read),
            human_bytes(stored)
        ),
    };
    if let Some((held, whole)) = model.sharded_bytes() {
        let line = format!(
            "fsdp: rank {rank} of {world_size} holds {} ({held} B) of the sharded weights' {} ({whole} B) — the \
             layers' linear weights, the embedding table and the head{}{read}{heap}\n",
            human_bytes(held as u64),
            human_bytes(whole as u64),
            if sharding.offload() { ", in host memory" } else { "" }
        );
        // One write: the ranks share the launcher's standard error, and `eprintln!` writes a line in pieces that
        // another rank's line could split.
        let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
    }
    Ok(model)
}
