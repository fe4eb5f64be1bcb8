//! Ollama's `Modelfile` beside an exported GGUF file, so that `ollama create NAME -f FILE.Modelfile` imports it as
//! it is: `FROM` the exported model (or, for an adapter alone, the base it was trained on, with `ADAPTER` the
//! exported adapter), the end-of-sequence tokens as stops, and the sampling defaults of the base's
//! `generation_config.json`. Ollama takes the chat template from the GGUF metadata (or the base folder) itself.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::files::{read_json, refuse_existing, write_atomic};
use crate::loading::gguf::GgufFile;
use crate::models::TextTokenizer;

/// Where the Modelfile of the GGUF file `output` goes: beside it, `NAME.Modelfile`.
pub fn modelfile_path(output: &Path) -> PathBuf {
    output.with_extension("Modelfile")
}

/// Refuses an existing Modelfile for `output` unless `overwrite` (checked before anything is written).
pub(super) fn check_modelfile(output: &Path, overwrite: bool) -> Result<()> {
    refuse_existing(&modelfile_path(output), overwrite)
}

/// Writes the Modelfile of `output` (a model, or with `adapter_only` an adapter of the base at `source`) and
/// returns its path.
pub(super) fn write_modelfile(
    output: &Path,
    source: &Path,
    gguf_source: Option<&GgufFile>,
    adapter_only: bool,
) -> Result<PathBuf> {
    let local = |p: &Path| format!("./{}", p.file_name().unwrap_or_default().to_string_lossy());
    // Paths as Ollama's examples write them: bare, quoted only where they hold spaces or quotes.
    let path = |p: String| match p.contains(|c: char| c.is_whitespace() || c == '"') {
        true => quoted(&p),
        false => p,
    };
    let absolute = |p: &Path| {
        std::fs::canonicalize(p)
            .map_err(|e| Error::io("cannot resolve", p, e))
            .map(|p| p.display().to_string())
    };
    let mut text = format!(
        "# Written by `qlora export`. Import with: ollama create NAME -f {}\n",
        modelfile_path(output).display()
    );
    match adapter_only {
        true => {
            text += &format!("FROM {}\n", path(absolute(source)?));
            text += &format!("ADAPTER {}\n", path(local(output)));
        }
        false => text += &format!("FROM {}\n", path(local(output))),
    }
    // A folder's generation defaults (a GGUF file carries none).
    let generation = match gguf_source {
        None => read_json::<serde_json::Value>(&source.join("generation_config.json")).ok(),
        Some(_) => None,
    };
    for stop in stop_tokens(source, gguf_source, generation.as_ref())? {
        text += &format!("PARAMETER stop {}\n", quoted(&stop));
    }
    if let Some(g) = generation.filter(|g| g["do_sample"] != false) {
        // transformers' names → Ollama's.
        for (ours, theirs) in [
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("repetition_penalty", "repeat_penalty"),
        ] {
            if let Some(v) = g[ours].as_f64() {
                text += &format!("PARAMETER {theirs} {v}\n");
            }
        }
    }
    let path = modelfile_path(output);
    write_atomic(&path, text)?;
    Ok(path)
}

/// A Modelfile string: in double quotes, with quotes and backslashes escaped.
fn quoted(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

/// The texts of the end-of-sequence tokens: a GGUF base's `tokenizer.ggml.eos_token_id`, or a folder's
/// `eos_token` and its `generation` config's `eos_token_id` (one or a list).
fn stop_tokens(
    source: &Path,
    gguf_source: Option<&GgufFile>,
    generation: Option<&serde_json::Value>,
) -> Result<Vec<String>> {
    let mut stops: Vec<String> = Vec::new();
    match gguf_source {
        Some(file) => {
            let md = file.metadata();
            let id = md
                .get("tokenizer.ggml.eos_token_id")
                .and_then(|v| v.to_u32().ok());
            let tokens = md
                .get("tokenizer.ggml.tokens")
                .and_then(|v| v.to_vec().ok());
            if let (Some(id), Some(tokens)) = (id, tokens) {
                if let Some(text) = tokens.get(id as usize).and_then(|t| t.to_string().ok()) {
                    stops.push(text.clone());
                }
            }
        }
        None => {
            if !source.join("tokenizer.json").exists() {
                return Ok(stops);
            }
            let tokenizer = TextTokenizer::from_folder(source)?;
            stops.extend(tokenizer.eos_token.clone());
            let ids: Vec<u32> = match generation.map(|g| &g["eos_token_id"]) {
                Some(serde_json::Value::Number(n)) => {
                    n.as_u64().into_iter().map(|i| i as u32).collect()
                }
                Some(serde_json::Value::Array(list)) => list
                    .iter()
                    .filter_map(|v| v.as_u64())
                    .map(|i| i as u32)
                    .collect(),
                _ => Vec::new(),
            };
            for id in ids {
                stops.push(tokenizer.decode(&[id], false)?);
            }
        }
    }
    let mut seen = std::collections::HashSet::new();
    stops.retain(|s| !s.is_empty() && seen.insert(s.clone()));
    Ok(stops)
}
