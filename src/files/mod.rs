//! Files the crate reads and writes: safetensors through a memory map, writes that never leave a half-written
//! file or folder behind (written next to the final name, then renamed into place), one writer per output folder
//! ([`lock`]), the cleaning of what killed writers left ([`sweep_abandoned`]), and outputs kept apart from their
//! inputs ([`apart`]).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView, View};

use crate::error::{Error, Result};

pub mod apart;
pub mod lock;

use lock::{FileLock, OutputLock};

/// A safetensors file mapped into memory.
pub struct MappedSafetensors {
    path: PathBuf,
    mmap: memmap2::Mmap,
}

impl MappedSafetensors {
    /// Maps `path` and checks its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|e| Error::io("cannot open", &path, e))?;
        // SAFETY: the file is opened read-only; like every mmap-based loader we assume no one truncates it while
        // it is mapped.
        let mmap =
            unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io("cannot map", &path, e))?;
        let mapped = MappedSafetensors { path, mmap };
        // safetensors accepts any shape with a 0 in it (no data to check), but Candle multiplies the dimensions
        // (strides, element counts) unchecked: refuse shapes whose product without the zeros overflows.
        for (name, view) in mapped.tensors()?.iter() {
            let shape = view.shape();
            let mut nonzero = shape.iter().filter(|d| **d != 0);
            if nonzero.try_fold(1usize, |n, &d| n.checked_mul(d)).is_none() {
                return Err(Error::invalid_file(
                    &mapped.path,
                    format!("tensor `{name}` has shape {shape:?}, larger than any tensor"),
                ));
            }
        }
        Ok(mapped)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Gives the pages under `bytes` (a slice of this mapping: a tensor's data once copied or quantized) back to
    /// the operating system, so loading a model one tensor at a time does not keep the whole file resident. Reading
    /// them again maps them back in from the file.
    pub fn release(&self, bytes: &[u8]) {
        let base = self.mmap.as_ptr() as usize;
        let start = bytes.as_ptr() as usize;
        if start < base || start + bytes.len() > base + self.mmap.len() {
            return;
        }
        #[cfg(unix)]
        // SAFETY: the mapping is read-only and backed by the file, so dropped pages come back unchanged from the
        // file on the next access; no slice into the mapping sees different bytes. A failure only keeps the pages.
        let _ = unsafe {
            self.mmap.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                start - base,
                bytes.len(),
            )
        };
    }

    /// The parsed file.
    pub fn tensors(&self) -> Result<SafeTensors<'_>> {
        SafeTensors::deserialize(&self.mmap).map_err(|e| {
            Error::invalid_file(
                &self.path,
                format!("not a valid safetensors file ({e}); it may be truncated or not safetensors at all"),
            )
        })
    }

    /// The `__metadata__` map of the header, if any.
    pub fn metadata(&self) -> Result<Option<HashMap<String, String>>> {
        let (_, meta) = SafeTensors::read_metadata(&self.mmap).map_err(|e| {
            Error::invalid_file(&self.path, format!("unreadable safetensors header: {e}"))
        })?;
        Ok(meta.metadata().clone())
    }
}

/// A tensor to write: dtype, shape and bytes (borrowed from a mapped file or owned).
#[derive(Clone, Debug)]
pub struct RawTensor<'a> {
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Little-endian bytes.
    pub data: Cow<'a, [u8]>,
}

impl<'a> RawTensor<'a> {
    /// A borrowed copy of a tensor read from a file.
    pub fn from_view(view: &TensorView<'a>) -> Self {
        RawTensor {
            dtype: view.dtype(),
            shape: view.shape().to_vec(),
            data: Cow::Borrowed(view.data()),
        }
    }

    /// A tensor's elements as they are (on the CPU, row-major), in its dtype.
    pub fn from_tensor(t: &candle_core::Tensor) -> Result<RawTensor<'static>> {
        // Candle's own `View` writes the bytes; on a contiguous CPU tensor it cannot fail.
        let t = t.to_device(&candle_core::Device::Cpu)?.contiguous()?;
        Ok(RawTensor {
            dtype: View::dtype(&t),
            shape: t.dims().to_vec(),
            data: Cow::Owned(View::data(&t).into_owned()),
        })
    }

    /// A U8 tensor.
    pub fn u8(shape: Vec<usize>, data: Vec<u8>) -> RawTensor<'static> {
        RawTensor {
            dtype: Dtype::U8,
            shape,
            data: Cow::Owned(data),
        }
    }

    /// An F32 tensor.
    pub fn f32(shape: Vec<usize>, values: &[f32]) -> RawTensor<'static> {
        let data = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        RawTensor {
            dtype: Dtype::F32,
            shape,
            data: Cow::Owned(data),
        }
    }
}

impl View for RawTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Reads a float tensor (F32, F16 or BF16) as float32 values; other dtypes give `None`.
pub fn view_to_f32(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let bytes = view.data();
    let values = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    };
    Some(values)
}

/// The candle dtype of a float safetensors dtype.
pub fn candle_float_dtype(dtype: Dtype) -> Option<candle_core::DType> {
    match dtype {
        Dtype::F32 => Some(candle_core::DType::F32),
        Dtype::F16 => Some(candle_core::DType::F16),
        Dtype::BF16 => Some(candle_core::DType::BF16),
        _ => None,
    }
}

/// Reads and parses the JSON file `path` (as a `serde_json::Value` or any deserializable type); errors name it.
pub fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io("cannot read", path, e))?;
    serde_json::from_str(&text)
        .map_err(|e| Error::invalid_file(path, format!("not valid JSON: {e}")))
}

/// A sibling path used while writing `path`: `dir/.name.partial-<pid>`.
pub fn partial_path(path: &Path) -> PathBuf {
    sibling(path, "partial")
}

/// `dir/.name.<tag>-<pid>`, next to `path`.
fn sibling(path: &Path, tag: &str) -> PathBuf {
    path.with_file_name(format!(
        ".{}.{tag}-{}",
        output_name(path),
        std::process::id()
    ))
}

/// Writes `path` atomically: `write` fills a temporary sibling, which is renamed over `path` (or removed when
/// `write` fails), so a crash never leaves a file that looks complete.
pub fn write_file_atomically(path: &Path, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let tmp = partial_path(path);
    let result = write(&tmp).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|e| Error::io("cannot move into place", path, e))
    });
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// The first value of `t` that is a NaN or an infinity, with its flat index; read in chunks, so the check needs no
/// copy of a large tensor.
pub fn first_non_finite(t: &candle_core::Tensor) -> candle_core::Result<Option<(usize, f32)>> {
    const CHUNK: usize = 1 << 20;
    let flat = t.flatten_all()?;
    let n = flat.elem_count();
    for start in (0..n).step_by(CHUNK) {
        let values: Vec<f32> = flat
            .narrow(0, start, CHUNK.min(n - start))?
            .to_dtype(candle_core::DType::F32)?
            .to_vec1()?;
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Ok(Some((start + i, values[i])));
        }
    }
    Ok(None)
}

/// Writes tensors to `path` atomically (see [`write_file_atomically`]). Tensors are written in name order (as
/// safetensors requires).
pub fn write_safetensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (String, RawTensor<'a>)>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    // safetensors' serializer indexes past its table (a panic) when a name repeats: refuse that here.
    let tensors: Vec<(String, RawTensor<'a>)> = tensors.into_iter().collect();
    let mut names: Vec<&str> = tensors.iter().map(|(n, _)| n.as_str()).collect();
    names.sort_unstable();
    if let Some(pair) = names.windows(2).find(|p| p[0] == p[1]) {
        return Err(Error::InvalidInput(format!(
            "{}: tensor `{}` would be written twice",
            path.display(),
            pair[0]
        )));
    }
    write_file_atomically(path, |tmp| {
        // safetensors writes through a private (0600) temporary file: give the result the mode any new file gets.
        let mode = std::fs::File::create(tmp)
            .and_then(|f| f.metadata())
            .map_err(|e| Error::io("cannot write", tmp, e))?
            .permissions();
        safetensors::tensor::serialize_to_file(tensors, metadata, tmp).map_err(|e| match e {
            safetensors::SafeTensorError::IoError(io) => Error::io("cannot write", path, io),
            e => Error::invalid_file(path, format!("cannot serialize: {e}")),
        })?;
        std::fs::set_permissions(tmp, mode).map_err(|e| Error::io("cannot write", tmp, e))
    })
}

/// Writes `bytes` to `path` atomically (see [`write_file_atomically`]).
pub fn write_atomic(path: &Path, bytes: impl AsRef<[u8]>) -> Result<()> {
    write_file_atomically(path, |tmp| {
        std::fs::write(tmp, bytes).map_err(|e| Error::io("cannot write", tmp, e))
    })
}

/// An error when `output` exists and may not be replaced (`overwrite` off): nothing a user wrote is lost.
pub fn refuse_existing(output: &Path, overwrite: bool) -> Result<()> {
    if output.exists() && !overwrite {
        return Err(Error::WouldOverwrite(format!(
            "`{}` already exists; choose another output, or allow replacing it (overwrite; --overwrite on the command line)",
            output.display()
        )));
    }
    Ok(())
}

/// Builds a folder at `output` atomically: `build` fills a staging sibling, which replaces `output` (an existing
/// folder or file there is moved aside and deleted only once the new one is in place) or is removed when anything
/// fails, so a failure leaves `output` as it was and no temporary folder behind. A folder a run is writing into
/// (its [`OutputLock`] held) is never replaced: the lock is taken before building and again before the move. What an
/// earlier builder of `output` left when it was killed is cleaned first (see [`sweep_abandoned`]).
pub fn replace_dir<R>(output: &Path, build: impl FnOnce(&Path) -> Result<R>) -> Result<R> {
    let parent = output
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    sweep_abandoned(parent, Some(&output_name(output)))?;
    let staging = partial_path(output);
    // Held until the new folder is in place, so that a later command finding the staging folder (or the previous
    // version moved aside) with this lock free knows its builder is gone.
    let builder = FileLock::try_acquire(&builder_lock_path(&staging))?.ok_or_else(|| {
        Error::InvalidInput(format!(
            "`{}` is being written by another command of this process",
            output.display()
        ))
    })?;
    let mut in_use = lock_existing(output)?;
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| Error::io("cannot create", &staging, e))?;
    let result = build(&staging).and_then(|result| {
        if in_use.is_none() {
            // It may have appeared while building.
            in_use = lock_existing(output)?;
        }
        move_into_place(&staging, output)?;
        Ok(result)
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    drop(in_use);
    drop(builder);
    result
}

/// The lock on `output` when it is an existing folder (refused when a run holds it).
fn lock_existing(output: &Path) -> Result<Option<OutputLock>> {
    if output.is_dir() && !output.is_symlink() {
        return OutputLock::acquire(output).map(Some);
    }
    Ok(None)
}

/// `output`'s file name, as the staging siblings spell it.
fn output_name(output: &Path) -> String {
    output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into())
}

/// The lock a builder holds while it fills `staging`: `staging` + `.lock`, beside it.
fn builder_lock_path(staging: &Path) -> PathBuf {
    let mut name = staging.file_name().unwrap_or_default().to_os_string();
    name.push(".lock");
    staging.with_file_name(name)
}

/// Cleans what killed writers left in `dir` (of the output named `only`, or of every output): a staging folder or
/// temporary file (`.NAME.partial-PID`) whose builder's lock (`.NAME.partial-PID.lock`) is free is deleted; a
/// previous version moved aside (`.NAME.replaced-PID`) is put back when `NAME` is missing (its replacement never
/// arrived) and deleted otherwise. A builder that is still running holds its lock, so its files are left alone
/// whatever process id they name.
pub fn sweep_abandoned(dir: &Path, only: Option<&str>) -> Result<()> {
    let mut writers = std::collections::BTreeSet::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let file_name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = file_name.strip_prefix('.') else {
            continue;
        };
        let rest = rest.strip_suffix(".lock").unwrap_or(rest);
        for tag in [".partial-", ".replaced-"] {
            if let Some((name, pid)) = rest.rsplit_once(tag) {
                let digits = !pid.is_empty() && pid.bytes().all(|b| b.is_ascii_digit());
                if digits && only.is_none_or(|o| o == name) {
                    writers.insert((name.to_string(), pid.to_string()));
                }
            }
        }
    }
    for (name, pid) in writers {
        let staging = dir.join(format!(".{name}.partial-{pid}"));
        // Dropped at the end of this iteration, removing the lock file too.
        let Some(_abandoned) = FileLock::try_acquire(&builder_lock_path(&staging))? else {
            continue; // its writer is alive
        };
        remove_path(&staging)?;
        let aside = dir.join(format!(".{name}.replaced-{pid}"));
        let output = dir.join(&name);
        if !aside.exists() {
            continue;
        }
        if output.exists() {
            remove_path(&aside)?;
        } else {
            std::fs::rename(&aside, &output)
                .map_err(|e| Error::io("cannot put back", &aside, e))?;
            eprintln!(
                "note: `{}` had been moved aside by a command that did not finish; put back",
                output.display()
            );
        }
    }
    Ok(())
}

/// Removes the folder or file at `path`, if any.
fn remove_path(path: &Path) -> Result<()> {
    let removed = match std::fs::symlink_metadata(path) {
        Err(_) => return Ok(()),
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
    };
    removed.map_err(|e| Error::io("cannot remove", path, e))
}

/// Renames `staging` to `output`; an existing `output` is moved aside first and restored if the rename fails.
fn move_into_place(staging: &Path, output: &Path) -> Result<()> {
    let aside = sibling(output, "replaced");
    let had_output = output.exists() || output.is_symlink();
    if had_output {
        std::fs::rename(output, &aside).map_err(|e| Error::io("cannot replace", output, e))?;
    }
    if let Err(e) = std::fs::rename(staging, output) {
        if had_output {
            let _ = std::fs::rename(&aside, output);
        }
        return Err(Error::io("cannot move into place", output, e));
    }
    if had_output {
        if let Err(e) = std::fs::remove_dir_all(&aside).or_else(|_| std::fs::remove_file(&aside)) {
            eprintln!(
                "warning: `{}` is in place, but its previous version at `{}` could not be removed: {e}",
                output.display(),
                aside.display()
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[cfg(unix)]
    #[test]
    fn safetensors_get_the_mode_of_any_new_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain.json");
        std::fs::write(&plain, "{}").unwrap();
        let weights = dir.path().join("adapter_model.safetensors");
        write_safetensors(
            &weights,
            [("w".to_string(), RawTensor::f32(vec![2], &[1.0, 2.0]))],
            None,
        )
        .unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&weights), mode(&plain));
    }

    #[test]
    fn replace_dir_leaves_the_old_output_or_the_new_one_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("merged");
        std::fs::write(&output, "a file the user asked to replace").unwrap();
        // A failing build leaves the output as it was and no staging folder.
        let failed = replace_dir(&output, |staging| {
            std::fs::write(staging.join("half.safetensors"), "x").unwrap();
            Err::<(), _>(Error::InvalidInput("disk full".into()))
        });
        assert!(failed.is_err());
        assert_eq!(entries(dir.path()), ["merged"]);
        assert!(output.is_file());
        // A successful one replaces the file by the folder.
        replace_dir(&output, |staging| {
            std::fs::write(staging.join("model.safetensors"), "y")
                .map_err(|e| Error::io("cannot write", staging, e))
        })
        .unwrap();
        assert_eq!(entries(dir.path()), ["merged"]);
        assert_eq!(entries(&output), ["model.safetensors"]);
    }

    /// A folder whose output lock is held (a run writing into it) is not replaced, before building or after: it
    /// stays as it was, with no staging folder beside it.
    #[test]
    fn replace_dir_never_replaces_a_folder_a_run_holds() {
        let dir = tempfile::tempdir().unwrap();
        let output = dir.path().join("run");
        std::fs::create_dir(&output).unwrap();
        std::fs::write(output.join("checkpoint"), "keep").unwrap();
        let running = OutputLock::acquire(&output).unwrap();
        let err = replace_dir(&output, |_| Ok(())).unwrap_err().to_string();
        assert!(err.contains("run in progress"), "{err}");
        // A run that claims the folder while the replacement is being built.
        let late = dir.path().join("late");
        let mut claimed = None;
        let err = replace_dir(&late, |_| {
            std::fs::create_dir(&late).unwrap();
            claimed = Some(OutputLock::acquire(&late).unwrap());
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains("run in progress"), "{err}");
        assert_eq!(entries(dir.path()), ["late", "run"]);
        assert_eq!(entries(&output), [".qlora.lock", "checkpoint"]);
        drop((running, claimed));
    }

    /// What a killed builder left — its staging folder, a temporary file, the previous version it had moved aside,
    /// a lone lock file — is cleaned by the next writer of that output (the previous version put back where the
    /// output is missing); a live builder's (its lock held) is left alone, whatever process id the names carry.
    #[test]
    fn leftovers_of_dead_builders_are_swept_and_live_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for folder in [
            ".merged.partial-7",
            ".merged.partial-8",
            ".gone.replaced-9",
            ".gone.partial-9",
            ".other.partial-5",
        ] {
            std::fs::create_dir(d.join(folder)).unwrap();
        }
        std::fs::write(d.join(".gone.replaced-9/model.safetensors"), "the user's").unwrap();
        std::fs::write(d.join(".adapter.json.partial-11"), "half").unwrap();
        std::fs::write(d.join(".merged.partial-12.lock"), "12").unwrap();
        // Builder 8 is alive.
        let live = FileLock::try_acquire(&d.join(".merged.partial-8.lock"))
            .unwrap()
            .unwrap();
        sweep_abandoned(d, Some("merged")).unwrap();
        assert_eq!(
            entries(d),
            [
                ".adapter.json.partial-11",
                ".gone.partial-9",
                ".gone.replaced-9",
                ".merged.partial-8",
                ".merged.partial-8.lock",
                ".other.partial-5"
            ]
        );
        sweep_abandoned(d, None).unwrap();
        assert_eq!(
            entries(d),
            [".merged.partial-8", ".merged.partial-8.lock", "gone"]
        );
        assert_eq!(entries(&d.join("gone")), ["model.safetensors"]);
        drop(live);
        replace_dir(&d.join("merged"), |_| Ok(())).unwrap();
        assert_eq!(entries(d), ["gone", "merged"]);
    }
}
