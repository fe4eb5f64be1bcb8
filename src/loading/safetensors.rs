//! The safetensors weights of a model folder: one file or shards, memory-mapped, read one tensor at a time.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::files::{read_json, MappedSafetensors};

/// The safetensors files of a model folder (one file, or shards listed by `model.safetensors.index.json`),
/// memory-mapped, with a name → file map. Tensors are read one at a time.
pub struct ShardedSafetensors {
    files: Vec<MappedSafetensors>,
    index: HashMap<String, usize>,
    folder: PathBuf,
}

impl ShardedSafetensors {
    /// Opens the weights of a Hugging Face model folder.
    pub fn open_folder(folder: &Path) -> Result<Self> {
        let index_path = folder.join("model.safetensors.index.json");
        let mut paths: Vec<PathBuf> = if index_path.exists() {
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
            files.sort();
            files.dedup();
            files
        } else {
            let mut files: Vec<PathBuf> = std::fs::read_dir(folder)
                .map_err(|e| Error::io("cannot list", folder, e))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
                .collect();
            files.sort();
            files
        };
        if paths.is_empty() {
            return Err(Error::invalid_file(
                folder,
                "no *.safetensors weights in this folder (pytorch_model.bin is not supported: save with safetensors)",
            ));
        }
        paths.dedup();
        let mut files = Vec::with_capacity(paths.len());
        let mut index = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            if !p.exists() {
                return Err(Error::invalid_file(
                    &index_path,
                    format!(
                        "lists shard `{}`, which is missing; download the complete model",
                        p.display()
                    ),
                ));
            }
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
}
