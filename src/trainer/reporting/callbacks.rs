//! Callbacks: code that runs at fixed points of the loop (transformers' `TrainerCallback` events), and two built
//! in: early stopping on the best-model metric, and a memory monitor.

use std::io::Write;
use std::path::{Path, PathBuf};

use candle_core::Device;

use super::eval_report::EvalReport;
use super::oom::memory_fixes;
use crate::error::{Error, Result};
use crate::memory::{human_bytes, process_memory, stats};
use crate::trainer::settings::args::{IntervalStrategy, TrainingArguments};
use crate::trainer::storage::state::{LogEntry, TrainerState};

/// What callbacks may ask of the loop.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainerControl {
    /// End training after this step (the final adapter is still saved).
    pub should_training_stop: bool,
}

/// Hooks called by the trainer. Every method has an empty default, so a callback implements only what it needs.
pub trait TrainerCallback {
    /// A stable name, the key of its state in `trainer_state.json` (`stateful_callbacks`).
    fn name(&self) -> &str;
    /// Before the first step (after a resume has restored the state).
    fn on_train_begin(&mut self, _args: &TrainingArguments, _state: &TrainerState) -> Result<()> {
        Ok(())
    }
    /// After each optimizer step (or skipped step).
    fn on_step_end(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _control: &mut TrainerControl,
    ) -> Result<()> {
        Ok(())
    }
    /// After a log entry is written.
    fn on_log(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _entry: &LogEntry,
    ) -> Result<()> {
        Ok(())
    }
    /// After an evaluation.
    fn on_evaluate(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _control: &mut TrainerControl,
        _report: &EvalReport,
    ) -> Result<()> {
        Ok(())
    }
    /// After a checkpoint folder is complete.
    fn on_save(
        &mut self,
        _args: &TrainingArguments,
        _state: &TrainerState,
        _checkpoint: &Path,
    ) -> Result<()> {
        Ok(())
    }
    /// After the final adapter is saved.
    fn on_train_end(&mut self, _args: &TrainingArguments, _state: &TrainerState) -> Result<()> {
        Ok(())
    }
    /// State to keep in checkpoints so a resumed run behaves as the uninterrupted one.
    fn state(&self) -> Option<serde_json::Value> {
        None
    }
    /// Restores what [`TrainerCallback::state`] returned.
    fn load_state(&mut self, _state: &serde_json::Value) -> Result<()> {
        Ok(())
    }
}

/// Stops training when the best-model metric (`metric_for_best_model`, the evaluation loss when unset) has not
/// improved by more than `threshold` for `patience` evaluations in a row (transformers' `EarlyStoppingCallback`).
#[derive(Clone, Debug, PartialEq)]
pub struct EarlyStoppingCallback {
    /// Evaluations without improvement that end the run.
    pub patience: usize,
    /// Minimum change of the metric, in its better direction, that counts as an improvement.
    pub threshold: f64,
    best: Option<f64>,
    without_improvement: usize,
}

impl EarlyStoppingCallback {
    /// A callback with transformers' arguments (`early_stopping_patience`, `early_stopping_threshold`).
    pub fn new(patience: usize, threshold: f64) -> Self {
        EarlyStoppingCallback {
            patience: patience.max(1),
            threshold,
            best: None,
            without_improvement: 0,
        }
    }
}

impl TrainerCallback for EarlyStoppingCallback {
    fn name(&self) -> &str {
        "EarlyStoppingCallback"
    }

    fn on_train_begin(&mut self, args: &TrainingArguments, _state: &TrainerState) -> Result<()> {
        if args.eval_strategy == IntervalStrategy::No {
            return Err(Error::InvalidInput(
                "early stopping needs evaluations: set eval_strategy = \"steps\" or \"epoch\" and an eval set".into(),
            ));
        }
        Ok(())
    }

    fn on_evaluate(
        &mut self,
        args: &TrainingArguments,
        state: &TrainerState,
        control: &mut TrainerControl,
        report: &EvalReport,
    ) -> Result<()> {
        // The metric of the best checkpoint, in its direction, as transformers' callback reads it.
        let value = args
            .best_metric_value(report.loss, &report.metrics)
            .unwrap_or(report.loss);
        let improved = args.improves(value, self.best, self.threshold);
        if improved {
            self.best = Some(value);
            self.without_improvement = 0;
        } else {
            self.without_improvement += 1;
        }
        if self.without_improvement >= self.patience {
            eprintln!(
                "early stopping at step {}: {} has not improved for {} evaluations (best {:.4})",
                state.global_step,
                args.best_metric_name(),
                self.patience,
                self.best.unwrap_or(f64::NAN)
            );
            control.should_training_stop = true;
        }
        Ok(())
    }

    fn state(&self) -> Option<serde_json::Value> {
        Some(serde_json::json!({
            "best": self.best,
            "without_improvement": self.without_improvement,
        }))
    }

    fn load_state(&mut self, state: &serde_json::Value) -> Result<()> {
        self.best = state["best"].as_f64();
        self.without_improvement = state["without_improvement"].as_u64().unwrap_or(0) as usize;
        Ok(())
    }
}

/// Records the process' memory (and a GPU's, when training on one) after every step in
/// `output_dir/memory.jsonl` and warns (once) when the memory in use passes `warn_fraction` of the device's: the
/// resident set of the machine's memory on the CPU, the memory pool's reserved bytes of the GPU's memory on CUDA.
#[derive(Clone, Debug)]
pub struct MemoryMonitorCallback {
    /// Fraction of the device's memory above which a warning is printed.
    pub warn_fraction: f64,
    device: Device,
    path: Option<PathBuf>,
    warned: bool,
}

impl MemoryMonitorCallback {
    /// A monitor of the CPU that warns above `warn_fraction` (e.g. 0.9) of physical memory.
    pub fn new(warn_fraction: f64) -> Self {
        MemoryMonitorCallback {
            warn_fraction,
            device: Device::Cpu,
            path: None,
            warned: false,
        }
    }

    /// The monitor for training on `device`.
    pub fn on_device(self, device: &Device) -> Self {
        MemoryMonitorCallback {
            device: device.clone(),
            ..self
        }
    }
}

impl TrainerCallback for MemoryMonitorCallback {
    fn name(&self) -> &str {
        "MemoryMonitorCallback"
    }

    fn on_train_begin(&mut self, args: &TrainingArguments, state: &TrainerState) -> Result<()> {
        let path = Path::new(&args.output_dir).join("memory.jsonl");
        if state.global_step == 0 {
            let _ = std::fs::remove_file(&path);
        }
        self.path = Some(path);
        Ok(())
    }

    fn on_step_end(
        &mut self,
        args: &TrainingArguments,
        state: &TrainerState,
        _control: &mut TrainerControl,
    ) -> Result<()> {
        let m = process_memory();
        let gpu = (!self.device.is_cpu()).then(|| stats(&self.device));
        if let Some(path) = &self.path {
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| Error::io("cannot write", path, e))?;
            let mut line = serde_json::json!({"step": state.global_step, "rss": m.rss, "peak_rss": m.peak_rss, "available": m.available});
            if let Some(g) = &gpu {
                line["device"] =
                    serde_json::to_value(g).map_err(|e| Error::InvalidInput(e.to_string()))?;
            }
            writeln!(f, "{line}").map_err(|e| Error::io("cannot write", path, e))?;
        }
        let (used, total, what) = match &gpu {
            Some(g) => (
                g.reserved,
                g.total,
                format!("{}'s memory pool holds", g.device),
            ),
            None => (m.rss, m.total, "the process holds".to_string()),
        };
        if let (Some(used), Some(total)) = (used, total) {
            if !self.warned && used as f64 > self.warn_fraction * total as f64 {
                self.warned = true;
                // The same fixes as the out-of-memory report, without those the run has made already.
                eprintln!(
                    "warning: step {}: {what} {} of {} memory ({:.0}%); to use less: {}",
                    state.global_step,
                    human_bytes(used),
                    human_bytes(total),
                    100.0 * used as f64 / total as f64,
                    memory_fixes(args, None, gpu.is_some()).join("; ")
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(loss: f64) -> EvalReport {
        EvalReport {
            loss,
            perplexity: loss.exp(),
            tokens: 1,
            examples: 1,
            truncated: 0,
            exact_match: None,
            metrics: Default::default(),
        }
    }

    #[test]
    fn early_stopping_counts_evaluations_without_improvement_and_resumes() {
        let args = TrainingArguments::default();
        let state = TrainerState::default();
        let mut cb = EarlyStoppingCallback::new(2, 0.01);
        let mut control = TrainerControl::default();
        for loss in [2.0, 1.5, 1.495, 1.6] {
            cb.on_evaluate(&args, &state, &mut control, &report(loss))
                .unwrap();
        }
        // 1.495 is not an improvement over 1.5 by more than 0.01; 1.6 neither: two in a row.
        assert!(control.should_training_stop);

        // A callback restored from the state after the third evaluation stops at the fourth, as the original did.
        let mut first = EarlyStoppingCallback::new(2, 0.01);
        let mut control = TrainerControl::default();
        for loss in [2.0, 1.5, 1.495] {
            first
                .on_evaluate(&args, &state, &mut control, &report(loss))
                .unwrap();
        }
        assert!(!control.should_training_stop);
        let mut resumed = EarlyStoppingCallback::new(2, 0.01);
        resumed.load_state(&first.state().unwrap()).unwrap();
        resumed
            .on_evaluate(&args, &state, &mut control, &report(1.6))
            .unwrap();
        assert!(control.should_training_stop, "state carried over a resume");
    }

    #[test]
    fn early_stopping_without_evaluation_is_an_error() {
        let mut cb = EarlyStoppingCallback::new(3, 0.0);
        let err = cb
            .on_train_begin(&TrainingArguments::default(), &TrainerState::default())
            .unwrap_err();
        assert!(err.to_string().contains("eval_strategy"), "{err}");
    }
}
