//! The safetensors weights of a model folder: one file or shards, memory-mapped, read one tensor at a time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::read_names::ReadNames;
use crate::error::{Error, Result};
use crate::files::{read_json, MappedSafetensors};

/// A sharded model's index of its shards (`weight_map`: tensor name → file).
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The weights file of an unsharded model.
pub const SINGLE_FILE: &str = "model.safetensors";

/// The safetensors files holding a model folder's weights, as transformers picks them: the shards
/// `model.safetensors.index.json` lists, else `model.safetensors`. Other `*.safetensors` files in the folder
/// (Mistral's `consolidated.safetensors` copy of the weights, an adapter, test data) are not the model's.
pub fn weight_files(folder: &Path) -> Result<Vec<PathBuf>> {
    let index_path = folder.join(INDEX_FILE);
    if index_path.exists() {
        let index: serde_json::Value = read_json(&index_path)?;
        let map = index
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::invalid_file(&index_path, "`weight_map` is missing"))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| folder.join(f))
            .collect();
        if files.is_empty() {
            return Err(Error::invalid_file(
                &index_path,
                "`weight_map` lists no weight files; download the complete model",
            ));
        }
        files.sort();
        files.dedup();
        if let Some(missing) = files.iter().find(|f| !f.exists()) {
            return Err(Error::invalid_file(
                &index_path,
                format!(
                    "lists shard `{}`, which is missing; download the complete model",
                    missing.display()
                ),
            ));
        }
        return Ok(files);
    }
    let single = folder.join(SINGLE_FILE);
    if single.exists() {
        return Ok(vec![single]);
    }
    let files: Vec<String> = std::fs::read_dir(folder)
        .map_err(|e| Error::io("cannot list", folder, e))?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .collect();
    let with = |ext: &str| -> Vec<&str> {
        let mut named: Vec<&str> = files
            .iter()
            .map(String::as_str)
            .filter(|n| n.ends_with(ext))
            .collect();
        named.sort();
        named
    };
    let (others, gguf) = (with(".safetensors"), with(".gguf"));
    let advice = if let Some(gguf) = gguf.first() {
        format!(
            "to use the GGUF file here, pass it itself: --model {}",
            folder.join(gguf).display()
        )
    } else if others.is_empty() {
        "pytorch_model.bin is not supported: save the model with safetensors".to_string()
    } else {
        format!(
            "only {}: as transformers, qlora reads the model's weights from those names; rename the weights file to \
             {SINGLE_FILE}",
            others.join(", ")
        )
    };
    Err(Error::invalid_file(
        folder,
        format!("no {SINGLE_FILE} (or {INDEX_FILE}) in this folder; {advice}"),
    ))
}

/// The safetensors files of a model folder (one file, or shards listed by `model.safetensors.index.json`),
/// memory-mapped, with a name → file map. Tensors are read one at a time, and the names read are recorded, so
/// what a model leaves unread can be reported.
pub struct ShardedSafetensors {
    files: Vec<MappedSafetensors>,
    index: HashMap<String, usize>,
    folder: PathBuf,
    read: ReadNames,
}

impl ShardedSafetensors {
    /// Opens the weights of a Hugging Face model folder (the files [`weight_files`] names).
    pub fn open_folder(folder: &Path) -> Result<Self> {
        let paths = weight_files(folder)?;
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            let f = MappedSafetensors::open(p)?;
            for name in f.tensors()?.names() {
                index.insert(name.to_string(), i);
            }
            files.push(f);
        }
        Ok(ShardedSafetensors {
            files,
            index,
            folder: folder.to_path_buf(),
            read: ReadNames::default(),
        })
    }

    /// The file holding `name`.
    pub fn file_of(&self, name: &str) -> Option<&MappedSafetensors> {
        self.index.get(name).map(|i| &self.files[*i])
    }

    /// The folder these files are in.
    pub fn folder(&self) -> &Path {
        &self.folder
    }

    /// Every tensor name.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// Records that the model has read tensor `name`.
    pub fn mark_read(&self, name: &str) {
        self.read.mark(name);
    }

    /// The tensors starting with `prefix` that no [`mark_read`](Self::mark_read) has named, sorted.
    pub fn unread(&self, prefix: &str) -> Vec<String> {
        self.read.unread(self.names(), prefix)
    }
}
