//! Exporting a model, its active adapter merged in, to a GGUF file that llama.cpp (and Ollama, LM Studio, …) loads:
//! the tensors under llama.cpp's names and layouts, in one of ggml's types ([`GgmlType`]), with the model's and the
//! tokenizer's metadata as llama.cpp's converter writes them. The model is written one tensor at a time: each
//! merged weight is formed, encoded and written before the next, so the export never holds a second copy of the
//! model.

pub mod ggml;
pub mod gguf_writer;
mod k_quants;
mod llama_cpp;
pub mod ollama;
pub mod tensor_types;
mod vocabulary;

use std::io::IsTerminal;
use std::path::Path;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::files::apart::check_output_apart;
use crate::files::{refuse_existing, write_file_atomically};
use crate::loading::gguf::GgufFile;
use crate::models::LlamaModel;

pub use ggml::GgmlType;
use gguf_writer::{GgufWriter, TensorRecord};
pub use tensor_types::Quantization;

/// How [`gguf`] writes a model.
#[derive(Clone, Debug)]
pub struct GgufOptions {
    /// The type of the matrices (embeddings, projections, head), or a mix of types ([`Quantization`]); vectors
    /// (norms, RoPE factors) stay float32.
    pub quant: Quantization,
    /// llama.cpp's name of the tokenizer's pre-tokenizer (`tokenizer.ggml.pre`), for a folder whose tokenizer
    /// splits words in a way not recognized (a GGUF source keeps its own).
    pub tokenizer_pre: Option<String>,
    /// Write the active adapter alone, as llama.cpp's `convert_lora_to_gguf.py` does (`llama-cli --lora`,
    /// Ollama's `ADAPTER`), instead of the model with the adapter merged in.
    pub adapter_only: bool,
    /// Also write Ollama's `Modelfile` beside the output ([`ollama::modelfile_path`]).
    pub ollama: bool,
    /// Replace an existing output file (and Modelfile).
    pub overwrite: bool,
    /// Show a progress line on standard error while writing, when it is a terminal.
    pub progress: bool,
}

/// What [`gguf`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufReport {
    /// Tensors written.
    pub tensors: usize,
    /// Linear layers whose adapter was merged in (or written, with [`GgufOptions::adapter_only`]).
    pub adapted_modules: usize,
    /// Bytes of the file.
    pub bytes: u64,
    /// The architecture written (`general.architecture`).
    pub architecture: String,
    /// The Ollama `Modelfile` written beside it, if asked for.
    pub modelfile: Option<std::path::PathBuf>,
}

/// Writes `model` — its active adapter merged into the weights, as they are loaded (a 4-bit base dequantized: the
/// weights training saw), or the adapter alone ([`GgufOptions::adapter_only`]) — to `output` as GGUF. `source` is
/// where the model was loaded from: a GGUF file's metadata (architecture, tokenizer, chat template) is carried over,
/// a Hugging Face folder's `config.json`, `tokenizer.json` and `tokenizer_config.json` are converted. The file is
/// written beside `output` and moved into place when complete.
pub fn gguf(
    model: &LlamaModel,
    source: &Path,
    output: &Path,
    options: &GgufOptions,
) -> Result<GgufReport> {
    check_output_apart(
        ("output", output),
        &[("the base model", source)],
        "exported",
    )?;
    refuse_existing(output, options.overwrite)?;
    if options.ollama {
        ollama::check_modelfile(output, options.overwrite)?;
    }
    let gguf_source = match source
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
    {
        true => Some(GgufFile::open(source)?),
        false => None,
    };
    let conversion = llama_cpp::Conversion::new(
        model,
        gguf_source.as_ref(),
        source,
        options.tokenizer_pre.as_deref(),
    )?;
    let (plan, metadata) = match options.adapter_only {
        true => {
            let Quantization::Uniform(quant) = options.quant else {
                return Err(Error::InvalidInput(format!(
                    "--adapter-only writes one type for every tensor (f32, f16, bf16, q8_0, …), not the mix `{}`",
                    options.quant.name()
                )));
            };
            let (plan, alpha) = conversion.adapter_tensors(quant)?;
            (plan, conversion.adapter_metadata(alpha))
        }
        false => (
            conversion.tensors(options.quant)?,
            conversion.metadata(options.quant)?,
        ),
    };
    let records: Vec<TensorRecord> = plan.iter().map(|p| p.record.clone()).collect();
    let adapted_modules = model
        .linears()
        .iter()
        .filter(|(_, l)| l.active_adapter().is_some())
        .count();
    write_file_atomically(output, |tmp| {
        let io = |e: std::io::Error| Error::io("cannot write", tmp, e);
        let file = std::fs::File::create(tmp).map_err(io)?;
        let mut writer =
            GgufWriter::start(std::io::BufWriter::new(file), &metadata, records).map_err(io)?;
        let mut progress = ExportProgress::new(options.progress, plan.len());
        for planned in &plan {
            let values = conversion.values(&planned.source)?;
            let record = &planned.record;
            let row = *record.shape.last().unwrap_or(&1);
            writer
                .write_tensor(&encode_on_all_cores(record.ggml_type, &values, row))
                .map_err(io)?;
            progress.tensor_done(&record.name);
        }
        progress.finish();
        let file = writer
            .finish()
            .map_err(io)?
            .into_inner()
            .map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)
    })?;
    let modelfile = match options.ollama {
        true => Some(ollama::write_modelfile(
            output,
            source,
            gguf_source.as_ref(),
            options.adapter_only,
        )?),
        false => None,
    };
    let bytes = std::fs::metadata(output)
        .map_err(|e| Error::io("cannot read", output, e))?
        .len();
    Ok(GgufReport {
        tensors: plan.len(),
        adapted_modules,
        bytes,
        architecture: conversion.architecture().to_string(),
        modelfile,
    })
}

/// `values` (rows of `row` values) encoded as `ggml_type`, in pieces of whole rows on all cores.
fn encode_on_all_cores(ggml_type: GgmlType, values: &[f32], row: usize) -> Vec<u8> {
    // About 64 Ki values a piece: enough work to share, few enough pieces to join cheaply.
    let rows_per_piece = (65_536 / row.max(1)).max(1);
    let pieces: Vec<Vec<u8>> = values
        .par_chunks(rows_per_piece * row.max(1))
        .map(|piece| {
            let mut out = Vec::with_capacity(ggml_type.bytes(piece.len()));
            ggml_type.encode(piece, &mut out);
            out
        })
        .collect();
    pieces.concat()
}

/// The progress line of an export: tensors written out of all, on a terminal's standard error.
struct ExportProgress {
    shown: bool,
    total: usize,
    done: usize,
}

impl ExportProgress {
    fn new(wanted: bool, total: usize) -> Self {
        ExportProgress {
            shown: wanted && std::io::stderr().is_terminal(),
            total,
            done: 0,
        }
    }

    fn tensor_done(&mut self, name: &str) {
        self.done += 1;
        if self.shown {
            eprint!(
                "\r\x1b[2Kwriting tensors {}/{} ({:.0}%) {name}",
                self.done,
                self.total,
                100.0 * self.done as f64 / self.total.max(1) as f64
            );
        }
    }

    fn finish(&self) {
        if self.shown {
            eprintln!();
        }
    }
}
