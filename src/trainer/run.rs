//! The training loop: gradient accumulation with token-level loss normalization over the whole window, the
//! schedule, clipping, the optimizer, evaluation and logging on schedule, and checkpoints that resume exactly.
//!
//! Data order depends only on (`data_seed`, epoch) and dropout masks only on (`seed`, micro-batch index), so a
//! resumed run replays the same batches and masks as an uninterrupted one.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::{Device, Var};

use super::args::{IntervalStrategy, TrainingArguments};
use crate::adapter::{load_adapter, save_adapter};
use crate::data::TokenizedExample;
use crate::error::{Error, Result};
use crate::eval::{collate, evaluate};
use crate::lora::LoraConfig;
use crate::models::{Checkpointing, LlamaModel};
use crate::ops::IGNORE_INDEX;
use crate::optim::{clip_grad_norm, Optimizer, OptimizerConfig, Schedule};

/// The adapter the trainer trains.
pub const ADAPTER: &str = "default";

/// One line of the training log (`log_history` in `trainer_state.json`, and `log.jsonl`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LogEntry {
    /// Optimizer step.
    pub step: usize,
    /// Fractional epoch.
    pub epoch: f64,
    /// Token-level mean training loss of the step's window (train entries).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub loss: Option<f64>,
    /// Pre-clip gradient norm.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub grad_norm: Option<f64>,
    /// Learning rate used by the step.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub learning_rate: Option<f64>,
    /// Evaluation loss (eval entries).
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub eval_loss: Option<f64>,
}

/// A trainer for one LoRA adapter on a model.
pub struct Trainer {
    /// The model (with the adapter being trained).
    pub model: LlamaModel,
    args: TrainingArguments,
    train: Vec<TokenizedExample>,
    eval: Vec<TokenizedExample>,
    base_model_name: String,
    /// Log entries so far.
    pub log_history: Vec<LogEntry>,
}

/// Micro-batches of example indices for `epoch` (seeded shuffle, or length-grouped).
fn epoch_batches(
    n: usize,
    batch: usize,
    seed: u64,
    epoch: usize,
    lengths: &[usize],
    strategy: &str,
    drop_last: bool,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..n).collect();
    if strategy != "sequential" {
        // Fisher–Yates with a counter-based generator: the order is a pure function of (seed, epoch).
        let mut state = seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        for i in (1..n).rev() {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let j = ((state >> 33) as usize) % (i + 1);
            order.swap(i, j);
        }
    }
    if strategy == "group_by_length" {
        // Length-sorted within chunks of 50 batches, as transformers' LengthGroupedSampler does.
        for chunk in order.chunks_mut(batch * 50) {
            chunk.sort_by_key(|i| std::cmp::Reverse(lengths[*i]));
        }
    }
    let mut batches: Vec<Vec<usize>> = order.chunks(batch).map(|c| c.to_vec()).collect();
    if drop_last && batches.last().is_some_and(|b| b.len() < batch) {
        batches.pop();
    }
    batches
}

/// Label tokens a batch contributes to the loss (after the shift).
fn counted_tokens(examples: &[&TokenizedExample]) -> usize {
    examples
        .iter()
        .map(|e| {
            e.labels
                .iter()
                .skip(1)
                .filter(|l| **l != IGNORE_INDEX)
                .count()
        })
        .sum()
}

/// The newest `checkpoint-N` folder in `dir`.
pub fn latest_checkpoint(dir: &Path) -> Option<PathBuf> {
    std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let n: usize = name.strip_prefix("checkpoint-")?.parse().ok()?;
            e.path()
                .join("trainer_state.json")
                .exists()
                .then_some((n, e.path()))
        })
        .max_by_key(|(n, _)| *n)
        .map(|(_, p)| p)
}

impl Trainer {
    /// A trainer that adds (or keeps) adapter [`ADAPTER`] with `lora` on `model`.
    pub fn new(
        mut model: LlamaModel,
        args: TrainingArguments,
        lora: &LoraConfig,
        train: Vec<TokenizedExample>,
        eval: Vec<TokenizedExample>,
        base_model_name: &str,
    ) -> Result<Self> {
        args.validate("TrainingArguments")?;
        if train.is_empty() {
            return Err(Error::InvalidInput("the training set is empty".into()));
        }
        if !model.adapter_names().iter().any(|n| n == ADAPTER) {
            model.add_adapter(ADAPTER, lora, args.seed)?;
        }
        model.set_adapter(ADAPTER)?;
        Ok(Trainer {
            model,
            args,
            train,
            eval,
            base_model_name: base_model_name.to_string(),
            log_history: vec![],
        })
    }

    /// The arguments.
    pub fn args(&self) -> &TrainingArguments {
        &self.args
    }

    fn vars(&self) -> Result<Vec<(String, Var)>> {
        self.model.adapter_parameters(ADAPTER)
    }

    /// Trains to the end (resuming from `resume` if given: a `checkpoint-N` folder) and saves the final adapter in
    /// `output_dir`. Returns the log.
    pub fn train(&mut self, resume: Option<&Path>) -> Result<Vec<LogEntry>> {
        let args = self.args.clone();
        let out = PathBuf::from(&args.output_dir);
        if resume.is_none()
            && out.join("adapter_config.json").exists()
            && !args.overwrite_output_dir
        {
            return Err(Error::WouldOverwrite(format!(
                "`{}` already holds a trained adapter; set overwrite_output_dir = true, resume, or pick another output_dir",
                out.display()
            )));
        }
        std::fs::create_dir_all(&out).map_err(|e| Error::io("cannot create", &out, e))?;
        let lengths: Vec<usize> = self.train.iter().map(|e| e.input_ids.len()).collect();
        let strategy = if args.group_by_length {
            "group_by_length"
        } else {
            args.train_sampling_strategy.as_str()
        };
        let data_seed = args.data_seed.unwrap_or(args.seed);
        let batch = args.per_device_train_batch_size;
        let per_epoch = epoch_batches(
            self.train.len(),
            batch,
            data_seed,
            0,
            &lengths,
            strategy,
            args.dataloader_drop_last,
        )
        .len();
        let total = args.total_steps(per_epoch);
        let schedule = Schedule::new(
            args.scheduler_type()?,
            args.learning_rate,
            args.warmup_for(total),
            total,
            args.lr_scheduler_kwargs.as_ref(),
        )?;
        let params = self.vars()?;
        let vars: Vec<Var> = params.iter().map(|(_, v)| v.clone()).collect();
        let config = OptimizerConfig {
            name: args.optim_name()?,
            beta1: args.adam_beta1,
            beta2: args.adam_beta2,
            eps: args.adam_epsilon,
            weight_decay: args.weight_decay,
            ..Default::default()
        };
        let mut optimizer = Optimizer::new(params, config)?;
        let mut step = 0usize;
        if let Some(ckpt) = resume {
            step = self.restore(ckpt, &mut optimizer)?;
        }
        let log_path = out.join("log.jsonl");
        let accumulation = args.gradient_accumulation_steps;
        let log_every = TrainingArguments::interval(args.logging_steps, total);
        let save_every = TrainingArguments::interval(args.save_steps, total);
        let eval_every =
            TrainingArguments::interval(args.eval_steps.unwrap_or(args.logging_steps), total);
        let started = Instant::now();
        let mut tokens_seen = 0usize;
        // Walk the micro-batches in order; a resumed run skips the windows already done.
        let mut micro = 0usize;
        'epochs: for epoch in 0.. {
            let batches = epoch_batches(
                self.train.len(),
                batch,
                data_seed,
                epoch,
                &lengths,
                strategy,
                args.dataloader_drop_last,
            );
            let windows = per_epoch.div_ceil(accumulation);
            for (w, window) in batches.chunks(accumulation).enumerate() {
                micro += window.len();
                let window_step = epoch * windows + w + 1;
                if window_step <= step {
                    continue;
                }
                if step >= total {
                    break 'epochs;
                }
                step += 1;
                let examples: Vec<Vec<&TokenizedExample>> = window
                    .iter()
                    .map(|b| b.iter().map(|i| &self.train[*i]).collect())
                    .collect();
                let window_tokens: usize = examples.iter().map(|e| counted_tokens(e)).sum();
                let mut grads = GradStore::default();
                let mut loss_sum = 0f64;
                self.model.lora_runtime.set_training(true);
                for (k, ex) in examples.iter().enumerate() {
                    self.model.lora_runtime.set_step_seed(
                        args.seed
                            ^ ((micro - window.len() + k) as u64)
                                .wrapping_mul(0x2545_F491_4F6C_DD1D),
                    );
                    let batch = collate(ex, &Device::Cpu)?;
                    let ck = Checkpointing {
                        enabled: args.gradient_checkpointing,
                        params: vars.clone(),
                        ..Default::default()
                    };
                    let (sum, _) =
                        self.model
                            .loss_sum(&batch.ids, &batch.labels, &batch.positions, &ck)?;
                    loss_sum += sum.to_scalar::<f32>()? as f64;
                    let mut g = (sum / window_tokens.max(1) as f64)?.backward()?;
                    ck.sink.merge_into(&mut g)?;
                    for v in &vars {
                        if let Some(gv) = g.get(v) {
                            let acc = match grads.get(v) {
                                Some(old) => (old + gv)?,
                                None => gv.clone(),
                            };
                            grads.insert(v, acc);
                        }
                    }
                }
                self.model.lora_runtime.set_training(false);
                tokens_seen += examples
                    .iter()
                    .flatten()
                    .map(|e| e.input_ids.len())
                    .sum::<usize>();
                let loss = loss_sum / window_tokens.max(1) as f64;
                let lr = schedule.lr_for_update(step);
                if !loss.is_finite() {
                    eprintln!("step {step}: non-finite loss {loss}; update skipped");
                    continue;
                }
                let grad_norm = clip_grad_norm(&vars, &mut grads, args.max_grad_norm)?;
                optimizer.step(&grads, lr)?;
                let epoch_f = epoch as f64 + (w + 1) as f64 / windows as f64;
                if step % log_every == 0 || (step == 1 && args.logging_first_step) || step == total
                {
                    let entry = LogEntry {
                        step,
                        epoch: epoch_f,
                        loss: Some(loss),
                        grad_norm: Some(grad_norm),
                        learning_rate: Some(lr),
                        eval_loss: None,
                    };
                    eprintln!(
                        "step {step}/{total}  loss {loss:.4}  lr {lr:.3e}  grad_norm {grad_norm:.3}  {:.0} tokens/s",
                        tokens_seen as f64 / started.elapsed().as_secs_f64()
                    );
                    self.append_log(&log_path, entry)?;
                }
                if args.eval_strategy == IntervalStrategy::Steps
                    && !self.eval.is_empty()
                    && step % eval_every == 0
                {
                    let report =
                        evaluate(&self.model, &self.eval, args.per_device_eval_batch_size)?;
                    eprintln!(
                        "step {step}: eval_loss {:.4}  perplexity {:.3}",
                        report.loss, report.perplexity
                    );
                    let entry = LogEntry {
                        step,
                        epoch: epoch_f,
                        loss: None,
                        grad_norm: None,
                        learning_rate: None,
                        eval_loss: Some(report.loss),
                    };
                    self.append_log(&log_path, entry)?;
                }
                if args.save_strategy == IntervalStrategy::Steps
                    && step % save_every == 0
                    && step < total
                {
                    self.save_checkpoint(&out, step, total, &optimizer)?;
                }
            }
            if args.eval_strategy == IntervalStrategy::Epoch && !self.eval.is_empty() {
                let report = evaluate(&self.model, &self.eval, args.per_device_eval_batch_size)?;
                eprintln!("epoch {}: eval_loss {:.4}", epoch + 1, report.loss);
            }
            if step >= total {
                break;
            }
        }
        save_adapter(&self.model, ADAPTER, &out, &self.base_model_name)?;
        Ok(self.log_history.clone())
    }

    fn append_log(&mut self, path: &Path, entry: LogEntry) -> Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| Error::io("cannot write", path, e))?;
        writeln!(f, "{}", serde_json::to_string(&entry).unwrap_or_default())
            .map_err(|e| Error::io("cannot write", path, e))?;
        self.log_history.push(entry);
        Ok(())
    }

    /// Writes `output_dir/checkpoint-{step}` atomically (a temporary folder renamed when complete) and removes the
    /// oldest checkpoints beyond `save_total_limit`.
    fn save_checkpoint(
        &self,
        out: &Path,
        step: usize,
        total: usize,
        optimizer: &Optimizer,
    ) -> Result<()> {
        let final_dir = out.join(format!("checkpoint-{step}"));
        let tmp = out.join(format!(".checkpoint-{step}.partial"));
        let _ = std::fs::remove_dir_all(&tmp);
        save_adapter(&self.model, ADAPTER, &tmp, &self.base_model_name)?;
        optimizer.save(&tmp)?;
        let state = serde_json::json!({
            "global_step": step,
            "max_steps": total,
            "log_history": self.log_history,
            "logging_steps": self.args.logging_steps,
            "save_steps": self.args.save_steps,
            "train_batch_size": self.args.per_device_train_batch_size,
            "num_train_epochs": self.args.num_train_epochs,
            "best_metric": null,
            "best_model_checkpoint": null,
            "is_world_process_zero": true,
        });
        let path = tmp.join("trainer_state.json");
        std::fs::write(
            &path,
            serde_json::to_string_pretty(&state).unwrap_or_default(),
        )
        .map_err(|e| Error::io("cannot write", &path, e))?;
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir)
                .map_err(|e| Error::io("cannot replace", &final_dir, e))?;
        }
        std::fs::rename(&tmp, &final_dir)
            .map_err(|e| Error::io("cannot move into place", &final_dir, e))?;
        if let Some(limit) = self.args.save_total_limit {
            let mut ckpts: Vec<(usize, PathBuf)> = std::fs::read_dir(out)
                .map_err(|e| Error::io("cannot list", out, e))?
                .filter_map(|e| e.ok())
                .filter_map(|e| {
                    Some((
                        e.file_name()
                            .to_string_lossy()
                            .strip_prefix("checkpoint-")?
                            .parse()
                            .ok()?,
                        e.path(),
                    ))
                })
                .collect();
            ckpts.sort();
            while ckpts.len() > limit.max(1) {
                let (_, p) = ckpts.remove(0);
                std::fs::remove_dir_all(&p).map_err(|e| Error::io("cannot remove", &p, e))?;
            }
        }
        Ok(())
    }

    /// Loads adapter weights, optimizer state and the log from a checkpoint; returns its step.
    fn restore(&mut self, ckpt: &Path, optimizer: &mut Optimizer) -> Result<usize> {
        let state_path = ckpt.join("trainer_state.json");
        let text = std::fs::read_to_string(&state_path)
            .map_err(|e| Error::io("cannot read", &state_path, e))?;
        let state: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::invalid_file(&state_path, e.to_string()))?;
        let step = state["global_step"]
            .as_u64()
            .ok_or_else(|| Error::invalid_file(&state_path, "global_step is missing"))?
            as usize;
        self.log_history = serde_json::from_value(state["log_history"].clone()).unwrap_or_default();
        // Load the checkpoint's adapter next to ours, copy its tensors into our variables, drop it.
        load_adapter(&mut self.model, ckpt, "__resume")?;
        let saved: Vec<(String, Var)> = self.model.adapter_parameters("__resume")?;
        let ours = self.vars()?;
        for ((k, v), (k2, s)) in ours.iter().zip(&saved) {
            if k != k2 {
                return Err(Error::invalid_file(
                    ckpt,
                    format!("checkpoint tensor `{k2}` does not match `{k}`"),
                ));
            }
            v.set(&s.as_tensor().copy()?)?;
        }
        self.model.delete_adapter("__resume")?;
        self.model.set_adapter(ADAPTER)?;
        optimizer.load(ckpt)?;
        Ok(step)
    }
}
