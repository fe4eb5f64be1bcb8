//! What differs from layer to layer of one model: the keys each layer's queries see ([`LayerAttention`]) and which
//! feed-forward blocks are mixtures of experts, with the experts' settings ([`MoeConfig`]).

use crate::ops::ClampedSwiglu;

/// Which keys a layer's queries see.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerAttention {
    /// Every earlier position (`full_attention`).
    Full,
    /// The last `sliding_window` positions (`sliding_attention`).
    Sliding,
}

/// The mixture-of-experts settings of a model (Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss), in transformers' terms.
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_local_experts`, `num_experts`).
    pub num_experts: usize,
    /// Experts each token goes to (`num_experts_per_tok`).
    pub num_experts_per_tok: usize,
    /// Each expert's MLP width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub moe_intermediate_size: usize,
    /// Qwen2-MoE's shared expert's MLP width, when it has one.
    pub shared_expert_intermediate_size: Option<usize>,
    /// The chosen experts' probabilities are renormalized to sum to 1 (always in Mixtral).
    pub norm_topk_prob: bool,
    /// Per layer: whether its feed-forward block is sparse (Qwen's `mlp_only_layers` and `decoder_sparse_step`
    /// make some dense, of width `intermediate_size`).
    pub sparse_layers: Vec<bool>,
    /// The auxiliary loss's weight in the training loss (`router_aux_loss_coef`).
    pub router_aux_loss_coef: f64,
    /// Whether training adds the auxiliary loss (`output_router_logits`, as transformers decides it).
    pub output_router_logits: bool,
    /// gpt-oss's experts: gate and up interleaved in one projection (`gate_up_proj[..., 0::2]` the gate), biases on
    /// both projections and on the router, the top-k's logits softmaxed, and this clamped SwiGLU.
    pub clamped_swiglu: Option<ClampedSwiglu>,
}
