//! What follows a step on schedule: its log entry (the history, `log.jsonl`, the callbacks' `on_log`), the limit on
//! non-finite losses in a row, an evaluation (logged, tracking the best metric), the callbacks' `on_step_end`, and a
//! checkpoint — on schedule, or when a stop was requested (Ctrl-C), which then ends the run.

use std::path::Path;

use super::interrupt;
use super::setup::Run;
use super::trainer::{Trainer, ADAPTER};
use crate::error::{Error, Result};
use crate::profile::trace;
use crate::trainer::reporting::eval_report::EvalReport;
use crate::trainer::reporting::progress::metric_figures;
use crate::trainer::settings::args::{IntervalStrategy, TrainingArguments};
use crate::trainer::storage::log::append_to_log;
use crate::trainer::storage::position::SchedulerState;
use crate::trainer::storage::state::LogEntry;

impl Trainer {
    /// What follows a step on schedule: its log entry, the non-finite-loss limit, evaluation, the callbacks'
    /// `on_step_end`, and a checkpoint. `micro` counts the micro-batches consumed; `last_window` ends an epoch.
    pub(super) fn after_step(
        &mut self,
        run: &mut Run,
        mut entry: LogEntry,
        micro: usize,
        last_window: bool,
    ) -> Result<()> {
        let (step, lr) = (entry.step, entry.learning_rate.unwrap_or_default());
        if Self::log_now(run, &run.args, step) && run.writes() {
            entry.texts = self.method.write_samples(&run.out, step)?;
        }
        if Self::log_now(run, &run.args, step) || entry.skipped {
            self.log(run.log_path.as_deref(), entry)?;
        }
        let args = &run.args;
        let limit = args.max_consecutive_nonfinite_losses;
        if limit > 0 && self.state.consecutive_nonfinite_losses >= limit {
            return Err(self.nonfinite_error(
                args,
                &format!(
                    "the loss was not finite for {limit} steps in a row (last at step {step})"
                ),
                " (max_consecutive_nonfinite_losses sets this limit)",
            ));
        }
        // As transformers: its epoch loop ends at the last step too, mid-epoch when max_steps cuts one short, and
        // the end of that (partial) epoch evaluates and saves with the "epoch" strategies.
        let epoch_end = last_window || step == run.total;
        let evaluate_now = match args.eval_strategy {
            IntervalStrategy::Steps => step % run.every.eval == 0,
            IntervalStrategy::Epoch => epoch_end,
            IntervalStrategy::No => false,
        };
        if evaluate_now && self.method.has_eval() {
            self.evaluate_and_log(run)?;
        }
        let args = &run.args;
        for cb in &mut self.callbacks {
            cb.on_step_end(args, &self.state, &mut run.control)?;
        }
        // As transformers: on schedule, and with "steps" also at the last step.
        let save_now = match args.save_strategy {
            IntervalStrategy::Steps => step % run.every.save == 0 || step == run.total,
            IntervalStrategy::Epoch => epoch_end,
            IntervalStrategy::No => false,
        };
        let interrupted = run.agreed_stop.unwrap_or_else(interrupt::stop_requested);
        if (save_now && !run.control.should_training_stop) || interrupted {
            let data = run.plan.position(args, micro);
            let scheduler = SchedulerState {
                lr_scheduler_type: args.lr_scheduler_type,
                learning_rate: args.learning_rate,
                warmup_steps: run.warmup,
                total_steps: run.total,
                last_step: step,
                last_lr: lr,
            };
            #[cfg(feature = "nccl")]
            if let Some(ddp) = &run.ddp {
                ddp.check_same_adapter(&run.vars, step)?;
            }
            let checkpoint = {
                let _save = trace::span("checkpoint", "checkpoint");
                self.save_checkpoint(run, &data, &scheduler)?
            };
            if interrupted {
                run.progress.finish();
                return Err(Error::Interrupted { step, checkpoint });
            }
        }
        Ok(())
    }

    /// The error ending a run whose loss was not finite (`what` says how long), with what may fix it: when no step
    /// of the run ever had a finite loss (none updated the adapter), the learning rate cannot be the cause, and the
    /// loss's own settings (the method's) and the data are named instead.
    pub(super) fn nonfinite_error(
        &self,
        args: &TrainingArguments,
        what: &str,
        limit: &str,
    ) -> Error {
        let from_start = self.state.consecutive_nonfinite_losses >= self.state.global_step;
        let fixes = match (from_start, self.method.loss_settings()) {
            (true, Some(settings)) => format!(
                "the loss was never finite, from the first step on, before any update, so the learning rate is not \
                 the cause: check {settings}, or the data"
            ),
            (true, None) => format!(
                "the loss was never finite, from the first step on, before any update: {}",
                fp16_fix(args).unwrap_or("check the data")
            ),
            (false, _) => divergence_fixes(args),
        };
        Error::Diverged(format!("{what}; {fixes}{limit}"))
    }

    /// Evaluates, logs the result, tracks the best metric and runs the callbacks' `on_evaluate`.
    pub(super) fn evaluate_and_log(&mut self, run: &mut Run) -> Result<EvalReport> {
        let step = self.state.global_step;
        // Each rank evaluates its share of the batches; the sums travel together (one all-reduce).
        let what = format!("step {step}'s evaluation");
        let sum_over_ranks = &mut |sums: &mut [f64]| run.sum_over_ranks(sums, &what);
        let report = self.method.evaluate(
            &mut self.model,
            ADAPTER,
            &self.args,
            run.shard,
            sum_over_ranks,
        )?;
        let exact = report
            .exact_match
            .map(|m| format!("  exact match {:.1}%", 100.0 * m))
            .unwrap_or_default();
        let perplexity = match report.metrics.is_empty() {
            true => format!("  perplexity {:.3}", report.perplexity),
            false => metric_figures(&report.metrics, self.method.progress_metrics(), "eval_"),
        };
        run.progress.println(&format!(
            "step {step}: eval_loss {:.4}{perplexity}{exact}",
            report.loss
        ));
        // As transformers' `_determine_best_metric`, by metric_for_best_model (the loss when unset).
        let value = self.args.best_metric_value(report.loss, &report.metrics);
        if let Some(value) = value.filter(|v| self.args.improves(*v, self.state.best_metric, 0.0)) {
            self.state.best_metric = Some(value);
            self.state.best_global_step = Some(step);
        }
        let entry = LogEntry {
            step,
            epoch: self.state.epoch,
            eval_loss: Some(report.loss),
            eval_perplexity: report.metrics.is_empty().then_some(report.perplexity),
            eval_exact_match: report.exact_match,
            metrics: report
                .metrics
                .iter()
                .map(|(k, v)| (format!("eval_{k}"), *v))
                .collect(),
            ..Default::default()
        };
        self.log(run.log_path.as_deref(), entry)?;
        for cb in &mut self.callbacks {
            cb.on_evaluate(&self.args, &self.state, &mut run.control, &report)?;
        }
        Ok(report)
    }

    /// Records `entry` in the history, appends it to the log file (rank 0's: `path` is `None` on the others) and
    /// runs the callbacks' `on_log`.
    fn log(&mut self, path: Option<&Path>, entry: LogEntry) -> Result<()> {
        if let Some(path) = path {
            append_to_log(path, &entry)?;
        }
        self.state.log_history.push(entry.clone());
        self.each_callback(|cb, a, s| cb.on_log(a, s, &entry))
    }
}

/// The advice for fp16, whose range overflows, when `args` train in it.
fn fp16_fix(args: &TrainingArguments) -> Option<&'static str> {
    args.fp16
        .then_some("use bf16 = true instead of fp16 (float16 overflows)")
}

/// What may stop a run's loss from going non-finite, of what `args` does not do already: a lower learning rate,
/// clipping (when `max_grad_norm` = 0 turns it off), bf16 in place of fp16 (whose range overflows), the data.
fn divergence_fixes(args: &TrainingArguments) -> String {
    let mut fixes = vec![format!(
        "lower learning_rate (now {:e})",
        args.learning_rate
    )];
    if args.max_grad_norm == 0.0 {
        fixes.push("set max_grad_norm = 1.0 (clipping is off)".into());
    }
    if let Some(fix) = fp16_fix(args) {
        fixes.push(fix.into());
    }
    fixes.push("check the data".into());
    let last = fixes.pop().unwrap_or_default();
    match fixes.is_empty() {
        true => last,
        false => format!("{}, or {last}", fixes.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn divergence_advice_names_only_what_the_run_does_not_do_already() {
        // transformers' defaults: clipping at 1.0, float32 — only the learning rate and the data are left.
        let fixes = divergence_fixes(&TrainingArguments::default());
        assert_eq!(fixes, "lower learning_rate (now 5e-5), or check the data");
        let fixes = divergence_fixes(&TrainingArguments {
            max_grad_norm: 0.0,
            fp16: true,
            ..Default::default()
        });
        assert!(
            fixes.contains("set max_grad_norm = 1.0")
                && fixes.contains("use bf16 = true instead of fp16"),
            "{fixes}"
        );
    }
}
