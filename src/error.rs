//! The crate's one error type. Every message says what went wrong, where (file, key, line) and what to do.

use std::path::PathBuf;

/// Errors returned by candle-qlora.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An error from Candle itself.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),

    /// A file could not be read or written.
    #[error("{action} `{path}`: {source}")]
    Io {
        /// What was being done ("cannot read", "cannot write", ...).
        action: &'static str,
        /// The file or folder concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A quantization setting is not allowed (blocksize, quant type, dtype, ...).
    #[error("invalid quantization config: {0}")]
    InvalidQuantConfig(String),

    /// A tensor cannot be quantized as given (non-finite values, unsupported dtype, ...).
    #[error("cannot quantize tensor `{name}`: {reason}")]
    Quantize {
        /// The tensor's name, or `<tensor>` when it has none.
        name: String,
        /// Why, and what to do.
        reason: String,
    },

    /// A checkpoint or file has content that does not match its format.
    #[error("invalid file `{path}`: {reason}")]
    InvalidFile {
        /// The offending file.
        path: PathBuf,
        /// What is wrong in it, naming the key when there is one.
        reason: String,
    },

    /// The bitsandbytes quantization state of one tensor is missing pieces or inconsistent.
    #[error("invalid bitsandbytes quant state for `{name}`: {reason}")]
    InvalidQuantState {
        /// The weight's name (e.g. `model.layers.0.self_attn.q_proj.weight`).
        name: String,
        /// What is wrong, and what to do.
        reason: String,
    },

    /// Bad user input (data files, flags), with the place and what to do.
    #[error("{0}")]
    InvalidInput(String),

    /// Tokenizing, detokenizing or rendering a chat template failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),

    /// A model's weights do not match its configuration, or a model cannot be found.
    #[error("model: {0}")]
    Model(String),

    /// A device ran out of memory; the message is the report (what was live, where, what would fit).
    #[error("{0}")]
    OutOfMemory(String),

    /// Training cannot go on (e.g. the loss stayed non-finite), with what to change.
    #[error("training stopped: {0}")]
    Diverged(String),

    /// Training stopped on request (Ctrl-C, [`request_stop`](crate::trainer::interrupt::request_stop)) after
    /// finishing a step; `checkpoint` is where the run can resume from.
    #[error("training interrupted after step {step}; {}", match checkpoint {
        Some(dir) => format!("checkpoint saved in `{}`: resume from it to go on", dir.display()),
        None => "no checkpoint could be saved (the state is not finite)".to_string(),
    })]
    Interrupted {
        /// The last finished optimizer step.
        step: usize,
        /// The checkpoint to resume from, if one was saved.
        checkpoint: Option<PathBuf>,
    },

    /// A distributed job cannot go on: a rank failed, hung or disagrees, named in the message.
    #[error("distributed training: {0}")]
    Distributed(String),

    /// The user asked for something that would overwrite or lose data.
    #[error("{0}")]
    WouldOverwrite(String),
}

impl Error {
    /// Wraps an I/O error with the path and action that produced it.
    pub fn io(action: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            action,
            path: path.into(),
            source,
        }
    }

    /// An [`Error::InvalidFile`] for `path`.
    pub fn invalid_file(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::InvalidFile {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

/// A serde error with the key it happened at: "`key`: message", or the message alone for the whole document.
pub(crate) fn at_key<E: std::fmt::Display>(e: serde_path_to_error::Error<E>) -> String {
    let key = e.path().to_string();
    if key == "." {
        e.into_inner().to_string()
    } else {
        format!("`{key}`: {}", e.into_inner())
    }
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, Error>;
