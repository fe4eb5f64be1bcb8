//! `qlora`: the command-line front end of candle-qlora. Each subcommand parses its flags and calls the library;
//! the subcommands and their flags are a stable interface (docs/cli.md).
// Doc comments below are the command's help text (clap), not rustdoc: `[model]` is a TOML section, not a link.
#![allow(rustdoc::broken_intra_doc_links)]

use std::path::PathBuf;
use std::process::ExitCode;

use std::io::Write;

use anyhow::Context;
use candle_core::DType;
use candle_qlora::adapter::{
    base_quantization, load_adapter, merge_to_folder, read_base_quantization, MergeOptions,
};
use candle_qlora::data::{read_jsonl, DataConfig, DataFormat, Dataset, Example};
use candle_qlora::distributed::RanksFrom;
use candle_qlora::export::{GgufOptions, Quantization};
use candle_qlora::files::apart::check_output_apart;
use candle_qlora::loading::bnb::{quantize_path, QuantizeOptions};
use candle_qlora::loading::{load_model, load_model_config, LoadOptions, LoadedModel};
use candle_qlora::lora::TargetModules;
use candle_qlora::models::{generate, ChatMessage, GenerationConfig};
use candle_qlora::optim::OptimizerName;
use candle_qlora::precision::{is_bf16_supported, select_device, TorchDtype};
use candle_qlora::quant::{BnbKernels, QuantConfig, QuantType};
use candle_qlora::trainer::{evaluate, DpoConfig, GrpoConfig, RunConfig, Trainer};
use clap::{Parser, Subcommand, ValueEnum};

/// Counts heap bytes so memory statistics and the timeline are exact.
#[global_allocator]
static ALLOCATOR: candle_qlora::memory::TrackingAllocator = candle_qlora::memory::TrackingAllocator;

#[derive(Parser)]
#[command(
    name = "qlora",
    version,
    about = "QLoRA fine-tuning of Llama-family models on Candle"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Quantize the linear weights of a .safetensors file or a model folder to 4 bits in bitsandbytes' layout
    /// (a folder also gets the `quantization_config` transformers needs to load it with bitsandbytes).
    Quantize(QuantizeArgs),
    /// Evaluate a model on a JSONL file: token-level mean loss, perplexity and token count.
    Eval(EvalArgs),
    /// Generate text from a prompt with a KV cache (greedy by default), streaming tokens as they come.
    Generate(GenerateArgs),
    /// Merge a LoRA adapter into its (dequantized) base and write a standard Hugging Face model folder.
    Merge(MergeArgs),
    /// Write a model (its adapter merged in) or an adapter alone as a GGUF file for llama.cpp, Ollama and LM Studio.
    Export(ExportArgs),
    /// Train a LoRA/QLoRA adapter from a TOML config ([model], [lora], [data], [training]).
    Train(TrainArgs),
    /// Predict training memory: weights, LoRA, optimizer state, gradients, activations — for full fine-tuning
    /// (float32 and mixed precision), LoRA, QLoRA, and the configuration given.
    Estimate(EstimateCliArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum QuantizeArg {
    Nf4,
    None,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(clap::Args)]
struct EstimateCliArgs {
    /// A Hub id, a model folder, a config.json or a .gguf file (only the configuration is read).
    #[arg(long)]
    model: String,
    /// Hub revision.
    #[arg(long)]
    revision: Option<String>,
    /// Micro-batch size.
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// Sequence length in tokens.
    #[arg(long, default_value_t = 2048)]
    seq: usize,
    /// LoRA rank.
    #[arg(long = "lora-r", default_value_t = 16)]
    lora_r: usize,
    /// The layers that get an adapter: `all-linear`, or module names separated by commas (`q_proj,v_proj`), as
    /// `[lora] target_modules` lists them.
    #[arg(long = "target-modules", default_value = "all-linear")]
    target_modules: String,
    /// Optimizer (TrainingArguments.optim name).
    #[arg(long, default_value = "paged_adamw_8bit")]
    optim: OptimizerName,
    /// Per-layer gradient checkpointing.
    #[arg(long = "gradient-checkpointing")]
    gradient_checkpointing: bool,
    /// With checkpointing, keep the last layers' activations while they fit in this many MiB (memory-aware
    /// checkpointing, as `activation_memory_budget_mib` in a run config).
    #[arg(long = "activation-memory-budget-mib")]
    activation_memory_budget_mib: Option<f64>,
    /// Tiled MLP (`tiled_mlp` in a run config): the MLP runs over slices of the tokens.
    #[arg(long = "tiled-mlp")]
    tiled_mlp: bool,
    /// Activation offload (`activation_offloading` in a run config; with --gradient-checkpointing): the recomputed
    /// layers' inputs wait in pinned host memory (counted apart: JSON host_bytes).
    #[arg(long = "activation-offloading")]
    activation_offloading: bool,
    /// A GPU's memory (e.g. 24GiB, 80GB): also print the longest sequence whose estimated peak fits in 91% of it,
    /// for these settings, with --tiled-mlp, with --activation-offloading and with both (JSON: max_seq_len,
    /// max_seq_len_tiled_mlp, max_seq_len_offloaded, max_seq_len_offloaded_tiled_mlp, and the host bytes the
    /// offload pins at those lengths).
    #[arg(long = "gpu-memory", value_parser = memory_size)]
    gpu_memory: Option<u64>,
    /// Base weights: NF4 (QLoRA) or the compute dtype (LoRA).
    #[arg(long, value_enum, default_value = "nf4")]
    quantize: QuantizeArg,
    /// Device: cpu (float32 compute) or cuda (bfloat16 compute).
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
    /// Compute dtype (float32, bfloat16 or float16), when not the device's.
    #[arg(long)]
    dtype: Option<TorchDtype>,
    /// Data-parallel ranks (GPUs, each holding the whole model; with --device cuda): the figures stay per GPU,
    /// and the gradient all-reduce of each optimizer step is added.
    #[arg(long = "world-size", default_value_t = 1, allow_negative_numbers = true, value_parser = count)]
    world_size: usize,
    /// DPO: --batch counts preference pairs, each forward holding both sequences of every pair.
    #[arg(long)]
    dpo: bool,
    /// GRPO: --batch counts completions, --seq is a prompt and its longest completion; generating a prompt's
    /// --num-generations completions adds their KV cache (the larger of generation and training counts).
    #[arg(long, conflicts_with = "dpo")]
    grpo: bool,
    /// GRPO's completions per prompt (TRL's num_generations).
    #[arg(long = "num-generations", default_value_t = 8, value_parser = count, requires = "grpo")]
    num_generations: usize,
    /// FSDP (`fsdp = "full_shard"` in a run config; with --gradient-checkpointing): each of the --world-size GPUs
    /// holds 1/N of the decoder layers' linear weights and gathers one layer at a time (JSON: sharded).
    #[arg(long)]
    fsdp: bool,
    /// With --fsdp, the shards live in host memory (`offload` / `offload_params` in a run config; JSON host_bytes)
    /// and each layer's share is copied to the GPU before its gather.
    #[arg(long = "fsdp-offload", requires = "fsdp")]
    fsdp_offload: bool,
    /// Print one JSON object for the configuration given instead of the table.
    #[arg(long)]
    json: bool,
}

fn estimate_memory(args: EstimateCliArgs) -> anyhow::Result<()> {
    use candle_qlora::memory::{
        comparison, estimate, human_bytes, max_seq_len, DeviceKind, EstimateArgs, USABLE_GPU_MEMORY,
    };
    // What `train` refuses has no estimate either: the same rule as its ranks'.
    if let Some(why) = args
        .dpo
        .then(|| DpoConfig::world_size_problem(args.world_size))
        .flatten()
    {
        anyhow::bail!(
            "--world-size {} with --dpo: {why}, and qlora train refuses it; estimate it with --world-size 1",
            args.world_size
        );
    }
    if let Some(why) = args
        .grpo
        .then(|| GrpoConfig::world_size_problem(args.world_size))
        .flatten()
    {
        anyhow::bail!(
            "--world-size {} with --grpo: {why}, and qlora train refuses it; estimate it with --world-size 1",
            args.world_size
        );
    }
    let config = load_model_config(&args.model, args.revision.as_deref())
        .with_context(|| format!("reading the configuration of `{}`", args.model))?;
    let request = EstimateArgs {
        batch: args.batch,
        seq: args.seq,
        lora_r: args.lora_r,
        target_modules: Some(match args.target_modules.as_str() {
            "all-linear" => TargetModules::AllLinear,
            names => TargetModules::List(names.split(',').map(|n| n.trim().to_string()).collect()),
        }),
        optim: args.optim,
        gradient_checkpointing: args.gradient_checkpointing,
        activation_memory_budget_mib: args.activation_memory_budget_mib,
        tiled_mlp: args.tiled_mlp,
        activation_offloading: args.activation_offloading,
        quantize: matches!(args.quantize, QuantizeArg::Nf4),
        device: match args.device {
            DeviceArg::Cpu => DeviceKind::Cpu,
            DeviceArg::Cuda => DeviceKind::Cuda,
        },
        dtype: args.dtype,
        world_size: args.world_size,
        preference: args.dpo,
        grpo_generations: args.grpo.then_some(args.num_generations),
        fsdp: args.fsdp,
        fsdp_offload: args.fsdp_offload,
    };
    let table = comparison(&config, &request)?;
    let asked = table.last().context("empty estimate")?;
    // The longest sequences that fit --gpu-memory: as asked, with the MLP tiled, with the layer inputs offloaded
    // (checkpointed; on CUDA only) and with both.
    let longest = match args.gpu_memory {
        Some(memory) => {
            let usable = (memory as f64 * USABLE_GPU_MEMORY) as u64;
            let mut rows = Vec::new();
            for (key, how, tiled, offload) in [
                ("max_seq_len", "as asked", false, false),
                ("max_seq_len_tiled_mlp", "with --tiled-mlp", true, false),
                (
                    "max_seq_len_offloaded",
                    "with --activation-offloading",
                    false,
                    true,
                ),
                (
                    "max_seq_len_offloaded_tiled_mlp",
                    "with --activation-offloading --tiled-mlp",
                    true,
                    true,
                ),
            ] {
                if offload && request.device == DeviceKind::Cpu {
                    continue;
                }
                let at = request.adding(tiled, offload);
                let longest = max_seq_len(&config, &at, usable)?;
                let host = match longest {
                    Some(seq) => estimate(&config, &EstimateArgs { seq, ..at })?.host_bytes,
                    None => 0,
                };
                rows.push((key, how, offload, longest, host));
            }
            Some((memory, usable, rows))
        }
        None => None,
    };
    if args.json {
        let mut json = serde_json::to_value(asked)?;
        for (key, _, offload, longest, host) in longest.iter().flat_map(|l| &l.2) {
            json[*key] = serde_json::json!(longest);
            if *offload || request.activation_offloading {
                json[format!("{key}_host_bytes")] = serde_json::json!(host);
            }
        }
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    println!(
        "{} — batch {} × {} tokens, LoRA r={} on {}, {}, {} compute, checkpointing {}{}\n",
        args.model,
        args.batch,
        args.seq,
        args.lora_r,
        args.target_modules,
        args.optim,
        request.compute_dtype(),
        if args.gradient_checkpointing {
            "on"
        } else {
            "off"
        },
        match args.world_size {
            1 => String::new(),
            n => format!(", per GPU of {n}"),
        }
    );
    println!(
        "{:<26} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
        "", "weights", "LoRA", "optimizer", "gradients", "activations", "other", "total"
    );
    for e in &table {
        let name = e.regime.label();
        println!(
            "{name:<26} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
            human_bytes(e.weights_bytes),
            human_bytes(e.lora_bytes),
            human_bytes(e.optimizer_bytes),
            human_bytes(e.gradients_bytes),
            human_bytes(e.activations_bytes),
            human_bytes(e.other_bytes),
            human_bytes(e.total_bytes)
        );
    }
    if let Some(d) = &asked.data_parallel {
        println!(
            "\ndata parallel over {} GPUs, per optimizer step: {} of float32 LoRA gradients all-reduced in {} \
             bucket(s); each GPU sends and receives {} (ring: 2 (N − 1) / N of it), {:.3} ms at a bus bandwidth \
             (nccl-tests' busbw) of 100 GB/s.",
            d.world_size,
            human_bytes(d.all_reduce_bytes),
            d.buckets,
            human_bytes(d.bytes_sent_per_gpu),
            d.bytes_sent_per_gpu as f64 / 100e9 * 1e3,
        );
    }
    if let Some(f) = &asked.sharded {
        println!(
            "\nFSDP over {} GPUs, per GPU: {} of the layers' linear weights, embedding table and head (1/{}{}) and \
             one of them gathered whole at a time ({} at most); {} whole on every GPU (norms, RoPE tables); {} of \
             all-gathers received per micro-batch (each layer twice: forward and recomputation; the head twice), \
             {:.1} ms at a bus bandwidth of 100 GB/s.",
            f.world_size,
            human_bytes(f.shard_bytes),
            f.world_size,
            if f.offload { ", in host memory" } else { "" },
            human_bytes(f.gathered_bytes),
            human_bytes(f.unsharded_bytes),
            human_bytes(f.all_gather_bytes_per_micro_batch),
            f.all_gather_bytes_per_micro_batch as f64 / 100e9 * 1e3,
        );
    }
    if let Some((memory, usable, rows)) = longest {
        println!(
            "\nlongest sequence (per row, batch {}) whose estimated peak fits {} of {}:",
            args.batch,
            human_bytes(usable),
            human_bytes(memory),
        );
        for (_, how, _, longest, host) in rows {
            let tokens = longest.map_or("none".to_string(), |n| format!("{n} tokens"));
            let pinned = match host {
                0 => String::new(),
                bytes => format!(" ({} of pinned host memory)", human_bytes(bytes)),
            };
            println!("  {how:<42} {tokens}{pinned}");
        }
    }
    println!("\nassumed:");
    for e in &table {
        println!("  {}:", e.regime.label());
        for a in &e.assumptions {
            println!("    {a}");
        }
    }
    Ok(())
}

#[derive(clap::Args)]
struct TrainArgs {
    /// The run config (see configs/).
    #[arg(long)]
    config: PathBuf,
    /// Override a config field: section.key=value (repeatable), e.g. --set training.learning_rate=1e-4.
    #[arg(long = "set", value_name = "SECTION.KEY=VALUE")]
    set: Vec<String>,
    /// Resume from a checkpoint folder, or from the latest checkpoint in output_dir when given without a value.
    #[arg(long, num_args = 0..=1, default_missing_value = "latest")]
    resume: Option<String>,
    /// Train data-parallel on N GPUs of this machine, one process each, as torchrun --nproc-per-node N does (a
    /// build with the `nccl` feature; several machines: start this command under torchrun or srun instead).
    #[arg(long, value_name = "N", allow_negative_numbers = true, value_parser = count)]
    nproc_per_node: Option<usize>,
}

/// The command line without `--nproc-per-node` (and its value): what each rank runs.
fn rank_args() -> Vec<std::ffi::OsString> {
    let mut out = Vec::new();
    let mut args = std::env::args_os().skip(1);
    while let Some(a) = args.next() {
        if a == "--nproc-per-node" {
            args.next();
        } else if !a.to_string_lossy().starts_with("--nproc-per-node=") {
            out.push(a);
        }
    }
    out
}

fn train(args: TrainArgs) -> anyhow::Result<()> {
    let mut config = RunConfig::load(&args.config, &args.set)?;
    if let Some(resume) = &args.resume {
        config.training.resume_from_checkpoint = Some(resume.clone());
    }
    let resume = config.training.resume_checkpoint()?;
    if let Some(n) = args
        .nproc_per_node
        .filter(|_| std::env::var_os("WORLD_SIZE").is_none())
    {
        // What every rank would refuse (the config, the build, the GPUs, the count) is refused before one starts.
        config.check_ranks(n, n, RanksFrom::Launcher)?;
        let status = candle_qlora::distributed::launch_local(n, &rank_args())?;
        if !status.success() {
            std::process::exit(status.code().unwrap_or(1));
        }
        return Ok(());
    }
    // `memory_snapshot` of a CPU run: record the heap from here, so the tokenizer, the data and the weights are in
    // the snapshot (a GPU's pool is recorded from when the trainer opens the device).
    let _recording = (config.training.memory_snapshot
        && config.training.memory_snapshot_max_entries > 0
        && (config.training.use_cpu || !cfg!(feature = "cuda")))
    .then(|| {
        candle_qlora::memory::snapshot::Recording::start(
            candle_qlora::memory::snapshot::Source::Heap,
            config.training.memory_snapshot_max_entries,
        )
    });
    let mut trainer = Trainer::from_run_config(&config)?;
    candle_qlora::trainer::interrupt::stop_on_ctrl_c()
        .context("cannot install the Ctrl-C handler")?;
    // Rank 0 alone speaks for a distributed run (the others stop with it).
    let world = candle_qlora::distributed::WorldEnv::from_env()?;
    let main = world.as_ref().is_none_or(|w| w.is_main());
    if main {
        eprintln!("Ctrl-C stops after the current step, with a checkpoint to resume from");
    }
    match trainer.train(resume.as_deref()) {
        Err(candle_qlora::Error::Interrupted { .. }) if !main => std::process::exit(130),
        Err(candle_qlora::Error::Interrupted {
            step,
            checkpoint: Some(dir),
        }) => {
            let sets: String = args.set.iter().map(|s| format!(" --set {s:?}")).collect();
            // The same ranks replay the run exactly: a one-node job as our launcher starts it, otherwise under
            // the same launcher.
            let ranks = match &world {
                Some(w) if w.world_size > 1 && w.local_world_size == w.world_size => {
                    format!(" --nproc-per-node {}", w.world_size)
                }
                Some(w) if w.world_size > 1 => {
                    format!(" (under your launcher, {} ranks)", w.world_size)
                }
                _ => String::new(),
            };
            eprintln!(
                "stopped by Ctrl-C after step {step}; checkpoint saved in {}\nresume with: qlora train --config {}{sets} \
                 --resume {}{ranks}",
                dir.display(),
                args.config.display(),
                dir.display()
            );
            std::process::exit(130);
        }
        Err(e @ candle_qlora::Error::Interrupted { .. }) => {
            eprintln!("error: {e}");
            std::process::exit(130);
        }
        result => {
            result?;
            Ok(())
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    Bf16,
    F16,
    F32,
}

#[derive(clap::Args)]
struct MergeArgs {
    /// Base model: a Hugging Face folder, a .gguf file, or a Hub id.
    #[arg(long)]
    model: String,
    /// Hub revision of the base.
    #[arg(long)]
    revision: Option<String>,
    /// The PEFT adapter folder to merge.
    #[arg(long, value_parser = folder)]
    adapter: PathBuf,
    /// Output folder.
    #[arg(long)]
    output: PathBuf,
    /// Dtype of the written weights.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: DtypeArg,
    /// Re-quantize the merged linear weights to 4 bits (bitsandbytes layout).
    #[arg(long, value_enum, default_value = "none")]
    requantize: QuantizeOnLoad,
    /// Replace an existing output folder.
    #[arg(long)]
    overwrite: bool,
}

#[derive(clap::Args)]
struct ExportArgs {
    /// Base model: a Hugging Face folder, a .gguf file, or a Hub id.
    #[arg(long)]
    model: String,
    /// Hub revision of the base.
    #[arg(long)]
    revision: Option<String>,
    /// A PEFT adapter folder to merge in (or to write alone, with --adapter-only).
    #[arg(long, value_parser = folder)]
    adapter: Option<PathBuf>,
    /// The file format.
    #[arg(long, value_enum)]
    format: ExportFormat,
    /// The type of the matrices: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k … q6_k, or llama-quantize's
    /// mixes q4_k_m and q5_k_m (norms stay f32).
    #[arg(long, default_value = "f16")]
    quant: Quantization,
    /// Merge into the base's stored (16-bit) weights instead of the 4-bit weights the adapter was trained on.
    #[arg(long)]
    original_base: bool,
    /// llama.cpp's name of the tokenizer's pre-tokenizer (tokenizer.ggml.pre) when it is not recognized.
    #[arg(long)]
    tokenizer_pre: Option<String>,
    /// Write the adapter alone, as llama.cpp's convert_lora_to_gguf.py does (llama-cli --lora, Ollama's ADAPTER).
    #[arg(long, requires = "adapter")]
    adapter_only: bool,
    /// Also write Ollama's Modelfile beside the output (FILE.Modelfile: FROM, ADAPTER, stop tokens, sampling).
    #[arg(long)]
    ollama: bool,
    /// The GGUF file to write.
    #[arg(long)]
    output: PathBuf,
    /// Replace an existing output file (and its Modelfile).
    #[arg(long)]
    overwrite: bool,
}

#[derive(Clone, Copy, ValueEnum)]
enum ExportFormat {
    /// llama.cpp's GGUF.
    Gguf,
}

fn export(args: ExportArgs) -> anyhow::Result<()> {
    let ExportFormat::Gguf = args.format;
    let mut inputs = vec![("--model", std::path::Path::new(&args.model))];
    inputs.extend(args.adapter.as_deref().map(|a| ("--adapter", a)));
    check_output_apart(("--output", &args.output), &inputs, "exported")?;
    let margs = ModelArgs {
        model: args.model.clone(),
        revision: args.revision.clone(),
        // None: as the adapter was trained (its recorded 4-bit base), else as stored.
        quantize: args.original_base.then_some(QuantizeOnLoad::None),
        adapter: args.adapter.clone(),
        // Merging is exact float32 arithmetic on the host, whatever the build.
        device: ComputeOn::Cpu,
    };
    // The linear weights stay in their files until written: the export holds one at a time.
    let loaded = margs.load_deferring(true)?;
    let options = GgufOptions {
        quant: args.quant,
        tokenizer_pre: args.tokenizer_pre.clone(),
        adapter_only: args.adapter_only,
        ollama: args.ollama,
        overwrite: args.overwrite,
        progress: true,
    };
    let start = std::time::Instant::now();
    let report = candle_qlora::export::gguf(
        &loaded.model,
        std::path::Path::new(&loaded.source),
        &args.output,
        &options,
    )?;
    println!(
        "wrote {} ({} tensors, {} {} in {}, {:.1} MiB; {} modules {}) in {:.1} s",
        args.output.display(),
        report.tensors,
        report.architecture,
        if args.adapter_only {
            "adapter"
        } else {
            "model"
        },
        args.quant.name(),
        report.bytes as f64 / (1 << 20) as f64,
        report.adapted_modules,
        if args.adapter_only {
            "adapted"
        } else {
            "with the adapter merged in"
        },
        start.elapsed().as_secs_f64()
    );
    if let Some(modelfile) = &report.modelfile {
        println!(
            "wrote {} (ollama create NAME -f {})",
            modelfile.display(),
            modelfile.display()
        );
    }
    Ok(())
}

fn merge(args: MergeArgs) -> anyhow::Result<()> {
    // Before anything loads: an output overlapping an input would destroy it, --overwrite or not.
    check_output_apart(
        ("--output", &args.output),
        &[
            ("--adapter", &args.adapter),
            ("--model", std::path::Path::new(&args.model)),
        ],
        "merged",
    )?;
    let margs = ModelArgs {
        model: args.model.clone(),
        revision: args.revision.clone(),
        quantize: Some(QuantizeOnLoad::None),
        adapter: Some(args.adapter.clone()),
        // Merging is exact float32 arithmetic on the host, whatever the build.
        device: ComputeOn::Cpu,
    };
    let loaded = margs.load()?;
    let dtype = match args.dtype {
        DtypeArg::Bf16 => DType::BF16,
        DtypeArg::F16 => DType::F16,
        DtypeArg::F32 => DType::F32,
    };
    let source = std::path::Path::new(&loaded.source);
    let options = MergeOptions {
        dtype,
        requantize: args.requantize.config(),
        overwrite: args.overwrite,
    };
    let report = merge_to_folder(
        &loaded.model,
        loaded.tokenizer.as_ref(),
        source.is_dir().then_some(source),
        &args.output,
        &options,
    )?;
    println!(
        "merged the adapter into {} modules; largest absolute weight change {:.6e}; wrote {} tensors ({:?}{}) to {}",
        report.merged_modules,
        report.max_abs_change,
        report.tensors,
        dtype,
        if options.requantize.is_some() { ", linears re-quantized to 4 bits" } else { "" },
        args.output.display()
    );
    Ok(())
}

#[derive(Clone, Copy, ValueEnum)]
enum QuantizeOnLoad {
    /// NF4 with double quantization, blocksize 64 (QLoRA).
    Nf4,
    /// FP4 with double quantization, blocksize 64.
    Fp4,
    /// Keep the weights as stored.
    None,
}

impl QuantizeOnLoad {
    fn config(self) -> Option<QuantConfig> {
        match self {
            QuantizeOnLoad::Nf4 => Some(QuantConfig::nf4()),
            QuantizeOnLoad::Fp4 => Some(QuantConfig::fp4()),
            QuantizeOnLoad::None => None,
        }
    }
}

/// Flags every command that loads a model shares.
#[derive(clap::Args)]
struct ModelArgs {
    /// Model: a Hugging Face folder, a .gguf file, or a Hub id (org/name).
    #[arg(long)]
    model: String,
    /// Hub revision (branch, tag or commit).
    #[arg(long)]
    revision: Option<String>,
    /// Quantize the linear weights on load [default: as the adapter's base was in training (its
    /// base_quantization.json), else none].
    #[arg(long, value_enum)]
    quantize: Option<QuantizeOnLoad>,
    /// A PEFT LoRA adapter folder to apply (unmerged).
    #[arg(long, value_parser = folder)]
    adapter: Option<PathBuf>,
    /// Where to compute: auto = CUDA GPU 0 in bf16 (fp16 where the GPU has no bf16) when this build has the cuda
    /// feature and a GPU answers, else the CPU in f32; cpu; cuda = GPU 0, or an error.
    #[arg(long, value_enum, default_value_t = ComputeOn::Auto)]
    device: ComputeOn,
}

/// `--device` of the commands that load a model.
#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum ComputeOn {
    Auto,
    Cpu,
    Cuda,
}

impl ModelArgs {
    fn load(&self) -> anyhow::Result<LoadedModel> {
        self.load_deferring(false)
    }

    /// The model, its linear weights left in their files with `defer_linear_weights`
    /// ([`LoadOptions::defer_linear_weights`]).
    fn load_deferring(&self, defer_linear_weights: bool) -> anyhow::Result<LoadedModel> {
        let start = std::time::Instant::now();
        let (quantization, why) = self.base_quantization()?;
        let device = select_device(self.device == ComputeOn::Cpu, 0, "computing")?;
        if self.device == ComputeOn::Cuda && device.is_cpu() {
            anyhow::bail!(
                "--device cuda: no CUDA GPU{}; use --device auto or cpu",
                match cfg!(feature = "cuda") {
                    true => " answered",
                    false =>
                        " in this build (it has no cuda feature: docs/gpu.md says how to build one)",
                }
            );
        }
        // As a GPU training run computes (bf16 autocast); the CPU computes in f32, where it is fastest.
        let compute_dtype = match (device.is_cpu(), is_bf16_supported(&device)) {
            (true, _) => DType::F32,
            (false, true) => DType::BF16,
            (false, false) => DType::F16,
        };
        let opts = LoadOptions {
            quantization,
            compute_dtype,
            defer_linear_weights,
        };
        let mut loaded = load_model(&self.model, self.revision.as_deref(), &opts)
            .with_context(|| format!("loading model `{}`", self.model))?;
        loaded.model = loaded.model.to_device(&device)?;
        if let Some(dir) = &self.adapter {
            load_adapter(&mut loaded.model, dir, "default")
                .with_context(|| format!("loading adapter `{}`", dir.display()))?;
            eprintln!("adapter {} applied", dir.display());
        }
        let base = match base_quantization(&loaded.model) {
            Some(q) => format!(
                "{} base, blocksize {}{}",
                q.quant_type,
                q.blocksize,
                if q.double_quant {
                    ", double quantization"
                } else {
                    ""
                }
            ),
            None => "base as stored".to_string(),
        };
        eprintln!(
            "loaded {} ({} layers, {:.1} MiB of weights; {base}{why}; {}) in {:.1} s",
            loaded.source,
            loaded.model.config().num_hidden_layers,
            loaded.model.weight_bytes() as f64 / (1 << 20) as f64,
            match device.is_cpu() {
                true => "on the CPU".to_string(),
                false => format!("on the GPU, {compute_dtype:?} compute"),
            },
            start.elapsed().as_secs_f64()
        );
        Ok(loaded)
    }

    /// What to quantize the base to on load, and why: `--quantize`, else what the adapter was trained on.
    fn base_quantization(&self) -> anyhow::Result<(Option<QuantConfig>, &'static str)> {
        if let Some(asked) = self.quantize {
            return Ok((asked.config(), ""));
        }
        let recorded = match &self.adapter {
            Some(dir) => read_base_quantization(dir)
                .with_context(|| format!("reading adapter `{}`", dir.display()))?,
            None => None,
        };
        Ok(match recorded {
            Some(q) => (q, ", as the adapter was trained; --quantize overrides"),
            None => (None, ""),
        })
    }
}

#[derive(Clone, Copy, ValueEnum)]
enum FormatArg {
    Auto,
    Text,
    Alpaca,
    Messages,
    Sharegpt,
}

#[derive(clap::Args)]
struct EvalArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSONL data file.
    #[arg(long)]
    data: PathBuf,
    /// Data format (auto detects it per line).
    #[arg(long, value_enum, default_value = "auto")]
    format: FormatArg,
    /// Longest example in tokens (longer ones are truncated and counted).
    #[arg(long, default_value_t = 2048)]
    max_length: usize,
    /// Count every token of instruction and chat examples, not only the completions.
    #[arg(long)]
    all_tokens: bool,
    /// Examples per forward pass.
    #[arg(long, default_value_t = 4)]
    batch_size: usize,
    /// Skip malformed lines (counted) instead of stopping at the first.
    #[arg(long)]
    skip_bad_lines: bool,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(clap::Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true, value_parser = temperature)]
    temperature: f64,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long, default_value_t = 1.0, allow_negative_numbers = true, value_parser = top_p)]
    top_p: f64,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sampling seed.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Generate all --max-new-tokens tokens, not stopping at end-of-sequence (for benchmarks).
    #[arg(long)]
    ignore_eos: bool,
}

/// A count for `--nproc-per-node` and `--world-size`. A negative number is taken as a value (clap would read it as
/// a flag) and refused as out of range; 0 goes on to the command's own message.
fn count(text: &str) -> Result<usize, String> {
    match text.trim().parse::<i128>() {
        Ok(n) if n < 0 => Err(format!(
            "{n} is out of range: give a whole number, 1 or more"
        )),
        Ok(n) => usize::try_from(n)
            .map_err(|_| format!("{n} is out of range: give a whole number, 1 or more")),
        Err(_) => Err(format!("`{text}` is not a whole number (give 1 or more)")),
    }
}

/// `--gpu-memory`: bytes, with a binary (KiB, MiB, GiB, TiB) or decimal (KB, MB, GB, TB) unit, or none (bytes).
fn memory_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = (&t[..split], t[split..].trim());
    let scale: f64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "kib" => 1024.0,
        "mib" => 1024f64.powi(2),
        "gib" => 1024f64.powi(3),
        "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => {
            return Err(format!(
                "`{text}`: unknown unit `{unit}` (give e.g. 24GiB, 80GB or a number of bytes)"
            ))
        }
    };
    match number.parse::<f64>() {
        Ok(n) if n > 0.0 && (n * scale).is_finite() && n * scale < u64::MAX as f64 => {
            Ok((n * scale) as u64)
        }
        _ => Err(format!(
            "`{text}` is not a memory size (give e.g. 24GiB, 80GB or a number of bytes, more than 0)"
        )),
    }
}

/// A folder flag: an empty path would be read as the working directory, so it is refused.
fn folder(text: &str) -> Result<PathBuf, String> {
    match text.is_empty() {
        true => Err(
            "an empty path names no folder: give the folder's path, or leave the flag out".into(),
        ),
        false => Ok(PathBuf::from(text)),
    }
}

/// A number for a generation setting, checked as [`GenerationConfig::validate`] checks it (`set` puts it in).
fn generation_number(text: &str, set: impl Fn(&mut GenerationConfig, f64)) -> Result<f64, String> {
    let value: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number"))?;
    let mut config = GenerationConfig::greedy(1);
    set(&mut config, value);
    config.validate().map_err(|e| e.to_string())?;
    Ok(value)
}

/// `--temperature`: 0 (greedy) or more.
fn temperature(text: &str) -> Result<f64, String> {
    generation_number(text, |c, v| c.temperature = v)
}

/// `--top-p`: in (0, 1].
fn top_p(text: &str) -> Result<f64, String> {
    generation_number(text, |c, v| c.top_p = v)
}

fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let data = DataConfig {
        format: match args.format {
            FormatArg::Auto => DataFormat::Auto,
            FormatArg::Text => DataFormat::Text,
            FormatArg::Alpaca => DataFormat::Alpaca,
            FormatArg::Messages => DataFormat::Messages,
            FormatArg::Sharegpt => DataFormat::ShareGpt,
        },
        max_length: args.max_length,
        completion_only_loss: !args.all_tokens,
        skip_bad_lines: args.skip_bad_lines,
        ..Default::default()
    };
    // The file is read (and its bad lines reported) before the model loads.
    let (examples, read) = read_jsonl(&args.data, data.format, data.skip_bad_lines)?;
    // Pairs are DPO's data, which eval does not score: say what does, before the model loads.
    if let Some(i) = examples
        .iter()
        .position(|e| matches!(e, Example::Preference(_)))
    {
        anyhow::bail!(
            "{}:{}: a preference pair (`chosen`/`rejected`); qlora eval scores supervised examples (text, \
             instructions, chat) and takes no run config: evaluate pairs in a DPO run (a run config with a [dpo] \
             section and the pairs as [data] eval_file, which logs eval_rewards/accuracies), or give eval \
             supervised examples, e.g. the chosen answers as {{\"instruction\": …, \"output\": …}}",
            args.data.display(),
            read.lines.get(i).copied().unwrap_or(i + 1)
        );
    }
    for (line, reason) in &read.skipped {
        eprintln!(
            "warning: {}:{line}: skipped ({reason})",
            args.data.display()
        );
    }
    let loaded = args.model.load()?;
    let tokenizer = loaded.tokenizer()?;
    let dataset = Dataset::from_read(&args.data, &examples, &read, tokenizer, &data)?;
    let learn_all = (!args.all_tokens).then_some("--all-tokens");
    dataset.check_learnable(&args.data.display().to_string(), learn_all)?;
    let report = evaluate(&loaded.model, &dataset.rows, args.batch_size)?;
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!("loss        {:.6}", report.loss);
        println!("perplexity  {:.4}", report.perplexity);
        println!("tokens      {}", report.tokens);
        println!(
            "examples    {} ({} truncated to {} tokens, {} lines skipped)",
            report.examples,
            report.truncated,
            args.max_length,
            read.skipped.len()
        );
    }
    Ok(())
}

fn generate_text(args: GenerateArgs) -> anyhow::Result<()> {
    let mut config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        eos_token_ids: None,
    };
    // The settings are checked before the weights load.
    config.validate()?;
    let loaded = args.model.load()?;
    let tokenizer = loaded.tokenizer()?;
    let prompt_ids = if args.chat {
        let text = tokenizer
            .apply_chat_template(
                &[ChatMessage {
                    role: "user".into(),
                    content: args.prompt.clone(),
                }],
                true,
            )
            .context("drop --chat to use the prompt as plain text")?;
        tokenizer.encode(&text, false)?
    } else {
        tokenizer.encode(&args.prompt, true)?
    };
    let mut eos = loaded.model.config().eos_token_ids.clone();
    if let Some(id) = tokenizer
        .eos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t))
    {
        eos.push(id);
    }
    config.eos_token_ids = Some(if args.ignore_eos { Vec::new() } else { eos });
    let start = std::time::Instant::now();
    let mut tokens = Vec::new();
    let mut printed = 0usize;
    let mut stdout = std::io::stdout();
    let out = generate(&loaded.model, &prompt_ids, &config, |t| {
        tokens.push(t);
        // Decode everything so far and print the new part, so multi-byte characters come out whole.
        let text = tokenizer.decode(&tokens, true)?;
        if text.len() > printed && text.is_char_boundary(printed) {
            let _ = write!(stdout, "{}", &text[printed..]);
            let _ = stdout.flush();
            printed = text.len();
        }
        Ok(())
    })?;
    println!();
    let context = loaded.model.config().max_position_embeddings;
    if out.len() < args.max_new_tokens && prompt_ids.len() + out.len() == context {
        eprintln!("note: stopped at the model's context of {context} positions");
    }
    eprintln!(
        "{} tokens in {:.2} s ({:.1} tokens/s)",
        out.len(),
        start.elapsed().as_secs_f64(),
        out.len() as f64 / start.elapsed().as_secs_f64()
    );
    Ok(())
}

#[derive(Clone, Copy, ValueEnum)]
enum QuantTypeArg {
    Nf4,
    Fp4,
}

#[derive(Clone, Copy, ValueEnum)]
enum KernelsArg {
    /// Reproduce bitsandbytes' CUDA kernels (what Hub checkpoints were made with).
    Cuda,
    /// Reproduce bitsandbytes' CPU backend.
    Cpu,
}

#[derive(clap::Args)]
struct QuantizeArgs {
    /// Input: a .safetensors file or a Hugging Face model folder (config.json + *.safetensors).
    #[arg(long)]
    input: PathBuf,
    /// Output: a .safetensors file (for a file input) or a folder (for a folder input).
    #[arg(long)]
    output: PathBuf,
    /// 4-bit data type.
    #[arg(long, value_enum, default_value = "nf4")]
    quant_type: QuantTypeArg,
    /// Elements per absmax block: 32, 64, 128, 256, 512, 1024, 2048 or 4096.
    #[arg(long, default_value_t = 64)]
    blocksize: usize,
    /// Quantize the block absmax values too (bnb_4bit_use_double_quant).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "true|false")]
    double_quant: bool,
    /// Which bitsandbytes kernels to match byte for byte.
    #[arg(long, value_enum, default_value = "cuda")]
    kernels: KernelsArg,
    /// bnb_4bit_compute_dtype written to config.json (bfloat16, float16, float32).
    #[arg(long, default_value = "bfloat16")]
    compute_dtype: TorchDtype,
    /// Replace an existing output (only once the new one is complete).
    #[arg(long)]
    overwrite: bool,
}

fn quantize(args: QuantizeArgs) -> anyhow::Result<()> {
    check_output_apart(
        ("--output", &args.output),
        &[("--input", &args.input)],
        "nf4",
    )?;
    let config = QuantConfig {
        quant_type: match args.quant_type {
            QuantTypeArg::Nf4 => QuantType::Nf4,
            QuantTypeArg::Fp4 => QuantType::Fp4,
        },
        blocksize: args.blocksize,
        double_quant: args.double_quant,
        kernels: match args.kernels {
            KernelsArg::Cuda => BnbKernels::Cuda,
            KernelsArg::Cpu => BnbKernels::Cpu,
        },
    };
    let options = QuantizeOptions {
        config,
        compute_dtype: args.compute_dtype,
        overwrite: args.overwrite,
    };
    let report = quantize_path(&args.input, &args.output, &options)
        .with_context(|| format!("quantizing `{}`", args.input.display()))?;
    println!(
        "quantized {} linear weights ({} parameters) to {}{} at blocksize {}: {:.3} bits/parameter",
        report.quantized_tensors,
        report.quantized_params,
        config.quant_type,
        if config.double_quant {
            " with double quantization"
        } else {
            ""
        },
        config.blocksize,
        report.bits_per_parameter()
    );
    println!(
        "kept {} tensors unquantized (embeddings, norms, lm_head, biases)",
        report.kept_tensors
    );
    println!("wrote {}", args.output.display());
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Quantize(args) => quantize(args),
        Command::Eval(args) => eval(args),
        Command::Generate(args) => generate_text(args),
        Command::Merge(args) => merge(args),
        Command::Export(args) => export(args),
        Command::Train(args) => train(args),
        Command::Estimate(args) => estimate_memory(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes on one line, each cause only once (an I/O error's message already ends with the OS
/// error, which is also its source).
fn error_text(e: &anyhow::Error) -> String {
    let mut text = e.to_string();
    for cause in e.chain().skip(1) {
        let cause = cause.to_string();
        if !text.contains(&cause) {
            text = format!("{text}: {cause}");
        }
    }
    text
}
