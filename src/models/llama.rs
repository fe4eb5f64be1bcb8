//! One decoder for the Llama family and its relatives (Llama 2/3/3.1/3.2, Mistral, Qwen2/3, Gemma 2/3, Phi-3,
//! SmolLM2, TinyLlama) built from the differentiable ops in [`crate::ops`]: frozen (dense or 4-bit) linears,
//! RMSNorm, RoPE, grouped-query causal attention (sliding windows, soft-capping), gated MLPs, optional per-layer
//! gradient checkpointing, and a KV cache for generation. Family differences are configuration
//! ([`ModelConfig`]): which norms wrap a block, fused or separate projections, query/key norms, partial rotary.

use crate::profile::context as snapshot_context;
use crate::profile::trace;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var, D};

use super::config::{LayerAttention, ModelConfig};
use super::mlp::{GateUpProjections, Mlp, MlpTiling};
use super::moe::{RouterLogits, SharedExpert, SparseMoe};
use super::shard::{FlatShards, Sharding};
use super::shared_read::read_shared;
use crate::ops::frozen_linear::InferenceMode;
use crate::ops::{
    self, attention, rms_norm, rope, split_heads, AttentionSinks, AttentionSpec, FrozenLinear,
    FrozenWeight, GradSink, Pass, RopeTables, Segments, WeightFrame,
};
use crate::precision::master_dtype;

pub use super::mlp::Linear;

/// The query, key and value projections of a layer: three, or one fused (Phi-3's `qkv_proj`, rows q, k, v).
#[derive(Clone, Debug)]
pub enum QkvProjections {
    /// `q_proj`, `k_proj`, `v_proj`.
    Separate {
        /// Query projection.
        q_proj: Linear,
        /// Key projection.
        k_proj: Linear,
        /// Value projection.
        v_proj: Linear,
    },
    /// `qkv_proj`.
    Fused {
        /// The three projections' rows stacked.
        qkv_proj: Linear,
    },
}

/// Self-attention of one layer.
#[derive(Clone, Debug)]
pub struct Attention {
    /// Query, key and value projections.
    pub qkv: QkvProjections,
    /// Output projection.
    pub o_proj: Linear,
    /// RMSNorm of each query head before RoPE (Qwen3, Gemma 3), over `head_dim`.
    pub q_norm: Option<Tensor>,
    /// RMSNorm of each key head before RoPE.
    pub k_norm: Option<Tensor>,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
    rotary_dim: usize,
    spec: AttentionSpec,
    eps: f64,
    /// Uses the sliding-window layers' RoPE tables.
    sliding_rope: bool,
}

/// One decoder layer: normed attention and MLP with residual connections. Llama-style layers norm each block's
/// input (`input_layernorm`, then `post_attention_layernorm` before the MLP); Gemma's also norm each block's
/// output (`input_layernorm` → attention → `post_attention_layernorm`, `pre_feedforward_layernorm` → MLP →
/// `post_feedforward_layernorm`). Norm weights are the effective scales (Gemma's stored `w` plus one).
#[derive(Clone, Debug)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub input_layernorm: Tensor,
    /// Attention.
    pub self_attn: Attention,
    /// Llama: the norm before the MLP; Gemma: the norm of the attention output.
    pub post_attention_layernorm: Tensor,
    /// Gemma: the norm before the MLP.
    pub pre_feedforward_layernorm: Option<Tensor>,
    /// Gemma: the norm of the MLP output.
    pub post_feedforward_layernorm: Option<Tensor>,
    /// MLP: dense, or a mixture of experts.
    pub mlp: FeedForward,
    eps: f64,
    /// With FSDP, this rank's share of the linear weights (which are then [`FrozenWeight::Sharded`] frames): the
    /// layer gathers them before it runs.
    shard: Option<Arc<FlatShards>>,
}

/// A layer's feed-forward block.
#[derive(Clone, Debug)]
pub enum FeedForward {
    /// One gated MLP.
    Dense(Mlp),
    /// A sparse mixture of experts (Mixtral, Qwen2/3-MoE).
    Sparse(SparseMoe),
}

/// Where a layer's router logits go: the forward's record, and whether the layer is checkpointed (then its logits
/// are kept without their graph, and its recomputation adds the auxiliary loss's gradient itself).
#[derive(Clone)]
struct RouterSink {
    record: RouterLogits,
    layer: usize,
    checkpointed: bool,
}

/// What a training forward hands a layer's feed-forward block: where a sparse block's router logits go, and how a
/// dense MLP is tiled.
#[derive(Clone, Default)]
struct FeedForwardRun {
    router: Option<RouterSink>,
    tiling: Option<MlpTiling>,
}

/// Keys and values of the positions seen so far, per layer (`[batch, kv_heads, seq, head_dim]`). A sliding-window
/// layer keeps only the keys its next query can see (the last `window − 1`), as transformers' sliding cache does.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// Positions seen.
    seen: usize,
}

impl KvCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        KvCache {
            layers: vec![None; layers],
            seen: 0,
        }
    }

    /// Positions seen (the next token's position).
    pub fn len(&self) -> usize {
        self.seen
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Keeps the batch rows `rows` of every layer's keys and values, in that order (a row may repeat): the cache
    /// of a batch whose row `i` is the old row `rows[i]`, at the same positions (sliding-window layers included).
    pub fn select_rows(&mut self, rows: &[usize]) -> Result<()> {
        let Some((k, _)) = self.layers.iter().flatten().next() else {
            return Ok(());
        };
        let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let ids = Tensor::new(ids.as_slice(), k.device())?;
        for (k, v) in self.layers.iter_mut().flatten() {
            // `index_select` reads contiguous tensors; a sliding window's kept suffix is a narrowed view.
            *k = k.contiguous()?.index_select(&ids, 0)?;
            *v = v.contiguous()?.index_select(&ids, 0)?;
        }
        Ok(())
    }

    /// Repeats each batch row `n` times in place (`[a, b]` → `[a, a, b, b]` for `n = 2`): one prompt's cache for
    /// `n` completions.
    pub fn repeat_rows(&mut self, n: usize) -> Result<()> {
        let Some((k, _)) = self.layers.iter().flatten().next() else {
            return Ok(());
        };
        let batch = k.dim(0)?;
        let rows: Vec<usize> = (0..batch * n).map(|i| i / n).collect();
        self.select_rows(&rows)
    }
}

/// The cos/sin of a batch's positions: of the model's RoPE, and of its sliding-window layers' own RoPE if any.
#[derive(Clone, Debug)]
struct PositionTables {
    cos: Tensor,
    sin: Tensor,
    sliding: Option<(Tensor, Tensor)>,
}

impl PositionTables {
    /// The tables of a layer.
    fn of(&self, attention: &Attention) -> (&Tensor, &Tensor) {
        match (&self.sliding, attention.sliding_rope) {
            (Some((c, s)), true) => (c, s),
            _ => (&self.cos, &self.sin),
        }
    }
}

/// `[b, t, heads·d]` → `[b, heads, t, d]`, copying a view (a column range of a fused projection) first.
fn to_heads(x: &Tensor, heads: usize) -> Result<Tensor> {
    split_heads(&x.contiguous()?, heads)
}

impl Attention {
    /// The layer's query, key and value heads, normed and rotated: `[b, heads, t, d]` each.
    fn heads(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let plain = self.q_norm.is_none() && self.rotary_dim == self.head_dim;
        let (q, k, v) = match &self.qkv {
            // The common case: RoPE inside the projection's fused op.
            QkvProjections::Separate {
                q_proj,
                k_proj,
                v_proj,
            } if plain => {
                return Ok((
                    q_proj.forward_to_heads(x, self.n_head, Some((cos, sin)))?,
                    k_proj.forward_to_heads(x, self.n_kv_head, Some((cos, sin)))?,
                    v_proj.forward_to_heads(x, self.n_kv_head, None)?,
                ))
            }
            QkvProjections::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => (
                q_proj.forward_to_heads(x, self.n_head, None)?,
                k_proj.forward_to_heads(x, self.n_kv_head, None)?,
                v_proj.forward_to_heads(x, self.n_kv_head, None)?,
            ),
            QkvProjections::Fused { qkv_proj } => {
                let y = qkv_proj.forward(x)?;
                let (qw, kvw) = (self.n_head * self.head_dim, self.n_kv_head * self.head_dim);
                (
                    to_heads(&y.narrow(D::Minus1, 0, qw)?, self.n_head)?,
                    to_heads(&y.narrow(D::Minus1, qw, kvw)?, self.n_kv_head)?,
                    to_heads(&y.narrow(D::Minus1, qw + kvw, kvw)?, self.n_kv_head)?,
                )
            }
        };
        let normed = |t: Tensor, w: &Option<Tensor>| match w {
            Some(w) => rms_norm(&t, w, self.eps),
            None => Ok(t),
        };
        let q = self.rotate(&normed(q, &self.q_norm)?, cos, sin)?;
        let k = self.rotate(&normed(k, &self.k_norm)?, cos, sin)?;
        Ok((q, k, v))
    }

    /// RoPE on the first `rotary_dim` dimensions of each head (all of them but in Phi-3 with a partial factor).
    fn rotate(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        if self.rotary_dim == self.head_dim {
            return rope(x, cos, sin);
        }
        let rotated = rope(
            &x.narrow(D::Minus1, 0, self.rotary_dim)?.contiguous()?,
            cos,
            sin,
        )?;
        let kept = x.narrow(D::Minus1, self.rotary_dim, self.head_dim - self.rotary_dim)?;
        Tensor::cat(&[&rotated, &kept], D::Minus1)
    }

    /// `attention(x)`, plus `residual` when given (then accumulated by the output projection).
    fn forward(
        &self,
        x: &Tensor,
        tables: &PositionTables,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        segments: Option<&Segments>,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (cos, sin) = tables.of(self);
        let (q, k, v) = self.heads(x, cos, sin)?;
        let (k, v) = match cache {
            Some(slot) => {
                let (k, v) = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                // Positions are relative to the keys held, so a window's mask is the same on the kept suffix.
                let held = k.dim(2)?;
                let kept = self
                    .spec
                    .sliding_window
                    .map_or(held, |w| held.min(w.saturating_sub(1)));
                *slot = Some((
                    k.narrow(2, held - kept, kept)?,
                    v.narrow(2, held - kept, kept)?,
                ));
                (k, v)
            }
            None => (k, v),
        };
        let y = attention(&q, &k, &v, &self.spec, segments)?;
        match residual {
            Some(r) => self.o_proj.forward_from_heads_plus(&y, r),
            None => self.o_proj.forward_from_heads(&y),
        }
    }
}

/// An MLP's projections named under `prefix`, appended to `out` (shared or, with `mut`, mutable borrows).
macro_rules! mlp_linears {
    ($out:ident, $prefix:expr, $mlp:expr $(, $m:ident)?) => {{
        let (prefix, mlp) = ($prefix, $mlp);
        match & $($m)? mlp.gate_up {
            GateUpProjections::Separate { gate_proj, up_proj } => $out.extend([
                (format!("{prefix}.gate_proj"), gate_proj),
                (format!("{prefix}.up_proj"), up_proj),
            ]),
            GateUpProjections::Fused { gate_up_proj }
            | GateUpProjections::Interleaved { gate_up_proj } => {
                $out.push((format!("{prefix}.gate_up_proj"), gate_up_proj))
            }
        }
        $out.push((format!("{prefix}.down_proj"), & $($m)? mlp.down_proj));
    }};
}

/// A layer's projections with their relative names, borrowed shared (`named_linears!(layer)`) or mutably
/// (`named_linears!(layer, mut)`), in [`ModelConfig::layer_linears`]' order.
macro_rules! named_linears {
    ($layer:expr $(, $m:ident)?) => {{
        let layer = $layer;
        let mut out = Vec::with_capacity(7);
        match & $($m)? layer.self_attn.qkv {
            QkvProjections::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => out.extend([
                ("self_attn.q_proj".to_string(), q_proj),
                ("self_attn.k_proj".to_string(), k_proj),
                ("self_attn.v_proj".to_string(), v_proj),
            ]),
            QkvProjections::Fused { qkv_proj } => out.push(("self_attn.qkv_proj".to_string(), qkv_proj)),
        }
        out.push(("self_attn.o_proj".to_string(), & $($m)? layer.self_attn.o_proj));
        match & $($m)? layer.mlp {
            FeedForward::Dense(mlp) => mlp_linears!(out, "mlp", mlp $(, $m)?),
            FeedForward::Sparse(moe) => {
                out.push((moe.router_name.to_string(), & $($m)? moe.gate));
                for (e, expert) in (& $($m)? moe.experts).into_iter().enumerate() {
                    mlp_linears!(out, format!("mlp.experts.{e}"), expert $(, $m)?);
                }
                if let Some(shared) = & $($m)? moe.shared_expert {
                    mlp_linears!(out, "mlp.shared_expert", & $($m)? shared.mlp $(, $m)?);
                    out.push(("mlp.shared_expert_gate".to_string(), & $($m)? shared.gate));
                }
            }
        }
        out
    }};
}

impl DecoderLayer {
    /// The layer for `pass` (see [`Pass`]: in a recomputation the output's value is not computed in full), and in
    /// the recomputation of a checkpointed sparse layer its share of the auxiliary loss (see [`RouterLogits`]).
    /// `ahead` is the layer that runs next (the following one in a forward, the one before in a recomputation):
    /// a sharded model starts gathering it while this one computes, where its [`Sharding`] prefetches.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        x: &Tensor,
        tables: &PositionTables,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        segments: Option<&Segments>,
        pass: Pass,
        ffn: &FeedForwardRun,
        ahead: Option<&DecoderLayer>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        if let Some(shard) = &self.shard {
            // The ops of the run hold the gathered weights as long as its graph needs them.
            let gathered = self.gathered(shard)?;
            let sharding = shard.sharding();
            let prefetches = match pass {
                Pass::Forward => sharding.prefetch_forward(),
                Pass::Recompute => sharding.prefetch_backward(),
            };
            if let Some(next) = ahead.and_then(DecoderLayer::shard).filter(|_| prefetches) {
                next.prefetch("a layer's weights")
                    .map_err(candle_core::Error::wrap)?;
            }
            return gathered.run(x, tables, cache, segments, pass, ffn, None);
        }
        let norm = |t: &Tensor, w: &Tensor| rms_norm(t, w, self.eps);
        match (
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ) {
            (Some(pre_mlp), Some(post_mlp)) => {
                let a = self.self_attn.forward(
                    &norm(x, &self.input_layernorm)?,
                    tables,
                    cache,
                    segments,
                    None,
                )?;
                let h = (x + norm(&a, &self.post_attention_layernorm)?)?;
                let (m, aux) = self.feed_forward(&norm(&h, pre_mlp)?, None, pass, ffn)?;
                Ok(((&h + norm(&m, post_mlp)?)?, aux))
            }
            _ => {
                // Each residual sum is accumulated by the block's last projection (see `LoraLinear::forward_plus`).
                let h = self.self_attn.forward(
                    &norm(x, &self.input_layernorm)?,
                    tables,
                    cache,
                    segments,
                    Some(x),
                )?;
                self.feed_forward(
                    &norm(&h, &self.post_attention_layernorm)?,
                    Some(&h),
                    pass,
                    ffn,
                )
            }
        }
    }

    /// The feed-forward block of `x`, plus `residual` when given; a sparse block's router logits go to
    /// `ffn.router` (see [`DecoderLayer::run`]); with `ffn.tiling` a dense MLP, or each expert over its own tokens,
    /// runs tiled.
    fn feed_forward(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        pass: Pass,
        ffn: &FeedForwardRun,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let moe = match (&self.mlp, &ffn.tiling) {
            (FeedForward::Dense(mlp), Some(tiling)) => {
                return Ok((mlp.forward_tiled(x, residual, pass, tiling)?, None))
            }
            (FeedForward::Dense(mlp), None) => return Ok((mlp.forward(x, residual, pass)?, None)),
            (FeedForward::Sparse(moe), _) => moe,
        };
        let (out, logits, choices) = moe.forward_with_choices(x, ffn.tiling.as_ref())?;
        let out = match residual {
            Some(r) => (out + r)?,
            None => out,
        };
        let aux = match (ffn.router.as_ref(), pass) {
            (None, _) => None,
            (Some(sink), Pass::Forward) => {
                // A checkpointed layer's graph is not kept: its recomputation differentiates the loss itself.
                let logits = if sink.checkpointed {
                    logits.detach()
                } else {
                    logits
                };
                sink.record.record(sink.layer, logits, choices)?;
                None
            }
            (Some(sink), Pass::Recompute) => sink.record.recomputed_loss(&logits)?,
        };
        Ok((out, aux))
    }

    /// The projections of this layer with their names relative to the layer (`self_attn.q_proj`, ...), in
    /// [`crate::models::ModelConfig::layer_linears`]' order.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        named_linears!(self)
    }

    /// [`DecoderLayer::linears`], mutable.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        named_linears!(self, mut)
    }

    /// The attention sinks (gpt-oss's `self_attn.sinks`), one per query head.
    pub fn attention_sinks(&self) -> Option<&[f32]> {
        self.self_attn.spec.sinks.as_ref().map(|s| s.values())
    }

    /// The layer's norm weights with their names relative to the layer (`input_layernorm`, ...), as the model
    /// holds them (effective scales).
    pub fn norms(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = vec![
            ("input_layernorm", &self.input_layernorm),
            ("post_attention_layernorm", &self.post_attention_layernorm),
        ];
        let optional = [
            ("pre_feedforward_layernorm", &self.pre_feedforward_layernorm),
            (
                "post_feedforward_layernorm",
                &self.post_feedforward_layernorm,
            ),
            ("self_attn.q_norm", &self.self_attn.q_norm),
            ("self_attn.k_norm", &self.self_attn.k_norm),
        ];
        out.extend(
            optional
                .into_iter()
                .filter_map(|(n, t)| t.as_ref().map(|t| (n, t))),
        );
        out
    }

    /// This layer holding only rank `sharding.rank()`'s share of its linear weights (see [`crate::models::shard`]);
    /// norms, biases and sinks stay whole (a few vectors). Adapters stay as they are.
    /// A weight still in its file is read on the layer's device first: in parts over the ranks once they can
    /// gather ([`read_shared`]), otherwise whole.
    fn sharded(&self, sharding: &Arc<Sharding>) -> crate::Result<DecoderLayer> {
        let mut out = self.clone();
        let device = self.input_layernorm.device().clone();
        let mut storage = Vec::new();
        for (name, lin) in out.linears_mut() {
            if let FrozenWeight::Deferred(d) = &lin.base.weight {
                let what = format!("weight `{name}` (being loaded)");
                let weight = match read_shared(d.as_ref(), sharding, &device, &what)? {
                    Some(w) => w,
                    None => d.read()?.to_device(&device)?,
                };
                let bias = lin.base.bias.as_ref().map(|b| b.to_device(&device));
                lin.base = Arc::new(FrozenLinear::new(weight, bias.transpose()?));
            }
            let (frame, parts) = WeightFrame::split(&lin.base.weight)?;
            storage.extend(parts);
            let base = FrozenLinear::new(
                FrozenWeight::Sharded(Arc::new(frame)),
                lin.base.bias.clone(),
            );
            lin.base = Arc::new(base);
        }
        out.shard = Some(Arc::new(FlatShards::new(&storage, sharding.clone())?));
        Ok(out)
    }

    /// This layer with its linear weights gathered whole from `shard` (every rank's share).
    fn gathered(&self, shard: &FlatShards) -> Result<DecoderLayer> {
        let storage = shard
            .gather("a layer's weights")
            .map_err(candle_core::Error::wrap)?;
        let mut storage = storage.into_iter();
        let mut out = self.clone();
        out.shard = None;
        for (_, lin) in out.linears_mut() {
            let FrozenWeight::Sharded(frame) = &lin.base.weight else {
                candle_core::bail!("a sharded layer holds a whole weight");
            };
            let weight = frame.rebuild(storage.by_ref().take(frame.parts()).collect())?;
            lin.base = Arc::new(FrozenLinear::new(weight, lin.base.bias.clone()));
        }
        Ok(out)
    }

    /// This layer's share ([`FlatShards`]), if it is sharded.
    pub fn shard(&self) -> Option<&FlatShards> {
        self.shard.as_deref()
    }

    /// This layer with every tensor mapped by `norm` and every projection by `linear` (moving a model).
    fn map(
        &self,
        norm: impl Fn(&Tensor) -> Result<Tensor>,
        linear: impl Fn(&Linear) -> Result<Linear>,
    ) -> Result<DecoderLayer> {
        let opt = |t: &Option<Tensor>| t.as_ref().map(&norm).transpose();
        let mut out = self.clone();
        for (_, lin) in out.linears_mut() {
            *lin = linear(lin)?;
        }
        out.input_layernorm = norm(&self.input_layernorm)?;
        out.post_attention_layernorm = norm(&self.post_attention_layernorm)?;
        out.pre_feedforward_layernorm = opt(&self.pre_feedforward_layernorm)?;
        out.post_feedforward_layernorm = opt(&self.post_feedforward_layernorm)?;
        out.self_attn.q_norm = opt(&self.self_attn.q_norm)?;
        out.self_attn.k_norm = opt(&self.self_attn.k_norm)?;
        Ok(out)
    }
}

/// Where the positions of a batch come from.
#[derive(Clone, Debug)]
pub enum Positions {
    /// `offset, offset+1, ...` for every row.
    Range(usize),
    /// Explicit positions `[batch, seq]` (u32).
    Explicit(Tensor),
    /// Packed rows: positions `[batch, seq]` (u32) that restart at 0 at every example; attention stays inside each
    /// example, so a packed row computes what its examples would compute alone.
    Packed(Tensor),
}

/// The model's RoPE tables on `device`: of its (full-attention) layers, and of its sliding-window layers where
/// those have their own base.
/// The RoPE tables of `config` for a model computing in `compute_dtype`: float64 from end to end for a float64
/// model, else float32 as transformers forms them.
fn rope_tables(
    config: &ModelConfig,
    device: &Device,
    compute_dtype: DType,
) -> Result<(RopeTables, Option<RopeTables>)> {
    let build = if compute_dtype == DType::F64 {
        RopeTables::new_f64
    } else {
        RopeTables::new
    };
    let tables = |theta, scaling| {
        build(
            config.rotary_dim,
            config.max_position_embeddings,
            theta,
            scaling,
            device,
        )
    };
    let sliding = match config.sliding_rope_theta {
        Some(theta) if config.layer_types.contains(&LayerAttention::Sliding) => {
            Some(tables(theta, None)?)
        }
        _ => None,
    };
    Ok((
        tables(config.rope_theta, config.rope_scaling.as_ref())?,
        sliding,
    ))
}

/// How to run the layers in a training forward.
#[derive(Clone, Default)]
pub struct Checkpointing {
    /// Recompute layers in the backward instead of keeping their activations.
    pub enabled: bool,
    /// With `enabled`, how many of the last layers still keep their activations (memory-aware checkpointing:
    /// the first layers are recomputed, so the kept layers' memory is freed before any recomputation starts).
    pub kept_layers: usize,
    /// Receives the parameter gradients found during recomputation.
    pub sink: GradSink,
    /// The trainable parameters the layers use.
    pub params: Vec<Var>,
    /// Run each MLP — dense, or each expert of a sparse block over its own tokens — over slices of the token rows,
    /// forward and backward (`TrainingArguments::tiled_mlp`; see [`MlpTiling`]); their parameter gradients go to
    /// `sink` too. Checkpointed or not.
    pub tiled_mlp: bool,
    /// With `tiled_mlp`, rows per slice; `None` chooses [`crate::models::mlp_slice_rows`].
    pub mlp_slice_rows: Option<usize>,
    /// With `enabled`, where the recomputed layers' inputs wait for the backward: pinned host memory
    /// (`TrainingArguments::activation_offloading`), or the device (`None`).
    pub offload: Option<ops::ActivationOffload>,
}

/// The labels each position predicts (`[b, t]`): position i predicts token i + 1, so the labels shift left by one and
/// each row's last position is ignored — the hidden states then go in whole (a narrowed view would be copied).
fn shifted_labels(labels: &Tensor) -> Result<Tensor> {
    let (b, t) = labels.dims2()?;
    let ignored =
        Tensor::full(ops::IGNORE_INDEX, (b, 1), labels.device())?.to_dtype(labels.dtype())?;
    Tensor::cat(&[&labels.narrow(1, 1, t - 1)?, &ignored], 1)
}

/// The model.
#[derive(Clone, Debug)]
pub struct LlamaModel {
    config: ModelConfig,
    /// Token embeddings `[vocab, hidden]`.
    pub embed_tokens: Tensor,
    /// Decoder layers.
    pub layers: Vec<Arc<DecoderLayer>>,
    /// Final norm.
    pub norm: Tensor,
    /// Output projection (shares the embedding matrix when tied).
    pub lm_head: Arc<FrozenLinear>,
    rope: RopeTables,
    /// The sliding-window layers' own RoPE tables (Gemma 3).
    sliding_rope: Option<RopeTables>,
    compute_dtype: DType,
    /// Dropout switch and step seed shared by all LoRA adapters.
    pub lora_runtime: Arc<crate::lora::LoraRuntime>,
    /// Configurations of the loaded adapters, by name.
    pub adapter_configs: std::collections::BTreeMap<String, crate::lora::LoraConfig>,
    /// The active adapter.
    pub active_adapter: Option<String>,
    /// Modules an adapter trains in full (`modules_to_save`), by adapter name.
    pub saved_modules: std::collections::BTreeMap<String, SavedModules>,
    /// With FSDP, this process's place among the ranks its layers are sharded over.
    sharding: Option<Arc<Sharding>>,
    /// With FSDP, the embedding table and the head held as this rank's shares (then `embed_tokens` is empty and
    /// `lm_head` a frame).
    ends: Option<Arc<ShardedEnds>>,
}

/// How many of the embedding's first rows a sharded model keeps whole (see [`LlamaModel::embedding_rows`]).
pub const WHOLE_EMBEDDING_ROWS: usize = 64;

/// The embedding table and the output head of a sharded model (FSDP): this rank's shares, gathered when used.
#[derive(Debug)]
struct ShardedEnds {
    /// The embedding table `[vocab, hidden]`.
    embed: FlatShards,
    /// Its shape and dtype.
    embed_shape: (usize, usize),
    /// The head's frame and shares; `None` when the head is the embedding table (tied).
    head: Option<(WeightFrame, FlatShards)>,
    /// The embedding's first [`WHOLE_EMBEDDING_ROWS`] rows, whole.
    first_rows: Tensor,
}

impl ShardedEnds {
    /// This rank's shares of `embed` and of `head` (`None`: tied to `embed`).
    fn new(
        embed: &Tensor,
        head: Option<&FrozenWeight>,
        sharding: &Arc<Sharding>,
    ) -> crate::Result<Self> {
        let head = match head {
            Some(w) => {
                let (frame, storage) = WeightFrame::split(w)?;
                Some((frame, FlatShards::new(&storage, sharding.clone())?))
            }
            None => None,
        };
        let rows = embed.dim(0)?.min(WHOLE_EMBEDDING_ROWS);
        Ok(ShardedEnds {
            embed: FlatShards::new(&[embed.flatten_all()?], sharding.clone())?,
            embed_shape: embed.dims2()?,
            head,
            // Compact: a view (or Candle's `copy` of one) would keep the whole table.
            first_rows: embed.narrow(0, 0, rows)?.force_contiguous()?,
        })
    }

    /// The whole embedding table.
    fn embedding(&self) -> Result<Tensor> {
        let parts = self
            .embed
            .gather("the embedding table")
            .map_err(candle_core::Error::wrap)?;
        parts[0].reshape(self.embed_shape)
    }

    /// The whole head, dense.
    fn head(&self, dtype: DType) -> Result<Tensor> {
        match &self.head {
            None => self.embedding(),
            Some((frame, shards)) => {
                let storage = shards
                    .gather("the output head")
                    .map_err(candle_core::Error::wrap)?;
                match frame.rebuild(storage)? {
                    FrozenWeight::Dense(t) => Ok(t),
                    w => w.to_dense(dtype),
                }
            }
        }
    }

    /// Bytes of this rank's shares.
    fn shard_bytes(&self) -> usize {
        self.embed.shard_bytes() + self.head.as_ref().map_or(0, |(_, h)| h.shard_bytes())
    }
}

/// Tensors an adapter trains in full (PEFT's `modules_to_save`), replacing the base's while it is active.
#[derive(Clone, Debug, Default)]
pub struct SavedModules {
    /// A trainable copy of `lm_head.weight`.
    pub lm_head: Option<Var>,
    /// A trainable copy of `model.embed_tokens.weight`.
    pub embed_tokens: Option<Var>,
}

/// The pieces of one layer, for [`LlamaModel::new`]. Norm weights are the effective scales (Gemma's stored `w`
/// plus one).
pub struct LayerWeights {
    /// `input_layernorm.weight`.
    pub input_layernorm: Tensor,
    /// `post_attention_layernorm.weight`.
    pub post_attention_layernorm: Tensor,
    /// `pre_feedforward_layernorm.weight` (Gemma).
    pub pre_feedforward_layernorm: Option<Tensor>,
    /// `post_feedforward_layernorm.weight` (Gemma).
    pub post_feedforward_layernorm: Option<Tensor>,
    /// `self_attn.q_norm.weight` (Qwen3, Gemma 3).
    pub q_norm: Option<Tensor>,
    /// `self_attn.k_norm.weight` (Qwen3, Gemma 3).
    pub k_norm: Option<Tensor>,
    /// `self_attn.sinks` (gpt-oss): one logit per query head joined to its attention softmax.
    pub sinks: Option<Tensor>,
    /// The projections in [`crate::models::ModelConfig::layer_linears`]' order: q, k, v, o, gate, up, down, or
    /// (fused) qkv, o, gate_up, down; in a sparse layer the router, each expert's gate_up and down, then the
    /// shared expert's projections and gate.
    pub linears: Vec<Linear>,
}

/// Whether `dtype` is a 16-bit float.
fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::BF16 | DType::F16)
}

impl LlamaModel {
    /// Assembles a model; `compute_dtype` is the dtype of activations and matmuls (f32 on CPU by default).
    pub fn new(
        config: ModelConfig,
        embed_tokens: Tensor,
        layers: Vec<LayerWeights>,
        norm: Tensor,
        lm_head: Arc<FrozenLinear>,
        compute_dtype: DType,
    ) -> Result<Self> {
        // A bf16 checkpoint computed in float16 (a T4) or the reverse: the embedding table and a dense head are
        // held in the compute dtype, as transformers loads them with `torch_dtype`; every use converted them to it
        // anyway, and the fused cross-entropy needs the head in the hidden states' dtype.
        let other_half =
            |t: &Tensor| is_half(t.dtype()) && is_half(compute_dtype) && t.dtype() != compute_dtype;
        let (embed_tokens, lm_head) = if other_half(&embed_tokens) {
            let converted = embed_tokens.to_dtype(compute_dtype)?;
            let head = match &lm_head.weight {
                FrozenWeight::Dense(w) if w.id() == embed_tokens.id() => Arc::new(
                    FrozenLinear::new(FrozenWeight::Dense(converted.clone()), None),
                ),
                FrozenWeight::Dense(w) if other_half(w) && lm_head.bias.is_none() => Arc::new(
                    FrozenLinear::new(FrozenWeight::Dense(w.to_dtype(compute_dtype)?), None),
                ),
                _ => lm_head,
            };
            (converted, head)
        } else {
            (embed_tokens, lm_head)
        };
        let (rope, sliding_rope) = rope_tables(&config, embed_tokens.device(), compute_dtype)?;
        let fused = config.architecture.has_fused_projections();
        let layers = layers
            .into_iter()
            .enumerate()
            .map(|(i, w)| {
                let expected = config.layer_linears(i).len();
                if w.linears.len() != expected {
                    candle_core::bail!(
                        "layer {i}: {} projections given, {} expected",
                        w.linears.len(),
                        expected
                    );
                }
                let mut linears = w.linears.into_iter();
                let mut next = || linears.next().expect("counted above");
                let qkv = if fused {
                    QkvProjections::Fused { qkv_proj: next() }
                } else {
                    QkvProjections::Separate {
                        q_proj: next(),
                        k_proj: next(),
                        v_proj: next(),
                    }
                };
                let o_proj = next();
                let mlp = match config.moe.as_ref().filter(|m| m.sparse_layers[i]) {
                    None => {
                        let gate_up = if fused {
                            GateUpProjections::Fused {
                                gate_up_proj: next(),
                            }
                        } else {
                            GateUpProjections::Separate {
                                gate_proj: next(),
                                up_proj: next(),
                            }
                        };
                        FeedForward::Dense(Mlp::new(gate_up, next(), config.activation))
                    }
                    Some(moe) => {
                        let router = next();
                        let experts = (0..moe.num_experts)
                            .map(|_| {
                                let gate_up_proj = next();
                                let down_proj = next();
                                match moe.clamped_swiglu {
                                    Some(c) => Mlp::clamped(gate_up_proj, down_proj, c),
                                    None => {
                                        let gate_up = GateUpProjections::Fused { gate_up_proj };
                                        Mlp::new(gate_up, down_proj, config.activation)
                                    }
                                }
                            })
                            .collect();
                        let shared = moe.shared_expert_intermediate_size.map(|_| {
                            let gate_up = GateUpProjections::Separate {
                                gate_proj: next(),
                                up_proj: next(),
                            };
                            let mlp = Mlp::new(gate_up, next(), config.activation);
                            SharedExpert { mlp, gate: next() }
                        });
                        let mut block = SparseMoe::new(
                            router,
                            experts,
                            shared,
                            moe.num_experts_per_tok,
                            moe.norm_topk_prob,
                        )
                        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                        block.router_name = config.architecture.router_name();
                        FeedForward::Sparse(block)
                    }
                };
                let window = config.window_of(i);
                Ok(Arc::new(DecoderLayer {
                    shard: None,
                    input_layernorm: w.input_layernorm,
                    self_attn: Attention {
                        qkv,
                        o_proj,
                        q_norm: w.q_norm,
                        k_norm: w.k_norm,
                        n_head: config.num_attention_heads,
                        n_kv_head: config.num_key_value_heads,
                        head_dim: config.head_dim,
                        rotary_dim: config.rotary_dim,
                        spec: AttentionSpec {
                            scale: config.attention_scale(),
                            sliding_window: window,
                            softcap: config.attn_logit_softcapping,
                            sinks: match &w.sinks {
                                Some(t) => Some(AttentionSinks::new(t.to_vec1::<f32>()?)),
                                None => None,
                            },
                        },
                        eps: config.rms_norm_eps,
                        sliding_rope: sliding_rope.is_some()
                            && config.layer_types.get(i) == Some(&LayerAttention::Sliding),
                    },
                    post_attention_layernorm: w.post_attention_layernorm,
                    pre_feedforward_layernorm: w.pre_feedforward_layernorm,
                    post_feedforward_layernorm: w.post_feedforward_layernorm,
                    mlp,
                    eps: config.rms_norm_eps,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LlamaModel {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            sliding_rope,
            compute_dtype,
            lora_runtime: Arc::default(),
            adapter_configs: Default::default(),
            active_adapter: None,
            saved_modules: Default::default(),
            sharding: None,
            ends: None,
        })
    }

    /// The model on `device` (`cuda:0`, say): embeddings, norms and frozen weights are copied there, 4-bit
    /// weights as their 4-bit codes (dequantized on the device in each forward). Move a model before adding or
    /// loading adapters: they are created on the model's device.
    pub fn to_device(self, device: &Device) -> crate::Result<Self> {
        self.move_to(device, None)
    }

    /// [`LlamaModel::to_device`], each layer keeping only rank `sharding.rank()`'s share of its linear weights
    /// (FSDP's full sharding, see [`crate::models::shard`]): a layer is sharded as it arrives, so the device never
    /// holds more than the shards and one whole layer. A model already on `device` is sharded in place, its
    /// adapters kept. The layers gather through `sharding`'s exchange when they run, so every rank must run the
    /// same layers in the same order.
    pub fn to_device_sharded(
        self,
        device: &Device,
        sharding: &Arc<Sharding>,
    ) -> crate::Result<Self> {
        self.move_to(device, Some(sharding))
    }

    fn move_to(self, device: &Device, sharding: Option<&Arc<Sharding>>) -> crate::Result<Self> {
        let moves = !self.embed_tokens.device().same_device(device);
        // Sharding in place keeps the adapters; a move would leave them on the old device.
        if !self.adapter_configs.is_empty() && (moves || sharding.is_none()) {
            return Err(crate::Error::InvalidInput(
                "move the model to its device before adding or loading adapters".into(),
            ));
        }
        let shard = |layer: DecoderLayer| -> crate::Result<Arc<DecoderLayer>> {
            Ok(Arc::new(match sharding {
                Some(s) => layer.sharded(s)?,
                None => layer,
            }))
        };
        if !moves {
            return match sharding {
                None => Ok(self),
                Some(s) => {
                    let layers = self
                        .layers
                        .iter()
                        .map(|l| shard(l.as_ref().clone()))
                        .collect::<crate::Result<Vec<_>>>()?;
                    LlamaModel { layers, ..self }.with_sharded_ends(s)
                }
            };
        }
        let embed_tokens = self.embed_tokens.to_device(device)?;
        // A head tied to the embeddings stays one tensor on the device.
        let lm_head = match &self.lm_head.weight {
            FrozenWeight::Dense(w) if w.id() == self.embed_tokens.id() => {
                FrozenLinear::new(FrozenWeight::Dense(embed_tokens.clone()), None)
            }
            _ => self.lm_head.to_device(device)?,
        };
        // A sharded layer reads a weight still in its file itself (`DecoderLayer::sharded`), in parts over the ranks.
        let linear = |l: &Linear| -> Result<Linear> {
            match (&l.base.weight, sharding) {
                (FrozenWeight::Deferred(_), Some(_)) => Ok(l.clone()),
                _ => Ok(Linear::new(Arc::new(l.base.to_device(device)?))),
            }
        };
        let layers = self
            .layers
            .iter()
            .map(|l| shard(l.map(|t| t.to_device(device), linear)?))
            .collect::<crate::Result<Vec<_>>>()?;
        let (rope, sliding_rope) = rope_tables(&self.config, device, self.compute_dtype)?;
        let moved = LlamaModel {
            embed_tokens,
            layers,
            norm: self.norm.to_device(device)?,
            lm_head: Arc::new(lm_head),
            rope,
            sliding_rope,
            ..self
        };
        match sharding {
            Some(s) => moved.with_sharded_ends(s),
            None => Ok(moved),
        }
    }

    /// This model (its layers sharded already) with the embedding table and the head sharded too, by `sharding`.
    fn with_sharded_ends(self, sharding: &Arc<Sharding>) -> crate::Result<Self> {
        let tied = matches!(&self.lm_head.weight, FrozenWeight::Dense(w) if w.id() == self.embed_tokens.id());
        let head = (!tied).then_some(&self.lm_head.weight);
        let ends = ShardedEnds::new(&self.embed_tokens, head, sharding)?;
        let (vocab, hidden) = ends.embed_shape;
        let empty = Tensor::zeros(
            (0, hidden),
            self.embed_tokens.dtype(),
            self.embed_tokens.device(),
        )?;
        let frame = WeightFrame::Dense {
            shape: (vocab, hidden),
        };
        let lm_head = match &ends.head {
            Some((frame, _)) => FrozenWeight::Sharded(Arc::new(frame.clone())),
            None => FrozenWeight::Sharded(Arc::new(frame)),
        };
        Ok(LlamaModel {
            embed_tokens: empty,
            lm_head: Arc::new(FrozenLinear::new(lm_head, self.lm_head.bias.clone())),
            sharding: Some(sharding.clone()),
            ends: Some(Arc::new(ends)),
            ..self
        })
    }

    /// With FSDP ([`LlamaModel::to_device_sharded`]), this process's place among the ranks, where the job's
    /// exchange is attached.
    pub fn sharding(&self) -> Option<&Arc<Sharding>> {
        self.sharding.as_ref()
    }

    /// With FSDP, the bytes of the sharded weights (the layers' linear weights, the embedding table and the head)
    /// this rank holds, and those of the whole weights.
    pub fn sharded_bytes(&self) -> Option<(usize, usize)> {
        let ends = self.ends.as_ref()?;
        let mut shards: Vec<&FlatShards> = self.layers.iter().filter_map(|l| l.shard()).collect();
        shards.push(&ends.embed);
        shards.extend(ends.head.as_ref().map(|(_, h)| h));
        Some(shards.iter().fold((0, 0), |(held, whole), s| {
            (held + s.shard_bytes(), whole + s.whole_bytes())
        }))
    }

    /// The device the model's tensors live on.
    pub fn device(&self) -> &Device {
        self.embed_tokens.device()
    }

    /// The configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Activation / matmul dtype.
    pub fn compute_dtype(&self) -> DType {
        self.compute_dtype
    }

    /// Sets the activation / matmul dtype (weights stay as stored, or as [`LlamaModel::new`] converted them; each
    /// op converts them). Into or out of float64, the RoPE tables are rebuilt in the new precision.
    pub fn set_compute_dtype(&mut self, dtype: DType) -> Result<()> {
        if (dtype == DType::F64) != (self.compute_dtype == DType::F64) {
            (self.rope, self.sliding_rope) = rope_tables(&self.config, self.device(), dtype)?;
        }
        self.compute_dtype = dtype;
        Ok(())
    }

    /// The active adapter's trained copies of the embeddings and head (`modules_to_save`), if it has any.
    pub fn active_saved(&self) -> Option<&SavedModules> {
        self.active_adapter
            .as_ref()
            .and_then(|a| self.saved_modules.get(a))
    }

    /// The embedding table `[vocab, hidden]` in use: the active adapter's trained copy (`modules_to_save`), or the
    /// base's.
    pub fn embedding_table(&self) -> Result<Tensor> {
        match (
            self.active_saved().and_then(|s| s.embed_tokens.as_ref()),
            &self.ends,
        ) {
            (Some(v), _) => Ok(v.as_tensor().clone()),
            (None, Some(ends)) => ends.embedding(),
            (None, None) => Ok(self.embed_tokens.clone()),
        }
    }

    /// The embedding table's first `n` rows (at most [`WHOLE_EMBEDDING_ROWS`] of a sharded model, which keeps those
    /// whole): what a checkpoint's fingerprint of the base reads, on every rank alike without a gather.
    pub fn embedding_rows(&self, n: usize) -> Result<Tensor> {
        let table = match &self.ends {
            Some(ends) => &ends.first_rows,
            None => &self.embed_tokens,
        };
        table.narrow(0, 0, n.min(table.dim(0)?))
    }

    /// Token embeddings of `ids` (`[batch, seq]`, u32) in the compute dtype, as the first layer takes them (the
    /// input of [`LlamaModel::forward_embeds`]): rows of [`LlamaModel::embedding_table`], times Gemma's `√hidden`
    /// (rounded to the compute dtype), which transformers' Gemma applies inside its embedding module too.
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let rows = ops::embedding(ids, &self.embedding_table()?)?.to_dtype(self.compute_dtype)?;
        // A gathered table is frozen and needs no gradient: the rows must not keep it alive through the step.
        let rows = match self.ends.is_some()
            && self.active_saved().is_none_or(|s| s.embed_tokens.is_none())
        {
            true => rows.detach(),
            false => rows,
        };
        match self.config.embedding_multiplier() {
            Some(m) => {
                // transformers rounds it to float32 first, unless the model computes in float64.
                let m = match rows.dtype() {
                    DType::F64 => Tensor::new(m, rows.device())?,
                    dtype => Tensor::new(m as f32, rows.device())?.to_dtype(dtype)?,
                };
                rows.broadcast_mul(&m)
            }
            None => Ok(rows),
        }
    }

    /// The output head `[vocab, hidden]`: the active adapter's trained copy, or the frozen base head.
    pub fn head_weight(&self) -> Result<Tensor> {
        match (
            self.active_saved().and_then(|s| s.lm_head.as_ref()),
            &self.ends,
        ) {
            (Some(v), _) => Ok(v.as_tensor().clone()),
            (None, Some(ends)) => ends.head(DType::F32),
            (None, None) => match &self.lm_head.weight {
                ops::FrozenWeight::Dense(t) => Ok(t.clone()),
                w => w.to_dense(DType::F32),
            },
        }
    }

    /// (Soft-capped, in Gemma 2) logits of final hidden states `[..., hidden]`, in float32 (float64 for a float64
    /// model). A decoding step multiplies by a bf16 head as stored (see [`FrozenLinear`]'s inference mode) instead
    /// of converting it per token.
    fn head_logits(&self, h: &Tensor) -> Result<Tensor> {
        let w = self.head_weight()?;
        let dtype = master_dtype(self.compute_dtype);
        let h = h.to_dtype(dtype)?;
        let logits = if InferenceMode::is_active() {
            let head = Arc::new(FrozenLinear::new(FrozenWeight::Dense(w), None));
            ops::frozen_linear(&h, &head)?
        } else {
            h.broadcast_matmul(&w.to_dtype(dtype)?.t()?)?
        };
        match self.config.final_logit_softcapping {
            Some(cap) => ops::softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    /// cos/sin of `seq` positions for every table the layers use.
    fn position_tables(&self, positions: &Positions, seq: usize) -> Result<PositionTables> {
        let of = |tables: &RopeTables| match positions {
            Positions::Range(offset) => tables.range(*offset, seq),
            Positions::Explicit(p) | Positions::Packed(p) => tables.gather(p),
        };
        let (cos, sin) = of(&self.rope)?;
        let sliding = self.sliding_rope.as_ref().map(of).transpose()?;
        Ok(PositionTables { cos, sin, sliding })
    }

    /// Final-normed hidden states `[batch, seq, hidden]` from input embeddings (see [`LlamaModel::embed`]).
    pub fn forward_embeds(
        &self,
        embeds: &Tensor,
        positions: &Positions,
        checkpointing: &Checkpointing,
    ) -> Result<Tensor> {
        self.forward_embeds_routed(embeds, positions, checkpointing, None)
    }

    /// [`LlamaModel::forward_embeds`], with the sparse layers' router logits recorded in `router` (for the
    /// auxiliary load-balancing loss: [`RouterLogits::aux_loss`]). Use a fresh record per forward.
    pub fn forward_embeds_routed(
        &self,
        embeds: &Tensor,
        positions: &Positions,
        checkpointing: &Checkpointing,
        router: Option<&RouterLogits>,
    ) -> Result<Tensor> {
        let (_, seq, _) = embeds.dims3()?;
        let tables = self.position_tables(positions, seq)?;
        let segments = match positions {
            Positions::Packed(p) => Some(Segments::from_positions(p)?),
            _ => None,
        };
        let mut x = embeds.clone();
        let tiling = checkpointing.tiled_mlp.then(|| MlpTiling {
            sink: checkpointing.sink.clone(),
            params: checkpointing.params.clone(),
            slice_rows: checkpointing.mlp_slice_rows,
        });
        let recomputed = match checkpointing.enabled {
            true => self.layers.len().saturating_sub(checkpointing.kept_layers),
            false => 0,
        };
        let ffn = |i: usize| FeedForwardRun {
            router: router.map(|record| RouterSink {
                record: record.clone(),
                layer: i,
                checkpointed: i < recomputed,
            }),
            tiling: tiling.clone(),
        };
        // The recomputed layers run as one checkpointed chain (their inputs offloaded when asked), the kept ones
        // after it with their graphs.
        // A block's name in step traces, made only while a step is traced.
        let label = |name: &dyn Fn() -> String| match trace::enabled() {
            true => name(),
            false => String::new(),
        };
        let mut chain: Vec<ops::LabeledBlock> = (0..recomputed)
            .map(|i| {
                let (layer, tables, segments) =
                    (self.layers[i].clone(), tables.clone(), segments.clone());
                // The layers that run after this one: the next in the forward, the one before in the backward.
                let (next, before) = (
                    self.layers.get(i + 1).cloned(),
                    i.checked_sub(1).map(|j| self.layers[j].clone()),
                );
                let ffn = ffn(i);
                let block: ops::Block = Arc::new(move |x: &Tensor, pass| {
                    let _layer = snapshot_context::layer(i);
                    let _span = (pass == Pass::Forward)
                        .then(|| trace::span_with(|| format!("model.layers.{i}"), "forward"));
                    let ahead = match pass {
                        Pass::Forward => next.as_deref(),
                        Pass::Recompute => before.as_deref(),
                    };
                    layer.run(x, &tables, None, segments.as_ref(), pass, &ffn, ahead)
                });
                let label = label(&|| format!("model.layers.{i}"));
                ops::LabeledBlock { block, label }
            })
            .collect();
        // With every layer recomputed the final norm ends the chain: the last layer's output is then a saved
        // input (offloaded with the others) rather than one the norm's graph holds through the whole backward.
        let norm_in_chain = !chain.is_empty() && recomputed == self.layers.len();
        if norm_in_chain {
            let (norm, eps) = (self.norm.clone(), self.config.rms_norm_eps);
            chain.push(ops::LabeledBlock {
                block: Arc::new(move |x: &Tensor, _| Ok((rms_norm(x, &norm, eps)?, None))),
                label: label(&|| "model.norm".into()),
            });
        }
        if !chain.is_empty() {
            x = ops::checkpoint_chain(
                &x,
                chain,
                &checkpointing.params,
                &checkpointing.sink,
                checkpointing.offload.clone(),
            )?;
        }
        for (i, layer) in self.layers.iter().enumerate().skip(recomputed) {
            let _layer = snapshot_context::layer(i);
            let _span = trace::span_with(|| format!("model.layers.{i}"), "forward");
            let next = self.layers.get(i + 1).map(|l| l.as_ref());
            let run = layer.run(
                &x,
                &tables,
                None,
                segments.as_ref(),
                Pass::Forward,
                &ffn(i),
                next,
            );
            x = run?.0;
        }
        match norm_in_chain {
            true => Ok(x),
            false => rms_norm(&x, &self.norm, self.config.rms_norm_eps),
        }
    }

    /// Logits `[batch, seq, vocab]` of every position (for evaluation and parity checks), float32 (float64 for a
    /// float64 model).
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        let h = self.forward_embeds(
            &self.embed(ids)?,
            &Positions::Range(0),
            &Checkpointing::default(),
        )?;
        self.head_logits(&h)
    }

    /// Causal-LM loss of `ids` with `labels` aligned to `ids` (transformers' convention: the loss shifts them,
    /// position `t` predicts label `t+1`; −100 ignores a token). Returns the *sum* over counted tokens and their
    /// number, so a caller can normalize over a whole accumulation window.
    pub fn loss_sum(
        &self,
        ids: &Tensor,
        labels: &Tensor,
        positions: &Positions,
        checkpointing: &Checkpointing,
    ) -> Result<(Tensor, usize)> {
        let h = self.forward_embeds(&self.embed(ids)?, positions, checkpointing)?;
        self.loss_from_hidden(&h, labels)
    }

    /// The loss of final hidden states against `labels` (see [`LlamaModel::loss_sum`]).
    pub fn loss_from_hidden(&self, hidden: &Tensor, labels: &Tensor) -> Result<(Tensor, usize)> {
        let (b, t, hdim) = hidden.dims3()?;
        if t < 2 {
            let dtype = master_dtype(self.compute_dtype);
            return Ok((Tensor::zeros((), dtype, hidden.device())?, 0));
        }
        let h = hidden.reshape((b * t, hdim))?;
        let l = shifted_labels(labels)?.flatten_all()?;
        let cap = self.config.final_logit_softcapping;
        let sharded_head = self
            .ends
            .clone()
            .filter(|_| self.active_saved().is_none_or(|s| s.lm_head.is_none()));
        match sharded_head {
            Some(ends) if h.track_op() => {
                // A sharded head is gathered for the loss and gathered again for its backward, so the whole head is
                // not held through the layers' backward in between.
                let counted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
                let count = counted.clone();
                let block: ops::Block = Arc::new(move |h: &Tensor, _| {
                    let (sum, n) =
                        ops::linear_cross_entropy_capped(h, &ends.head(DType::F32)?, &l, cap)?;
                    count.store(n, std::sync::atomic::Ordering::Relaxed);
                    Ok((sum, None))
                });
                let sum = ops::checkpoint(&h, block, &[], &GradSink::default())?;
                Ok((sum, counted.load(std::sync::atomic::Ordering::Relaxed)))
            }
            _ => ops::linear_cross_entropy_capped(&h, &self.head_weight()?, &l, cap),
        }
    }

    /// The log-probability of each row's labelled tokens, summed per row: `[batch]` float32 (float64 for a float64
    /// model), differentiable
    /// (`log p(label_{t+1} | ..t)` for every label that is not −100, as [`LlamaModel::loss_from_hidden`] shifts them).
    /// DPO's sequence log-probabilities. Each row goes through the fused head + cross-entropy op on its own, so no
    /// `[tokens, vocab]` logits exist.
    pub fn sequence_logps(&self, hidden: &Tensor, labels: &Tensor) -> Result<Tensor> {
        let (b, t, _) = hidden.dims3()?;
        let dtype = master_dtype(self.compute_dtype);
        if t < 2 {
            return Tensor::zeros(b, dtype, hidden.device());
        }
        let head = self.head_weight()?;
        let shifted = shifted_labels(labels)?;
        let rows = (0..b)
            .map(|row| {
                let (nll, _) = ops::linear_cross_entropy_capped(
                    &hidden.get(row)?,
                    &head,
                    &shifted.get(row)?,
                    self.config.final_logit_softcapping,
                )?;
                nll.neg()?.to_dtype(dtype)
            })
            .collect::<Result<Vec<_>>>()?;
        Tensor::stack(&rows, 0)
    }

    /// The log-probability of each completion token under the model's distribution at `temperature` (its logits
    /// divided by it, after any soft-capping), and the entropy of that distribution there, as TRL's GRPO computes
    /// them: `rows[b] = (prompt_len, completion)` for row `b` of `hidden: [batch, seq, hidden]` (the final hidden
    /// states of prompt ++ completion, right-padded). Returns the log-probabilities of every row's completion tokens,
    /// row after row, `[Σ completion lengths]` float32 (float64 for a float64 model), differentiable; and their
    /// entropies. No `[tokens, vocab]` logits exist (the head runs token block by block).
    pub fn completion_logps(
        &self,
        hidden: &Tensor,
        rows: &[(usize, &[u32])],
        temperature: f64,
    ) -> Result<(Tensor, Vec<f64>)> {
        let (b, t, hdim) = hidden.dims3()?;
        if rows.len() != b {
            candle_core::bail!("{} completion rows for a batch of {b}", rows.len());
        }
        // Position p predicts token p + 1: a completion starting at `prompt_len` is predicted from `prompt_len − 1`.
        let mut positions = Vec::new();
        let mut labels = Vec::new();
        for (row, (prompt_len, completion)) in rows.iter().enumerate() {
            if *prompt_len == 0 || prompt_len + completion.len() > t {
                candle_core::bail!(
                    "row {row}: a prompt of {prompt_len} tokens and a completion of {} do not fit {t} positions",
                    completion.len()
                );
            }
            positions.extend((0..completion.len()).map(|i| (row * t + prompt_len - 1 + i) as u32));
            labels.extend_from_slice(completion);
        }
        let index = Tensor::new(positions.as_slice(), hidden.device())?;
        let picked = hidden.reshape((b * t, hdim))?.index_select(&index, 0)?;
        ops::token_logps(
            &picked,
            &self.head_weight()?,
            &labels,
            temperature,
            self.config.final_logit_softcapping,
        )
    }

    /// Logits `[batch, vocab]` of the last position for new tokens `ids`, extending `cache` (generation).
    ///
    /// Runs in [`InferenceMode`]: with 4-bit weights on the CPU, a step of a few tokens multiplies by the 4-bit
    /// codes in place instead of dequantizing every weight (same logits up to float summation order). The step runs
    /// on a rayon worker thread (the caller waits), so that its many small parallel ops — one token's RoPE,
    /// attention, output head — share out their work inside the pool instead of each waking it from outside, which
    /// cost a third of a decoding step on 2 cores.
    pub fn forward_cached(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        rayon::scope(|_| self.forward_cached_on_worker(ids, cache))
    }

    /// [`LlamaModel::forward_cached`] on the current thread.
    fn forward_cached_on_worker(&self, ids: &Tensor, cache: &mut KvCache) -> Result<Tensor> {
        let _inference = InferenceMode::enter();
        if cache.layers.len() != self.layers.len() {
            *cache = KvCache::new(self.layers.len());
        }
        let (_, seq) = ids.dims2()?;
        let tables = self.position_tables(&Positions::Range(cache.len()), seq)?;
        let mut x = self.embed(ids)?;
        for (i, (layer, slot)) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            x = layer
                .run(
                    &x,
                    &tables,
                    Some(slot),
                    None,
                    Pass::Forward,
                    &FeedForwardRun::default(),
                    self.layers.get(i + 1).map(|l| l.as_ref()),
                )?
                .0;
        }
        cache.seen += seq;
        let last = x.narrow(1, seq - 1, 1)?;
        let h = rms_norm(&last, &self.norm, self.config.rms_norm_eps)?.squeeze(1)?;
        self.head_logits(&h)
    }

    /// Every projection with its full module name (`model.layers.{i}.self_attn.q_proj`, ...), mutable (layers are
    /// copied on write if shared).
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (rel, lin) in Arc::make_mut(layer).linears_mut() {
                out.push((format!("model.layers.{i}.{rel}"), lin));
            }
        }
        out
    }

    /// Every projection with its full module name.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (rel, lin) in layer.linears() {
                out.push((format!("model.layers.{i}.{rel}"), lin));
            }
        }
        out
    }

    /// Bytes of the RoPE tables the model holds beside its weights (the memory estimate counts them with the
    /// weights).
    pub fn rope_table_bytes(&self) -> usize {
        self.rope.bytes() + self.sliding_rope.as_ref().map_or(0, RopeTables::bytes)
    }

    /// Bytes of the frozen weights on the model's device (4-bit ones at their packed size; a sharded layer's share,
    /// unless it is offloaded to host memory).
    pub fn weight_bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let mut total = t(&self.embed_tokens) + t(&self.norm);
        let offloaded = self.sharding.as_ref().is_some_and(|s| s.offload());
        if let Some(ends) = &self.ends {
            total += t(&ends.first_rows) + if offloaded { 0 } else { ends.shard_bytes() };
        }
        if !self.config.tie_word_embeddings {
            total += self.lm_head.weight.size_in_bytes();
        }
        for l in &self.layers {
            total += l.norms().into_iter().map(|(_, w)| t(w)).sum::<usize>();
            // Offloaded shards wait in host memory.
            if !offloaded {
                total += l.shard().map_or(0, FlatShards::shard_bytes);
            }
            for (_, lin) in l.linears() {
                total +=
                    lin.base.weight.size_in_bytes() + lin.base.bias.as_ref().map(t).unwrap_or(0);
            }
        }
        total
    }
}
