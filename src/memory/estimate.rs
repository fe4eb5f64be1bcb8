//! Predicting a run's memory before it starts: parameters, optimizer state, gradients, activations — for full
//! fine-tuning in float32, mixed precision, LoRA on a bf16 base and QLoRA, and for the configuration asked, which
//! is modelled on what this library keeps alive (see [`activation_bytes`]).

use serde::Serialize;

use super::stats::human_bytes;
use crate::lora::config::{rank_too_large, MAX_RANK};
use crate::lora::targets::{is_target, rank_and_alpha};
use crate::lora::{LoraConfig, TargetModules};
use crate::models::llama::WHOLE_EMBEDDING_ROWS;
use crate::models::{mlp_slice_rows, LayerAttention, ModelConfig};
use crate::ops::attention::{dq_kv_heads_per_launch, CUDA_HEAD_DIMS, QUERY_BLOCK};
use crate::ops::cross_entropy::{CUDA_LOGITS_BYTES, TOKEN_BLOCK};
use crate::ops::rope::RopeScaling;
use crate::optim::OptimizerName;
use crate::precision::TorchDtype;

/// Where the run happens: decides the default compute dtype (CPU float32, CUDA bfloat16) and the runtime's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// CPU: float32 compute.
    Cpu,
    /// CUDA: bfloat16 compute.
    Cuda,
}

/// What is being estimated (the `qlora estimate` flags).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EstimateArgs {
    /// Micro-batch size.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
    /// LoRA rank of every adapted layer.
    pub lora_r: usize,
    /// The linear layers that get an adapter, as `[lora] target_modules` chooses them (PEFT's rules; `None`:
    /// PEFT's default, `q_proj` and `v_proj`).
    pub target_modules: Option<TargetModules>,
    /// Optimizer.
    pub optim: OptimizerName,
    /// Per-layer gradient checkpointing.
    pub gradient_checkpointing: bool,
    /// Memory-aware checkpointing: the last layers keep their activations while they fit in this many MiB
    /// (`TrainingArguments::activation_memory_budget_mib`).
    pub activation_memory_budget_mib: Option<f64>,
    /// Tiled MLP (`TrainingArguments::tiled_mlp`): each layer's MLP runs over slices of the micro-batch's tokens,
    /// so its intermediates and their gradients exist for one slice at a time and a layer saves only its input.
    pub tiled_mlp: bool,
    /// Activation offload (`TrainingArguments::activation_offloading`; needs `gradient_checkpointing`): on CUDA the
    /// recomputed layers' inputs (and the final norm's, when every layer is recomputed) wait in pinned host memory
    /// ([`Estimate::host_bytes`]); the GPU holds two of them (the one being recomputed, and the next coming back);
    /// on the CPU it changes nothing.
    pub activation_offloading: bool,
    /// NF4 base (QLoRA) instead of a base in the compute dtype (LoRA).
    pub quantize: bool,
    /// Device.
    pub device: DeviceKind,
    /// Compute dtype of activations and a dense base (`None`: the device's default, see [`DeviceKind`]).
    pub dtype: Option<TorchDtype>,
    /// Ranks of a data-parallel run (GPUs, each holding the whole model): 1 alone.
    pub world_size: usize,
    /// DPO: `batch` counts preference pairs, and each forward runs both sequences of every pair (2 × `batch`
    /// rows, `seq` tokens each), after a reference forward without gradients.
    pub preference: bool,
    /// GRPO: `batch` counts completions and `seq` is a prompt and its longest completion; generating a prompt's
    /// completions holds a KV cache of this many rows (`num_generations`), before the training forward.
    pub grpo_generations: Option<usize>,
    /// FSDP (`fsdp = "full_shard"`, needs `gradient_checkpointing`): each of the `world_size` GPUs holds 1/N of the
    /// decoder layers' linear weights and gathers one layer at a time ([`Sharded`]).
    pub fsdp: bool,
    /// With `fsdp`, the shards live in host memory ([`Estimate::host_bytes`]) and each layer's share is copied to
    /// the GPU before its gather (`offload_params`).
    pub fsdp_offload: bool,
}

/// PyTorch DDP's gradient bucket size in MiB, which a data-parallel run uses unless `ddp_bucket_cap_mb` says
/// otherwise.
pub const DDP_BUCKET_CAP_MB: f64 = 25.0;

/// The most tokens a micro-batch may have for an estimate (far beyond any GPU; keeps every byte count in 64 bits).
const MAX_ESTIMATE_TOKENS: usize = 1 << 31;

impl EstimateArgs {
    /// Checks the sizes: at least 1, and a micro-batch small enough to count in 64 bits.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |m: String| Err(crate::Error::InvalidInput(format!("estimate: {m}")));
        for (name, value) in [
            ("batch", self.batch),
            ("seq", self.seq),
            ("lora_r", self.lora_r),
            ("world_size", self.world_size),
        ] {
            if value == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if self.lora_r > MAX_RANK {
            return bad(format!(
                "lora_r = {}: {}",
                self.lora_r,
                rank_too_large(self.lora_r)
            ));
        }
        match self.batch.checked_mul(self.seq) {
            Some(tokens) if tokens <= MAX_ESTIMATE_TOKENS => {}
            _ => {
                return bad(format!(
                "batch × seq = {} × {} tokens is too large (at most 2^31 tokens in a micro-batch)",
                self.batch, self.seq
            ))
            }
        }
        if self
            .activation_memory_budget_mib
            .is_some_and(|b| !b.is_finite() || b < 0.0)
        {
            return bad("activation_memory_budget_mib must be a number of MiB, 0 or more".into());
        }
        if self.activation_offloading && !self.gradient_checkpointing {
            return bad(
                "activation offloading moves the inputs of recomputed layers to the host, and no layer is \
                 recomputed without gradient checkpointing: add --gradient-checkpointing"
                    .into(),
            );
        }
        if self.fsdp_offload && !self.fsdp {
            return bad("--fsdp-offload offloads FSDP's shards: add --fsdp".into());
        }
        if self.fsdp && !self.gradient_checkpointing {
            return bad(
                "FSDP frees a layer's gathered weights after its forward and gathers them again for its \
                 recomputation: add --gradient-checkpointing"
                    .into(),
            );
        }
        if self.world_size > 1 && self.device == DeviceKind::Cpu {
            return bad(format!(
                "world_size {}: data-parallel training runs on GPUs (one per rank); estimate it for device cuda \
                 (`--device cuda`)",
                self.world_size
            ));
        }
        Ok(())
    }

    /// These arguments with the tiled MLP and/or activation offload added where `tiled_mlp` / `offload` say
    /// (offload brings gradient checkpointing, which it needs).
    pub fn adding(&self, tiled_mlp: bool, offload: bool) -> EstimateArgs {
        EstimateArgs {
            tiled_mlp: self.tiled_mlp || tiled_mlp,
            activation_offloading: self.activation_offloading || offload,
            gradient_checkpointing: self.gradient_checkpointing || offload,
            ..self.clone()
        }
    }

    /// The compute dtype: the one asked, else the device's default.
    pub fn compute_dtype(&self) -> TorchDtype {
        self.dtype.unwrap_or(match self.device {
            DeviceKind::Cpu => TorchDtype::Float32,
            DeviceKind::Cuda => TorchDtype::BFloat16,
        })
    }

    /// The adapter these arguments describe, for PEFT's matching rules.
    fn adapter(&self) -> LoraConfig {
        LoraConfig {
            r: self.lora_r,
            target_modules: self.target_modules.clone(),
            ..Default::default()
        }
    }

    /// The `qlora estimate` flags that estimate these arguments (all but `--model`), so a run's estimate can be
    /// repeated; `None` when `target_modules` is a regular expression, which the command has no flag for.
    pub fn flags(&self) -> Option<String> {
        let targets = match &self.target_modules {
            Some(TargetModules::AllLinear) => "all-linear".to_string(),
            Some(TargetModules::List(names)) => names.join(","),
            Some(TargetModules::Regex(_)) => return None,
            None => crate::lora::config::DEFAULT_LLAMA_TARGETS.join(","),
        };
        let mut flags = format!(
            "--batch {} --seq {} --lora-r {} --target-modules {targets} --optim {}",
            self.batch, self.seq, self.lora_r, self.optim
        );
        if self.gradient_checkpointing {
            flags += " --gradient-checkpointing";
        }
        if let Some(budget) = self.activation_memory_budget_mib {
            flags += &format!(" --activation-memory-budget-mib {budget}");
        }
        if self.activation_offloading {
            flags += " --activation-offloading";
        }
        if self.tiled_mlp {
            flags += " --tiled-mlp";
        }
        flags += &format!(
            " --quantize {} --device {} --dtype {}",
            if self.quantize { "nf4" } else { "none" },
            match self.device {
                DeviceKind::Cpu => "cpu",
                DeviceKind::Cuda => "cuda",
            },
            self.compute_dtype()
        );
        if self.world_size > 1 {
            flags += &format!(" --world-size {}", self.world_size);
        }
        if self.preference {
            flags += " --dpo";
        }
        if let Some(g) = self.grpo_generations {
            flags += &format!(" --grpo --num-generations {g}");
        }
        if self.fsdp {
            flags += " --fsdp";
        }
        if self.fsdp_offload {
            flags += " --fsdp-offload";
        }
        Some(flags)
    }
}

impl Default for EstimateArgs {
    fn default() -> Self {
        EstimateArgs {
            batch: 1,
            seq: 2048,
            lora_r: 16,
            target_modules: Some(TargetModules::AllLinear),
            optim: OptimizerName::PagedAdamW8bit,
            gradient_checkpointing: false,
            activation_memory_budget_mib: None,
            tiled_mlp: false,
            activation_offloading: false,
            quantize: true,
            device: DeviceKind::Cpu,
            dtype: None,
            world_size: 1,
            preference: false,
            grpo_generations: None,
            fsdp: false,
            fsdp_offload: false,
        }
    }
}

/// A training regime of the comparison table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Regime {
    /// All weights trained, float32 weights, gradients and AdamW state.
    FullFp32,
    /// All weights trained, bf16 weights and gradients, float32 AdamW moments.
    MixedPrecision,
    /// LoRA on a frozen bf16 base.
    LoraBf16,
    /// LoRA on a frozen NF4 base (double quantization).
    Qlora,
    /// The configuration asked, as this library runs it.
    Configured,
}

impl Regime {
    /// How a person names it (the rows of `qlora estimate`).
    pub fn label(self) -> &'static str {
        match self {
            Regime::FullFp32 => "full fine-tune, fp32",
            Regime::MixedPrecision => "full fine-tune, mixed",
            Regime::LoraBf16 => "LoRA, bf16 base",
            Regime::Qlora => "QLoRA, NF4 base",
            Regime::Configured => "this configuration",
        }
    }
}

/// Predicted bytes by category.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Estimate {
    /// The regime.
    pub regime: Regime,
    /// Base weights (trained or frozen).
    pub weights_bytes: u64,
    /// Adapter parameters (float32).
    pub lora_bytes: u64,
    /// Optimizer state.
    pub optimizer_bytes: u64,
    /// Gradients of the trained parameters.
    pub gradients_bytes: u64,
    /// Activations at the peak (saved tensors, recomputation, gradients in flight, block temporaries).
    pub activations_bytes: u64,
    /// Pinned host memory the offloaded layer inputs wait in (with `activation_offloading` on CUDA; not part of
    /// `total_bytes`, which is the device's peak).
    pub host_bytes: u64,
    /// Runtime overhead counted (the CUDA context on GPU; 0 on CPU).
    pub other_bytes: u64,
    /// The sum.
    pub total_bytes: u64,
    /// What the numbers assume.
    pub assumptions: Vec<String>,
    /// The gradient exchange of a data-parallel run (the configuration asked, with more than one rank).
    pub data_parallel: Option<DataParallel>,
    /// How a mixture of experts' tokens spread over its experts (the configuration asked, a sparse model).
    pub routing: Option<Routing>,
    /// How FSDP shares out the base (the configuration asked, with `fsdp`).
    pub sharded: Option<Sharded>,
}

/// What FSDP's full sharding holds and moves on each GPU: the decoder layers' linear weights split over the ranks,
/// a layer gathered whole while it runs (its forward, then its recomputation and backward) beside the next one's
/// gather, started ahead.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sharded {
    /// Ranks (GPUs).
    pub world_size: usize,
    /// Whether the shards live in host memory (`offload_params`).
    pub offload: bool,
    /// The sharded weights each rank holds — 1/N of the decoder layers' linear weights, the embedding table and the
    /// head — in `weights_bytes`, or offloaded in `host_bytes`.
    pub shard_bytes: u64,
    /// The most gathered whole at once (two neighbouring layers' linear weights — the one running and the one
    /// prefetched —, or the embedding table or head), in `weights_bytes` (none for one rank alone, whose share is
    /// the whole, unless offloaded).
    pub gathered_bytes: u64,
    /// What stays whole on every GPU (counted in `weights_bytes`): norms, biases, routers, the RoPE tables and the
    /// embedding's first rows.
    pub unsharded_bytes: u64,
    /// Bytes each GPU receives per micro-batch: every layer gathered twice (forward, recomputation), the embedding
    /// table once and the head twice (the loss, its backward), `(N − 1) / N` of it from the others.
    pub all_gather_bytes_per_micro_batch: u64,
}

/// The estimate of one run: the arguments its settings give and what they predict — what `qlora estimate` prints
/// with [`EstimateArgs::flags`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RunEstimate {
    /// The run's settings, as the estimate takes them.
    pub args: EstimateArgs,
    /// What they predict.
    pub prediction: Estimate,
}

impl RunEstimate {
    /// The estimate of `args` on model `c`.
    pub fn new(c: &ModelConfig, args: EstimateArgs) -> crate::Result<Self> {
        let prediction = estimate(c, &args)?;
        Ok(RunEstimate { args, prediction })
    }
}

/// The rows each expert of a sparse layer runs over in one micro-batch. Every token goes to `num_experts_per_tok`
/// different experts, so a layer always runs `tokens × top_k` expert rows in all, however the router spreads
/// them: the saved activations count those. One expert gets `tokens × top_k / experts` rows when the router is
/// balanced and at most `tokens` (every token choosing it); the backward of the widest expert at that worst case
/// stays within the layer's gradients in flight that the estimate counts (all `top_k` experts' widths at once).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Routing {
    /// Rows (token, expert) per sparse layer: tokens × `num_experts_per_tok`.
    pub routed_rows: u64,
    /// Rows of one expert when the router is balanced.
    pub expected_rows_per_expert: u64,
    /// Rows of one expert at worst: every token of the micro-batch.
    pub worst_rows_per_expert: u64,
}

impl Routing {
    /// The routing of `tokens` tokens in a model with experts; `None` for a dense one.
    fn of(c: &ModelConfig, tokens: u64) -> Option<Self> {
        let m = c.moe.as_ref()?;
        let routed_rows = tokens * m.num_experts_per_tok as u64;
        Some(Routing {
            routed_rows,
            expected_rows_per_expert: routed_rows.div_ceil(m.num_experts as u64),
            worst_rows_per_expert: tokens,
        })
    }
}

/// What a data-parallel step exchanges: the LoRA gradients (float32), summed over the ranks once per optimizer
/// step (after the accumulation window) in buckets, as PyTorch's DDP does.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DataParallel {
    /// Ranks (GPUs).
    pub world_size: usize,
    /// Bytes all-reduced per optimizer step (the adapter's float32 gradients).
    pub all_reduce_bytes: u64,
    /// All-reduce calls per optimizer step (buckets of [`DDP_BUCKET_CAP_MB`]).
    pub buckets: u64,
    /// Bytes each GPU sends (and receives) per optimizer step in a ring all-reduce: `2 (N − 1) / N` times the
    /// gradients. Divided by NCCL's bus bandwidth (`busbw` of nccl-tests) it gives the exchange's time.
    pub bytes_sent_per_gpu: u64,
    /// Memory of the exchange on each GPU, counted in `other_bytes`: a bucket's flattened gradients and its sum.
    pub bucket_bytes: u64,
}

impl DataParallel {
    /// The exchange of `gradient_bytes` of float32 gradients over `world_size` ranks.
    fn new(world_size: usize, gradient_bytes: u64) -> Self {
        let bucket = (DDP_BUCKET_CAP_MB * (1u64 << 20) as f64) as u64;
        let n = world_size as u64;
        DataParallel {
            world_size,
            all_reduce_bytes: gradient_bytes,
            buckets: gradient_bytes.div_ceil(bucket),
            bytes_sent_per_gpu: 2 * (n - 1) * gradient_bytes / n,
            bucket_bytes: 2 * bucket.min(gradient_bytes),
        }
    }
}

/// Parameter counts of a model.
#[derive(Clone, Debug, PartialEq)]
struct Counts {
    /// Linear weights of the blocks (the ones NF4 quantizes and LoRA targets).
    block_linear: u64,
    /// Everything else: embeddings, output head (when untied), norms, biases.
    rest: u64,
    /// LoRA parameters at the asked rank.
    lora: u64,
    /// Element counts of the LoRA matrices (the 8-bit optimizer keeps small ones in float32).
    lora_tensors: Vec<u64>,
}

/// Hidden, query, key/value and MLP widths; a mixture of experts' MLP width is what a token runs through: its
/// `num_experts_per_tok` experts' widths, plus the shared expert's.
fn widths(c: &ModelConfig) -> (u64, u64, u64, u64) {
    let mlp = match &c.moe {
        Some(m) => {
            (m.num_experts_per_tok * m.moe_intermediate_size
                + m.shared_expert_intermediate_size.unwrap_or(0)) as u64
        }
        None => c.intermediate_size as u64,
    };
    (
        c.hidden_size as u64,
        c.q_width() as u64,
        c.kv_width() as u64,
        mlp,
    )
}

/// `(module, in, out)` of every layer's quantized projections (q, k, v, o, gate, up, down; Phi-3's fused qkv, o,
/// gate_up, down; each expert's gate_up and down) under the model's module names (`model.layers.0.self_attn.
/// q_proj`). Routers stay dense (see [`router_params`]).
fn block_linear_shapes(c: &ModelConfig) -> Vec<(String, u64, u64)> {
    (0..c.num_hidden_layers)
        .flat_map(|l| {
            layer_linear_shapes(c, l)
                .into_iter()
                .map(move |(name, inp, out)| (format!("model.layers.{l}.{name}"), inp, out))
        })
        .collect()
}

/// Layer `l`'s linear weights as `(name in the layer, in_features, out_features)`, its router left out (kept dense).
fn layer_linear_shapes(c: &ModelConfig, l: usize) -> Vec<(String, u64, u64)> {
    c.layer_linears(l)
        .into_iter()
        .filter(|(name, _)| name != c.architecture.router_name())
        .map(|(name, [out, inp])| (name, inp as u64, out as u64))
        .collect()
}

/// Parameters of the routers of the sparse layers (kept dense).
fn router_params(c: &ModelConfig) -> u64 {
    c.moe.as_ref().map_or(0, |m| {
        let sparse = m.sparse_layers.iter().filter(|s| **s).count();
        (sparse * m.num_experts * c.hidden_size) as u64
    })
}

/// The parameter counts of model `c` with `adapter`, whose pairs go where PEFT's rules put them: `"all-linear"`
/// gives none to experts, which transformers holds as 3-D parameters, not `nn.Linear`s. An error when the adapter
/// matches no layer (as the trainer refuses it).
fn counts(c: &ModelConfig, adapter: &LoraConfig) -> crate::Result<Counts> {
    let (h, hq, hkv, _) = widths(c);
    let l = c.num_hidden_layers as u64;
    let shapes = block_linear_shapes(c);
    let block_linear = shapes.iter().map(|(_, a, b)| a * b).sum::<u64>();
    let embed = c.vocab_size as u64 * h;
    let head = if c.tie_word_embeddings { 0 } else { embed };
    let bias = bias_params(c, l, h, hq, hkv);
    let block_norms = if c.architecture.has_feedforward_norms() {
        4
    } else {
        2
    };
    let head_norms = if c.architecture.has_qk_norm() {
        2 * c.head_dim as u64
    } else {
        0
    };
    let norms = (block_norms * l + 1) * h + l * head_norms;
    let mut lora_tensors = Vec::new();
    for (module, a, b) in &shapes {
        if is_target(adapter, module)? {
            let r = rank_and_alpha(adapter, module)?.0 as u64;
            lora_tensors.extend([r * a, r * b]);
        }
    }
    if lora_tensors.is_empty() {
        return Err(crate::Error::InvalidInput(format!(
            "estimate: target_modules {} matches no linear layer of the model's blocks (e.g. {}); name some of them",
            serde_json::to_string(&adapter.target_modules).unwrap_or_default(),
            shapes.first().map_or("q_proj", |(m, _, _)| m.as_str())
        )));
    }
    Ok(Counts {
        block_linear,
        rest: embed + head + bias + norms + router_params(c),
        lora: lora_tensors.iter().sum(),
        lora_tensors,
    })
}

/// Biases and other small per-layer vectors kept dense: attention biases (q/k/v; gpt-oss's o too), gpt-oss's
/// attention sinks, and its router and expert biases.
fn bias_params(c: &ModelConfig, layers: u64, h: u64, hq: u64, hkv: u64) -> u64 {
    let attention = match (c.attention_bias, c.architecture.biases_attention_output()) {
        (false, _) => 0,
        (true, false) => layers * (hq + 2 * hkv),
        (true, true) => layers * (hq + 2 * hkv + h),
    };
    let sinks = if c.architecture.has_attention_sinks() {
        layers * c.num_attention_heads as u64
    } else {
        0
    };
    let experts = c
        .moe
        .as_ref()
        .filter(|m| m.clamped_swiglu.is_some())
        .map_or(0, |m| {
            let sparse = m.sparse_layers.iter().filter(|s| **s).count() as u64;
            let (e, w) = (m.num_experts as u64, m.moe_intermediate_size as u64);
            sparse * e * (2 * w + h + 1)
        });
    attention + sinks + experts
}

/// Bytes of an NF4 double-quantized tensor of `n` elements with blocksize 64: packed codes, 8-bit absmax per
/// block, float32 absmax per 256 absmax values, the 256-entry nested code table, the offset and the 16-entry
/// codebook (4.127 bits/parameter).
fn nf4_bytes(n: u64) -> u64 {
    let blocks = n.div_ceil(64);
    n.div_ceil(2) + blocks + 4 * blocks.div_ceil(256) + 256 * 4 + 4 + 16 * 4
}

/// Optimizer state bytes for trainable tensors of `sizes` elements.
fn optimizer_bytes(name: OptimizerName, sizes: &[u64]) -> u64 {
    sizes
        .iter()
        .map(|&n| match name {
            OptimizerName::AdamW8bit | OptimizerName::PagedAdamW8bit if n >= 4096 => {
                2 * n + 2 * 4 * n.div_ceil(256)
            }
            OptimizerName::Sgd => 4 * n,
            _ => 8 * n,
        })
        .sum()
}

/// Elements per token that one decoder layer keeps alive for the backward, as this library's ops and Candle's
/// graph hold them: the normed input, the rotated query/key heads and the value heads, the attention output, the
/// gate and up projections and SwiGLU, the residual sums and the second norm. LoRA runs as one fused op that saves
/// nothing but its inputs: the query/key/value projections leave as (rotated) heads, the output projection takes
/// heads, and the output and down projections accumulate their residual — on the CPU and on CUDA alike.
pub fn layer_elements_per_token(c: &ModelConfig) -> u64 {
    let (h, hq, hkv, i) = widths(c);
    // Gate, up, SwiGLU; a mixture of experts also keeps each token's rows gathered for its experts, their outputs
    // and their weighted outputs, and the router's logits and probabilities.
    let mlp = 3 * i
        + c.moe.as_ref().map_or(0, |m| {
            (3 * m.num_experts_per_tok as u64) * h + 2 * m.num_experts as u64
        });
    let norms_and_sums = 4 * h;
    hq + 2 * hkv + hq + mlp + norms_and_sums
}

/// How many of the last layers keep their activations under memory-aware checkpointing (see
/// `TrainingArguments::activation_memory_budget_mib`): as many as fit in `budget_mib`, each costing its saved
/// tensors beyond the input a checkpointed layer keeps, for `tokens` tokens of `dtype_bytes`. 0 without a budget.
pub fn kept_layers(
    c: &ModelConfig,
    tokens: u64,
    dtype_bytes: u64,
    budget_mib: Option<f64>,
) -> usize {
    let Some(budget) = budget_mib else {
        return 0;
    };
    let extra = (layer_elements_per_token(c) - c.hidden_size as u64) * tokens * dtype_bytes;
    let fit = (budget * (1u64 << 20) as f64 / extra.max(1) as f64).floor() as usize;
    fit.min(c.num_hidden_layers)
}

/// Activation bytes at the peak of a training step of this library. Saved for the backward: every layer's
/// tensors, or with checkpointing only each layer's input. On top of that, the larger of two moments: the fused
/// cross-entropy (on the CPU one `TOKEN_BLOCK` × vocabulary float32 logits block plus the hidden-state gradient;
/// on CUDA one `CUDA_LOGITS_BYTES` block of float32 logits, its gradient in the compute dtype, the float32
/// hidden-state gradient and a contiguous copy of the hidden states), or the backward through one layer (with checkpointing
/// the layer recomputed, plus the gradients in flight, plus the attention's working memory: the float32 scores of
/// one `QUERY_BLOCK` of queries, or, with the CUDA kernels, their float32 query-gradient accumulator for the kv
/// heads of one launch, `dq_kv_heads_per_launch`).
pub fn activation_bytes(c: &ModelConfig, args: &EstimateArgs, dtype_bytes: u64) -> u64 {
    let tokens = (args.batch * args.seq) as u64;
    let (h, hq, hkv, i) = widths(c);
    let layer_elements = layer_elements_per_token(c);
    // A tiled MLP keeps its gate, up and activation outputs (3·i a token) for one slice of `slice` tokens, while
    // it runs that slice's forward and backward, instead of for every token.
    let slice = match args.tiled_mlp {
        true => mlp_slice_rows(tokens as usize, c.hidden_size) as u64,
        false => tokens,
    };
    let untiled_elements = layer_elements - if args.tiled_mlp { 3 * i } else { 0 };
    let layer = untiled_elements * tokens * dtype_bytes;
    // A recomputed layer's output is only differentiated: where the dense MLP adds the residual itself, a tiled MLP
    // leaves its value unallocated, and so does the CPU's LoRA op (float32/float64) on the down projection.
    let cpu_lora_down = args.device == DeviceKind::Cpu
        && dtype_bytes >= 4
        && is_target(&args.adapter(), "model.layers.0.mlp.down_proj").unwrap_or(false);
    let output_unallocated = c.moe.is_none()
        && !c.architecture.has_feedforward_norms()
        && (args.tiled_mlp || cpu_lora_down);
    let recomputed_layer = layer
        - if output_unallocated {
            h * tokens * dtype_bytes
        } else {
            0
        };
    let mlp_slice = if args.tiled_mlp {
        3 * i * slice * dtype_bytes
    } else {
        0
    };
    // The MLP's backward: the SwiGLU, gate and up gradients, each added by Candle into a zeroed accumulator of its
    // own (one of which is live at a time), and the hidden-state gradients.
    let mlp_backward = 4 * i * slice + 3 * h * tokens;
    let gradients_in_flight = match args.device {
        DeviceKind::Cpu => mlp_backward,
        // Held through a recomputed layer's backward: the chain's output gradient (Candle's backward holds it while
        // the chain runs); then the wider of the MLP's moment (with the layer's output gradient, which Candle
        // holds until the MLP's backward is done) and the attention's (the residual sum's gradient, the output
        // heads', the query's and the key/value heads').
        DeviceKind::Cuda => {
            let attention_backward = (h + 2 * hq + 2 * hkv) * tokens;
            h * tokens + attention_backward.max(mlp_backward)
        }
    } * dtype_bytes;
    let layers = c.num_hidden_layers as u64;
    let hidden_states = tokens * h * dtype_bytes;
    // Held by the graph: the final norm's output (the loss's input) and its input — the embeddings' output
    // without checkpointing (the first layer's input), a kept layer's output with some; with every layer
    // recomputed the final norm ends the checkpointed chain and its input is one of the chain's.
    let (saved, recomputed, graph_held) = if args.gradient_checkpointing {
        let recomputed_count = recomputed_layers(c, args, dtype_bytes);
        let kept = layers - recomputed_count;
        let recomputed = if kept < layers {
            recomputed_layer + mlp_slice
        } else {
            0
        };
        // Offloaded, the device holds two of the chain's inputs, the one recomputed and the next one coming back.
        let chain_inputs = chain_inputs(recomputed_count, layers);
        let inputs_on_device = match offloaded(args) {
            true => chain_inputs.min(2),
            false => chain_inputs,
        };
        let graph_held = if norm_in_chain(recomputed_count, layers) {
            1
        } else {
            2
        };
        (
            inputs_on_device * hidden_states + kept * layer,
            recomputed,
            graph_held * hidden_states,
        )
    } else {
        (layers * layer, mlp_slice, 2 * hidden_states)
    };
    let attention_kernels =
        args.device == DeviceKind::Cuda && dtype_bytes == 2 && CUDA_HEAD_DIMS.contains(&c.head_dim);
    let attention = if attention_kernels {
        let (kv_heads, group) = (
            c.num_key_value_heads,
            c.num_attention_heads / c.num_key_value_heads.max(1),
        );
        let launch_heads = dq_kv_heads_per_launch(tokens as usize, kv_heads, group, c.head_dim);
        (launch_heads * group * c.head_dim) as u64 * tokens * 4
    } else {
        4 * (args.batch * c.num_attention_heads) as u64
            * QUERY_BLOCK.min(args.seq) as u64
            * args.seq as u64
            * 4
    };
    let layer_backward = recomputed + gradients_in_flight + attention;
    let vocab = c.vocab_size as u64;
    let cross_entropy = match args.device {
        // The slice path: one logits block, turned into its gradient in place, and the hidden-state gradient.
        DeviceKind::Cpu => {
            TOKEN_BLOCK.min(args.batch * args.seq) as u64 * vocab * 4 + tokens * h * 4
        }
        // Soft-capped logits run as composed ops in `TOKEN_BLOCK`s: the logits, their capped copy and gradient.
        DeviceKind::Cuda if c.final_logit_softcapping.is_some() => {
            3 * TOKEN_BLOCK.min(args.batch * args.seq) as u64 * vocab * 4
                + tokens * h * (dtype_bytes + 4)
        }
        DeviceKind::Cuda => {
            let block_tokens =
                (CUDA_LOGITS_BYTES as u64 / (vocab * 4).max(1)).clamp(1, tokens.max(1));
            // Logits (f32) and their gradient (compute dtype) per block; the hidden states' contiguous copy and
            // their float32 gradient.
            block_tokens * vocab * (4 + dtype_bytes) + tokens * h * (dtype_bytes + 4)
        }
    };
    saved + graph_held + layer_backward.max(cross_entropy)
}

/// Bytes of a model's RoPE tables, counted with its weights: cos and sin for every position up to
/// `max_position_embeddings` over the rotated dimensions, in float32 (float64 for a float64 model); LongRoPE keeps a
/// second pair for long sequences, and sliding layers with a base frequency of their own (Gemma 3) a pair of theirs.
fn rope_table_bytes(c: &ModelConfig, dtype_bytes: u64) -> u64 {
    let long = matches!(c.rope_scaling, Some(RopeScaling::LongRope(_)));
    let sliding =
        c.sliding_rope_theta.is_some() && c.layer_types.contains(&LayerAttention::Sliding);
    let pairs = 1 + u64::from(long) + u64::from(sliding);
    pairs * 2 * (c.max_position_embeddings * c.rotary_dim) as u64 * dtype_bytes.max(4)
}

/// Whether the recomputed layers' inputs go to the host: offloading asked, with checkpointing, on CUDA.
fn offloaded(args: &EstimateArgs) -> bool {
    args.activation_offloading && args.gradient_checkpointing && args.device == DeviceKind::Cuda
}

/// Pinned host bytes of an offloaded run: the inputs of the checkpointed chain's blocks (the recomputed layers,
/// and the final norm when every layer is recomputed), one buffer each (0 when nothing is offloaded).
pub fn offloaded_host_bytes(c: &ModelConfig, args: &EstimateArgs, dtype_bytes: u64) -> u64 {
    if !offloaded(args) {
        return 0;
    }
    let tokens = (args.batch * args.seq) as u64;
    let recomputed = recomputed_layers(c, args, dtype_bytes);
    chain_inputs(recomputed, c.num_hidden_layers as u64)
        * tokens
        * c.hidden_size as u64
        * dtype_bytes
}

/// How many inputs a checkpointed run's chain saves: every recomputed layer's (the embeddings included: they need
/// no gradient), and the final norm's when every layer is recomputed (the norm then ends the chain).
fn chain_inputs(recomputed: u64, layers: u64) -> u64 {
    recomputed + u64::from(norm_in_chain(recomputed, layers))
}

/// Whether the final norm ends the checkpointed chain: when every one of the `layers` is `recomputed`.
fn norm_in_chain(recomputed: u64, layers: u64) -> bool {
    recomputed == layers && recomputed > 0
}

/// How many layers a checkpointed run recomputes: those memory-aware checkpointing does not keep.
fn recomputed_layers(c: &ModelConfig, args: &EstimateArgs, dtype_bytes: u64) -> u64 {
    let kept = kept_layers(
        c,
        (args.batch * args.seq) as u64,
        dtype_bytes,
        args.activation_memory_budget_mib,
    );
    c.num_hidden_layers.saturating_sub(kept) as u64
}

/// The share of a GPU's memory an estimated peak may take in [`max_seq_len`]: the rest is left for allocator
/// fragmentation and what the estimate does not count (21.8 GiB of a 24 GiB card).
pub const USABLE_GPU_MEMORY: f64 = 0.91;

/// The longest sequence (tokens per row, the other arguments as given) whose estimated peak is at most `bytes`;
/// `None` when not even one token fits. The estimate grows with the length (memory-aware checkpointing keeps fewer
/// layers as rows grow, so it can step back by one layer's tensors, which the search may miss), and the search
/// halves the range of lengths until one is left.
pub fn max_seq_len(
    c: &ModelConfig,
    args: &EstimateArgs,
    bytes: u64,
) -> crate::Result<Option<usize>> {
    let fits = |seq: usize| -> crate::Result<bool> {
        let at = EstimateArgs {
            seq,
            ..args.clone()
        };
        Ok(estimate(c, &at)?.total_bytes <= bytes)
    };
    if !fits(1)? {
        return Ok(None);
    }
    let (mut lo, mut hi) = (1, MAX_ESTIMATE_TOKENS / args.batch.max(1));
    if fits(hi)? {
        return Ok(Some(hi));
    }
    // fits(lo) and not fits(hi).
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        match fits(mid)? {
            true => lo = mid,
            false => hi = mid,
        }
    }
    Ok(Some(lo))
}

fn finish(regime: Regime, parts: [u64; 6], assumptions: Vec<String>) -> Estimate {
    let [weights_bytes, lora_bytes, optimizer_bytes, gradients_bytes, activations_bytes, other_bytes] =
        parts;
    Estimate {
        regime,
        weights_bytes,
        lora_bytes,
        optimizer_bytes,
        gradients_bytes,
        activations_bytes,
        other_bytes,
        total_bytes: parts.iter().sum(),
        host_bytes: 0,
        assumptions,
        data_parallel: None,
        routing: None,
        sharded: None,
    }
}

/// The configuration asked, as this library would run it.
pub fn estimate(c: &ModelConfig, args: &EstimateArgs) -> crate::Result<Estimate> {
    args.validate()?;
    // DPO's forward holds every chosen and every rejected sequence: the activations of twice the rows. Its
    // reference forward runs first, without gradients and checkpointed, so it peaks below the training forward.
    let rows = EstimateArgs {
        batch: args.batch * if args.preference { 2 } else { 1 },
        ..args.clone()
    };
    let args = &rows;
    let optim = args.optim;
    let n = counts(c, &args.adapter())?;
    let dtype = args.compute_dtype();
    let e = dtype.dtype().size_in_bytes() as u64;
    let rope_tables = rope_table_bytes(c, e);
    let layers = layer_bytes(c, args.quantize, e);
    let layer_linears: u64 = layers.iter().sum();
    // The embedding table, and the head when it is not tied to it: FSDP shards them with the layers.
    let table = (c.vocab_size * c.hidden_size) as u64 * e;
    let ends = table * if c.tie_word_embeddings { 1 } else { 2 };
    let sharded = args.fsdp.then(|| {
        let world = args.world_size as u64;
        // Gathered at once: a layer and the one prefetched beside it (the backward's recomputation gathers the
        // layer before it ahead, as `backward_prefetch` does by default; a forward prefetch is the same pair), or
        // the table (the embedding, or the head for the loss).
        let one = layers.iter().copied().max().unwrap_or(0);
        let pair = layers.windows(2).map(|w| w[0] + w[1]).max().unwrap_or(one);
        let largest = pair.max(table);
        let shard_bytes = layer_linears.div_ceil(world) + ends.div_ceil(world);
        Sharded {
            world_size: args.world_size,
            offload: args.fsdp_offload,
            shard_bytes,
            // One rank alone gathers its own share in place; offloaded, its share comes back whole.
            gathered_bytes: match world == 1 && !args.fsdp_offload {
                true => 0,
                false => largest,
            },
            unsharded_bytes: rope_tables
                + (n.rest * e).saturating_sub(ends)
                + (WHOLE_EMBEDDING_ROWS.min(c.vocab_size) * c.hidden_size) as u64 * e,
            // Every layer twice (forward, recomputation), the table once, the head twice (loss and its backward).
            all_gather_bytes_per_micro_batch: (2 * layer_linears + 3 * ends - table) * (world - 1)
                / world,
        }
    });
    let weights = match &sharded {
        Some(s) if s.offload => s.unsharded_bytes + s.gathered_bytes,
        Some(s) => s.unsharded_bytes + s.shard_bytes + s.gathered_bytes,
        None => rope_tables + n.rest * e + layer_linears,
    };
    let data_parallel =
        (args.world_size > 1).then(|| DataParallel::new(args.world_size, 4 * n.lora));
    let other = match args.device {
        DeviceKind::Cpu => 0,
        DeviceKind::Cuda => 512 << 20,
    } + data_parallel.as_ref().map_or(0, |d| d.bucket_bytes);
    let mut assumptions = vec![
        format!(
            "{dtype} compute; LoRA r={} on {}, float32 adapter weights and gradients",
            args.lora_r,
            match &args.target_modules {
                Some(TargetModules::AllLinear) => "every linear layer of the blocks".to_string(),
                _ => format!(
                    "{} of the {} linear layers of the blocks (target_modules)",
                    n.lora_tensors.len() / 2,
                    block_linear_shapes(c).len()
                ),
            }
        ),
        format!(
            "{}; the RoPE tables ({} positions) {}",
            if args.quantize {
                "base linears NF4 with double quantization (4.127 bits/parameter); embeddings, head and norms in \
                 the compute dtype"
            } else {
                "base weights in the compute dtype"
            },
            c.max_position_embeddings,
            human_bytes(rope_tables)
        ),
        format!("optimizer {} on the adapter", args.optim),
        format!(
            "activations: micro-batch {} × {} tokens, {}, {}",
            args.batch,
            args.seq,
            match (args.gradient_checkpointing, args.activation_memory_budget_mib) {
                (false, _) => "every layer's tensors saved".to_string(),
                (true, None) => "layer inputs saved and one layer recomputed at a time".to_string(),
                (true, Some(budget)) => format!(
                    "the last {} layers' tensors kept within a {budget} MiB budget, the other layers' inputs saved \
                     and one recomputed at a time",
                    kept_layers(
                        c,
                        (args.batch * args.seq) as u64,
                        e,
                        Some(budget)
                    )
                ),
            },
            match args.device {
                DeviceKind::Cpu => format!(
                    "attention in {QUERY_BLOCK}-query blocks, cross-entropy in {TOKEN_BLOCK}-token blocks"
                ),
                DeviceKind::Cuda => format!(
                    "attention by the CUDA kernels (bf16/f16, heads of {CUDA_HEAD_DIMS:?}; otherwise in \
                     {QUERY_BLOCK}-query blocks), cross-entropy in {} MiB blocks of float32 logits",
                    CUDA_LOGITS_BYTES >> 20
                ),
            }
        ),
        match args.preference {
            true => format!(
                "DPO: {} rows per forward (the chosen and the rejected sequence of each of {} preference pairs); \
                 the reference forward before it (no gradients, checkpointed) peaks lower and is not added",
                args.batch,
                args.batch / 2
            ),
            false => match args.grpo_generations {
                Some(g) => format!(
                    "GRPO: {} completions per micro-batch, each a prompt and its completion ({} tokens); generating \
                     a prompt's {g} completions holds their KV cache ({}) and one row of float32 logits each, \
                     before and apart from the training forward (the larger of the two counts)",
                    args.batch,
                    args.seq,
                    human_bytes(generation_bytes(c, g, args.seq, e))
                ),
                None => "supervised fine-tuning: one sequence per row".into(),
            },
        },
        match args.device {
            DeviceKind::Cpu => "other: the process' runtime, tokenizer and data are not counted (tens of MiB)".into(),
            DeviceKind::Cuda => "other: 512 MiB for the CUDA context; allocator fragmentation not counted".into(),
        },
    ];
    if args.activation_offloading {
        assumptions.push(match offloaded(args) {
            true => format!(
                "activation offload: the checkpointed layers' inputs wait in {} of pinned host memory (not in the \
                 total), copied out while each layer computes and back one layer ahead of its recomputation",
                human_bytes(offloaded_host_bytes(c, args, e))
            ),
            false => "activation offload: no effect on the CPU (its host memory is the device's)".into(),
        });
    }
    if args.tiled_mlp {
        let tokens = args.batch * args.seq;
        let slice = mlp_slice_rows(tokens, c.hidden_size);
        assumptions.push(format!(
            "tiled MLP: {} slices of at most {slice} tokens; a layer saves its MLP's input only, and the MLP's \
             intermediates and their gradients exist for one slice at a time",
            tokens.div_ceil(slice)
        ));
    }
    let routing = Routing::of(c, (args.batch * args.seq) as u64);
    if let (Some(r), Some(m)) = (&routing, &c.moe) {
        assumptions.push(format!(
            "mixture of experts: {} of {} experts per token, {} expert rows per sparse layer; one expert runs {} \
             rows when the router is balanced, {} at worst (every token), within the counted gradients in flight; \
             experts and routers are not adapted by all-linear (PEFT's target_parameters adds one pair per expert)",
            m.num_experts_per_tok, m.num_experts, r.routed_rows, r.expected_rows_per_expert, r.worst_rows_per_expert
        ));
    }
    if let Some(d) = &data_parallel {
        assumptions.push(format!(
            "data parallel over {} GPUs: the figures are per GPU (each holds {} and its own micro-batches); \
             other adds a gradient bucket (up to {DDP_BUCKET_CAP_MB} MiB) and its sum; NCCL's own buffers \
             (NCCL_BUFFSIZE per channel and peer) are not counted",
            d.world_size,
            match args.fsdp {
                true => "its share of the model (FSDP, below)",
                false => "the whole model",
            }
        ));
    }
    if let Some(s) = &sharded {
        assumptions.push(format!(
            "FSDP over {} GPUs: each holds 1/{} of the decoder layers' linear weights, the embedding table and the \
             head ({}{}), gathered whole while used ({} at most: a layer for its forward and again for its \
             recomputation, with the next one's gather started beside it (backward_prefetch, forward_prefetch), the \
             table for the embedding, the head for the loss and again for its backward); norms, RoPE tables and the \
             embedding's first rows ({}) and the adapter with its optimizer state stay whole on every GPU; each GPU \
             receives {} of gathers per micro-batch",
            s.world_size,
            s.world_size,
            human_bytes(s.shard_bytes),
            match s.offload {
                true => ", in host memory (host_bytes), each share copied in for its gather",
                false => "",
            },
            human_bytes(s.gathered_bytes),
            human_bytes(s.unsharded_bytes),
            human_bytes(s.all_gather_bytes_per_micro_batch)
        ));
    }
    let mut estimate = finish(
        Regime::Configured,
        [
            weights,
            4 * n.lora,
            optimizer_bytes(optim, &n.lora_tensors),
            4 * n.lora,
            match args.grpo_generations {
                Some(g) => activation_bytes(c, args, e).max(generation_bytes(c, g, args.seq, e)),
                None => activation_bytes(c, args, e),
            },
            other,
        ],
        assumptions,
    );
    estimate.host_bytes = offloaded_host_bytes(c, args, e)
        + sharded
            .as_ref()
            .filter(|s| s.offload)
            .map_or(0, |s| s.shard_bytes);
    estimate.data_parallel = data_parallel;
    estimate.routing = routing;
    estimate.sharded = sharded;
    Ok(estimate)
}

/// What sampling `rows` completions of `seq` tokens (prompt included) holds besides the weights: every layer's
/// keys and values of every row (a sliding-window layer keeps its window), and a row of float32 logits each.
pub fn generation_bytes(c: &ModelConfig, rows: usize, seq: usize, e: u64) -> u64 {
    let kv_row = 2 * c.num_key_value_heads as u64 * c.head_dim as u64 * e;
    let positions: u64 = (0..c.num_hidden_layers)
        .map(|l| match c.window_of(l) {
            Some(w) => seq.min(w) as u64,
            None => seq as u64,
        })
        .sum();
    rows as u64 * (positions * kv_row + 4 * c.vocab_size as u64)
}

/// NF4 bytes of the block linears, tensor by tensor (each has its own quantization state).
/// Each decoder layer's linear weights in bytes: NF4 when `quantize`, else `e` bytes a parameter.
fn layer_bytes(c: &ModelConfig, quantize: bool, e: u64) -> Vec<u64> {
    (0..c.num_hidden_layers)
        .map(|l| {
            layer_linear_shapes(c, l)
                .iter()
                .map(|(_, a, b)| match quantize {
                    true => nf4_bytes(a * b),
                    false => a * b * e,
                })
                .sum()
        })
        .collect()
}

fn per_layer_nf4(c: &ModelConfig) -> u64 {
    block_linear_shapes(c)
        .iter()
        .map(|(_, a, b)| nf4_bytes(a * b))
        .sum()
}

/// The comparison table: full fine-tuning in float32 and in mixed precision (AdamW), LoRA on a bf16 base and QLoRA
/// (with the asked optimizer on the adapter), all at the asked batch, sequence and checkpointing, then the
/// configuration asked as this library runs it.
pub fn comparison(c: &ModelConfig, args: &EstimateArgs) -> crate::Result<Vec<Estimate>> {
    let asked = estimate(c, args)?; // validates the arguments
    let optim = args.optim;
    let n = counts(c, &args.adapter())?;
    let p = n.block_linear + n.rest;
    let all: Vec<u64> = vec![p];
    let lora_opt = optimizer_bytes(optim, &n.lora_tensors);
    let act = |e: u64| activation_bytes(c, args, e);
    let note = |s: &str| vec![s.to_string()];
    Ok(vec![
        finish(
            Regime::FullFp32,
            [4 * p, 0, optimizer_bytes(OptimizerName::AdamWTorch, &all), 4 * p, act(4), 0],
            note("float32 weights, gradients and AdamW moments (16 bytes/parameter), float32 activations"),
        ),
        finish(
            Regime::MixedPrecision,
            [2 * p, 0, optimizer_bytes(OptimizerName::AdamWTorch, &all), 2 * p, act(2), 0],
            note("bf16 weights and gradients, float32 AdamW moments (12 bytes/parameter; no float32 master copy), bf16 activations"),
        ),
        finish(
            Regime::LoraBf16,
            [2 * p, 4 * n.lora, lora_opt, 4 * n.lora, act(2), 0],
            note("frozen bf16 base, float32 adapter, bf16 activations"),
        ),
        finish(
            Regime::Qlora,
            [per_layer_nf4(c) + 2 * n.rest, 4 * n.lora, lora_opt, 4 * n.lora, act(2), 0],
            note("NF4 base (4.127 bits/parameter), bf16 embeddings/head/norms, float32 adapter, bf16 activations"),
        ),
        asked,
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{Nf4Tensor, QuantConfig};

    const GIB: f64 = (1u64 << 30) as f64;

    /// Memory-aware checkpointing keeps as many whole layers as fit in the budget, never more than the model has,
    /// and its estimate lies between full checkpointing and none.
    #[test]
    fn kept_layers_fill_the_budget() {
        let c = llama2_7b();
        let tokens = 2048u64;
        let layer_mib =
            ((layer_elements_per_token(&c) - 4096) * tokens * 2) as f64 / (1u64 << 20) as f64;
        assert_eq!(kept_layers(&c, tokens, 2, None), 0);
        assert_eq!(kept_layers(&c, tokens, 2, Some(0.0)), 0);
        assert_eq!(kept_layers(&c, tokens, 2, Some(2.5 * layer_mib)), 2);
        assert_eq!(kept_layers(&c, tokens, 2, Some(1e9)), 32);
        let args = |ckpt: bool, budget: Option<f64>| EstimateArgs {
            seq: 2048,
            gradient_checkpointing: ckpt,
            activation_memory_budget_mib: budget,
            device: DeviceKind::Cuda,
            ..Default::default()
        };
        let activations = |a: EstimateArgs| estimate(&c, &a).unwrap().activations_bytes;
        let (full, partial, none) = (
            activations(args(true, None)),
            activations(args(true, Some(10.0 * layer_mib))),
            activations(args(false, None)),
        );
        assert!(full < partial && partial < none, "{full} {partial} {none}");
        // Every layer kept: nothing is recomputed, as without checkpointing.
        assert_eq!(activations(args(true, Some(1e9))), none);
    }

    /// DPO: a micro-batch of pairs holds the activations of twice the rows; weights, adapter and optimizer are
    /// the same.
    #[test]
    fn preference_pairs_double_the_rows_of_activations() {
        let c = llama2_7b();
        let args = |batch: usize, preference: bool| EstimateArgs {
            batch,
            seq: 1024,
            gradient_checkpointing: true,
            device: DeviceKind::Cuda,
            preference,
            ..Default::default()
        };
        let dpo = estimate(&c, &args(2, true)).unwrap();
        let sft = estimate(&c, &args(4, false)).unwrap();
        let single = estimate(&c, &args(2, false)).unwrap();
        assert_eq!(dpo.activations_bytes, sft.activations_bytes);
        assert!(dpo.activations_bytes > single.activations_bytes);
        assert_eq!(dpo.weights_bytes, single.weights_bytes);
        assert!(dpo
            .assumptions
            .iter()
            .any(|a| a.contains("DPO: 4 rows per forward")));
    }

    /// GRPO counts the larger of the training forward and the generation's KV cache: Llama-2-7B's cache is 0.5 MiB a
    /// token a row in bf16 (32 layers × 2 × 4096 × 2 bytes), plus a float32 row of logits per completion.
    #[test]
    fn grpo_counts_the_generation_kv_cache_when_it_is_larger() {
        let c = llama2_7b();
        let kv = generation_bytes(&c, 8, 1024, 2);
        assert_eq!(kv, 8 * (1024 * 32 * 2 * 4096 * 2 + 4 * 32000));
        let args = |batch: usize, grpo: Option<usize>| EstimateArgs {
            batch,
            seq: 1024,
            gradient_checkpointing: true,
            device: DeviceKind::Cuda,
            grpo_generations: grpo,
            ..Default::default()
        };
        let train = estimate(&c, &args(1, None)).unwrap();
        let grpo = estimate(&c, &args(1, Some(64))).unwrap();
        assert!(generation_bytes(&c, 64, 1024, 2) > train.activations_bytes);
        assert_eq!(grpo.activations_bytes, generation_bytes(&c, 64, 1024, 2));
        let small = estimate(&c, &args(1, Some(1))).unwrap();
        assert_eq!(small.activations_bytes, train.activations_bytes);
        assert!(grpo
            .assumptions
            .iter()
            .any(|a| a.contains("GRPO: 1 completions")));
    }

    /// Data parallel on 8 GPUs: the per-GPU figures are one GPU's plus a bucket and its sum; the exchange is
    /// the adapter's float32 gradients (Llama-2-7B, r=16 on every linear: PEFT's 39,976,960 trainable
    /// parameters), 7 buckets of 25 MiB, 2·7/8 of it sent by each GPU. A CPU run with ranks is refused.
    /// FSDP divides the decoder layers' linear weights by the ranks and adds what is gathered; everything else
    /// is the data-parallel run's; each rank receives every layer twice a micro-batch, (N − 1)/N of it.
    #[test]
    fn fsdp_shares_out_the_layers_and_gathers_two_at_once() {
        let c = llama2_7b();
        let args = |world_size: usize, fsdp: bool| EstimateArgs {
            device: DeviceKind::Cuda,
            world_size,
            gradient_checkpointing: true,
            fsdp,
            ..Default::default()
        };
        let layers = per_layer_nf4(&c);
        // Llama 2's head is not tied: the table twice, bf16.
        let table: u64 = 32_000 * 4096 * 2;
        let ends = 2 * table;
        for world in [1u64, 2, 4] {
            let ddp = estimate(&c, &args(world as usize, false)).unwrap();
            let fsdp = estimate(&c, &args(world as usize, true)).unwrap();
            let s = fsdp.sharded.clone().unwrap();
            assert_eq!(ddp.sharded, None);
            // The table (250 MiB) is larger than two layers (2 × 101 MiB in NF4, the one running and the one
            // prefetched): it is the gathered peak (one rank alone gathers in place).
            let gathered = if world == 1 { 0 } else { table };
            assert_eq!(
                (s.shard_bytes, s.gathered_bytes),
                (layers.div_ceil(world) + ends.div_ceil(world), gathered)
            );
            let first_rows = 64 * 4096 * 2;
            assert_eq!(
                fsdp.weights_bytes,
                ddp.weights_bytes - layers - ends + s.shard_bytes + gathered + first_rows
            );
            assert_eq!(
                fsdp.total_bytes - fsdp.weights_bytes,
                ddp.total_bytes - ddp.weights_bytes
            );
            assert_eq!(
                s.all_gather_bytes_per_micro_batch,
                (2 * layers + 3 * ends - table) * (world - 1) / world
            );
            // Offloaded: the shards move to the host; the GPU holds the gathered table.
            let offloaded = estimate(
                &c,
                &EstimateArgs {
                    fsdp_offload: true,
                    ..args(world as usize, true)
                },
            )
            .unwrap();
            assert_eq!(offloaded.host_bytes, fsdp.host_bytes + s.shard_bytes);
            assert_eq!(
                offloaded.weights_bytes,
                fsdp.weights_bytes - s.shard_bytes - gathered + table
            );
        }
        let err = estimate(
            &c,
            &EstimateArgs {
                gradient_checkpointing: false,
                ..args(2, true)
            },
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("--gradient-checkpointing"), "{err}");
        let offload_alone = EstimateArgs {
            fsdp_offload: true,
            ..args(2, false)
        };
        let err = estimate(&c, &offload_alone).unwrap_err().to_string();
        assert!(err.contains("add --fsdp"), "{err}");
        // With a small vocabulary the table is below two layers: the running layer and the prefetched one are
        // the gathered peak.
        let small_vocabulary = ModelConfig {
            vocab_size: 1000,
            ..c.clone()
        };
        let s = estimate(&small_vocabulary, &args(2, true))
            .unwrap()
            .sharded
            .unwrap();
        assert_eq!(s.gathered_bytes, 2 * layers / 32);
    }

    #[test]
    fn data_parallel_adds_the_bucket_and_counts_the_exchange() {
        let c = llama2_7b();
        let args = |world_size: usize| EstimateArgs {
            device: DeviceKind::Cuda,
            world_size,
            ..Default::default()
        };
        let alone = estimate(&c, &args(1)).unwrap();
        let eight = estimate(&c, &args(8)).unwrap();
        assert_eq!(alone.data_parallel, None);
        let d = eight.data_parallel.clone().unwrap();
        let gradients = 4 * 39_976_960;
        assert_eq!(
            (d.world_size, d.all_reduce_bytes, d.buckets),
            (8, gradients, 7)
        );
        assert_eq!(d.bytes_sent_per_gpu, 2 * 7 * gradients / 8);
        assert_eq!(d.bucket_bytes, 2 * (25 << 20));
        assert_eq!(eight.total_bytes, alone.total_bytes + d.bucket_bytes);
        assert_eq!(eight.other_bytes, alone.other_bytes + d.bucket_bytes);
        let cpu = EstimateArgs {
            world_size: 2,
            ..Default::default()
        };
        let err = estimate(&c, &cpu).unwrap_err().to_string();
        assert!(err.contains("runs on GPUs"), "{err}");
    }

    /// Qwen3-30B-A3B (the Hub's config): 30,532,122,624 parameters, as its model card's 30.5B; all-linear adapts
    /// the attention alone (PEFT: 13,369,344 trainable at r = 16); a 1 × 2048 micro-batch routes 16,384 rows, 128
    /// per expert when balanced, 2048 at worst; a dense model has no routing.
    #[test]
    fn mixture_of_experts_counts_every_expert_and_its_routed_rows() {
        let json = serde_json::json!({
            "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
            "norm_topk_prob": true, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": false
        });
        let c = ModelConfig::from_hf_config(&json, std::path::Path::new("config.json")).unwrap();
        let n = counts(&c, &all_linear(16)).unwrap();
        assert_eq!(n.block_linear + n.rest, 30_532_122_624);
        assert_eq!(n.lora, 13_369_344);
        let e = estimate(
            &c,
            &EstimateArgs {
                device: DeviceKind::Cuda,
                gradient_checkpointing: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            e.routing,
            Some(Routing {
                routed_rows: 16_384,
                expected_rows_per_expert: 128,
                worst_rows_per_expert: 2048,
            })
        );
        assert!(e.assumptions.iter().any(|a| a.contains("2048 at worst")));
        assert_eq!(
            estimate(&llama2_7b(), &EstimateArgs::default())
                .unwrap()
                .routing,
            None
        );
    }

    /// gpt-oss-20b (the Hub's config): 20,914,757,184 parameters, as transformers counts them; all-linear adapts
    /// the attention alone (PEFT: 7,962,624 trainable at r = 16); 1 × 2048 tokens route 8,192 rows per layer.
    #[test]
    fn gpt_oss_20b_counts_its_experts_biases_and_sinks() {
        let json = serde_json::json!({
            "architectures": ["GptOssForCausalLM"], "attention_bias": true, "attention_dropout": 0.0,
            "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
            "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880, "max_position_embeddings": 131072, "model_type": "gpt_oss",
            "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
            "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
            "pad_token_id": 199999, "rms_norm_eps": 1e-05,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
            "tie_word_embeddings": false, "use_cache": true, "vocab_size": 201088
        });
        let c = ModelConfig::from_hf_config(&json, std::path::Path::new("config.json")).unwrap();
        let n = counts(&c, &all_linear(16)).unwrap();
        assert_eq!(n.block_linear + n.rest, 20_914_757_184);
        assert_eq!(n.lora, 7_962_624);
        let args = EstimateArgs {
            device: DeviceKind::Cuda,
            gradient_checkpointing: true,
            ..Default::default()
        };
        let e = estimate(&c, &args).unwrap();
        assert_eq!(e.routing.unwrap().routed_rows, 8_192);
    }

    /// An adapter of rank `r` on every linear layer.
    fn all_linear(r: usize) -> LoraConfig {
        LoraConfig {
            r,
            target_modules: Some(TargetModules::AllLinear),
            ..Default::default()
        }
    }

    /// The adapter goes where `target_modules` says, as PEFT puts it: Llama-2-7B's query and value projections
    /// at r = 16 are PEFT's 8,388,608 trainable parameters, also by default (`None`); a list that names no layer
    /// is an error.
    #[test]
    fn target_modules_choose_the_adapted_layers() {
        let c = llama2_7b();
        let args = |target_modules: Option<TargetModules>| EstimateArgs {
            target_modules,
            ..Default::default()
        };
        let qv = TargetModules::List(vec!["q_proj".into(), "v_proj".into()]);
        let lora = |t: Option<TargetModules>| estimate(&c, &args(t)).map(|e| e.lora_bytes);
        assert_eq!(lora(Some(qv.clone())).unwrap(), 4 * 8_388_608);
        assert_eq!(lora(None).unwrap(), 4 * 8_388_608);
        let all = estimate(&c, &args(Some(TargetModules::AllLinear))).unwrap();
        assert_eq!(all.lora_bytes, 4 * 39_976_960);
        let e = estimate(&c, &args(Some(qv))).unwrap();
        assert!(e.optimizer_bytes < all.optimizer_bytes && e.weights_bytes == all.weights_bytes);
        assert!(
            e.assumptions[0].contains("on 64 of the 224 linear layers"),
            "{:?}",
            e.assumptions
        );
        let err = lora(Some(TargetModules::List(vec!["qkv".into()])))
            .unwrap_err()
            .to_string();
        assert!(err.contains("matches no linear layer"), "{err}");
    }

    /// The compute dtype sets the bytes of activations and of a dense base; without one the device's default
    /// (CPU float32, CUDA bfloat16) applies.
    #[test]
    fn the_compute_dtype_sizes_activations_and_a_dense_base() {
        let c = llama2_7b();
        let args = |device: DeviceKind, dtype: Option<TorchDtype>| EstimateArgs {
            device,
            dtype,
            quantize: false,
            seq: 512,
            ..Default::default()
        };
        let on = |a: EstimateArgs| estimate(&c, &a).unwrap();
        assert_eq!(
            on(args(DeviceKind::Cpu, None)),
            on(args(DeviceKind::Cpu, Some(TorchDtype::Float32)))
        );
        assert_eq!(
            on(args(DeviceKind::Cuda, None)),
            on(args(DeviceKind::Cuda, Some(TorchDtype::BFloat16)))
        );
        let (half, full) = (
            on(args(DeviceKind::Cuda, Some(TorchDtype::Float16))),
            on(args(DeviceKind::Cuda, Some(TorchDtype::Float32))),
        );
        // The weights double; the RoPE tables are float32 in both.
        let tables = rope_table_bytes(&c, 4);
        assert_eq!(tables, 2 * 4096 * 128 * 4);
        assert_eq!(
            full.weights_bytes - tables,
            2 * (half.weights_bytes - tables)
        );
        assert!(full.activations_bytes > half.activations_bytes);
        assert!(full.assumptions[0].starts_with("float32 compute"));
    }

    /// The flags repeat every argument the command takes, and none where it has no flag for one (a regex).
    #[test]
    fn flags_name_every_argument() {
        let args = EstimateArgs {
            batch: 4,
            seq: 58,
            target_modules: None,
            gradient_checkpointing: true,
            activation_memory_budget_mib: Some(512.0),
            tiled_mlp: true,
            device: DeviceKind::Cuda,
            world_size: 2,
            preference: true,
            ..Default::default()
        };
        assert_eq!(
            args.flags().unwrap(),
            "--batch 4 --seq 58 --lora-r 16 --target-modules q_proj,v_proj --optim paged_adamw_8bit \
             --gradient-checkpointing --activation-memory-budget-mib 512 --tiled-mlp --quantize nf4 --device cuda \
             --dtype bfloat16 --world-size 2 --dpo"
        );
        assert_eq!(
            EstimateArgs::default().flags().unwrap(),
            "--batch 1 --seq 2048 --lora-r 16 --target-modules all-linear --optim paged_adamw_8bit --quantize nf4 \
             --device cpu --dtype float32"
        );
        let regex = EstimateArgs {
            target_modules: Some(TargetModules::Regex(".*q_proj".into())),
            ..Default::default()
        };
        assert_eq!(regex.flags(), None);
    }

    /// A tiled MLP keeps its intermediates (3 · 11,008 a token) for one slice of at most 4,096 tokens instead of
    /// all of them, and its backward's gradients too, so that the widest moment of a layer's backward on CUDA becomes
    /// the attention's: at 32,768 tokens, checkpointed, the activations drop by exactly 3 · 11,008 · (32,768 −
    /// 4,096) bf16 elements plus, for every token, the untiled MLP's moment (4 · 11,008 + 3 · 4,096) less the
    /// attention's (4,096 + 2 · 4,096 + 2 · 4,096), plus the recomputed layer's output (4,096), whose value the
    /// tiled op leaves unallocated; and the assumptions say so.
    #[test]
    fn a_tiled_mlp_holds_one_slice_of_intermediates() {
        let c = llama2_7b();
        let args = |tiled_mlp: bool| EstimateArgs {
            seq: 32_768,
            gradient_checkpointing: true,
            device: DeviceKind::Cuda,
            tiled_mlp,
            ..Default::default()
        };
        let (plain, tiled) = (
            estimate(&c, &args(false)).unwrap(),
            estimate(&c, &args(true)).unwrap(),
        );
        assert_eq!(
            plain.activations_bytes - tiled.activations_bytes,
            (3 * 11_008 * (32_768 - 4_096) + (4 * 11_008 + 3 * 4_096 - 5 * 4_096 + 4_096) * 32_768)
                * 2
        );
        assert_eq!(
            plain.total_bytes - tiled.total_bytes,
            plain.activations_bytes - tiled.activations_bytes
        );
        assert!(
            tiled
                .assumptions
                .iter()
                .any(|a| a.contains("tiled MLP: 8 slices of at most 4096 tokens")),
            "{:?}",
            tiled.assumptions
        );
    }

    /// `max_seq_len` finds the boundary: the length it returns fits, one more token does not; none fits a budget
    /// below the weights; the tiled MLP fits a longer one.
    /// Offloaded, the GPU keeps two of the 33 inputs the chain saves (the embeddings', the other layers' and the
    /// final norm's) and the host pins all 33; on the CPU and without checkpointing nothing changes (the latter is
    /// refused).
    #[test]
    fn offloading_moves_the_layer_inputs_to_the_host() {
        let c = llama2_7b();
        let args = |device, activation_offloading| EstimateArgs {
            seq: 8_192,
            gradient_checkpointing: true,
            device,
            activation_offloading,
            ..Default::default()
        };
        let input = 8_192 * 4_096 * 2; // one layer's input, bf16
        let plain = estimate(&c, &args(DeviceKind::Cuda, false)).unwrap();
        let offloaded = estimate(&c, &args(DeviceKind::Cuda, true)).unwrap();
        assert_eq!(plain.total_bytes - offloaded.total_bytes, (33 - 2) * input);
        assert_eq!((plain.host_bytes, offloaded.host_bytes), (0, 33 * input));
        assert!(offloaded
            .assumptions
            .iter()
            .any(|a| a
                .contains("activation offload: the checkpointed layers' inputs wait in 2.06 GiB")));
        // With a budget, only the recomputed layers' inputs go (the final norm's input is a kept layer's output).
        let budget = EstimateArgs {
            activation_memory_budget_mib: Some(2_000.0),
            ..args(DeviceKind::Cuda, true)
        };
        let kept = kept_layers(&c, 8_192, 2, Some(2_000.0)) as u64;
        assert!(kept > 0);
        assert_eq!(
            estimate(&c, &budget).unwrap().host_bytes,
            (32 - kept) * input
        );
        let cpu = (
            estimate(&c, &args(DeviceKind::Cpu, false)).unwrap(),
            estimate(&c, &args(DeviceKind::Cpu, true)).unwrap(),
        );
        assert_eq!(cpu.0.total_bytes, cpu.1.total_bytes);
        assert_eq!(cpu.1.host_bytes, 0);
        assert_eq!(
            args(DeviceKind::Cuda, true)
                .flags()
                .unwrap()
                .matches("--activation-offloading")
                .count(),
            1
        );
        let unchecked = EstimateArgs {
            gradient_checkpointing: false,
            ..args(DeviceKind::Cuda, true)
        };
        let err = estimate(&c, &unchecked).unwrap_err().to_string();
        assert!(err.contains("--gradient-checkpointing"), "{err}");
    }

    #[test]
    fn the_longest_sequence_that_fits_is_the_boundary() {
        let c = llama2_7b();
        let args = EstimateArgs {
            gradient_checkpointing: true,
            device: DeviceKind::Cuda,
            ..Default::default()
        };
        let budget = (21.8 * GIB) as u64;
        let total = |a: &EstimateArgs, seq: usize| {
            estimate(&c, &EstimateArgs { seq, ..a.clone() })
                .unwrap()
                .total_bytes
        };
        let longest = max_seq_len(&c, &args, budget).unwrap().unwrap();
        assert!(total(&args, longest) <= budget && total(&args, longest + 1) > budget);
        let tiled = EstimateArgs {
            tiled_mlp: true,
            ..args.clone()
        };
        let longest_tiled = max_seq_len(&c, &tiled, budget).unwrap().unwrap();
        assert!(longest_tiled > longest, "{longest_tiled} vs {longest}");
        assert!(
            total(&tiled, longest_tiled) <= budget && total(&tiled, longest_tiled + 1) > budget
        );
        assert_eq!(max_seq_len(&c, &args, 1 << 30).unwrap(), None);
    }

    fn llama2_7b() -> ModelConfig {
        let json = serde_json::json!({
            "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": false
        });
        ModelConfig::from_hf_config(&json, std::path::Path::new("llama-2-7b/config.json")).unwrap()
    }

    #[test]
    fn llama2_7b_reproduces_the_familiar_orders_of_magnitude() {
        let c = llama2_7b();
        let n = counts(&c, &all_linear(16)).unwrap();
        assert_eq!(
            n.block_linear + n.rest,
            6_738_415_616,
            "Llama-2-7B parameter count"
        );
        let args = EstimateArgs {
            batch: 1,
            seq: 2048,
            device: DeviceKind::Cuda,
            ..Default::default()
        };
        let table = comparison(&c, &args).unwrap();
        let gib = |r: Regime| {
            let e = table.iter().find(|e| e.regime == r).unwrap();
            (e.total_bytes as f64 / GIB, e.weights_bytes as f64 / GIB)
        };
        let (full, _) = gib(Regime::FullFp32);
        let (mixed, _) = gib(Regime::MixedPrecision);
        let (_, qlora_weights) = gib(Regime::Qlora);
        assert!(
            (110.0..150.0).contains(&full),
            "full fp32 {full} GiB (≈130)"
        );
        assert!(
            (70.0..95.0).contains(&mixed),
            "mixed precision {mixed} GiB (≈76 + activations)"
        );
        assert!(
            (3.0..6.5).contains(&qlora_weights),
            "QLoRA weights {qlora_weights} GiB (≈4–6)"
        );
        // Model states alone: 16 and 12 bytes per parameter.
        let states = |r: Regime| {
            let e = table.iter().find(|e| e.regime == r).unwrap();
            e.weights_bytes + e.gradients_bytes + e.optimizer_bytes
        };
        assert_eq!(states(Regime::FullFp32), 16 * 6_738_415_616);
        assert_eq!(states(Regime::MixedPrecision), 12 * 6_738_415_616);
        // Checkpointing shrinks activations by far more than half at this length.
        let ckpt = estimate(
            &c,
            &EstimateArgs {
                gradient_checkpointing: true,
                ..args.clone()
            },
        )
        .unwrap();
        let plain = estimate(&c, &args).unwrap();
        assert!(ckpt.activations_bytes * 4 < plain.activations_bytes);
    }

    #[test]
    fn nf4_bytes_are_those_of_a_quantized_tensor() {
        for (rows, cols) in [(64, 64), (576, 1536), (100, 70)] {
            let w = candle_core::Tensor::randn(0f32, 1.0, (rows, cols), &candle_core::Device::Cpu)
                .unwrap();
            let q = Nf4Tensor::quantize(&w, &QuantConfig::nf4()).unwrap();
            assert_eq!(
                nf4_bytes((rows * cols) as u64),
                q.size_in_bytes() as u64,
                "{rows}×{cols}"
            );
        }
    }

    #[test]
    fn eight_bit_state_is_a_quarter_of_adamw_for_large_tensors() {
        let sizes = [1 << 20, 1000];
        let eight = optimizer_bytes(OptimizerName::PagedAdamW8bit, &sizes);
        let full = optimizer_bytes(OptimizerName::AdamWTorch, &sizes);
        assert_eq!(eight, 2 * (1 << 20) + 8 * (1 << 12) + 8 * 1000);
        assert_eq!(full, 8 * ((1 << 20) + 1000));
    }

    /// Fused Phi-3 projections count the same parameters as separate ones, with one adapter pair each.
    #[test]
    fn fused_projections_count_one_adapter_pair() {
        let mut phi = llama2_7b();
        let separate = counts(&phi, &all_linear(16)).unwrap();
        phi.architecture = crate::models::Architecture::parse("phi3").unwrap();
        let fused = counts(&phi, &all_linear(16)).unwrap();
        assert_eq!(fused.block_linear, separate.block_linear);
        assert!(
            fused.lora < separate.lora,
            "one adapter pair per fused projection"
        );
    }
}
