//! transformers' `fsdp` and `fsdp_config` arguments: which of FSDP's options apply to a LoRA model whose frozen base
//! is sharded layer by layer (`models::shard`), and the refusal, by name, of those that do not.

use serde::{Deserialize, Serialize};

/// How the frozen base is shared out, from `fsdp` ("full_shard", with "auto_wrap" and "offload" words as
/// transformers takes them) and `fsdp_config`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FsdpPlan {
    /// Every rank keeps `1/world_size` of each decoder layer's weights and gathers the rest before the layer runs.
    pub full_shard: bool,
    /// The shards live in host memory and travel to the GPU for each gather (`"offload"`, `offload_params`).
    pub offload: bool,
    /// A layer's forward starts gathering the next layer (`forward_prefetch`).
    pub forward_prefetch: bool,
    /// A layer's recomputation in the backward starts gathering the layer before it (`backward_prefetch`, unless
    /// `"no_prefetch"`).
    pub backward_prefetch: bool,
}

impl FsdpPlan {
    /// Rank `rank` of `world_size`'s place in the sharded job this plan describes.
    pub fn sharding(
        &self,
        rank: usize,
        world_size: usize,
    ) -> crate::Result<std::sync::Arc<crate::models::Sharding>> {
        let sharding = crate::models::Sharding::new(rank, world_size, self.offload)?;
        sharding.set_prefetch(self.forward_prefetch, self.backward_prefetch);
        Ok(sharding)
    }
}

/// transformers' `fsdp_config` (accelerate's FSDP plugin settings), the keys that apply here.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsdpConfig {
    /// The modules each FSDP unit wraps: here always one decoder layer (transformers' `LlamaDecoderLayer`, …), so
    /// a list naming the model's decoder layer class is what the sharding does anyway.
    pub transformer_layer_cls_to_wrap: Option<Vec<String>>,
    /// Size-based wrapping: refused (a unit is a decoder layer).
    pub min_num_params: Option<u64>,
    /// `"backward_pre"` (the default) or `"backward_post"`: the backward's recomputation of a layer starts
    /// gathering the layer before it (both mean that here: a layer's weights are gathered for its recomputation,
    /// which comes before its backward); `"no_prefetch"`: each layer gathers as its recomputation starts.
    pub backward_prefetch: Option<String>,
    /// Whether a layer's forward starts gathering the next layer before it computes (on GPUs the gather runs on
    /// the communicator's stream beside the layer's kernels). False (the default, as in transformers): each layer
    /// gathers when it starts, after the previous layer's kernels (the host does not wait, the GPU does).
    pub forward_prefetch: bool,
    /// Whether at most two layers' gathers are in flight: true here (the current and the next layer's).
    pub limit_all_gathers: Option<bool>,
    /// accelerate's way to keep host memory low (rank 0 reads, the others receive): here, whichever this says,
    /// each rank reads its part of every weight of a safetensors folder (about 1/N of its bytes; of a bitsandbytes
    /// folder, its blocks as stored) as the weight's layer moves to the GPU, and the ranks gather it; a GGUF file
    /// and the experts of a mixture of experts are read whole first.
    pub cpu_ram_efficient_loading: bool,
    /// Whether rank 0's weights are broadcast to the others after loading: each rank loads the same files, so the
    /// shards agree without it.
    pub sync_module_states: bool,
    /// Accepted for compatibility: the adapter's parameters are never flattened.
    pub use_orig_params: Option<bool>,
    /// transformers' FSDP option for checkpointing each unit: the same as `gradient_checkpointing`.
    pub activation_checkpointing: Option<bool>,
    /// accelerate's FSDP version (1 or 2): the sharding is the same.
    pub version: Option<u8>,
    /// FSDP2's: true (free a layer's gathered weights after its forward) is what the sharding does; false refused.
    pub reshard_after_forward: Option<bool>,
    /// Whether the shards live in host memory between uses: accelerate's name for `fsdp = "full_shard offload"`.
    /// Each layer's share is then copied to the GPU before its gather (the GPU holds the layer being run and that
    /// copy).
    pub offload_params: bool,
}

/// `fsdp`'s words transformers knows and that are refused here, with the reason.
const REFUSED_WORDS: &[(&str, &str)] = &[
    (
        "shard_grad_op",
        "ZeRO-2 keeps the whole base on every rank, which is what data-parallel training (without `fsdp`) does",
    ),
    (
        "hybrid_shard",
        "shards within a node only; use \"full_shard\" (one node)",
    ),
    (
        "hybrid_shard_zero2",
        "shards within a node only; use \"full_shard\" (one node)",
    ),
    (
        "no_shard",
        "that is data-parallel training: leave `fsdp` unset",
    ),
];

impl FsdpConfig {
    /// The plan of `fsdp` (space-separated words, as transformers takes them) with this config, or why it is
    /// refused (the message names the key).
    pub fn plan(
        &self,
        fsdp: Option<&str>,
        gradient_checkpointing: bool,
    ) -> Result<Option<FsdpPlan>, String> {
        let words: Vec<&str> = fsdp.unwrap_or("").split_whitespace().collect();
        if words.is_empty() {
            return match self == &FsdpConfig::default() {
                true => Ok(None),
                false => {
                    Err("fsdp_config is set but fsdp is not: set fsdp = \"full_shard\"".into())
                }
            };
        }
        let mut full_shard = false;
        let mut offload = self.offload_params;
        for word in &words {
            match *word {
                "full_shard" => full_shard = true,
                "auto_wrap" => {}
                "offload" => offload = true,
                other => {
                    return Err(match REFUSED_WORDS.iter().find(|(w, _)| w == &other) {
                        Some((_, why)) => format!("fsdp = \"{other}\" is not supported: {why}"),
                        None => format!(
                            "fsdp: unknown option \"{other}\" (use \"full_shard\", optionally with \"auto_wrap\")"
                        ),
                    })
                }
            }
        }
        if !full_shard {
            return Err(format!(
                "fsdp = \"{}\" names no sharding strategy: add \"full_shard\"",
                words.join(" ")
            ));
        }
        if !gradient_checkpointing || self.activation_checkpointing == Some(false) {
            return Err(
                "fsdp needs gradient_checkpointing = true: a layer's gathered weights are freed after its forward \
                 and gathered again for its backward, which recomputes the layer"
                    .into(),
            );
        }
        if self.min_num_params.is_some() {
            return Err(
                "fsdp_config.min_num_params is not supported: each FSDP unit is one decoder layer \
                 (transformer_layer_cls_to_wrap)"
                    .into(),
            );
        }
        if let Some(p) = self
            .backward_prefetch
            .as_deref()
            .filter(|p| !matches!(*p, "backward_pre" | "backward_post" | "no_prefetch"))
        {
            return Err(format!(
                "fsdp_config.backward_prefetch = \"{p}\": use \"backward_pre\", \"backward_post\" or \"no_prefetch\""
            ));
        }
        if self.limit_all_gathers == Some(false) {
            return Err(
                "fsdp_config.limit_all_gathers = false is not supported: at most the current and the next layer \
                 are gathered"
                    .into(),
            );
        }
        if self.reshard_after_forward == Some(false) {
            return Err(
                "fsdp_config.reshard_after_forward = false is not supported: a layer's gathered weights are freed \
                 after its forward"
                    .into(),
            );
        }
        if let Some(v) = self.version.filter(|v| !matches!(v, 1 | 2)) {
            return Err(format!(
                "fsdp_config.version = {v}: FSDP's versions are 1 and 2"
            ));
        }
        Ok(Some(FsdpPlan {
            full_shard,
            offload,
            forward_prefetch: self.forward_prefetch,
            backward_prefetch: self.backward_prefetch.as_deref() != Some("no_prefetch"),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_shard_is_the_one_strategy_and_the_rest_is_refused_by_name() {
        let config = FsdpConfig::default();
        assert_eq!(config.plan(None, true), Ok(None));
        assert_eq!(
            config.plan(Some("full_shard auto_wrap"), true),
            Ok(Some(FsdpPlan {
                full_shard: true,
                offload: false,
                forward_prefetch: false,
                backward_prefetch: true,
            }))
        );
        let offloaded = FsdpConfig {
            offload_params: true,
            ..Default::default()
        };
        for (fsdp, config) in [("full_shard offload", &config), ("full_shard", &offloaded)] {
            assert_eq!(
                config.plan(Some(fsdp), true),
                Ok(Some(FsdpPlan {
                    full_shard: true,
                    offload: true,
                    forward_prefetch: false,
                    backward_prefetch: true,
                }))
            );
        }
        for (fsdp, config, needle) in [
            ("shard_grad_op", FsdpConfig::default(), "shard_grad_op"),
            ("auto_wrap", FsdpConfig::default(), "add \"full_shard\""),
            (
                "full_shard sharded",
                FsdpConfig::default(),
                "unknown option \"sharded\"",
            ),
            (
                "full_shard",
                FsdpConfig {
                    min_num_params: Some(1_000_000),
                    ..Default::default()
                },
                "min_num_params",
            ),
            (
                "full_shard",
                FsdpConfig {
                    backward_prefetch: Some("backward".into()),
                    ..Default::default()
                },
                "backward_pre",
            ),
        ] {
            let err = config.plan(Some(fsdp), true).unwrap_err();
            assert!(err.contains(needle), "{fsdp}: {err}");
        }
        let err = FsdpConfig::default()
            .plan(Some("full_shard"), false)
            .unwrap_err();
        assert!(err.contains("gradient_checkpointing"), "{err}");
        let prefetching = FsdpConfig {
            forward_prefetch: true,
            backward_prefetch: Some("no_prefetch".into()),
            ..Default::default()
        };
        let plan = prefetching.plan(Some("full_shard"), true).unwrap().unwrap();
        assert!(plan.forward_prefetch && !plan.backward_prefetch);
        let stray = prefetching;
        assert!(stray
            .plan(None, true)
            .unwrap_err()
            .contains("fsdp_config is set"));
    }
}
