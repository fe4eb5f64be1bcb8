//! The two ways a `config.json` declares a mixture of experts, read and written for the families that use them:
//! Mixtral's keys (gpt-oss's too) and Qwen-MoE's.

use std::path::Path;

use serde_json::Value;

use crate::error::Result;
use crate::models::config::keys::{bad, HfConfig};
use crate::models::config::layers::MoeConfig;
use crate::ops::ClampedSwiglu;

/// Which keys name a family's experts.
#[derive(Clone, Copy, Debug)]
pub(super) enum ExpertKeys {
    /// Mixtral's: `num_local_experts` experts as wide as `intermediate_size`, every layer sparse, the chosen
    /// experts' probabilities always renormalized.
    Mixtral,
    /// Qwen-MoE's: `num_experts` experts of `moe_intermediate_size`, `norm_topk_prob`, and layers left dense by
    /// `mlp_only_layers` and `decoder_sparse_step`.
    Qwen,
}

/// A family's experts as its `config.json` declares them, the family's defaults applied.
pub(super) struct Experts {
    /// The keys they are read from.
    pub keys: ExpertKeys,
    /// Experts per sparse layer.
    pub num_experts: usize,
    /// Experts each token goes to.
    pub num_experts_per_tok: usize,
    /// Each expert's MLP width.
    pub width: usize,
    /// The shared expert's MLP width (Qwen2-MoE).
    pub shared_width: Option<usize>,
    /// gpt-oss's activation.
    pub clamped_swiglu: Option<ClampedSwiglu>,
}

impl Experts {
    /// The settings these experts make with the keys every family reads alike (transformers 5.23's defaults for
    /// what the file leaves out), each checked.
    pub(super) fn read(self, hf: &HfConfig, path: &Path) -> Result<MoeConfig> {
        let (experts, per_token) = (self.num_experts, self.num_experts_per_tok);
        if experts == 0 {
            // The count itself is wrong, not the share of it a token takes: name the key the file used.
            let key = match self.keys {
                ExpertKeys::Qwen if hf.num_experts.is_none() && hf.num_local_experts.is_some() => {
                    "num_local_experts"
                }
                ExpertKeys::Qwen => "num_experts",
                ExpertKeys::Mixtral => "num_local_experts",
            };
            return Err(bad(
                path,
                format!("`{key}` = 0: a mixture of experts has at least 1 expert (and at least `num_experts_per_tok`)"),
            ));
        }
        if per_token == 0 || per_token > experts {
            return Err(bad(
                path,
                format!("num_experts_per_tok = {per_token}: a token goes to 1 to {experts} experts (the model has {experts})"),
            ));
        }
        let step = hf.decoder_sparse_step.unwrap_or(1);
        if step == 0 {
            return Err(bad(path, "`decoder_sparse_step` must be at least 1".into()));
        }
        let mixtral = matches!(self.keys, ExpertKeys::Mixtral);
        let dense = hf.mlp_only_layers.clone().unwrap_or_default();
        // transformers: sparse unless listed in `mlp_only_layers`, and only every `decoder_sparse_step`-th layer.
        let sparse_layers = (0..hf.num_hidden_layers)
            .map(|l| mixtral || (!dense.contains(&l) && (l + 1) % step == 0))
            .collect();
        let coef = hf.router_aux_loss_coef.unwrap_or(0.001);
        if !coef.is_finite() || coef < 0.0 {
            return Err(bad(
                path,
                format!("`router_aux_loss_coef` must be a non-negative number, not {coef}"),
            ));
        }
        Ok(MoeConfig {
            num_experts: experts,
            num_experts_per_tok: per_token,
            moe_intermediate_size: self.width,
            shared_expert_intermediate_size: self.shared_width,
            // gpt-oss's softmax over the top-k logits is the renormalized top-k of the softmax.
            norm_topk_prob: mixtral || hf.norm_topk_prob.unwrap_or(false),
            sparse_layers,
            router_aux_loss_coef: coef,
            output_router_logits: hf.output_router_logits.unwrap_or(false),
            clamped_swiglu: self.clamped_swiglu,
        })
    }
}

impl ExpertKeys {
    /// Writes `moe` into `config` under these keys; [`Experts::read`] reads them back to equal settings.
    pub(super) fn write(self, moe: &MoeConfig, config: &mut Value) {
        let v = config;
        v["num_experts_per_tok"] = moe.num_experts_per_tok.into();
        v["router_aux_loss_coef"] = moe.router_aux_loss_coef.into();
        v["output_router_logits"] = moe.output_router_logits.into();
        if let Some(c) = moe.clamped_swiglu {
            v["swiglu_alpha"] = c.alpha.into();
            v["swiglu_limit"] = c.limit.into();
        }
        if let Some(width) = moe.shared_expert_intermediate_size {
            v["shared_expert_intermediate_size"] = width.into();
        }
        match self {
            ExpertKeys::Mixtral => v["num_local_experts"] = moe.num_experts.into(),
            ExpertKeys::Qwen => {
                v["num_experts"] = moe.num_experts.into();
                v["moe_intermediate_size"] = moe.moe_intermediate_size.into();
                v["norm_topk_prob"] = moe.norm_topk_prob.into();
                v["decoder_sparse_step"] = 1.into();
                let dense: Vec<usize> = (0..moe.sparse_layers.len())
                    .filter(|l| !moe.sparse_layers[*l])
                    .collect();
                v["mlp_only_layers"] = dense.into();
            }
        }
    }
}
