//! Models from the Hugging Face Hub: files downloaded into (or found in) the Hugging Face cache with `hf-hub`.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::files::read_json;

/// Fetches one file of a Hub repository: its local path, or why not.
type FetchFn = dyn Fn(&str) -> std::result::Result<PathBuf, String>;

/// The files a model folder needs from the Hub (the weight shards are added from the index).
pub(super) const HUB_FILES: [&str; 3] = ["config.json", "tokenizer.json", "tokenizer_config.json"];

/// The local snapshot folder of a Hub model: files are downloaded into (or found in) the Hugging Face cache
/// (`$HF_HOME/hub`). With `HF_HUB_OFFLINE=1` only the cache is used. The token comes from `$HF_TOKEN` or the
/// token file `huggingface-cli login` writes.
pub fn hub_snapshot(id: &str, revision: &str) -> Result<PathBuf> {
    let fetch = hub_fetcher(id, revision)?;
    let need = |file: &str| hub_required(&fetch, id, revision, file);
    let config = need(HUB_FILES[0])?;
    for optional in &HUB_FILES[1..] {
        let _ = fetch(optional);
    }
    match fetch("model.safetensors.index.json") {
        Ok(index) => {
            let value: serde_json::Value = read_json(&index)?;
            let mut shards: Vec<&str> = value
                .get("weight_map")
                .and_then(|m| m.as_object())
                .map(|m| m.values().filter_map(|v| v.as_str()).collect())
                .unwrap_or_default();
            shards.sort();
            shards.dedup();
            for shard in shards {
                need(shard)?;
            }
        }
        Err(_) => {
            need("model.safetensors")?;
        }
    }
    Ok(config.parent().map(Path::to_path_buf).unwrap_or_default())
}

/// `file` of Hub repository `id`, or an error that says what to do when offline.
pub(super) fn hub_required(
    fetch: &FetchFn,
    id: &str,
    revision: &str,
    file: &str,
) -> Result<PathBuf> {
    fetch(file).map_err(|reason| {
        let what_to_do = if hub_offline() {
            "download it on a machine with network access (into the same Hugging Face cache), or load a local \
             model folder or .gguf file instead"
        } else {
            "if this machine is offline, load a local model folder or .gguf file instead, or set \
             HF_HUB_OFFLINE=1 to use models already in the Hugging Face cache"
        };
        Error::Model(format!(
            "Hub model `{id}` (revision {revision}): {reason}; {what_to_do}"
        ))
    })
}

/// `HF_HUB_OFFLINE` is set (to anything but empty or 0): files come from the cache only.
fn hub_offline() -> bool {
    std::env::var("HF_HUB_OFFLINE").is_ok_and(|v| !v.is_empty() && v != "0")
}

/// A function that fetches files of Hub repository `id` (from the cache only under `HF_HUB_OFFLINE`).
pub(super) fn hub_fetcher(id: &str, revision: &str) -> Result<Box<FetchFn>> {
    use hf_hub::{Repo, RepoType};
    let repo = Repo::with_revision(id.to_string(), RepoType::Model, revision.to_string());
    let fetch: Box<FetchFn> = if hub_offline() {
        let cache = hf_hub::Cache::from_env().repo(repo);
        Box::new(move |file: &str| {
            cache.get(file).ok_or_else(|| {
                format!("`{file}` is not in the Hugging Face cache and HF_HUB_OFFLINE is set")
            })
        })
    } else {
        let mut builder = hf_hub::api::sync::ApiBuilder::from_env().with_progress(false);
        if let Ok(token) = std::env::var("HF_TOKEN") {
            builder = builder.with_token(Some(token));
        }
        let api = builder
            .build()
            .map_err(|e| Error::Model(format!("cannot set up the Hub client: {e}")))?;
        let repo = api.repo(repo);
        Box::new(move |file: &str| {
            repo.get(file)
                .map_err(|e| format!("cannot download `{file}`: {e}"))
        })
    };
    Ok(fetch)
}
