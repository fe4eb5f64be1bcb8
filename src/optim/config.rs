//! Which optimizer and its hyper-parameters, under `TrainingArguments`' names, and which parameters decay.

use crate::names::named_enum;

named_enum! {
    /// The `optim` names of `TrainingArguments` this crate implements.
    pub enum OptimizerName ("optim") {
        /// `adamw_torch` (also `adamw_torch_fused`, transformers 5's default).
        AdamWTorch = "adamw_torch" | "adamw_torch_fused",
        /// `adamw_8bit` / `adamw_bnb_8bit`.
        AdamW8bit = "adamw_8bit" | "adamw_bnb_8bit",
        /// `paged_adamw_8bit`.
        PagedAdamW8bit = "paged_adamw_8bit",
        /// `paged_adamw_32bit`.
        PagedAdamW32bit = "paged_adamw_32bit",
        /// `sgd`.
        Sgd = "sgd",
    }
}

impl OptimizerName {
    /// Whether its state is paged: kept in host memory and brought to the GPU for each update.
    pub fn is_paged(self) -> bool {
        matches!(
            self,
            OptimizerName::PagedAdamW8bit | OptimizerName::PagedAdamW32bit
        )
    }

    /// Whether its moments are stored in 8 bits (bitsandbytes' blockwise quantization).
    pub fn is_8bit(self) -> bool {
        matches!(
            self,
            OptimizerName::AdamW8bit | OptimizerName::PagedAdamW8bit
        )
    }
}

/// Optimizer hyper-parameters (`TrainingArguments` names).
#[derive(Clone, Debug, PartialEq)]
pub struct OptimizerConfig {
    /// Which optimizer.
    pub name: OptimizerName,
    /// `adam_beta1`.
    pub beta1: f64,
    /// `adam_beta2`.
    pub beta2: f64,
    /// `adam_epsilon`.
    pub eps: f64,
    /// `weight_decay` (not applied to biases and norm weights).
    pub weight_decay: f64,
    /// SGD momentum.
    pub momentum: f64,
    /// 8-bit optimizers keep f32 state for tensors with fewer elements (bitsandbytes' `min_8bit_size`).
    pub min_8bit_size: usize,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            name: OptimizerName::AdamWTorch,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            momentum: 0.0,
            min_8bit_size: 4096,
        }
    }
}

/// The HF Trainer's rule (`get_decay_parameter_names`): no weight decay for biases and norm weights.
pub fn decays(name: &str) -> bool {
    static NO_DECAY: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    let re = NO_DECAY.get_or_init(|| {
        regex::Regex::new(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")
            .expect("valid regex")
    });
    !re.is_match(&name.to_lowercase())
}
