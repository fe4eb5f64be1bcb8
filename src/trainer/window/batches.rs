//! What a method's accumulation window takes from the loop and gives back: the window's micro-batches (of every
//! rank, with the run's index of the first) and its outcome (the loss sum and what it averages over, tokens,
//! gradients, an auxiliary loss, the method's metrics).

use std::collections::BTreeMap;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

use super::shard::Shard;

/// The micro-batches of one window, of every rank (micro-batch `k` is rank `k % world_size`'s), and the run's
/// index of the first.
pub(crate) struct WindowBatches<'a> {
    /// The micro-batches: indices of the method's training items.
    pub batches: &'a [Vec<usize>],
    /// The run's index of the first micro-batch (seeds dropout and noise).
    pub first_micro: usize,
    /// This process's share.
    pub shard: Shard,
}

/// The outcome of one accumulation window.
pub(crate) struct WindowOutput {
    /// Sum of this rank's losses (token losses, or micro-batch losses): a float64 scalar on the model's device
    /// (read with the gradient norm).
    pub loss_sum: Tensor,
    /// What the loss is averaged over, of all ranks (label tokens, or micro-batches): the window's loss is
    /// `loss_sum / counted` (summed over the ranks), and its metrics are `metrics / counted`.
    pub counted: usize,
    /// Input tokens, of all ranks.
    pub input_tokens: usize,
    /// Gradients of the trainable variables, summed over this rank's micro-batches.
    pub grads: GradStore,
    /// A mixture of experts' auxiliary load-balancing loss (with `output_router_logits`), the mean of this rank's
    /// micro-batches': a float64 scalar on the device.
    pub aux_loss: Option<Tensor>,
    /// The method's metrics ([`Method::metric_names`](crate::trainer::methods::method::Method::metric_names)),
    /// summed as the loss is: float64 on the device.
    pub metrics: Option<Tensor>,
    /// Metrics the method computed on the host, already averaged over the window, logged as they are (GRPO's, whose
    /// names depend on its rewards).
    pub host_metrics: BTreeMap<String, f64>,
}

/// How a method whose items are prompts sampled in groups (GRPO) has the loop deal them, as TRL's `RepeatSampler`:
/// each epoch's prompts in order (shuffled with `shuffle`), cut into generation batches of `prompts_per_generation`
/// (an incomplete last one dropped), each dealt as `micro_batches` micro-batches that all list the generation
/// batch's prompts — the method splits the completions it generates for them among those micro-batches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct PromptGroups {
    /// Prompts per generation batch.
    pub prompts_per_generation: usize,
    /// Micro-batches each generation batch feeds (`steps_per_generation × num_iterations`).
    pub micro_batches: usize,
    /// Whether the prompts are shuffled each epoch.
    pub shuffle: bool,
}
