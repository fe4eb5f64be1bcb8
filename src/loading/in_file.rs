//! Weights left in their files ([`LoadOptions::defer_linear_weights`](super::LoadOptions)), each a
//! [`WeightInFile`]: read whole when used, or in parts by the ranks of a sharded load — runs of its elements, taken
//! flat, from the runs of stored tensors it is made of ([`Piece`]), or a weight stored in 4 bits by blocks as stored.
//! What holds the tensors ([`StoredTensors`]: a safetensors folder, a GGUF file) reads them.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};
use crate::ops::frozen_linear::{DeferredWeight, StoredBlocks};
use crate::ops::FrozenWeight;
use crate::quant::mxfp4::{dequantize_mxfp4, MXFP4_BLOCK};
use crate::quant::{Nf4Tensor, QuantConfig};

/// Stored tensors read by name, in parts: what a [`WeightInFile`] reads from.
pub(super) trait StoredTensors: Send + Sync {
    /// Where they are, for messages.
    fn place(&self) -> String;
    /// Elements `runs` of plain tensor `name` taken flat, joined in order (1-D, on the host): as stored, a GGUF
    /// tensor's dequantized to float32. Only the bytes of the file they lie in are read.
    fn element_runs(&self, name: &str, runs: &[Range<usize>]) -> Result<Tensor>;
    /// The bytes of the file [`StoredTensors::element_runs`] reads for elements `range` of plain tensor `name`.
    fn bytes_in_file(&self, name: &str, range: Range<usize>) -> Result<usize>;
    /// Elements `range` of bitsandbytes 4-bit tensor `name` taken flat, dequantized to float32 (1-D, on the
    /// host): only the blocks they lie in are read, besides the weight's small state.
    fn bnb_values(&self, name: &str, range: Range<usize>) -> Result<Tensor>;
    /// The bytes of the file [`StoredTensors::bnb_values`] reads for elements `range` of bitsandbytes 4-bit tensor
    /// `name`: its blocks' codes and scales.
    fn bnb_bytes(&self, name: &str, range: Range<usize>) -> Result<usize>;
    /// Bitsandbytes 4-bit weight `name`, checked to be of `shape`, whole as stored.
    fn stored_4bit_weight(&self, name: &str, shape: [usize; 2]) -> Result<FrozenWeight>;
    /// Blocks `blocks` of bitsandbytes 4-bit weight `name` as stored ([`StoredBlocks`]).
    fn bnb_blocks(&self, name: &str, blocks: Range<usize>) -> Result<StoredBlocks>;

    /// [`StoredTensors::element_runs`] of one run.
    fn element_runs_of(&self, name: &str, range: Range<usize>) -> Result<Tensor> {
        self.element_runs(name, std::slice::from_ref(&range))
    }
}

/// `dense` as the model holds it: quantized with `quant` (errors naming `name`), or as stored.
pub(super) fn frozen_weight(
    dense: Tensor,
    name: &str,
    quant: Option<&QuantConfig>,
) -> Result<FrozenWeight> {
    Ok(match quant {
        Some(cfg) => FrozenWeight::Nf4(Arc::new(Nf4Tensor::quantize_named(&dense, cfg, name)?)),
        None => FrozenWeight::Dense(dense),
    })
}

/// A linear weight left in its file ([`LoadOptions::defer_linear_weights`](super::LoadOptions)): a tensor of a
/// safetensors folder or a GGUF file, or an expert's runs of stored elements.
pub(super) struct WeightInFile {
    weights: Arc<dyn StoredTensors>,
    /// The name the model gives it.
    name: String,
    shape: [usize; 2],
    /// Its elements taken flat, in order: one whole tensor, an expert of a stacked one, or an expert's gate
    /// projection then its up projection. Unused for a weight stored in 4 bits ([`WeightInFile::stored_4bit`]).
    pieces: Vec<Piece>,
    /// The 4-bit format it is quantized to when read (a bitsandbytes 4-bit weight's own).
    quant: Option<QuantConfig>,
    /// The bitsandbytes 4-bit tensor it is, read as stored.
    stored_4bit: Option<String>,
}

/// Where a run of a [`WeightInFile`]'s elements (taken flat) lies in its file.
pub(super) enum Piece {
    /// Elements `range` of plain tensor `tensor`, taken flat, as stored.
    Elements { tensor: String, range: Range<usize> },
    /// Expert `expert`'s `[rows, cols]` weight of a stack stored `[experts, cols, rows]` (transformers' gpt-oss
    /// experts): the transpose of the expert's matrix, in float32 (as the model loaded whole holds it).
    Transposed {
        tensor: String,
        expert: usize,
        rows: usize,
        cols: usize,
    },
    /// Elements `range` of bitsandbytes 4-bit tensor `tensor`, taken flat, dequantized to float32 (as the model
    /// loaded whole reads a 4-bit tensor it quantizes again: Mixtral's gate and up projections, joined).
    Dequantized { tensor: String, range: Range<usize> },
    /// Expert `expert`'s `[rows, cols]` weight in MXFP4 (gpt-oss's checkpoints): its rows of `blocks`
    /// (`[experts, rows, groups, 16]` bytes) and `scales` (`[experts, rows, groups]`), decoded to float32.
    Mxfp4 {
        blocks: String,
        scales: String,
        expert: usize,
        rows: usize,
        cols: usize,
    },
}

impl Piece {
    /// Elements `range` of plain tensor `tensor`.
    pub(super) fn elements(tensor: &str, range: Range<usize>) -> Self {
        Piece::Elements {
            tensor: tensor.to_string(),
            range,
        }
    }

    /// Its elements.
    fn len(&self) -> usize {
        match self {
            Piece::Elements { range, .. } | Piece::Dequantized { range, .. } => range.len(),
            Piece::Transposed { rows, cols, .. } | Piece::Mxfp4 { rows, cols, .. } => rows * cols,
        }
    }

    /// Its rows holding elements `range` (of a piece read in rows), and their elements' offset.
    fn rows_of(range: &Range<usize>, cols: usize) -> (Range<usize>, usize) {
        let rows = range.start / cols..range.end.div_ceil(cols);
        let first = rows.start * cols;
        (rows, first)
    }

    /// Its elements `range` (1-D, on the host): as stored, or in float32 for a piece read in rows.
    fn read(&self, weights: &dyn StoredTensors, range: Range<usize>) -> Result<Tensor> {
        let (first, values) = match self {
            Piece::Elements { tensor, range: at } => {
                return weights
                    .element_runs_of(tensor, at.start + range.start..at.start + range.end)
            }
            Piece::Dequantized { tensor, range: at } => {
                return weights.bnb_values(tensor, at.start + range.start..at.start + range.end)
            }
            Piece::Transposed {
                tensor,
                expert,
                rows,
                cols,
            } => {
                // Row r of the weight is column r of the expert's stored matrix: a run of each stored row.
                let (want, first) = Piece::rows_of(&range, *cols);
                let stored_row = |c: usize| {
                    let at = (expert * cols + c) * rows;
                    at + want.start..at + want.end
                };
                let runs: Vec<Range<usize>> = (0..*cols).map(stored_row).collect();
                let columns = weights.element_runs(tensor, &runs)?;
                let values = columns
                    .reshape((*cols, want.len()))?
                    .t()?
                    .contiguous()?
                    .to_dtype(DType::F32)?;
                (first, values)
            }
            Piece::Mxfp4 {
                blocks,
                scales,
                expert,
                rows,
                cols,
            } => {
                let (want, first) = Piece::rows_of(&range, *cols);
                let (groups, group_bytes) = (cols / MXFP4_BLOCK, MXFP4_BLOCK / 2);
                let at = expert * rows + want.start;
                let row_bytes = groups * group_bytes;
                let codes = weights
                    .element_runs_of(blocks, at * row_bytes..(at + want.len()) * row_bytes)?;
                let exponents =
                    weights.element_runs_of(scales, at * groups..(at + want.len()) * groups)?;
                let values = dequantize_mxfp4(
                    &codes.reshape((want.len(), groups, group_bytes))?,
                    &exponents.reshape((want.len(), groups))?,
                )
                .map_err(|err| Error::Model(format!("`{blocks}` in {}: {err}", weights.place())))?;
                (first, values)
            }
        };
        Ok(values
            .flatten_all()?
            .narrow(0, range.start - first, range.len())?)
    }

    /// The bytes of its file [`Piece::read`] reads for its elements `range`.
    fn bytes_in_file(&self, weights: &dyn StoredTensors, range: Range<usize>) -> Result<usize> {
        Ok(match self {
            Piece::Elements { tensor, range: at } => {
                weights.bytes_in_file(tensor, at.start + range.start..at.start + range.end)?
            }
            Piece::Dequantized { tensor, range: at } => {
                weights.bnb_bytes(tensor, at.start + range.start..at.start + range.end)?
            }
            Piece::Transposed { tensor, cols, .. } => {
                let rows = Piece::rows_of(&range, *cols).0.len();
                weights.bytes_in_file(tensor, 0..rows * cols)?
            }
            Piece::Mxfp4 { cols, .. } => {
                let rows = Piece::rows_of(&range, *cols).0.len();
                let groups = cols / MXFP4_BLOCK;
                rows * groups * (MXFP4_BLOCK / 2 + 1)
            }
        })
    }
}

impl WeightInFile {
    /// Plain weight `name` made of `pieces` (see [`WeightInFile::pieces`]), quantized with `quant` when read.
    pub(super) fn plain(
        weights: Arc<dyn StoredTensors>,
        name: String,
        shape: [usize; 2],
        pieces: Vec<Piece>,
        quant: Option<&QuantConfig>,
    ) -> Self {
        WeightInFile {
            weights,
            name,
            shape,
            pieces,
            quant: quant.copied(),
            stored_4bit: None,
        }
    }

    /// Weight `name` as bitsandbytes 4-bit tensor `tensor` stores it, in its format `config`.
    pub(super) fn stored_4bit(
        weights: Arc<dyn StoredTensors>,
        name: String,
        tensor: &str,
        shape: [usize; 2],
        config: QuantConfig,
    ) -> Self {
        WeightInFile {
            weights,
            name,
            shape,
            pieces: Vec::new(),
            quant: Some(config),
            stored_4bit: Some(tensor.to_string()),
        }
    }

    /// The pieces that elements `range` of the weight lie in, each with its elements of them.
    fn runs(&self, range: &Range<usize>) -> Vec<(&Piece, Range<usize>)> {
        let mut at = 0;
        let mut runs = Vec::new();
        for piece in &self.pieces {
            let (from, to) = (range.start.max(at), range.end.min(at + piece.len()));
            if from < to {
                runs.push((piece, from - at..to - at));
            }
            at += piece.len();
        }
        runs
    }

    /// Elements `range` of the plain weight (1-D, on the host).
    fn elements(&self, range: Range<usize>) -> Result<Tensor> {
        let mut parts = self
            .runs(&range)
            .into_iter()
            .map(|(piece, elements)| piece.read(self.weights.as_ref(), elements))
            .collect::<Result<Vec<_>>>()?;
        Ok(match parts.len() {
            // None: the first piece's, for its type.
            0 => self.pieces[0].read(self.weights.as_ref(), 0..0)?,
            1 => parts.remove(0),
            _ => Tensor::cat(&parts, 0)?,
        })
    }
}

impl std::fmt::Debug for WeightInFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "`{}` {:?} in {}",
            self.name,
            self.shape,
            self.weights.place()
        )
    }
}

impl DeferredWeight for WeightInFile {
    fn dims2(&self) -> (usize, usize) {
        (self.shape[0], self.shape[1])
    }

    fn read(&self) -> candle_core::Result<FrozenWeight> {
        let read = || -> Result<FrozenWeight> {
            match &self.stored_4bit {
                Some(tensor) => self.weights.stored_4bit_weight(tensor, self.shape),
                None => {
                    let values = self.elements(0..self.shape[0] * self.shape[1])?;
                    frozen_weight(
                        values.reshape(self.dims2())?,
                        &self.name,
                        self.quant.as_ref(),
                    )
                }
            }
        };
        read().map_err(candle_core::Error::wrap)
    }

    fn quantization(&self) -> Option<QuantConfig> {
        self.quant
    }

    fn read_4bit_blocks(&self, blocks: Range<usize>) -> candle_core::Result<Option<StoredBlocks>> {
        match &self.stored_4bit {
            Some(tensor) => self
                .weights
                .bnb_blocks(tensor, blocks)
                .map(Some)
                .map_err(candle_core::Error::wrap),
            None => Ok(None),
        }
    }

    fn read_elements(&self, range: Range<usize>) -> candle_core::Result<Option<Tensor>> {
        match self.stored_4bit {
            Some(_) => Ok(None),
            None => self
                .elements(range)
                .map(Some)
                .map_err(candle_core::Error::wrap),
        }
    }

    fn bytes_in_file(&self, range: Range<usize>) -> candle_core::Result<usize> {
        let bytes = self
            .runs(&range)
            .into_iter()
            .map(|(piece, elements)| piece.bytes_in_file(self.weights.as_ref(), elements))
            .sum::<Result<usize>>();
        bytes.map_err(candle_core::Error::wrap)
    }
}
