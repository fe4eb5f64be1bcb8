//! A checkpoint's manifest (`checkpoint_manifest.json`) and what resuming checks against it: the base model the
//! adapter was trained on ([`BaseModelId`]: a name and a fingerprint of the weights) and every other file's size
//! and SHA-256, so a damaged file or another base model is refused instead of diverging silently; and the base's
//! 4-bit format, which the adapter files record.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

use candle_core::DType;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::adapter::{read_base_quantization, ADAPTER_CONFIG, ADAPTER_WEIGHTS, BASE_QUANTIZATION};
use crate::error::{Error, Result};
use crate::models::LlamaModel;
use crate::quant::QuantConfig;

/// The base model and every other file's size and SHA-256.
pub const MANIFEST: &str = "checkpoint_manifest.json";

/// Which base model a checkpoint's adapter was trained on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BaseModelId {
    /// `base_model_name_or_path`, when known.
    pub name: Option<String>,
    /// SHA-256 of the architecture's shape and of the embedding's first rows and the final norm (rounded to bf16,
    /// so the same model gives the same value on every device and precision): cheap, and different for two models
    /// of the same shape.
    pub fingerprint: String,
}

impl BaseModelId {
    /// The identity of `model`, loaded from `name`.
    pub fn of(model: &LlamaModel, name: Option<&str>) -> Result<Self> {
        const ROWS: usize = crate::models::llama::WHOLE_EMBEDDING_ROWS;
        let c = model.config();
        let mut hash = Sha256::new();
        let shape = format!(
            "{:?} vocab {} hidden {} intermediate {} layers {} heads {}/{} head_dim {}",
            c.architecture,
            c.vocab_size,
            c.hidden_size,
            c.intermediate_size,
            c.num_hidden_layers,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim
        );
        hash.update(shape.as_bytes());
        for t in [&model.embedding_rows(ROWS)?, &model.norm] {
            let values: Vec<f32> = t
                .to_dtype(DType::BF16)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            for v in values {
                hash.update(v.to_le_bytes());
            }
        }
        Ok(BaseModelId {
            name: name.map(str::to_string),
            fingerprint: hex(&hash.finalize()),
        })
    }
}

/// Size and SHA-256 of one checkpoint file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileDigest {
    /// Length in bytes.
    pub bytes: u64,
    /// SHA-256, lowercase hex.
    pub sha256: String,
}

impl FileDigest {
    /// Reads `path` through once.
    pub fn of(path: &Path) -> Result<Self> {
        let mut file = std::fs::File::open(path).map_err(|e| Error::io("cannot read", path, e))?;
        let (mut hash, mut bytes, mut buf) = (Sha256::new(), 0u64, vec![0u8; 1 << 20]);
        loop {
            let n = file
                .read(&mut buf)
                .map_err(|e| Error::io("cannot read", path, e))?;
            if n == 0 {
                break;
            }
            hash.update(&buf[..n]);
            bytes += n as u64;
        }
        Ok(FileDigest {
            bytes,
            sha256: hex(&hash.finalize()),
        })
    }
}

/// `bytes` in lowercase hex.
pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `checkpoint_manifest.json`: the base model and the digest of every other file in the checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// The base model the adapter was trained on.
    pub base_model: BaseModelId,
    /// File name → size and SHA-256.
    pub files: BTreeMap<String, FileDigest>,
}

impl Manifest {
    /// Digests every file of folder `dir` (but the manifest).
    pub(super) fn of_folder(dir: &Path, base_model: &BaseModelId) -> Result<Self> {
        let mut files = BTreeMap::new();
        for entry in std::fs::read_dir(dir).map_err(|e| Error::io("cannot list", dir, e))? {
            let entry = entry.map_err(|e| Error::io("cannot list", dir, e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if name != MANIFEST && entry.path().is_file() {
                files.insert(name, FileDigest::of(&entry.path())?);
            }
        }
        Ok(Manifest {
            base_model: base_model.clone(),
            files,
        })
    }
}

/// Checks that every file the manifest of checkpoint `ckpt` lists is there with the recorded size and SHA-256,
/// and returns the manifest (`None`, with a warning, for a checkpoint written before manifests existed).
pub fn verify_checkpoint_files(ckpt: &Path) -> Result<Option<Manifest>> {
    verify_files(
        ckpt,
        |_| true,
        "resume from another checkpoint",
        "resume from another checkpoint or start a new run",
    )
}

/// Checks the adapter files of checkpoint `ckpt` (`adapter_config.json`, `adapter_model.safetensors`) against its
/// manifest, as [`verify_checkpoint_files`] checks them all: what `load_best_model_at_end` reads back.
pub fn verify_adapter_files(ckpt: &Path) -> Result<()> {
    const REMEDY: &str =
        "the best model cannot be loaded; set load_best_model_at_end = false to keep the last \
                          step's adapter (the newest checkpoint holds it too)";
    let adapter = |name: &str| name == ADAPTER_CONFIG || name == ADAPTER_WEIGHTS;
    verify_files(ckpt, adapter, REMEDY, REMEDY).map(|_| ())
}

/// The files of checkpoint `ckpt`'s manifest that `checked` selects, each there with its recorded size and
/// SHA-256; an error names the file with `if_missing` or `if_damaged` as what to do.
fn verify_files(
    ckpt: &Path,
    checked: impl Fn(&str) -> bool,
    if_missing: &str,
    if_damaged: &str,
) -> Result<Option<Manifest>> {
    let path = ckpt.join(MANIFEST);
    if !path.exists() {
        eprintln!(
            "warning: {} has no {MANIFEST} (written by an older version): its files are not verified",
            ckpt.display()
        );
        return Ok(None);
    }
    let manifest: Manifest = crate::files::read_json(&path)?;
    for (name, recorded) in manifest.files.iter().filter(|(n, _)| checked(n)) {
        let file = ckpt.join(name);
        if !file.exists() {
            return Err(Error::invalid_file(
                &file,
                format!("missing from the checkpoint ({MANIFEST} lists it): {if_missing}"),
            ));
        }
        let found = FileDigest::of(&file)?;
        if &found != recorded {
            return Err(Error::invalid_file(
                &file,
                format!(
                    "damaged: {} bytes with SHA-256 {}, but the checkpoint wrote {} bytes with SHA-256 {}; \
                     {if_damaged}",
                    found.bytes, found.sha256, recorded.bytes, recorded.sha256
                ),
            ));
        }
    }
    Ok(Some(manifest))
}

/// An error unless checkpoint `ckpt` (with `manifest`, checked by [`verify_checkpoint_files`]) was trained on `base`
/// (or `ignore_base_mismatch`).
pub fn check_base_model(
    ckpt: &Path,
    manifest: &Manifest,
    base: &BaseModelId,
    ignore_base_mismatch: bool,
) -> Result<()> {
    let path = ckpt.join(MANIFEST);
    let then = &manifest.base_model;
    if then.fingerprint != base.fingerprint && !ignore_base_mismatch {
        let named = |id: &BaseModelId| id.name.clone().unwrap_or_else(|| "an unnamed model".into());
        return Err(Error::invalid_file(
            &path,
            format!(
                "the checkpoint was trained on {} (fingerprint {}), this run loads {} (fingerprint {}): the \
                 adapter belongs to another base model; load that model, or set ignore_base_model_mismatch = true \
                 to resume anyway",
                named(then),
                &then.fingerprint[..12.min(then.fingerprint.len())],
                named(base),
                &base.fingerprint[..12.min(base.fingerprint.len())],
            ),
        ));
    }
    Ok(())
}

/// An error when the checkpoint in `ckpt` was trained on a base stored another way than this run's (`now`: its
/// 4-bit format, or `None` for a dense base): the adapter learned against other weights. Checkpoints that do not
/// record it, and `ignore_base_mismatch`, pass.
pub fn check_base_quantization(
    ckpt: &Path,
    now: Option<QuantConfig>,
    ignore_base_mismatch: bool,
) -> Result<()> {
    let Some(then) = read_base_quantization(ckpt)? else {
        return Ok(());
    };
    let format = |q: Option<QuantConfig>| q.map(|q| (q.quant_type, q.blocksize, q.double_quant));
    if ignore_base_mismatch || format(then) == format(now) {
        return Ok(());
    }
    let words = |q: Option<QuantConfig>| match q {
        None => "a dense base (not quantized)".to_string(),
        Some(q) => format!(
            "a {} base (bnb_4bit_blocksize = {}, bnb_4bit_use_double_quant = {})",
            q.quant_type, q.blocksize, q.double_quant
        ),
    };
    Err(Error::invalid_file(
        ckpt.join(BASE_QUANTIZATION),
        format!(
            "the checkpoint was trained on {}, this run loads {}: the adapter learned against other base weights; \
             set [model.quantization] as the checkpoint's, set ignore_base_model_mismatch = true to resume anyway, \
             or start a new run",
            words(then),
            words(now)
        ),
    ))
}
