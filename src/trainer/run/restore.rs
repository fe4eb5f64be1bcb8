//! Reading a checkpoint back: a resumed run's adapter weights (after checking its LoRA settings), the method's
//! files, the optimizer, the trainer state and the callbacks' state, after checking the checkpoint replays the same
//! data; and `load_best_model_at_end`'s adapter of the best checkpoint.

use std::path::{Path, PathBuf};

use candle_core::Var;

use super::sampler::DataPlan;
use super::trainer::{Trainer, ADAPTER};
use crate::adapter::{load_adapter, Adapters, ADAPTER_CONFIG};
use crate::error::{Error, Result};
use crate::lora::LoraConfig;
use crate::optim::Optimizer;
use crate::trainer::reporting::progress::Progress;
use crate::trainer::storage::manifest::verify_adapter_files;
use crate::trainer::storage::resume::Saved;
use crate::trainer::storage::state::TrainerState;

impl Trainer {
    /// Loads adapter weights, optimizer state, the trainer state and the callbacks' state from a checkpoint, after
    /// checking it replays the same data.
    pub(super) fn restore(
        &mut self,
        ckpt: &Path,
        optimizer: &mut Optimizer,
        plan: &DataPlan,
    ) -> Result<()> {
        let Saved {
            state: saved,
            position,
            scheduler,
        } = Saved::read(ckpt)?;
        position.check_compatible(&plan.position(&self.args, 0), ckpt)?;
        if scheduler.total_steps != self.state.max_steps {
            eprintln!(
                "warning: {} was written for {} steps, this run has {}: the learning-rate schedule changes",
                ckpt.display(),
                scheduler.total_steps,
                self.state.max_steps
            );
        }
        self.copy_adapter_from(ckpt)?;
        self.method.restore(ckpt)?;
        optimizer.load(ckpt)?;
        for cb in &mut self.callbacks {
            if let Some(s) = saved.stateful_callbacks.get(cb.name()) {
                cb.load_state(s)?;
            }
        }
        self.state = TrainerState {
            max_steps: self.state.max_steps,
            ..saved
        };
        // As transformers: a best checkpoint removed since is forgotten (the run goes on without it).
        if let Some(best) = &self.state.best_model_checkpoint {
            if !Path::new(best).is_dir() {
                eprintln!(
                    "warning: the best checkpoint {best} recorded in the resumed state does not exist anymore; \
                     ignoring it for this run"
                );
                self.state.best_model_checkpoint = None;
            }
        }
        Ok(())
    }

    /// Sets the trained adapter's weights to checkpoint `ckpt`'s (its PEFT adapter files), after checking that it
    /// has this run's LoRA settings.
    fn copy_adapter_from(&mut self, ckpt: &Path) -> Result<()> {
        const LOADED: &str = "__checkpoint";
        let config_path = ckpt.join(ADAPTER_CONFIG);
        let then = LoraConfig::from_file(&config_path)?;
        if let Some(now) = self.model.adapter_configs.get(ADAPTER) {
            check_same_lora(&then, now, &config_path)?;
        }
        // Load the checkpoint's adapter next to ours, copy its tensors into our variables, drop it.
        load_adapter(&mut self.model, ckpt, LOADED)?;
        let restored: Vec<(String, Var)> = self.model.adapter_parameters(LOADED)?;
        let ours = self.model.adapter_parameters(ADAPTER)?;
        for ((k, v), (k2, s)) in ours.iter().zip(&restored) {
            if k != k2 {
                return Err(Error::invalid_file(
                    ckpt,
                    format!("checkpoint tensor `{k2}` does not match `{k}`"),
                ));
            }
            v.set(&s.as_tensor().copy()?)?;
        }
        self.model.delete_adapter(LOADED)?;
        self.model.set_adapter(ADAPTER)
    }

    /// `load_best_model_at_end`, as transformers' `_load_best_model`: the adapter of the best checkpoint
    /// (`best_model_checkpoint`) back into the model, announced with its score; returns that checkpoint. Without
    /// one — no evaluation was saved, or its folder is gone — the last step's model stays, with a note saying why.
    pub(super) fn load_best_model(&mut self, progress: &Progress) -> Result<Option<PathBuf>> {
        let step = self.state.global_step;
        let metric = self.args.best_metric_name();
        let Some(best) = self.state.best_model_checkpoint.clone().map(PathBuf::from) else {
            let why = match (self.state.best_global_step, self.state.best_metric) {
                (Some(at), Some(value)) => {
                    format!("the best evaluation, {metric} {value} at step {at}, has no checkpoint")
                }
                _ => "no evaluation ran".to_string(),
            };
            progress.println(&format!(
                "load_best_model_at_end: no best checkpoint to load ({why}); keeping the model of the last step, \
                 {step}"
            ));
            return Ok(None);
        };
        if !best.is_dir() {
            progress.println(&format!(
                "warning: load_best_model_at_end: could not locate the best model at {} (it was removed); keeping \
                 the model of the last step, {step}",
                best.display()
            ));
            return Ok(None);
        }
        // The checkpoint's own score: a best evaluation after it that has no checkpoint is not this one's.
        let saved_at: Option<usize> = best
            .file_name()
            .and_then(|n| n.to_str()?.strip_prefix("checkpoint-")?.parse().ok());
        let score = self
            .state
            .log_history
            .iter()
            .rev()
            .filter(|e| Some(e.step) == saved_at)
            .find_map(|e| match metric.as_str() {
                "eval_loss" => e.eval_loss,
                name => e.metrics.get(name).copied(),
            })
            .or(self.state.best_metric);
        let shown = score.map_or("unknown".into(), |s| s.to_string());
        progress.println(&format!(
            "Loading best model from {} (score: {shown}).",
            best.display()
        ));
        if let (Some(at), Some(value)) = (self.state.best_global_step, self.state.best_metric) {
            if saved_at.is_some_and(|s| s != at) {
                progress.println(&format!(
                    "note: the best evaluation, {metric} {value} at step {at}, has no checkpoint; {} holds the best \
                     one saved",
                    best.display()
                ));
            }
        }
        verify_adapter_files(&best)?;
        self.copy_adapter_from(&best)?;
        Ok(Some(best))
    }
}

/// An error naming the first LoRA setting in which checkpoint config `then` (read from `path`) and this run's
/// `now` differ: a resumed run must train the same adapter.
fn check_same_lora(then: &LoraConfig, now: &LoraConfig, path: &Path) -> Result<()> {
    match then.first_difference(now) {
        None => Ok(()),
        Some((key, a, b)) => Err(Error::invalid_file(
            path,
            format!(
                "the checkpoint has {key} = {a}, the config asks for {key} = {b}: resume with the checkpoint's \
                 LoRA settings, or start a new run in another output_dir"
            ),
        )),
    }
}
