//! One optimizer step: the method's forward, loss and backward over an accumulation window, a distributed run's
//! gradients and loss summed over the ranks, the one read from the device (loss, gradient norm, auxiliary loss,
//! stop flag, the method's metrics), then clipping and the optimizer's update — skipped when the loss is not
//! finite — and the step's progress line.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::backprop::GradStore;
use candle_core::Tensor;

#[cfg(feature = "nccl")]
use super::interrupt;
use super::setup::Run;
use super::trainer::{Trainer, ADAPTER};
use crate::error::Result;
use crate::memory::{process_memory, Phase};
use crate::optim::clip::{scale_to_norm, squared_norm};
use crate::profile::context as snapshot_context;
use crate::profile::trace;
use crate::trainer::reporting::memory::gradient_bytes;
use crate::trainer::reporting::progress::{metric_figures, StepFigures};
use crate::trainer::settings::args::TrainingArguments;
use crate::trainer::storage::state::LogEntry;
use crate::trainer::window::batches::WindowBatches;

impl Trainer {
    /// One optimizer step on the micro-batches of `window` (the next step; `epoch` counts the epochs done after
    /// it): forward and backward, then clipping and the update — skipped when the loss is not finite.
    pub(super) fn step(
        &mut self,
        run: &mut Run,
        window: &[Vec<usize>],
        first_micro: usize,
        epoch: f64,
    ) -> Result<LogEntry> {
        let args = &run.args;
        let step = self.state.global_step + 1;
        let step_started = Instant::now();
        run.memory.step = step;
        snapshot_context::set_step(step);
        let batches = WindowBatches {
            batches: window,
            first_micro,
            shard: run.shard,
        };
        let result = self
            .method
            .run_window(
                &mut self.model,
                ADAPTER,
                args,
                &batches,
                &run.vars,
                &mut run.memory,
            )
            .map_err(|e| run.memory.explain(e, args))?;
        self.state.global_step = step;
        self.state.epoch = epoch;
        self.state.num_input_tokens_seen += result.input_tokens;
        let mut grads = result.grads;
        let sync = trace::span("read loss and gradient norm", "sync");
        let (loss_sum, stop_flag) =
            Self::reduce_over_ranks(run, &mut grads, result.loss_sum, step)?;
        // The one read from the device in a step: the loss and the squared gradient norm together (and a
        // distributed run's stop flag).
        let squared_norm = squared_norm(&run.vars, &grads)?;
        let read: Vec<f64> = Tensor::cat(
            &[
                Some(&loss_sum),
                squared_norm.as_ref(),
                result.aux_loss.as_ref(),
                stop_flag.as_ref(),
                result.metrics.as_ref(),
            ]
            .into_iter()
            .flatten()
            .map(|t| t.flatten_all())
            .collect::<candle_core::Result<Vec<_>>>()?,
            0,
        )?
        .to_vec1()?;
        drop(sync);
        let grad_norm = squared_norm.as_ref().map_or(0.0, |_| read[1].sqrt());
        let aux_at = 1 + usize::from(squared_norm.is_some());
        let aux_loss = result.aux_loss.as_ref().map(|_| read[aux_at]);
        let flag_at = aux_at + usize::from(aux_loss.is_some());
        // The method's metrics, averaged as the loss is (DPO's: means over the window's micro-batches).
        let mut metrics: BTreeMap<String, f64> = match result.metrics {
            Some(_) => self
                .method
                .metric_names()
                .iter()
                .zip(&read[flag_at + usize::from(stop_flag.is_some())..])
                .map(|(name, sum)| (name.to_string(), sum / result.counted.max(1) as f64))
                .collect(),
            None => BTreeMap::new(),
        };
        metrics.extend(result.host_metrics);
        // A distributed run stops where the ranks agreed (a Ctrl-C arriving later on one rank counts next step).
        run.agreed_stop = stop_flag.map(|_| read[flag_at] > 0.0);
        let loss = read[0] / result.counted.max(1) as f64;
        let lr = run.schedule.lr_for_update(step);
        let mut entry = LogEntry {
            step,
            epoch,
            learning_rate: Some(lr),
            tokens: Some(result.input_tokens),
            aux_loss,
            metrics,
            ..Default::default()
        };
        if loss.is_finite() {
            self.state.consecutive_nonfinite_losses = 0;
            let _optimizer = trace::span("optimizer", "optimizer");
            run.memory.timeline.start_phase(Phase::Optimizer);
            scale_to_norm(&run.vars, &mut grads, grad_norm, args.max_grad_norm)?;
            run.optimizer
                .step(&grads, lr)
                .map_err(|e| run.memory.explain(e, args))?;
            run.memory.optimizer_bytes = run.optimizer.resident_bytes() as u64;
            run.memory.end_phase(0, gradient_bytes(&run.vars, &grads));
            entry.loss = Some(loss);
            entry.grad_norm = Some(grad_norm);
        } else {
            self.state.consecutive_nonfinite_losses += 1;
            entry.skipped = true;
            run.progress.println(&format!(
                "step {step}: non-finite loss ({loss}); update skipped ({} in a row)",
                self.state.consecutive_nonfinite_losses
            ));
        }
        entry.step_seconds = Some(step_started.elapsed().as_secs_f64());
        entry.memory_bytes = process_memory().rss;
        let tokens_per_second = (self.state.num_input_tokens_seen - run.tokens_at_start) as f64
            / run.started.elapsed().as_secs_f64();
        run.progress.update(&StepFigures {
            step,
            loss,
            lr,
            tokens_per_second,
            memory: entry.memory_bytes,
        });
        if Self::log_now(run, args, step) && !entry.skipped {
            let aux = aux_loss.map_or(String::new(), |a| format!("  aux_loss {a:.4}"));
            run.progress.println(&format!(
                "step {step}/{}  loss {loss:.4}{aux}{}  lr {lr:.3e}  grad_norm {:.3}  {tokens_per_second:.0} tokens/s",
                run.total,
                metric_figures(&entry.metrics, self.method.progress_metrics(), ""),
                entry.grad_norm.unwrap_or(f64::NAN)
            ));
        }
        Ok(entry)
    }

    /// A distributed run's gradients summed over the ranks (in place) and its loss sum too, with the flag that
    /// is positive when any rank was asked to stop; alone, `loss_sum` and no flag.
    #[cfg_attr(not(feature = "nccl"), allow(unused_variables))]
    fn reduce_over_ranks(
        run: &Run,
        grads: &mut GradStore,
        loss_sum: Tensor,
        step: usize,
    ) -> Result<(Tensor, Option<Tensor>)> {
        #[cfg(feature = "nccl")]
        if let Some(ddp) = &run.ddp {
            ddp.reduce_gradients(&run.vars, grads, step)?;
            let agreed = ddp.agree(&loss_sum, interrupt::stop_requested(), step)?;
            return Ok((agreed.get(0)?, Some(agreed.get(1)?)));
        }
        Ok((loss_sum, None))
    }

    /// Whether `step` is logged.
    pub(super) fn log_now(run: &Run, args: &TrainingArguments, step: usize) -> bool {
        step % run.every.log == 0 || (step == 1 && args.logging_first_step) || step == run.total
    }
}
