//! A GRPO generation batch, as TRL 1.16's `_generate_and_score_completions` makes it: `num_generations`
//! completions of each of its prompts — sampled now on the training model (NF4 base and live adapter, KV cache, one
//! batch per prompt) or read from a rollouts file —, scored by the rewards, turned into advantages, with the
//! log-probabilities the loss needs from the time of generation (the policy's when it will have moved by the time
//! the batch is used, the reference's with `beta` ≠ 0), shuffled and split into the micro-batches it feeds. It is
//! kept in checkpoints, so a run resumed between two of its micro-batches uses the same completions.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Device};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::loss::{advantages, nanmean, nanstd};
use super::rewards::{Reward, RewardInputs};
use crate::adapter::Adapters;
use crate::data::{collate, Prompt, PromptDataset, TokenizedExample};
use crate::error::{Error, Result};
use crate::models::generate::{generate_group, GroupCompletion};
use crate::models::{Checkpointing, LlamaModel, TextTokenizer};
use crate::ops::IGNORE_INDEX;
use crate::rng::splitmix;
use crate::trainer::settings::grpo::GrpoConfig;

/// One completion of a generation batch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Completion {
    /// Its prompt's index in the prompt set.
    pub prompt: usize,
    /// Its tokens (an ended completion's last is its end-of-sequence token).
    pub ids: Vec<u32>,
    /// No end-of-sequence token within `max_completion_length`.
    pub truncated: bool,
    /// Its advantage.
    pub advantage: f64,
    /// The policy's log-probabilities at generation, when the policy will have moved by the time they are used.
    pub old_logps: Option<Vec<f64>>,
    /// The reference's log-probabilities (with `beta` ≠ 0).
    pub ref_logps: Option<Vec<f64>>,
}

/// A completion as the run's completions files show it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Sample {
    /// The prompt, as its data line holds it.
    pub prompt: Value,
    /// The completion's text.
    pub completion: String,
    /// Each reward's value (`null`: skipped).
    pub rewards: BTreeMap<String, Option<f64>>,
    /// Its advantage.
    pub advantage: f64,
}

/// A generation batch, split into the micro-batches it feeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct GenerationBatch {
    /// Its index in the run (generation batch `g` feeds micro-batches `g·m … g·m + m − 1`).
    pub index: usize,
    /// `steps_per_generation` micro-batches of completions (shuffled).
    pub parts: Vec<Vec<Completion>>,
    /// Counted completion tokens of the whole batch (`dapo`'s normalizer).
    pub tokens: usize,
    /// Prompt and completion tokens.
    pub input_tokens: usize,
    /// Seconds spent sampling (or reading) the completions.
    pub seconds: f64,
    /// TRL's generation metrics (`reward`, `reward_std`, `rewards/{name}/mean`, `completions/mean_length`, …).
    pub metrics: BTreeMap<String, f64>,
    /// The completions with their prompts and rewards, for the completions files.
    pub samples: Vec<Sample>,
}

/// What a generation needs besides the model.
pub(crate) struct Generator<'a> {
    /// The settings.
    pub config: &'a GrpoConfig,
    /// The prompts (and, for a rollouts file, their completions).
    pub prompts: &'a PromptDataset,
    /// The rewards (the rollouts file's own when it gives them).
    pub rewards: &'a [Reward],
    /// For decoding completions and tokenizing rollouts.
    pub tokenizer: &'a TextTokenizer,
    /// The run's seed.
    pub seed: u64,
    /// Completions per forward of the log-probability passes (`per_device_train_batch_size`).
    pub batch_size: usize,
    /// Whether the policy's log-probabilities are kept from generation time (TRL: when the accumulation steps are
    /// not a multiple of `steps_per_generation × num_iterations`).
    pub keep_old_logps: bool,
    /// The adapter to switch back to after the reference's pass, and the reference's adapter (`None`: the base).
    pub trained: &'a str,
    /// A frozen copy of a continued adapter, which is then the reference.
    pub reference_adapter: Option<&'a str>,
}

/// The seed of prompt `position` of generation batch `index` (its completions are drawn from it).
fn sampling_seed(seed: u64, index: usize, position: usize) -> u64 {
    splitmix(splitmix(seed ^ 0x4752_504F_5341_4D50) ^ ((index as u64) << 24) ^ position as u64)
}

/// The order generation batch `index`'s `n` completions are dealt in: Fisher–Yates driven by `splitmix`, a pure
/// function of (`seed`, `index`) that `scripts/golden_grpo.py` reproduces.
pub(crate) fn generation_order(n: usize, seed: u64, index: usize) -> Vec<usize> {
    let key = splitmix(seed ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (splitmix(key ^ i as u64) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// Splits `values`, the completions' tokens one after another, into one vector per completion.
pub(crate) fn per_row(values: &[f64], completions: &[&Completion]) -> Vec<Vec<f64>> {
    let mut at = 0;
    completions
        .iter()
        .map(|c| {
            at += c.ids.len();
            values[at - c.ids.len()..at].to_vec()
        })
        .collect()
}

/// The policy's (or, with the model switched, the reference's) log-probabilities of each completion's tokens,
/// `batch_size` completions per forward, without dropout.
pub(crate) fn completion_logps(
    model: &LlamaModel,
    prompts: &[Prompt],
    completions: &[&Completion],
    temperature: f64,
    batch_size: usize,
) -> Result<Vec<Vec<f64>>> {
    model.lora_runtime.set_training(false);
    let mut out = Vec::with_capacity(completions.len());
    for chunk in completions.chunks(batch_size.max(1)) {
        let (hidden, rows) = forward(model, prompts, chunk)?;
        let (logps, _) = model.completion_logps(&hidden, &rows, temperature)?;
        let values: Vec<f64> = logps.detach().to_dtype(DType::F64)?.to_vec1()?;
        out.extend(per_row(&values, chunk));
    }
    Ok(out)
}

/// A row of prompt ++ completion as the loss reads it: the prompt's length, and the completion's tokens.
pub(crate) type CompletionSpan<'c> = (usize, &'c [u32]);

/// A rollout line's own rewards, when it gives them (`None` in a reward: skipped).
type GivenRewards = Option<Vec<Option<f64>>>;

/// The rows prompt ++ completion of `completions` (labels unused: the loss reads the completions' tokens), and each
/// row's (prompt length, completion).
pub(crate) fn rows_of<'c>(
    prompts: &[Prompt],
    completions: &[&'c Completion],
) -> (Vec<TokenizedExample>, Vec<CompletionSpan<'c>>) {
    let examples = completions
        .iter()
        .map(|c| {
            let ids: Vec<u32> = prompts[c.prompt]
                .ids
                .iter()
                .chain(&c.ids)
                .copied()
                .collect();
            TokenizedExample {
                labels: vec![IGNORE_INDEX; ids.len()],
                input_ids: ids,
                truncated: false,
                segments: Vec::new(),
            }
        })
        .collect();
    let rows = completions
        .iter()
        .map(|c| (prompts[c.prompt].ids.len(), c.ids.as_slice()))
        .collect();
    (examples, rows)
}

/// The forward of prompt ++ completion rows, checkpointed (no training state kept): the final hidden states and
/// each row's (prompt length, completion).
fn forward<'c>(
    model: &LlamaModel,
    prompts: &[Prompt],
    completions: &[&'c Completion],
) -> Result<(candle_core::Tensor, Vec<CompletionSpan<'c>>)> {
    let (examples, rows) = rows_of(prompts, completions);
    let refs: Vec<&TokenizedExample> = examples.iter().collect();
    let batch = collate(&refs, &Device::Cpu)?;
    let ck = Checkpointing {
        enabled: true,
        ..Default::default()
    };
    let hidden = model.forward_embeds(&model.embed(&batch.ids)?, &batch.positions, &ck)?;
    Ok((hidden, rows))
}

impl Generator<'_> {
    /// Whether `ids` ended (its last token ends a sequence).
    fn ended(model: &LlamaModel, ids: &[u32]) -> bool {
        ids.last()
            .is_some_and(|t| model.config().eos_token_ids.contains(t))
    }

    /// The completions of `prompt` (`num_generations`): sampled with `seed`, or its rollout's, tokenized as they
    /// stand (cut at `max_completion_length`), with the rollout's rewards when it has them.
    fn completions_of(
        &self,
        model: &LlamaModel,
        prompt: usize,
        seed: u64,
    ) -> Result<(Vec<GroupCompletion>, GivenRewards)> {
        let (g, max) = (
            self.config.num_generations,
            self.config.max_completion_length,
        );
        let Some(rollout) = self.prompts.rollouts.get(prompt) else {
            let sampled = generate_group(
                model,
                &self.prompts.prompts[prompt].ids,
                g,
                max,
                &self.config.sampling(),
                &model.config().eos_token_ids,
                seed,
            )?;
            return Ok((sampled, None));
        };
        let line = self.prompts.prompts[prompt].line;
        if rollout.completions.len() != g {
            return Err(Error::InvalidInput(format!(
                "rollouts line {line}: {} completions, and [grpo] num_generations = {g}: give each prompt exactly \
                 num_generations completions",
                rollout.completions.len()
            )));
        }
        let completions = rollout
            .completions
            .iter()
            .map(|text| {
                let mut ids = self.tokenizer.encode(text, false)?;
                if ids.is_empty() {
                    return Err(Error::InvalidInput(format!(
                        "rollouts line {line}: an empty completion has no token to learn from; drop it, or give it \
                         its end-of-sequence token"
                    )));
                }
                ids.truncate(max);
                let truncated = !Self::ended(model, &ids);
                Ok(GroupCompletion { ids, truncated })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((completions, rollout.rewards.clone()))
    }

    /// Generation batch `index` for `prompts` (indices into the prompt set), split into `parts` micro-batches.
    pub(crate) fn generate(
        &self,
        model: &mut LlamaModel,
        index: usize,
        prompts: &[usize],
        parts: usize,
    ) -> Result<GenerationBatch> {
        let started = Instant::now();
        let g = self.config.num_generations;
        let mut completions = Vec::with_capacity(prompts.len() * g);
        let mut given: Vec<GivenRewards> = Vec::new();
        model.lora_runtime.set_training(false);
        for (position, &prompt) in prompts.iter().enumerate() {
            let (made, rewards) =
                self.completions_of(model, prompt, sampling_seed(self.seed, index, position))?;
            given.push(rewards);
            completions.extend(made.into_iter().map(|c| Completion {
                prompt,
                ids: c.ids,
                truncated: c.truncated,
                advantage: 0.0,
                old_logps: None,
                ref_logps: None,
            }));
        }
        let generation_seconds = started.elapsed().as_secs_f64();
        let texts = completions
            .iter()
            .map(|c| self.tokenizer.decode(&c.ids, true))
            .collect::<Result<Vec<String>>>()?;
        let (names, per_func) = self.score(prompts, &completions, &texts, &given)?;
        // One weight per reward (checked against the rewards when the method was made).
        let weights = self
            .config
            .reward_weights
            .clone()
            .unwrap_or(vec![1.0; names.len()]);
        let scored = advantages(&per_func, &weights, g, self.config.scale_rewards);
        for (c, a) in completions.iter_mut().zip(&scored.advantages) {
            c.advantage = *a;
        }
        self.keep_logps(model, &mut completions)?;
        let counted = |c: &Completion| !(self.config.mask_truncated_completions && c.truncated);
        let tokens = completions
            .iter()
            .filter(|c| counted(c))
            .map(|c| c.ids.len())
            .sum();
        let input_tokens = completions
            .iter()
            .map(|c| self.prompts.prompts[c.prompt].ids.len() + c.ids.len())
            .sum();
        let metrics = generation_metrics(
            &completions,
            &names,
            &per_func,
            &scored.rewards,
            &scored.std_is_zero,
        );
        let samples = completions
            .iter()
            .zip(&texts)
            .zip(&per_func)
            .map(|((c, text), values)| Sample {
                prompt: self.prompts.prompts[c.prompt].prompt.clone(),
                completion: text.clone(),
                rewards: names
                    .iter()
                    .zip(values)
                    .map(|(n, v)| (n.clone(), (!v.is_nan()).then_some(*v)))
                    .collect(),
                advantage: c.advantage,
            })
            .collect();
        // Dealt in a seeded order, then cut into equal micro-batches (TRL's `shuffle_sequence_dict`, `split_tensor_dict`).
        let order = generation_order(completions.len(), self.seed, index);
        let mut slots: Vec<Option<Completion>> = completions.into_iter().map(Some).collect();
        let dealt: Vec<Completion> = order
            .iter()
            .map(|&i| slots[i].take().expect("a permutation"))
            .collect();
        let size = dealt.len() / parts;
        let parts = dealt
            .chunks(size.max(1))
            .map(<[Completion]>::to_vec)
            .collect();
        Ok(GenerationBatch {
            index,
            parts,
            tokens,
            input_tokens,
            seconds: generation_seconds,
            metrics,
            samples,
        })
    }

    /// Every reward's value for each completion (NaN: skipped), with the rewards' names: the rollouts file's own
    /// rewards (`rollouts`) when it gives them, else the configured ones.
    fn score(
        &self,
        prompts: &[usize],
        completions: &[Completion],
        texts: &[String],
        given: &[GivenRewards],
    ) -> Result<(Vec<String>, Vec<Vec<f64>>)> {
        let value = |r: Option<f64>| r.unwrap_or(f64::NAN);
        if !given.is_empty() && given.iter().all(Option::is_some) {
            let per_func = given
                .iter()
                .flatten()
                .flatten()
                .map(|r| vec![value(*r)])
                .collect();
            return Ok((vec!["rollouts".into()], per_func));
        }
        if let Some(p) = given.iter().position(Option::is_some) {
            return Err(Error::InvalidInput(format!(
                "rollouts line {} gives rewards and another line of its batch does not: give rewards on every line, \
                 or on none (the configured [grpo] reward_funcs then score them)",
                self.prompts.prompts[prompts[p]].line
            )));
        }
        if self.rewards.is_empty() {
            return Err(Error::InvalidInput(
                "GRPO has no reward: name at least one in [[grpo.reward_funcs]] (or give the rollouts file's \
                 rewards)"
                    .into(),
            ));
        }
        let prompt_values: Vec<&Value> = completions
            .iter()
            .map(|c| &self.prompts.prompts[c.prompt].prompt)
            .collect();
        let columns: Vec<&Map<String, Value>> = completions
            .iter()
            .map(|c| &self.prompts.prompts[c.prompt].columns)
            .collect();
        let ids: Vec<Vec<u32>> = completions.iter().map(|c| c.ids.clone()).collect();
        let inputs = RewardInputs {
            prompts: &prompt_values,
            completions: texts,
            completion_ids: &ids,
            columns: &columns,
        };
        let mut per_func = vec![Vec::with_capacity(self.rewards.len()); completions.len()];
        for reward in self.rewards {
            for (row, r) in per_func.iter_mut().zip(reward.score(&inputs)?) {
                row.push(value(r));
            }
        }
        Ok((
            self.rewards.iter().map(|r| r.name.clone()).collect(),
            per_func,
        ))
    }

    /// The log-probabilities the loss will need from now: the policy's (when it will have moved) and the
    /// reference's (adapter off, or the frozen copy of a continued adapter).
    fn keep_logps(&self, model: &mut LlamaModel, completions: &mut [Completion]) -> Result<()> {
        let refs: Vec<&Completion> = completions.iter().collect();
        let logps = |model: &LlamaModel| {
            let (prompts, temperature) = (&self.prompts.prompts, self.config.temperature);
            completion_logps(model, prompts, &refs, temperature, self.batch_size)
        };
        let old = self.keep_old_logps.then(|| logps(model)).transpose()?;
        let reference = if self.config.beta != 0.0 {
            match self.reference_adapter {
                Some(name) => model.set_adapter(name)?,
                None => model.disable_adapters(),
            }
            let reference = logps(model);
            model.set_adapter(self.trained)?;
            Some(reference?)
        } else {
            None
        };
        let (mut old, mut reference) = (old.map(Vec::into_iter), reference.map(Vec::into_iter));
        for c in completions.iter_mut() {
            c.old_logps = old.as_mut().and_then(Iterator::next);
            c.ref_logps = reference.as_mut().and_then(Iterator::next);
        }
        Ok(())
    }
}

/// TRL's metrics of a generation batch: rewards (mean, standard deviation, per reward), the share of groups whose
/// rewards are all equal, and completion lengths.
fn generation_metrics(
    completions: &[Completion],
    names: &[String],
    per_func: &[Vec<f64>],
    rewards: &[f64],
    std_is_zero: &[bool],
) -> BTreeMap<String, f64> {
    let mut m = BTreeMap::new();
    for (i, name) in names.iter().enumerate() {
        let values: Vec<f64> = per_func.iter().map(|r| r[i]).collect();
        m.insert(format!("rewards/{name}/mean"), nanmean(&values));
        m.insert(format!("rewards/{name}/std"), nanstd(&values));
    }
    m.insert("reward".into(), nanmean(rewards));
    m.insert("reward_std".into(), nanstd(rewards));
    let share = |n: usize| n as f64 / completions.len().max(1) as f64;
    m.insert(
        "frac_reward_zero_std".into(),
        share(std_is_zero.iter().filter(|z| **z).count()),
    );
    let lengths: Vec<f64> = completions.iter().map(|c| c.ids.len() as f64).collect();
    let ended: Vec<f64> = completions
        .iter()
        .filter(|c| !c.truncated)
        .map(|c| c.ids.len() as f64)
        .collect();
    // TRL reports 0 for the terminated lengths when every completion was cut.
    let ended = if ended.is_empty() { vec![0.0] } else { ended };
    for (what, values) in [("length", &lengths), ("terminated_length", &ended)] {
        let min = values.iter().copied().fold(f64::INFINITY, f64::min);
        let max = values.iter().copied().fold(0.0, f64::max);
        m.insert(format!("completions/mean_{what}"), nanmean(values));
        m.insert(format!("completions/min_{what}"), min);
        m.insert(format!("completions/max_{what}"), max);
    }
    m.insert(
        "completions/clipped_ratio".into(),
        share(completions.iter().filter(|c| c.truncated).count()),
    );
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_is_a_seeded_permutation() {
        let a = generation_order(10, 42, 3);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        assert_eq!(a, generation_order(10, 42, 3));
        assert_ne!(a, generation_order(10, 42, 4));
        assert_eq!(generation_order(1, 42, 0), vec![0]);
        // The golden script's Python copy (which deals TRL's batches) gives the same orders.
        let golden: serde_json::Value =
            serde_json::from_str(include_str!("../../../../tests/data/grpo/golden.json")).unwrap();
        for (index, order) in golden["generation_order"].as_object().unwrap() {
            let order: Vec<usize> = serde_json::from_value(order.clone()).unwrap();
            assert_eq!(
                generation_order(8, 0, index.parse().unwrap()),
                order,
                "batch {index}"
            );
        }
    }
}
