//! Online reinforcement learning with GRPO, as TRL 1.16's `GRPOTrainer` does it on a PEFT model: the prompts are
//! dealt in generation batches (`PromptGroups`), each prompt's `num_generations` completions are sampled on the
//! training model itself — NF4 base and live adapter, KV cache, no copy — or read from a rollouts file
//! (`generation`), scored by the [`Reward`]s (closures, or those a run config names: `rewards`), and the clipped,
//! importance-weighted objective with its KL term is computed on the host in float64 (`loss`) and back-propagated
//! through each completion token's log-probability (`window`). Its settings are `[grpo]` ([`GrpoConfig`]); the loop
//! runs it like the other methods (accumulation, checkpointing, the optimizer, checkpoints and resume, callbacks,
//! evaluation) when the trainer is built with [`crate::trainer::Trainer::new_grpo`] or from a config with `[grpo]`.

mod generation;
mod loss;
mod rewards;
mod window;

pub use crate::trainer::settings::grpo::{
    GrpoConfig, GrpoLossType, ImportanceSamplingLevel, RewardSpec, ScaleRewards,
};
pub use rewards::{final_answer, overlong_penalty, same_answer, Reward, RewardFn, RewardInputs};

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Tensor, Var};

use super::method::{refuse_ranks, Method};
use crate::adapter::Adapters;
use crate::data::{PromptDataset, TokenizedExample};
use crate::error::{Error, Result};
use crate::files::{read_json, write_atomic};
use crate::models::{LlamaModel, TextTokenizer};
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::reporting::memory::StepMemory;
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::settings::config::RunConfig;
use crate::trainer::settings::preflight::DataFacts;
use crate::trainer::storage::position::DataFingerprint;
use crate::trainer::window::batches::{PromptGroups, WindowBatches, WindowOutput};
use crate::trainer::window::micro_batch::micro_batch_seed;
use crate::trainer::window::shard::{Shard, SumOverRanks};
use generation::{GenerationBatch, Generator};
use loss::{micro_batch_loss, nanmean, Normalization, LOSS_METRICS};

/// The checkpoint file holding the generation batch in use, so a run resumed in the middle of it trains on the
/// same completions.
pub const GENERATION_FILE: &str = "grpo_generation.json";

/// The frozen copy of a continued adapter, the reference with `beta` ≠ 0 (TRL's `ref` adapter).
const REFERENCE_ADAPTER: &str = "reference";

/// The metrics an evaluation reports besides the loss (named without `eval_`).
const EVAL_METRICS: [&str; 4] = [
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
];

/// A GRPO run's settings, prompts, rewards and the generation batch in use.
pub(crate) struct Grpo {
    config: GrpoConfig,
    train: PromptDataset,
    eval: PromptDataset,
    rewards: Vec<Reward>,
    tokenizer: TextTokenizer,
    /// Completions per generation batch.
    generation_size: usize,
    /// Micro-batches (accumulation steps) one generation batch feeds per pass.
    steps_per_generation: usize,
    /// The generation batch in use.
    generation: Option<GenerationBatch>,
    /// The index of the last generation batch whose samples were written.
    samples_written: Option<usize>,
    /// The reference's adapter when the run continues one (`None`: the base model).
    reference_adapter: Option<String>,
}

impl Grpo {
    /// GRPO with `config` on `train` prompts (or rollouts), evaluated on `eval` prompts, scored by `rewards`: an
    /// error for settings of `config` or `args` that GRPO refuses, or no training prompts.
    pub(crate) fn new(
        config: GrpoConfig,
        args: &TrainingArguments,
        train: PromptDataset,
        eval: PromptDataset,
        rewards: Vec<Reward>,
        tokenizer: TextTokenizer,
    ) -> Result<Self> {
        config.validate("GrpoConfig")?;
        let (generation_size, steps_per_generation) = config.check_training(args, "GrpoConfig")?;
        let prompts = generation_size / config.num_generations;
        if train.len() < prompts {
            return Err(Error::InvalidInput(format!(
                "{} training prompts, and a generation batch takes {prompts} ({generation_size} completions of \
                 num_generations = {}): give more prompts, or make the batch smaller",
                train.len(),
                config.num_generations
            )));
        }
        if !eval.is_empty() && args.per_device_eval_batch_size % config.num_generations != 0 {
            return Err(Error::InvalidInput(format!(
                "per_device_eval_batch_size = {} must be a multiple of [grpo] num_generations = {} (an evaluation \
                 batch holds whole groups of completions, as in TRL)",
                args.per_device_eval_batch_size, config.num_generations
            )));
        }
        let has_rollout_rewards = train.rollouts.iter().any(|r| r.rewards.is_some());
        if rewards.is_empty() && !has_rollout_rewards {
            return Err(Error::InvalidInput(
                "GRPO needs a reward: name at least one in [[grpo.reward_funcs]] (Trainer::new_grpo: pass one), or \
                 give rewards in the rollouts file"
                    .into(),
            ));
        }
        // The rollouts file's own rewards, when it gives them, replace the configured ones (as one named `rollouts`).
        let scored_by = if has_rollout_rewards {
            1
        } else {
            rewards.len()
        };
        if let Some(w) = config
            .reward_weights
            .as_ref()
            .filter(|w| w.len() != scored_by)
        {
            return Err(Error::InvalidInput(format!(
                "[grpo] reward_weights has {} values for {scored_by} rewards: give one weight per reward",
                w.len()
            )));
        }
        Ok(Grpo {
            config,
            train,
            eval,
            rewards,
            tokenizer,
            generation_size,
            steps_per_generation,
            generation: None,
            samples_written: None,
            reference_adapter: None,
        })
    }

    /// The method of `config`, whose `[grpo]` is `grpo`: prompts read from `[data] train_file` (or the rollouts
    /// file) and tokenized as TRL does, the rewards it names, and the notes to print.
    pub(crate) fn from_run_config(
        config: &RunConfig,
        grpo: &GrpoConfig,
        tokenizer: &TextTokenizer,
    ) -> Result<(Self, Vec<String>)> {
        let data = &config.data;
        let read = |path: &Path, rollouts: bool| {
            PromptDataset::from_jsonl(
                path,
                tokenizer,
                rollouts,
                data.skip_bad_lines,
                data.max_length,
            )
        };
        let (mut train, name) = match (&grpo.rollouts, &data.train_file) {
            (Some(r), _) => (read(r, true)?, r.display().to_string()),
            (None, Some(f)) => (read(f, false)?, f.display().to_string()),
            (None, None) => {
                return Err(Error::InvalidInput(
                    "[data] needs train_file (the prompts), or [grpo] rollouts".into(),
                ))
            }
        };
        let eval = match (&data.eval_file, data.eval_split) {
            (Some(f), _) => read(f, false)?,
            (None, Some(split)) => train.split_off(split),
            (None, None) => PromptDataset::default(),
        };
        let mut notes = Vec::new();
        if !train.skipped.is_empty() {
            notes.push(format!("{name}: {} bad lines skipped", train.skipped.len()));
        }
        notes.push(format!(
            "{} training prompts{}, {} evaluation prompts",
            train.len(),
            if grpo.rollouts.is_some() {
                " with their rollouts"
            } else {
                ""
            },
            eval.len()
        ));
        let rewards = grpo
            .reward_funcs
            .iter()
            .map(Reward::from_spec)
            .collect::<Result<Vec<_>>>()?;
        let method = Self::new(
            grpo.clone(),
            &config.training,
            train,
            eval,
            rewards,
            tokenizer.clone(),
        )?;
        Ok((method, notes))
    }

    /// The generator of this run's training prompts (`eval`: of its evaluation prompts, whose log-probabilities
    /// from generation time are never needed).
    fn generator<'a>(
        &'a self,
        args: &TrainingArguments,
        trained: &'a str,
        eval: bool,
    ) -> Generator<'a> {
        let every = self.steps_per_generation * self.config.num_iterations;
        Generator {
            config: &self.config,
            prompts: if eval { &self.eval } else { &self.train },
            rewards: &self.rewards,
            tokenizer: &self.tokenizer,
            seed: args.seed,
            batch_size: args.per_device_train_batch_size,
            keep_old_logps: !eval && args.gradient_accumulation_steps % every != 0,
            trained,
            reference_adapter: self.reference_adapter.as_deref(),
        }
    }
}

/// The mean of each key over `maps` (NaN values left out, as TRL's log does).
fn mean_by_key(maps: &[BTreeMap<String, f64>]) -> BTreeMap<String, f64> {
    let mut values: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for m in maps {
        for (k, v) in m {
            values.entry(k.clone()).or_default().push(*v);
        }
    }
    values
        .into_iter()
        .map(|(k, v)| (k, nanmean(&v)))
        .filter(|(_, v)| !v.is_nan())
        .collect()
}

impl Method for Grpo {
    /// A prompt's tokens and the longest completion.
    fn train_lengths(&self) -> Vec<usize> {
        self.train
            .prompts
            .iter()
            .map(|p| p.ids.len() + self.config.max_completion_length)
            .collect()
    }

    fn train_fingerprint(&self) -> DataFingerprint {
        let items: Vec<TokenizedExample> = self
            .train
            .prompts
            .iter()
            .map(|p| TokenizedExample::learning_every_token(p.ids.clone()))
            .collect();
        DataFingerprint::of(&items)
    }

    fn data_facts(&self) -> DataFacts {
        let lengths = |d: &PromptDataset| {
            d.prompts
                .iter()
                .map(|p| p.ids.len() + self.config.max_completion_length)
                .collect()
        };
        DataFacts {
            eval_examples: self.eval.len(),
            lengths: vec![
                (
                    "training prompts with max_completion_length",
                    lengths(&self.train),
                ),
                (
                    "evaluation prompts with max_completion_length",
                    lengths(&self.eval),
                ),
            ],
            eval_metrics: &EVAL_METRICS,
        }
    }

    fn has_eval(&self) -> bool {
        !self.eval.is_empty()
    }

    fn completions_per_prompt(&self) -> Option<usize> {
        Some(self.config.num_generations)
    }

    fn check_world_size(&self, world_size: usize) -> Result<()> {
        refuse_ranks(world_size, GrpoConfig::world_size_problem(world_size))
    }

    /// With `beta` ≠ 0 and a continued adapter, its frozen copy is the reference (TRL's `ref` adapter); else the
    /// base model with the adapter off.
    fn attach(&mut self, model: &mut LlamaModel, trained: &str, continued: bool) -> Result<()> {
        if continued && self.config.beta != 0.0 {
            model.copy_adapter(trained, REFERENCE_ADAPTER)?;
            self.reference_adapter = Some(REFERENCE_ADAPTER.into());
        }
        Ok(())
    }

    fn prompt_groups(&self) -> Option<PromptGroups> {
        Some(PromptGroups {
            prompts_per_generation: self.generation_size / self.config.num_generations,
            micro_batches: self.steps_per_generation * self.config.num_iterations,
            // Rollouts are consumed in file order.
            shuffle: self.config.shuffle_dataset && self.train.rollouts.is_empty(),
        })
    }

    fn run_window(
        &mut self,
        model: &mut LlamaModel,
        trained: &str,
        args: &TrainingArguments,
        window: &WindowBatches<'_>,
        vars: &[Var],
        memory: &mut StepMemory,
    ) -> Result<WindowOutput> {
        let started = Instant::now();
        let parts = self.steps_per_generation;
        let every = parts * self.config.num_iterations;
        let mut grads = GradStore::default();
        let mut loss_total = 0.0;
        let mut input_tokens = 0;
        let (mut generated, mut micro_metrics) = (Vec::new(), Vec::new());
        let mut generation_seconds = 0.0;
        let mut aux_losses = Vec::new();
        for (k, prompts) in window.batches.iter().enumerate() {
            let micro = window.first_micro + k;
            let index = micro / every;
            if self.generation.as_ref().map(|g| g.index) != Some(index) {
                let batch = self
                    .generator(args, trained, false)
                    .generate(model, index, prompts, parts)?;
                input_tokens += batch.input_tokens;
                generation_seconds += batch.seconds;
                generated.push(batch.metrics.clone());
                self.generation = Some(batch);
            }
            let batch = self.generation.as_ref().expect("generated above");
            let normalization = Normalization {
                accumulation: args.gradient_accumulation_steps,
                steps_per_generation: parts,
                generation_tokens: batch.tokens,
                training: true,
            };
            let (loss, aux) = window::run_micro_batch(
                model,
                &self.train.prompts,
                &batch.parts[micro % parts],
                &self.config,
                normalization,
                args,
                vars,
                micro_batch_seed(args.seed, micro),
                &mut grads,
                memory,
                k,
            )?;
            loss_total += loss.loss;
            aux_losses.extend(aux);
            let mut m: BTreeMap<String, f64> = LOSS_METRICS
                .iter()
                .map(|n| n.to_string())
                .zip(loss.metrics)
                .collect();
            m.extend(loss.kl.map(|kl| ("kl".to_string(), kl)));
            micro_metrics.push(m);
        }
        let mut host_metrics = mean_by_key(&micro_metrics);
        host_metrics.extend(mean_by_key(&generated));
        if !generated.is_empty() {
            host_metrics.insert("generation_seconds".into(), generation_seconds);
            host_metrics.insert(
                "generation_share".into(),
                generation_seconds / started.elapsed().as_secs_f64().max(1e-9),
            );
        }
        Ok(WindowOutput {
            loss_sum: Tensor::new(loss_total, model.device())?,
            counted: 1,
            input_tokens,
            grads,
            aux_loss: match aux_losses.is_empty() {
                true => None,
                false => Some(Tensor::new(nanmean(&aux_losses), model.device())?),
            },
            metrics: None,
            host_metrics,
        })
    }

    fn loss_settings(&self) -> Option<String> {
        Some(format!(
            "[grpo] beta (now {:e}), epsilon (now {}), loss_type (now \"{}\") and the rewards",
            self.config.beta, self.config.epsilon, self.config.loss_type
        ))
    }

    fn progress_metrics(&self) -> &'static [&'static str] {
        &["reward", "completions/mean_length"]
    }

    /// Samples `num_generations` completions of every evaluation prompt (seeded alike at every evaluation, so
    /// evaluations compare like with like), scores them, and reports the on-policy loss and TRL's metrics.
    fn evaluate(
        &mut self,
        model: &mut LlamaModel,
        trained: &str,
        args: &TrainingArguments,
        _shard: Shard,
        _sum_over_ranks: SumOverRanks<'_>,
    ) -> Result<EvalReport> {
        let per_batch = (args.per_device_eval_batch_size / self.config.num_generations).max(1);
        // The entropy mask is off in evaluation (TRL's eval loss sees every token).
        let config = GrpoConfig {
            top_entropy_quantile: 1.0,
            ..self.config.clone()
        };
        let (mut losses, mut metrics, mut tokens, mut truncated) = (Vec::new(), Vec::new(), 0, 0);
        let chunks: Vec<Vec<usize>> = (0..self.eval.len())
            .collect::<Vec<_>>()
            .chunks(per_batch)
            .map(<[usize]>::to_vec)
            .collect();
        for (i, prompts) in chunks.iter().enumerate() {
            // Indices far from the training batches' keep the evaluation's draws apart from theirs.
            let index = usize::MAX / 2 + i;
            let batch = self
                .generator(args, trained, true)
                .generate(model, index, prompts, 1)?;
            let completions: Vec<&generation::Completion> = batch.parts[0].iter().collect();
            // On policy the ratios are 1, so the loss needs the log-probabilities only for the KL term; neither it
            // nor the entropy mask (off in evaluation) needs the entropies.
            let zeros: Vec<Vec<f64>> = completions.iter().map(|c| vec![0.0; c.ids.len()]).collect();
            let logps = match self.config.beta {
                0.0 => zeros.clone(),
                _ => generation::completion_logps(
                    model,
                    &self.eval.prompts,
                    &completions,
                    self.config.temperature,
                    args.per_device_eval_batch_size,
                )?,
            };
            let entropies = zeros;
            let rows = window::loss_rows(&completions, &logps, &entropies, &config);
            let normalization = Normalization {
                accumulation: 1,
                steps_per_generation: 1,
                generation_tokens: batch.tokens,
                training: false,
            };
            losses.push(micro_batch_loss(&rows, &config, normalization).loss);
            tokens += completions.iter().map(|c| c.ids.len()).sum::<usize>();
            truncated += completions.iter().filter(|c| c.truncated).count();
            metrics.push(batch.metrics);
        }
        Ok(EvalReport {
            loss: nanmean(&losses),
            perplexity: f64::NAN,
            tokens,
            examples: self.eval.len(),
            truncated,
            exact_match: None,
            metrics: mean_by_key(&metrics),
        })
    }

    /// The generation batch in use.
    fn save(&self, _model: &LlamaModel, dir: &Path) -> Result<()> {
        if let Some(batch) = &self.generation {
            let json =
                serde_json::to_string(batch).map_err(|e| Error::InvalidInput(e.to_string()))?;
            write_atomic(&dir.join(GENERATION_FILE), json)?;
        }
        Ok(())
    }

    fn restore(&mut self, dir: &Path) -> Result<()> {
        let path = dir.join(GENERATION_FILE);
        if path.exists() {
            self.generation = Some(read_json(&path)?);
        }
        Ok(())
    }

    /// The last generation batch's completions, prompts, rewards and advantages in
    /// `completions/completions_{step:05}.jsonl` (once per batch), and the first few as a TensorBoard text.
    fn write_samples(&mut self, out: &Path, step: usize) -> Result<Vec<(String, String)>> {
        let Some(batch) = &self.generation else {
            return Ok(Vec::new());
        };
        if self.samples_written == Some(batch.index) {
            return Ok(Vec::new());
        }
        let dir = out.join("completions");
        std::fs::create_dir_all(&dir).map_err(|e| Error::io("cannot create", &dir, e))?;
        let mut lines = String::new();
        for s in &batch.samples {
            let mut line =
                serde_json::to_value(s).map_err(|e| Error::InvalidInput(e.to_string()))?;
            line["step"] = step.into();
            lines.push_str(&line.to_string());
            lines.push('\n');
        }
        write_atomic(&dir.join(format!("completions_{step:05}.jsonl")), lines)?;
        self.samples_written = Some(batch.index);
        let mut table =
            String::from("| prompt | completion | rewards | advantage |\n|---|---|---|---|\n");
        let cell = |s: &str| s.replace('|', "\\|").replace('\n', "<br>");
        for s in batch.samples.iter().take(4) {
            let prompt = match &s.prompt {
                serde_json::Value::String(t) => t.clone(),
                other => other.to_string(),
            };
            let rewards: Vec<String> = s
                .rewards
                .iter()
                .map(|(k, v)| format!("{k}: {}", v.map_or("–".into(), |v| format!("{v:.3}"))))
                .collect();
            table.push_str(&format!(
                "| {} | {} | {} | {:.3} |\n",
                cell(&prompt),
                cell(&s.completion),
                rewards.join(", "),
                s.advantage
            ));
        }
        Ok(vec![("completions".into(), table)])
    }
}
