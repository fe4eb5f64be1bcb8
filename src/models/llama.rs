//! One Llama-family decoder (Llama 2/3/3.1/3.2, Mistral, Qwen2, SmolLM2, TinyLlama) built from the differentiable
//! ops in [`crate::ops`]: frozen (dense or 4-bit) linears, RMSNorm, RoPE, grouped-query causal attention, SwiGLU,
//! optional per-layer gradient checkpointing, and a KV cache for generation.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};

use super::config::ModelConfig;
use crate::ops::frozen_linear::InferenceMode;
use crate::ops::{
    self, causal_attention, packed_causal_attention, rms_norm, swiglu, FrozenLinear, FrozenWeight,
    GradSink, Pass, RopeTables, Segments,
};

/// A linear projection of the model: a frozen base with optional LoRA adapters.
pub type Linear = crate::lora::LoraLinear;

/// Self-attention of one layer.
#[derive(Clone, Debug)]
pub struct Attention {
    /// Query projection.
    pub q_proj: Linear,
    /// Key projection.
    pub k_proj: Linear,
    /// Value projection.
    pub v_proj: Linear,
    /// Output projection.
    pub o_proj: Linear,
    n_head: usize,
    n_kv_head: usize,
    head_dim: usize,
}

/// The SwiGLU MLP of one layer.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Gate projection.
    pub gate_proj: Linear,
    /// Up projection.
    pub up_proj: Linear,
    /// Down projection.
    pub down_proj: Linear,
}

/// One decoder layer: pre-norm attention and MLP with residual connections.
#[derive(Clone, Debug)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub input_layernorm: Tensor,
    /// Attention.
    pub self_attn: Attention,
    /// Norm before the MLP.
    pub post_attention_layernorm: Tensor,
    /// MLP.
    pub mlp: Mlp,
    eps: f64,
}

/// Keys and values of the positions seen so far, per layer (`[batch, kv_heads, seq, head_dim]`).
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl KvCache {
    /// An empty cache for `layers` layers.
    pub fn new(layers: usize) -> Self {
        KvCache {
            layers: vec![None; layers],
        }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map(|(k, _)| k.dims()[2])
            .unwrap_or(0)
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Attention {
    /// `residual + attention(x)`.
    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        segments: Option<&Segments>,
        residual: &Tensor,
    ) -> Result<Tensor> {
        let q = self
            .q_proj
            .forward_to_heads(x, self.n_head, Some((cos, sin)))?;
        let k = self
            .k_proj
            .forward_to_heads(x, self.n_kv_head, Some((cos, sin)))?;
        let v = self.v_proj.forward_to_heads(x, self.n_kv_head, None)?;
        let (k, v) = match cache {
            Some(slot) => {
                let (k, v) = match slot.take() {
                    Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
                    None => (k, v),
                };
                *slot = Some((k.clone(), v.clone()));
                (k, v)
            }
            None => (k, v),
        };
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let y = match segments {
            Some(segments) => packed_causal_attention(&q, &k, &v, scale, segments)?,
            None => causal_attention(&q, &k, &v, scale)?,
        };
        self.o_proj.forward_from_heads_plus(&y, residual)
    }
}

impl Mlp {
    /// `residual + mlp(x)`; in a [`Pass::Recompute`] the last projection's value is not computed (only its graph is
    /// differentiated).
    fn forward(&self, x: &Tensor, residual: &Tensor, pass: Pass) -> Result<Tensor> {
        let hidden = swiglu(&self.gate_proj.forward(x)?, &self.up_proj.forward(x)?)?;
        self.down_proj.forward_plus(&hidden, residual, pass)
    }
}

impl DecoderLayer {
    /// The layer for `pass` (see [`Pass`]: in a recomputation the output's value is not computed in full).
    fn run(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        segments: Option<&Segments>,
        pass: Pass,
    ) -> Result<Tensor> {
        // Each residual sum is accumulated by the block's last projection (see `LoraLinear::forward_plus`).
        let h = self.self_attn.forward(
            &rms_norm(x, &self.input_layernorm, self.eps)?,
            cos,
            sin,
            cache,
            segments,
            x,
        )?;
        self.mlp.forward(
            &rms_norm(&h, &self.post_attention_layernorm, self.eps)?,
            &h,
            pass,
        )
    }

    /// The projections of this layer with their names relative to the layer (`self_attn.q_proj`, ...).
    pub fn linears(&self) -> [(&'static str, &Linear); 7] {
        [
            ("self_attn.q_proj", &self.self_attn.q_proj),
            ("self_attn.k_proj", &self.self_attn.k_proj),
            ("self_attn.v_proj", &self.self_attn.v_proj),
            ("self_attn.o_proj", &self.self_attn.o_proj),
            ("mlp.gate_proj", &self.mlp.gate_proj),
            ("mlp.up_proj", &self.mlp.up_proj),
            ("mlp.down_proj", &self.mlp.down_proj),
        ]
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

/// The model's RoPE tables on `device`.
fn rope_tables(config: &ModelConfig, device: &Device) -> Result<RopeTables> {
    RopeTables::new(
        config.head_dim,
        config.max_position_embeddings,
        config.rope_theta,
        config.rope_scaling.as_ref(),
        device,
    )
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
    compute_dtype: DType,
    /// Dropout switch and step seed shared by all LoRA adapters.
    pub lora_runtime: Arc<crate::lora::LoraRuntime>,
    /// Configurations of the loaded adapters, by name.
    pub adapter_configs: std::collections::BTreeMap<String, crate::lora::LoraConfig>,
    /// The active adapter.
    pub active_adapter: Option<String>,
    /// Modules an adapter trains in full (`modules_to_save`), by adapter name.
    pub saved_modules: std::collections::BTreeMap<String, SavedModules>,
}

/// Tensors an adapter trains in full (PEFT's `modules_to_save`), replacing the base's while it is active.
#[derive(Clone, Debug, Default)]
pub struct SavedModules {
    /// A trainable copy of `lm_head.weight`.
    pub lm_head: Option<Var>,
    /// A trainable copy of `model.embed_tokens.weight`.
    pub embed_tokens: Option<Var>,
}

/// The pieces of one layer, for [`LlamaModel::new`].
pub struct LayerWeights {
    /// `input_layernorm.weight`.
    pub input_layernorm: Tensor,
    /// `post_attention_layernorm.weight`.
    pub post_attention_layernorm: Tensor,
    /// q, k, v, o, gate, up, down (in that order).
    pub linears: [Linear; 7],
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
        let rope = rope_tables(&config, embed_tokens.device())?;
        let layers = layers
            .into_iter()
            .map(|w| {
                let [q, k, v, o, gate, up, down] = w.linears;
                Arc::new(DecoderLayer {
                    input_layernorm: w.input_layernorm,
                    self_attn: Attention {
                        q_proj: q,
                        k_proj: k,
                        v_proj: v,
                        o_proj: o,
                        n_head: config.num_attention_heads,
                        n_kv_head: config.num_key_value_heads,
                        head_dim: config.head_dim,
                    },
                    post_attention_layernorm: w.post_attention_layernorm,
                    mlp: Mlp {
                        gate_proj: gate,
                        up_proj: up,
                        down_proj: down,
                    },
                    eps: config.rms_norm_eps,
                })
            })
            .collect();
        Ok(LlamaModel {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            compute_dtype,
            lora_runtime: Arc::default(),
            adapter_configs: Default::default(),
            active_adapter: None,
            saved_modules: Default::default(),
        })
    }

    /// The model on `device` (`cuda:0`, say): embeddings, norms and frozen weights are copied there, 4-bit
    /// weights as their 4-bit codes (dequantized on the device in each forward). Move a model before adding or
    /// loading adapters: they are created on the model's device.
    pub fn to_device(self, device: &Device) -> crate::Result<Self> {
        if !self.adapter_configs.is_empty() {
            return Err(crate::Error::InvalidInput(
                "move the model to its device before adding or loading adapters".into(),
            ));
        }
        if self.embed_tokens.device().same_device(device) {
            return Ok(self);
        }
        let embed_tokens = self.embed_tokens.to_device(device)?;
        // A head tied to the embeddings stays one tensor on the device.
        let lm_head = match &self.lm_head.weight {
            FrozenWeight::Dense(w) if w.id() == self.embed_tokens.id() => {
                FrozenLinear::new(FrozenWeight::Dense(embed_tokens.clone()), None)
            }
            _ => self.lm_head.to_device(device)?,
        };
        let linear =
            |l: &Linear| -> Result<Linear> { Ok(Linear::new(Arc::new(l.base.to_device(device)?))) };
        let layers = self
            .layers
            .iter()
            .map(|l| -> Result<Arc<DecoderLayer>> {
                let a = &l.self_attn;
                Ok(Arc::new(DecoderLayer {
                    input_layernorm: l.input_layernorm.to_device(device)?,
                    self_attn: Attention {
                        q_proj: linear(&a.q_proj)?,
                        k_proj: linear(&a.k_proj)?,
                        v_proj: linear(&a.v_proj)?,
                        o_proj: linear(&a.o_proj)?,
                        ..*a
                    },
                    post_attention_layernorm: l.post_attention_layernorm.to_device(device)?,
                    mlp: Mlp {
                        gate_proj: linear(&l.mlp.gate_proj)?,
                        up_proj: linear(&l.mlp.up_proj)?,
                        down_proj: linear(&l.mlp.down_proj)?,
                    },
                    eps: l.eps,
                }))
            })
            .collect::<Result<Vec<_>>>()?;
        let rope = rope_tables(&self.config, device)?;
        Ok(LlamaModel {
            embed_tokens,
            layers,
            norm: self.norm.to_device(device)?,
            lm_head: Arc::new(lm_head),
            rope,
            ..self
        })
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

    /// Sets the activation / matmul dtype (weights stay as stored; each op converts them).
    pub fn set_compute_dtype(&mut self, dtype: DType) {
        self.compute_dtype = dtype;
    }

    fn active_saved(&self) -> Option<&SavedModules> {
        self.active_adapter
            .as_ref()
            .and_then(|a| self.saved_modules.get(a))
    }

    /// Token embeddings of `ids` (`[batch, seq]`, u32) in the compute dtype (the active adapter's trained table
    /// when it saves `embed_tokens`).
    pub fn embed(&self, ids: &Tensor) -> Result<Tensor> {
        let table = match self.active_saved().and_then(|s| s.embed_tokens.as_ref()) {
            Some(v) => v.as_tensor(),
            None => &self.embed_tokens,
        };
        ops::embedding(ids, table)?.to_dtype(self.compute_dtype)
    }

    /// The output head `[vocab, hidden]`: the active adapter's trained copy, or the frozen base head.
    pub fn head_weight(&self) -> Result<Tensor> {
        match self.active_saved().and_then(|s| s.lm_head.as_ref()) {
            Some(v) => Ok(v.as_tensor().clone()),
            None => match &self.lm_head.weight {
                ops::FrozenWeight::Dense(t) => Ok(t.clone()),
                w => w.to_dense(DType::F32),
            },
        }
    }

    /// Float32 logits of final hidden states `[..., hidden]`.
    fn head_logits(&self, h: &Tensor) -> Result<Tensor> {
        let w = self.head_weight()?.to_dtype(DType::F32)?;
        h.to_dtype(DType::F32)?.broadcast_matmul(&w.t()?)
    }

    fn cos_sin(&self, positions: &Positions, seq: usize) -> Result<(Tensor, Tensor)> {
        match positions {
            Positions::Range(offset) => self.rope.range(*offset, seq),
            Positions::Explicit(p) | Positions::Packed(p) => self.rope.gather(p),
        }
    }

    /// Final-normed hidden states `[batch, seq, hidden]` from input embeddings.
    pub fn forward_embeds(
        &self,
        embeds: &Tensor,
        positions: &Positions,
        checkpointing: &Checkpointing,
    ) -> Result<Tensor> {
        let (_, seq, _) = embeds.dims3()?;
        let (cos, sin) = self.cos_sin(positions, seq)?;
        let segments = match positions {
            Positions::Packed(p) => Some(Segments::from_positions(p)?),
            _ => None,
        };
        let mut x = embeds.clone();
        let recomputed = self.layers.len().saturating_sub(checkpointing.kept_layers);
        for (i, layer) in self.layers.iter().enumerate() {
            x = if checkpointing.enabled && i < recomputed {
                let (layer, cos, sin, segments) =
                    (layer.clone(), cos.clone(), sin.clone(), segments.clone());
                let block: ops::Block = Arc::new(move |x: &Tensor, pass| {
                    layer.run(x, &cos, &sin, None, segments.as_ref(), pass)
                });
                ops::checkpoint(&x, block, &checkpointing.params, &checkpointing.sink)?
            } else {
                layer.run(&x, &cos, &sin, None, segments.as_ref(), Pass::Forward)?
            };
        }
        rms_norm(&x, &self.norm, self.config.rms_norm_eps)
    }

    /// Float32 logits `[batch, seq, vocab]` of every position (for evaluation and parity checks).
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
            return Ok((Tensor::zeros((), DType::F32, hidden.device())?, 0));
        }
        let h = hidden.narrow(1, 0, t - 1)?.reshape((b * (t - 1), hdim))?;
        let l = labels.narrow(1, 1, t - 1)?.flatten_all()?;
        ops::linear_cross_entropy(&h, &self.head_weight()?, &l)
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
        let (cos, sin) = self.rope.range(cache.len(), seq)?;
        let mut x = self.embed(ids)?;
        for (layer, slot) in self.layers.iter().zip(cache.layers.iter_mut()) {
            x = layer.run(&x, &cos, &sin, Some(slot), None, Pass::Forward)?;
        }
        let last = x.narrow(1, seq - 1, 1)?;
        let h = rms_norm(&last, &self.norm, self.config.rms_norm_eps)?.squeeze(1)?;
        self.head_logits(&h)
    }

    /// Every projection with its full module name (`model.layers.{i}.self_attn.q_proj`, ...), mutable (layers are
    /// copied on write if shared).
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let mut out = Vec::new();
        for (i, layer) in self.layers.iter_mut().enumerate() {
            let l = Arc::make_mut(layer);
            let p = format!("model.layers.{i}");
            let DecoderLayer {
                self_attn: a,
                mlp: m,
                ..
            } = l;
            out.push((format!("{p}.self_attn.q_proj"), &mut a.q_proj));
            out.push((format!("{p}.self_attn.k_proj"), &mut a.k_proj));
            out.push((format!("{p}.self_attn.v_proj"), &mut a.v_proj));
            out.push((format!("{p}.self_attn.o_proj"), &mut a.o_proj));
            out.push((format!("{p}.mlp.gate_proj"), &mut m.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), &mut m.up_proj));
            out.push((format!("{p}.mlp.down_proj"), &mut m.down_proj));
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

    /// Bytes of the frozen weights (4-bit ones at their packed size).
    pub fn weight_bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        let mut total = t(&self.embed_tokens) + t(&self.norm);
        if !self.config.tie_word_embeddings {
            total += self.lm_head.weight.size_in_bytes();
        }
        for l in &self.layers {
            total += t(&l.input_layernorm) + t(&l.post_attention_layernorm);
            for (_, lin) in l.linears() {
                total +=
                    lin.base.weight.size_in_bytes() + lin.base.bias.as_ref().map(t).unwrap_or(0);
            }
        }
        total
    }
}
