//! Files the crate reads and writes: safetensors through a memory map, and writes that never leave a half-written
//! file or folder behind (written next to the final name, then renamed into place).

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Dtype, SafeTensors, TensorView, View};

use crate::error::{Error, Result};

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
        mapped.tensors()?;
        Ok(mapped)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
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
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    path.with_file_name(format!(".{name}.partial-{}", std::process::id()))
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

/// Writes tensors to `path` atomically (see [`write_file_atomically`]). Tensors are written in name order (as
/// safetensors requires).
pub fn write_safetensors<'a>(
    path: &Path,
    tensors: impl IntoIterator<Item = (String, RawTensor<'a>)>,
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    write_file_atomically(path, |tmp| {
        safetensors::tensor::serialize_to_file(tensors, metadata, tmp)
            .map_err(|e| Error::invalid_file(path, format!("cannot serialize: {e}")))
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
            "`{}` already exists; choose another output or pass --overwrite to replace it",
            output.display()
        )));
    }
    Ok(())
}

/// Builds a folder at `output` atomically: `build` fills a staging sibling, which replaces `output` (an existing
/// folder or file there goes only once the new one is complete) or is removed when `build` fails.
pub fn replace_dir<R>(output: &Path, build: impl FnOnce(&Path) -> Result<R>) -> Result<R> {
    let staging = partial_path(output);
    let _ = std::fs::remove_dir_all(&staging);
    std::fs::create_dir_all(&staging).map_err(|e| Error::io("cannot create", &staging, e))?;
    let result = match build(&staging) {
        Ok(result) => result,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(e);
        }
    };
    if output.exists() {
        std::fs::remove_dir_all(output)
            .or_else(|_| std::fs::remove_file(output))
            .map_err(|e| Error::io("cannot replace", output, e))?;
    }
    std::fs::rename(&staging, output)
        .map_err(|e| Error::io("cannot move into place", output, e))?;
    Ok(result)
}
