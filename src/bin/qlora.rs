//! `qlora`: the command-line front end of candle-qlora (see DESIGN.md, "The command").

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use candle_qlora::loading::bnb::{quantize_path, QuantizeOptions};
use candle_qlora::quant::{BnbKernels, QuantConfig, QuantType};
use clap::{Parser, Subcommand, ValueEnum};

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
    #[arg(long, default_value = "bfloat16", value_parser = ["bfloat16", "float16", "float32"])]
    compute_dtype: String,
    /// Replace an existing output (only once the new one is complete).
    #[arg(long)]
    overwrite: bool,
}

fn quantize(args: QuantizeArgs) -> anyhow::Result<()> {
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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
