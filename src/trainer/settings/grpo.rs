//! `[grpo]`: the fields of TRL 1.16's `GRPOConfig` that are GRPO's own, with TRL's names and defaults (the rest of
//! its arguments are `TrainingArguments`, in `[training]`), and the rewards a run config names (`[[grpo.reward_funcs]]`:
//! built-in checks, or a command in any language). A batch size counts completions, as in TRL:
//! `per_device_train_batch_size = 8` with `num_generations = 4` is two prompts.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::args::TrainingArguments;
use crate::error::{Error, Result};
use crate::models::sampling::SamplingConfig;
use crate::names::named_enum;

named_enum! {
    /// How the per-token losses of a batch are aggregated (TRL's `loss_type`).
    pub enum GrpoLossType ("loss_type") {
        /// Token losses summed over the generation batch's active tokens (DAPO): no length bias.
        Dapo = "dapo",
        /// Each sequence's mean token loss, averaged over sequences (the original GRPO).
        Grpo = "grpo",
        /// Token losses summed and divided by `batch × max_completion_length` (Dr. GRPO).
        DrGrpo = "dr_grpo",
        /// Token losses averaged over the micro-batch's active tokens.
        Bnpo = "bnpo",
    }
}

named_enum! {
    /// What the advantages are divided by (TRL's `scale_rewards`; `true` reads as `group`, `false` as `none`).
    pub enum ScaleRewards ("scale_rewards") {
        /// The standard deviation of the prompt's group.
        Group = "group",
        /// The standard deviation of the whole generation batch.
        Batch = "batch",
        /// Nothing (Dr. GRPO).
        None = "none",
    }
}

named_enum! {
    /// Whether the importance ratio is per token or one per sequence (GSPO).
    pub enum ImportanceSamplingLevel ("importance_sampling_level") {
        /// One ratio per token.
        Token = "token",
        /// The mean log-ratio over a completion's tokens, one ratio per sequence.
        Sequence = "sequence",
    }
}

/// A reward a run config names (`[[grpo.reward_funcs]]`, in order; each gives one float per completion, or none to
/// skip it as TRL's `None`). In the library a reward is any closure (see `trainer::dpo`'s sibling `grpo::Reward`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
pub enum RewardSpec {
    /// 1 when the completion's final answer equals the prompt row's `column`, else 0. The answer is the first
    /// capture group of `pattern`'s last match (default: the last number in the completion); numbers compare as
    /// numbers (`1,000`, `1000.0` and `$1000` are equal), other text after trimming.
    ExactAnswer {
        /// The name in the logs (`rewards/{name}/mean`); default `exact_answer`.
        name: Option<String>,
        /// The data column holding the reference answer.
        column: String,
        /// A regular expression whose first capture group is the answer.
        pattern: Option<String>,
    },
    /// `reward` (default 1) when the completion matches the regular expression `pattern`, else 0 (anchor it
    /// with `^…$` for a whole-completion format; `(?s)` lets `.` cross lines).
    Regex {
        /// The name in the logs; default `regex`.
        name: Option<String>,
        /// The regular expression.
        pattern: String,
        /// The reward of a match.
        reward: Option<f64>,
    },
    /// DAPO's soft overlong punishment (TRL's `get_soft_overlong_punishment`): 0 up to
    /// `max_completion_len − soft_punish_cache` tokens, then falling linearly to −1 at `max_completion_len`, −1 beyond.
    OverlongPenalty {
        /// The name in the logs; default `overlong_penalty`.
        name: Option<String>,
        /// The length at which the penalty reaches −1.
        max_completion_len: usize,
        /// How many tokens before it the penalty starts.
        soft_punish_cache: usize,
    },
    /// A command (program and arguments) that reads one JSON object per completion on its standard input
    /// (`{"prompt", "completion", …the prompt row's other columns}`) and writes one reward per line (a number, or
    /// `null` to skip); it runs once per generation batch and must finish within `timeout_seconds`.
    Command {
        /// The name in the logs; default the program's file name.
        name: Option<String>,
        /// Program and arguments (no shell).
        command: Vec<String>,
        /// Seconds it may take (default 600).
        timeout_seconds: Option<f64>,
    },
}

impl RewardSpec {
    /// The name logged for it (`rewards/{name}/mean`).
    pub fn name(&self) -> String {
        let given = match self {
            RewardSpec::ExactAnswer { name, .. }
            | RewardSpec::Regex { name, .. }
            | RewardSpec::OverlongPenalty { name, .. }
            | RewardSpec::Command { name, .. } => name.clone(),
        };
        given.unwrap_or_else(|| match self {
            RewardSpec::ExactAnswer { .. } => "exact_answer".into(),
            RewardSpec::Regex { .. } => "regex".into(),
            RewardSpec::OverlongPenalty { .. } => "overlong_penalty".into(),
            RewardSpec::Command { command, .. } => command
                .first()
                .and_then(|p| std::path::Path::new(p).file_name())
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "command".into()),
        })
    }
}

/// GRPO's settings, with TRL 1.16's names and defaults.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GrpoConfig {
    /// Completions sampled per prompt (the group whose rewards are compared).
    pub num_generations: usize,
    /// The longest completion, in tokens.
    pub max_completion_length: usize,
    /// Sampling temperature; the log-probabilities of the loss use it too, as TRL's.
    pub temperature: f64,
    /// Nucleus sampling threshold (1 keeps every token).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (0: off).
    pub top_k: usize,
    /// Keep only tokens at least `min_p` × the most likely one's probability.
    pub min_p: Option<f64>,
    /// transformers' repetition penalty on the tokens seen (1: off).
    pub repetition_penalty: f64,
    /// The KL coefficient against the reference — the base model, adapters off (0: no reference at all).
    pub beta: f64,
    /// The lower clipping bound of the importance ratio, `1 − epsilon`.
    pub epsilon: f64,
    /// The upper clipping bound, `1 + epsilon_high` (default `epsilon`; DAPO's clip-higher).
    pub epsilon_high: Option<f64>,
    /// An upper bound on the unclipped ratio (two-sided clipping, INTELLECT-2), when set.
    pub delta: Option<f64>,
    /// How token losses are aggregated.
    pub loss_type: GrpoLossType,
    /// What the advantages are divided by.
    #[serde(deserialize_with = "scale_rewards_or_bool")]
    pub scale_rewards: ScaleRewards,
    /// Optimizer passes over each generation batch (μ in the paper).
    pub num_iterations: usize,
    /// Accumulation steps one generation batch feeds (default `gradient_accumulation_steps`).
    pub steps_per_generation: Option<usize>,
    /// Completions generated at once (default `per_device_train_batch_size × steps_per_generation`).
    pub generation_batch_size: Option<usize>,
    /// Per-token or per-sequence importance ratios.
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// Leave completions that hit `max_completion_length` without an end-of-sequence token out of the loss.
    pub mask_truncated_completions: bool,
    /// Train only on the tokens whose entropy is in this top share of the batch (1: every token).
    pub top_entropy_quantile: f64,
    /// Multiply the KL term by the importance ratio (DeepSeek-V3.2's unbiased estimator; TRL 1.16's default).
    pub use_bias_correction_kl: bool,
    /// One weight per reward (1 each when unset).
    pub reward_weights: Option<Vec<f64>>,
    /// Shuffle the prompts each epoch.
    pub shuffle_dataset: bool,
    /// Train on completions generated elsewhere, one JSON line per prompt (`{"prompt", "completions": [...],
    /// "rewards"?: [...]}`), in file order, instead of sampling them.
    pub rollouts: Option<PathBuf>,
    /// The rewards, in order (the library's `Trainer::new_grpo` takes closures too).
    pub reward_funcs: Vec<RewardSpec>,
}

impl Default for GrpoConfig {
    fn default() -> Self {
        GrpoConfig {
            num_generations: 8,
            max_completion_length: 512,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
            beta: 0.0,
            epsilon: 0.2,
            epsilon_high: None,
            delta: None,
            loss_type: GrpoLossType::Dapo,
            scale_rewards: ScaleRewards::Group,
            num_iterations: 1,
            steps_per_generation: None,
            generation_batch_size: None,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            mask_truncated_completions: false,
            top_entropy_quantile: 1.0,
            use_bias_correction_kl: true,
            reward_weights: None,
            shuffle_dataset: true,
            rollouts: None,
            reward_funcs: Vec::new(),
        }
    }
}

/// `scale_rewards` as a name, or TRL's booleans (`true` = `group`, `false` = `none`).
fn scale_rewards_or_bool<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<ScaleRewards, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum NameOrBool {
        Bool(bool),
        Name(String),
    }
    match NameOrBool::deserialize(d)? {
        NameOrBool::Bool(true) => Ok(ScaleRewards::Group),
        NameOrBool::Bool(false) => Ok(ScaleRewards::None),
        NameOrBool::Name(n) => n.parse().map_err(serde::de::Error::custom),
    }
}

/// TRL `GRPOConfig` fields this trainer does not have, with why and what to do; a run config naming one gets this
/// message rather than "unknown key".
pub const REFUSED_TRL_FIELDS: &[(&str, &str)] = &[
    ("use_vllm", "generation runs in this process on the training model (no vLLM server); for completions generated elsewhere, write them to a file and set rollouts"),
    ("vllm_mode", "there is no vLLM here; see rollouts for completions generated elsewhere"),
    ("entropy_coef", "the entropy bonus is not built"),
    ("use_adaptive_entropy", "the entropy bonus is not built"),
    ("sync_ref_model", "the reference is the base model with the adapter off; it is never synchronized"),
    ("off_policy_mask_threshold", "off-policy sequence masking is not built"),
    ("multi_objective_aggregation", "rewards are weighted and summed, then normalized (TRL's default, sum_then_normalize)"),
    ("num_generations_eval", "evaluation samples num_generations completions per prompt"),
    ("max_tool_calling_iterations", "tool calls are not built"),
    ("cast_lm_head_to_fp32", "the log-probabilities are always computed in float32 (float64 for a float64 model)"),
    ("vllm_importance_sampling_correction", "there is no vLLM here"),
];

impl GrpoConfig {
    /// How completions are sampled.
    pub fn sampling(&self) -> SamplingConfig {
        SamplingConfig {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
        }
    }

    /// The upper clipping offset (`epsilon_high`, or `epsilon`).
    pub fn epsilon_high(&self) -> f64 {
        self.epsilon_high.unwrap_or(self.epsilon)
    }

    /// Checks the values alone; `path` names the config in errors.
    pub fn validate(&self, path: &str) -> Result<()> {
        let bad = |m: String| Err(Error::InvalidInput(format!("{path}: [grpo]: {m}")));
        if self.num_generations < 2 {
            return bad(format!(
                "num_generations = {}: GRPO compares each completion with the others of its prompt, so it needs \
                 at least 2",
                self.num_generations
            ));
        }
        if self.max_completion_length == 0 {
            return bad("max_completion_length = 0: must be at least 1".into());
        }
        if let Some(problem) = self.sampling().problem() {
            return bad(problem);
        }
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            return bad(format!("beta = {}: must be a number ≥ 0", self.beta));
        }
        if !(self.epsilon.is_finite() && (0.0..1.0).contains(&self.epsilon)) {
            return bad(format!(
                "epsilon = {}: must be in [0, 1) (the ratio is clipped below at 1 − epsilon)",
                self.epsilon
            ));
        }
        if let Some(e) = self.epsilon_high.filter(|e| !(e.is_finite() && *e >= 0.0)) {
            return bad(format!("epsilon_high = {e}: must be a number ≥ 0"));
        }
        if let Some(d) = self.delta.filter(|d| !(d.is_finite() && *d > 1.0)) {
            return bad(format!(
                "delta = {d}: must be a number > 1 (the bound on the unclipped ratio)"
            ));
        }
        if self.num_iterations == 0 {
            return bad("num_iterations = 0: must be at least 1".into());
        }
        if self.steps_per_generation == Some(0) || self.generation_batch_size == Some(0) {
            return bad("steps_per_generation and generation_batch_size must be at least 1".into());
        }
        if !(self.top_entropy_quantile > 0.0 && self.top_entropy_quantile <= 1.0) {
            return bad(format!(
                "top_entropy_quantile = {}: must be in (0, 1] (1 trains on every token)",
                self.top_entropy_quantile
            ));
        }
        if let Some(w) = &self.reward_weights {
            if let Some(x) = w.iter().find(|x| !x.is_finite()) {
                return bad(format!(
                    "reward_weights holds {x}: every weight must be finite"
                ));
            }
        }
        for (i, spec) in self.reward_funcs.iter().enumerate() {
            let at = format!("reward_funcs[{i}] ({})", spec.name());
            match spec {
                RewardSpec::OverlongPenalty {
                    max_completion_len,
                    soft_punish_cache,
                    ..
                } if soft_punish_cache > max_completion_len || *soft_punish_cache == 0 => {
                    return bad(format!(
                        "{at}: soft_punish_cache = {soft_punish_cache} must be in [1, max_completion_len = \
                         {max_completion_len}]"
                    ));
                }
                RewardSpec::Command { command, timeout_seconds, .. } => {
                    if command.is_empty() {
                        return bad(format!(
                            "{at}: command is empty: give the program and its arguments, e.g. [\"python3\", \
                             \"score.py\"]"
                        ));
                    }
                    if let Some(t) = timeout_seconds.filter(|t| !(t.is_finite() && *t > 0.0)) {
                        return bad(format!("{at}: timeout_seconds = {t}: must be positive"));
                    }
                }
                RewardSpec::Regex { pattern, .. } => {
                    if let Err(e) = regex::Regex::new(pattern) {
                        return bad(format!("{at}: pattern is not a regular expression: {e}"));
                    }
                }
                RewardSpec::ExactAnswer { pattern: Some(pattern), .. } => {
                    match regex::Regex::new(pattern) {
                        Err(e) => {
                            return bad(format!("{at}: pattern is not a regular expression: {e}"))
                        }
                        Ok(r) if r.captures_len() < 2 => {
                            return bad(format!(
                                "{at}: pattern {pattern:?} has no capture group: put the answer in one, e.g. \
                                 \"answer: (.+)\""
                            ))
                        }
                        Ok(_) => {}
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The generation batch's size in completions and how many accumulation steps it feeds, as TRL's
    /// `GRPOConfig.__post_init__` derives them from the batch sizes; `path` names the config in errors.
    pub fn generation_shape(&self, args: &TrainingArguments, path: &str) -> Result<(usize, usize)> {
        let bad = |m: String| Err(Error::InvalidInput(format!("{path}: [grpo]: {m}")));
        let batch = args.per_device_train_batch_size;
        let (size, steps) = match (self.generation_batch_size, self.steps_per_generation) {
            (None, None) => (
                batch * args.gradient_accumulation_steps,
                args.gradient_accumulation_steps,
            ),
            (Some(size), None) => {
                if size % batch != 0 {
                    return bad(format!(
                        "generation_batch_size = {size} must be a multiple of [training] \
                         per_device_train_batch_size = {batch}"
                    ));
                }
                (size, size / batch)
            }
            (None, Some(steps)) => (batch * steps, steps),
            (Some(_), Some(_)) => {
                return bad(
                    "generation_batch_size and steps_per_generation are both set: set one (each follows from \
                     the other and per_device_train_batch_size)"
                        .into(),
                )
            }
        };
        if size % self.num_generations != 0 {
            return bad(format!(
                "the generation batch of {size} completions (per_device_train_batch_size × \
                 steps_per_generation) is not a whole number of groups of num_generations = {}: make it a \
                 multiple (batch sizes count completions, as in TRL)",
                self.num_generations
            ));
        }
        Ok((size, steps))
    }

    /// Why GRPO cannot train on `world_size` processes, if it cannot: the one rule a run's ranks and `qlora estimate
    /// --grpo --world-size` both apply.
    pub fn world_size_problem(world_size: usize) -> Option<&'static str> {
        (world_size > 1).then_some(
            "GRPO runs in one process for now (each rank would need the whole prompt groups of its generation batch \
             and the group statistics of the others)",
        )
    }

    /// Refuses `[training]` settings that have no meaning for GRPO, and checks the batch shape, which it returns
    /// ([`GrpoConfig::generation_shape`]); `path` names the config in errors.
    pub fn check_training(&self, args: &TrainingArguments, path: &str) -> Result<(usize, usize)> {
        if args.predict_with_generate {
            return Err(Error::InvalidInput(format!(
                "{path}: [training] predict_with_generate = true: GRPO's evaluation samples completions and \
                 scores them with the rewards; turn it off"
            )));
        }
        if args.group_by_length {
            return Err(Error::InvalidInput(format!(
                "{path}: [training] group_by_length = true: GRPO deals prompts in groups of num_generations \
                 (TRL's RepeatSampler); turn it off"
            )));
        }
        self.generation_shape(args, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_trl_names_and_defaults_and_refuses_bad_values_by_key() {
        let c: GrpoConfig = toml::from_str("").unwrap();
        assert_eq!(
            (
                c.num_generations,
                c.max_completion_length,
                c.loss_type,
                c.beta
            ),
            (8, 512, GrpoLossType::Dapo, 0.0)
        );
        let c: GrpoConfig = toml::from_str("scale_rewards = false").unwrap();
        assert_eq!(c.scale_rewards, ScaleRewards::None);
        let c: GrpoConfig = toml::from_str("scale_rewards = \"batch\"").unwrap();
        assert_eq!(c.scale_rewards, ScaleRewards::Batch);
        let err = toml::from_str::<GrpoConfig>("loss_type = \"cispo\"")
            .unwrap_err()
            .to_string();
        assert!(err.contains("cispo") && err.contains("dr_grpo"), "{err}");
        let c: GrpoConfig = toml::from_str(
            "[[reward_funcs]]\ntype = \"exact_answer\"\ncolumn = \"answer\"\n\
             [[reward_funcs]]\ntype = \"command\"\ncommand = [\"python3\", \"score.py\"]",
        )
        .unwrap();
        assert_eq!(c.reward_funcs[0].name(), "exact_answer");
        assert_eq!(c.reward_funcs[1].name(), "python3");
        for (text, key) in [
            ("num_generations = 1", "num_generations"),
            ("temperature = 0.0", "temperature"),
            ("top_p = 0.0", "top_p"),
            ("epsilon = 1.5", "epsilon"),
            ("delta = 0.5", "delta"),
            ("num_iterations = 0", "num_iterations"),
            ("top_entropy_quantile = 0.0", "top_entropy_quantile"),
            (
                "[[reward_funcs]]\ntype = \"regex\"\npattern = \"(\"",
                "reward_funcs[0] (regex)",
            ),
            (
                "[[reward_funcs]]\ntype = \"exact_answer\"\ncolumn = \"a\"\npattern = \"\\\\d+\"",
                "capture group",
            ),
            (
                "[[reward_funcs]]\ntype = \"command\"\ncommand = []",
                "command is empty",
            ),
        ] {
            let c: GrpoConfig = toml::from_str(text).unwrap();
            let err = c.validate("run.toml").unwrap_err().to_string();
            assert!(err.contains(key) && err.contains("[grpo]"), "{text}: {err}");
        }
    }

    #[test]
    fn the_generation_batch_follows_trls_rules() {
        let args = TrainingArguments {
            per_device_train_batch_size: 4,
            gradient_accumulation_steps: 2,
            ..Default::default()
        };
        let grpo = |text: &str| -> GrpoConfig { toml::from_str(text).unwrap() };
        let c = grpo("num_generations = 4");
        assert_eq!(c.generation_shape(&args, "r").unwrap(), (8, 2));
        let c = grpo("num_generations = 4\nsteps_per_generation = 4");
        assert_eq!(c.generation_shape(&args, "r").unwrap(), (16, 4));
        let c = grpo("num_generations = 4\ngeneration_batch_size = 12");
        assert_eq!(c.generation_shape(&args, "r").unwrap(), (12, 3));
        for text in [
            "num_generations = 4\ngeneration_batch_size = 6",
            "num_generations = 3",
            "num_generations = 4\ngeneration_batch_size = 8\nsteps_per_generation = 2",
        ] {
            let err = grpo(text)
                .generation_shape(&args, "r")
                .unwrap_err()
                .to_string();
            assert!(err.contains("[grpo]"), "{text}: {err}");
        }
    }
}
