//! What one attention call computes besides the causal mask ([`AttentionSpec`]: scale, sliding window, soft cap,
//! sinks), the packed rows' example boundaries ([`Segments`]), and the block sizes the kernels work in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::{DType, Result, Tensor};

use super::cpu::Dims;

/// Query rows per block: the score tensor is `[batch, heads, QUERY_BLOCK, keys]`.
pub const QUERY_BLOCK: usize = 128;

/// Head dimensions the CUDA attention kernels take (in bf16 or f16); others run the composed path.
pub const CUDA_HEAD_DIMS: [usize; 2] = [64, 128];

/// Bytes the CUDA attention backward's float32 query-gradient accumulator may take at once (256 MiB unless
/// [`set_cuda_dq_bytes`] changed it): past that, a long sequence's dQ is made a few kv heads' query heads at a time,
/// one launch of the kernel each.
static CUDA_DQ_BYTES: AtomicUsize = AtomicUsize::new(256 << 20);

/// Sets the bytes the CUDA attention backward's float32 query-gradient accumulator may take at once, returning the
/// previous figure. Smaller, more launches; 1 makes one launch per kv head (the GPU suite runs short sequences so).
pub fn set_cuda_dq_bytes(bytes: usize) -> usize {
    CUDA_DQ_BYTES.swap(bytes, Ordering::Relaxed)
}

/// Kv heads whose query heads' float32 dQ one launch of the CUDA attention backward accumulates, for `rows` (batch ×
/// query tokens), `group` query heads per kv head and heads of `head_dim`: all of them while that fits the bytes
/// [`set_cuda_dq_bytes`] allows (256 MiB: one launch up to 16k tokens of an 8B model), else as many as fit, at
/// least one.
pub fn dq_kv_heads_per_launch(
    rows: usize,
    kv_heads: usize,
    group: usize,
    head_dim: usize,
) -> usize {
    let per_kv_head = rows * group * head_dim * 4;
    (CUDA_DQ_BYTES.load(Ordering::Relaxed) / per_kv_head.max(1)).clamp(1, kv_heads.max(1))
}

/// What one layer's attention computes besides the causal mask.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    /// Score scale (`1/√head_dim`, or Gemma's `query_pre_attn_scalar^-½`).
    pub scale: f64,
    /// Keys at most `window - 1` positions before the query are visible (transformers' `sliding_window`); `None`:
    /// all earlier keys.
    pub sliding_window: Option<usize>,
    /// Scores become `cap·tanh(score/cap)` before the mask (Gemma 2's `attn_logit_softcapping`).
    pub softcap: Option<f64>,
    /// One extra logit per query head in every row's softmax, with no value (gpt-oss's `sinks`).
    pub sinks: Option<AttentionSinks>,
}

impl AttentionSpec {
    /// Plain causal attention with score scale `scale`.
    pub fn causal(scale: f64) -> Self {
        AttentionSpec {
            scale,
            sliding_window: None,
            softcap: None,
            sinks: None,
        }
    }

    /// This spec with a sliding window of `window` keys (the query's own included).
    pub fn with_sliding_window(self, window: usize) -> Self {
        AttentionSpec {
            sliding_window: Some(window),
            ..self
        }
    }

    /// This spec with scores soft-capped at `cap`.
    pub fn with_softcap(self, cap: f64) -> Self {
        AttentionSpec {
            softcap: Some(cap),
            ..self
        }
    }

    /// This spec with attention sinks (one per query head).
    pub fn with_sinks(self, sinks: AttentionSinks) -> Self {
        AttentionSpec {
            sinks: Some(sinks),
            ..self
        }
    }

    /// An error for a window of 0, a cap that is not a finite positive number, or sinks that are not one finite
    /// value per each of the `heads` query heads.
    pub(super) fn validate(&self, heads: usize) -> Result<()> {
        if self.sliding_window == Some(0) {
            candle_core::bail!("attention: a sliding window must hold at least 1 key");
        }
        if let Some(cap) = self.softcap {
            if !(cap.is_finite() && cap > 0.0) {
                candle_core::bail!(
                    "attention: the logit soft cap must be finite and positive, not {cap}"
                );
            }
        }
        if let Some(sinks) = &self.sinks {
            if sinks.values.len() != heads {
                candle_core::bail!(
                    "attention: {} sinks for {heads} query heads (one per query head)",
                    sinks.values.len()
                );
            }
            // A sink of −∞ would be no sink; NaN would poison every row.
            if let Some(bad) = sinks.values.iter().find(|x| !x.is_finite()) {
                candle_core::bail!("attention: sinks must be finite, not {bad}");
            }
        }
        Ok(())
    }

    /// The spec an op runs with: a window holding every one of `keys` keys changes nothing (and leaves the CUDA
    /// kernels usable), so it is dropped.
    pub(super) fn normalized(&self, keys: usize) -> Self {
        AttentionSpec {
            sliding_window: self.sliding_window.filter(|&w| w < keys),
            ..self.clone()
        }
    }
}

/// gpt-oss's attention sinks: per query head `h` a learned logit `sinks[h]` that joins the softmax of each of the
/// head's rows as one more column and is then dropped (it has no value vector), so
/// `p_j = exp(s_j) / (Σ_k exp(s_k) + exp(sinks[h]))` and the probabilities of a row sum to less than 1.
///
/// Frozen constants of the base model: they get no gradient. Cheap to clone (shared values).
#[derive(Clone, Debug)]
pub struct AttentionSinks {
    /// One value per query head, in head order.
    pub(super) values: Arc<Vec<f32>>,
    /// `values` on the GPU, uploaded by the first kernel that reads them and shared by every clone (every layer
    /// call of a model holds a clone of the same sinks).
    #[cfg(feature = "cuda")]
    pub(super) on_device: Arc<std::sync::OnceLock<Tensor>>,
}

impl PartialEq for AttentionSinks {
    fn eq(&self, other: &Self) -> bool {
        self.values == other.values
    }
}

impl AttentionSinks {
    /// Sinks of `values`, one per query head in head order (checked against the heads when used).
    pub fn new(values: Vec<f32>) -> Self {
        AttentionSinks {
            values: Arc::new(values),
            #[cfg(feature = "cuda")]
            on_device: Default::default(),
        }
    }

    /// The sink of each query head.
    pub fn values(&self) -> &[f32] {
        &self.values
    }

    /// The sinks of the rows of a grouped score block `[1, hkv, g*c, 1]` (kv head, then query head of the group,
    /// then `c` query rows), in `dtype`.
    pub(super) fn block_column(
        &self,
        dims: Dims,
        c: usize,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<Tensor> {
        let column: Vec<f32> = self
            .values
            .iter()
            .flat_map(|&x| std::iter::repeat_n(x, c))
            .collect();
        Tensor::from_vec(column, (1, dims.hkv, dims.g * c, 1), device)?.to_dtype(dtype)
    }
}

/// Where each example of packed rows begins: queries attend only to keys of their own example.
///
/// Built from positions that restart at 0 at every example (`start = index − position`), so the same tensor that
/// drives RoPE defines the mask and the two cannot disagree.
#[derive(Clone, Debug)]
pub struct Segments {
    /// `[batch * len]`: the index of the first token of each token's example.
    pub(super) starts: Arc<Vec<u32>>,
    pub(super) batch: usize,
    pub(super) len: usize,
    /// `starts` on the GPU, uploaded by the first kernel that reads them and shared by every clone (each layer's
    /// forward, recompute and backward of one batch).
    #[cfg(feature = "cuda")]
    pub(super) on_device: Arc<std::sync::OnceLock<Tensor>>,
}

impl PartialEq for Segments {
    fn eq(&self, other: &Self) -> bool {
        (&self.starts, self.batch, self.len) == (&other.starts, other.batch, other.len)
    }
}

impl Segments {
    /// Segments of `positions` (`[batch, len]`): each row must count up by one from 0 and may restart at 0.
    pub fn from_positions(positions: &Tensor) -> Result<Self> {
        let rows = positions.to_dtype(DType::U32)?.to_vec2::<u32>()?;
        let (batch, len) = (rows.len(), rows.first().map_or(0, |r| r.len()));
        let mut starts = Vec::with_capacity(batch * len);
        for (r, row) in rows.iter().enumerate() {
            for (i, &p) in row.iter().enumerate() {
                let restarts = p == 0;
                let continues = i > 0 && p == row[i - 1] + 1;
                if !(restarts || continues) {
                    candle_core::bail!(
                        "packed positions must restart at 0 or count up by one: row {r}, index {i} has {p}"
                    );
                }
                starts.push((i as u32) - p);
            }
        }
        Ok(Segments {
            starts: Arc::new(starts),
            batch,
            len,
            #[cfg(feature = "cuda")]
            on_device: Default::default(),
        })
    }
}
