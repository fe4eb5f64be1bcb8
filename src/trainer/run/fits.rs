//! Whether a run fits its device's memory, by the memory estimate (`memory::estimate`), checked before the weights
//! load: a training step whose estimated peak is more than the GPU holds is refused with the settings that would
//! make it fit (activation offload, the tiled MLP, both, a shorter `max_length`), and an offloaded run whose pinned
//! host memory is more than the machine has free is refused with the figure — instead of an out-of-memory error
//! after minutes of loading.

use candle_core::{DType, Device};

use crate::error::{Error, Result};
use crate::lora::LoraConfig;
use crate::memory::{
    estimate, human_bytes, max_seq_len, process_memory, stats, DeviceKind, Estimate, EstimateArgs,
    USABLE_GPU_MEMORY,
};
use crate::models::ModelConfig;
use crate::precision::TorchDtype;
use crate::trainer::settings::args::TrainingArguments;

/// What a run is, as the memory estimate takes it.
pub(super) struct RunShape<'a> {
    pub args: &'a TrainingArguments,
    pub lora: &'a LoraConfig,
    /// Tokens of the longest training row (or sequence of a pair).
    pub longest: usize,
    /// Whether the base linears are 4-bit.
    pub quantize: bool,
    pub device: &'a Device,
    pub compute_dtype: DType,
    pub world_size: usize,
    /// DPO: each row of a batch is a pair of sequences.
    pub preference: bool,
    /// GRPO: the completions sampled per prompt (their KV cache while generating).
    pub grpo_generations: Option<usize>,
}

impl RunShape<'_> {
    /// The estimate's arguments for the run's longest micro-batch: its batch and longest example, the adapter's
    /// rank and target modules, optimizer, checkpointing and its activation budget, the tiled MLP, activation
    /// offload, base, device and compute dtype.
    pub(super) fn estimate_args(&self) -> EstimateArgs {
        let args = self.args;
        // Settings FSDP refuses were refused when the config was read.
        let fsdp = args.fsdp_plan().ok().flatten();
        EstimateArgs {
            batch: args.per_device_train_batch_size,
            seq: self.longest,
            lora_r: self.lora.r,
            target_modules: self.lora.target_modules.clone(),
            optim: args.optim,
            gradient_checkpointing: args.checkpointing(),
            activation_memory_budget_mib: args.activation_memory_budget_mib,
            tiled_mlp: args.tiled_mlp,
            activation_offloading: args.activation_offloading,
            quantize: self.quantize,
            device: match self.device.is_cpu() {
                true => DeviceKind::Cpu,
                false => DeviceKind::Cuda,
            },
            dtype: Some(TorchDtype::of(self.compute_dtype)),
            world_size: self.world_size,
            preference: self.preference,
            grpo_generations: self.grpo_generations,
            fsdp: fsdp.is_some(),
            fsdp_offload: fsdp.is_some_and(|p| p.offload),
        }
    }
}

/// Refuses a GPU run whose estimated peak is more than the device's memory, and an offloaded run whose pinned host
/// memory is more than the machine has available; `path` names the config in the messages. Warns when the peak
/// comes within the margin the estimate leaves for fragmentation (more than 91% of the GPU).
pub(super) fn check_memory_fits(c: &ModelConfig, run: &RunShape<'_>, path: &str) -> Result<()> {
    if run.device.is_cpu() {
        return Ok(());
    }
    let gpu = stats(run.device);
    let host_available = process_memory().available;
    let capacity = gpu.total.map(|total| (total, gpu.device.as_str()));
    if let Some(note) = memory_verdict(c, &run.estimate_args(), capacity, host_available, path)? {
        eprintln!("note: {note}");
    }
    Ok(())
}

/// [`check_memory_fits`] for a GPU of `capacity` bytes (and its name) and `host_available` bytes of host memory
/// free: an error when the run does not fit, a note when it comes close.
fn memory_verdict(
    c: &ModelConfig,
    asked: &EstimateArgs,
    capacity: Option<(u64, &str)>,
    host_available: Option<u64>,
    path: &str,
) -> Result<Option<String>> {
    let Ok(predicted) = estimate(c, asked) else {
        return Ok(None); // sizes the estimate refuses are refused, with their reason, where they are read
    };
    if let Some(available) = host_available.filter(|a| predicted.host_bytes > *a) {
        return Err(Error::InvalidInput(format!(
            "{path}: [training] activation_offloading = true would pin {} of host memory for the offloaded layer \
             inputs ({} × {} tokens), and this machine has {} available: set a shorter [data] max_length, or \
             activation_offloading = false",
            human_bytes(predicted.host_bytes),
            asked.batch,
            asked.seq,
            human_bytes(available)
        )));
    }
    let Some((total, name)) = capacity else {
        return Ok(None);
    };
    if predicted.total_bytes <= total {
        let close = predicted.total_bytes as f64 > total as f64 * USABLE_GPU_MEMORY;
        return Ok(close.then(|| {
            format!(
                "the estimated peak of a training step, {}, is within 9% of the GPU's {}: fragmentation may \
                 still run it out of memory",
                human_bytes(predicted.total_bytes),
                human_bytes(total)
            )
        }));
    }
    let usable = (total as f64 * USABLE_GPU_MEMORY) as u64;
    Err(Error::InvalidInput(format!(
        "{path}: a training step of this run needs about {} of GPU memory ({} × {} tokens, the longest example), \
         more than the {} of {name}: it would run out of memory. {}{}",
        human_bytes(predicted.total_bytes),
        asked.batch,
        asked.seq,
        human_bytes(total),
        what_fits(c, asked, usable)?,
        match asked.flags() {
            Some(flags) => format!(
                " (`qlora estimate --model <the base model> {flags}` shows where the memory goes)"
            ),
            None => String::new(),
        }
    )))
}

/// The settings, beyond `asked`, whose estimated peak fits in `usable` bytes, as a sentence.
fn what_fits(c: &ModelConfig, asked: &EstimateArgs, usable: u64) -> Result<String> {
    let fits = |a: &EstimateArgs| -> Option<Estimate> {
        estimate(c, a).ok().filter(|e| e.total_bytes <= usable)
    };
    let mut way = None;
    for (offload, tiled) in [(true, false), (false, true), (true, true)] {
        if (offload && asked.activation_offloading) || (tiled && asked.tiled_mlp) {
            continue;
        }
        if let Some(e) = fits(&asked.adding(tiled, offload)) {
            let mut keys = Vec::new();
            if offload {
                if !asked.gradient_checkpointing {
                    keys.push("gradient_checkpointing = true".to_string());
                }
                keys.push(format!(
                    "activation_offloading = true (pinning {} of host memory)",
                    human_bytes(e.host_bytes)
                ));
            }
            if tiled {
                keys.push("tiled_mlp = true (with lora_dropout = 0 on the MLP projections)".into());
            }
            way = Some(format!(
                "[training] {} (about {})",
                keys.join(" and "),
                human_bytes(e.total_bytes)
            ));
            break;
        }
    }
    let mut text = match way {
        Some(way) => format!("It fits with {way}"),
        None => "Neither activation_offloading nor tiled_mlp makes it fit".to_string(),
    };
    if let Ok(Some(longest)) = max_seq_len(c, asked, usable) {
        text += &format!(
            "; as configured, examples of at most {longest} tokens fit ([data] max_length = {longest})"
        );
    }
    Ok(text + ".")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama_8b() -> ModelConfig {
        let json = serde_json::json!({
            "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": false
        });
        ModelConfig::from_hf_config(&json, std::path::Path::new("llama-3.1-8b/config.json"))
            .unwrap()
    }

    /// Llama-3.1-8B at 64k tokens on a 24 GiB GPU: refused before loading, naming the settings that fit (offload and
    /// the tiled MLP; neither alone is enough) and the
    /// longest examples that fit as configured; those settings pass; an offload the host cannot hold is refused
    /// with its figure; close to the capacity, a note.
    #[test]
    fn a_run_that_does_not_fit_is_refused_with_what_would_fit() {
        let c = llama_8b();
        let asked = EstimateArgs {
            seq: 65_536,
            gradient_checkpointing: true,
            device: DeviceKind::Cuda,
            ..Default::default()
        };
        let gpu = Some((24u64 << 30, "GPU 0"));
        // The longest that fits as configured: the search's answer for 91% of the GPU, between 20k and 64k tokens.
        let usable = ((24u64 << 30) as f64 * USABLE_GPU_MEMORY) as u64;
        let longest = max_seq_len(&c, &asked, usable).unwrap().unwrap();
        assert!((20_000..65_536).contains(&longest), "{longest}");
        let err = memory_verdict(&c, &asked, gpu, None, "run.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("run.toml: a training step of this run needs about")
                && err.contains(
                    "It fits with [training] activation_offloading = true (pinning 16.50 GiB of host memory) and \
                     tiled_mlp = true"
                )
                && err.contains(&format!("examples of at most {longest} tokens fit"))
                && err.contains("qlora estimate --model <the base model> --batch 1 --seq 65536"),
            "{err}"
        );
        let offloaded = EstimateArgs {
            activation_offloading: true,
            tiled_mlp: true,
            ..asked.clone()
        };
        assert_eq!(
            memory_verdict(&c, &offloaded, gpu, None, "run.toml").unwrap(),
            None
        );
        let err = memory_verdict(&c, &offloaded, gpu, Some(8 << 30), "run.toml")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("would pin 16.50 GiB of host memory")
                && err.contains("8.00 GiB available"),
            "{err}"
        );
        // Just under the capacity: it runs, with a note.
        let peak = estimate(&c, &asked).unwrap().total_bytes;
        let note = memory_verdict(&c, &asked, Some((peak + 1, "GPU 0")), None, "run.toml").unwrap();
        assert!(note.unwrap().contains("within 9% of the GPU's"));
    }
}
