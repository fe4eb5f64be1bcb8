//! The training loop: `setup`, then one optimizer `step` per accumulation window — each rank's share of the
//! window's micro-batches, a resumed run skipping the windows done before its checkpoint — each followed by
//! `after_step` (log, evaluate, callbacks, checkpoint on schedule), until the last step, a callback or a stop
//! request; then `load_best_model_at_end`, the final adapter and the run's files. Data order depends only on
//! (`data_seed`, epoch), and dropout masks and NEFTune noise only on (`seed`, micro-batch index), so a resumed run
//! replays the same batches, masks and noise as an uninterrupted one.

use std::path::Path;

use super::setup::Run;
use super::trainer::{Trainer, ADAPTER};
use crate::adapter::save_adapter;
use crate::error::Result;
use crate::memory::process_memory;
use crate::profile::trace;
use crate::trainer::reporting::results::{write_profiles, write_results};
use crate::trainer::storage::checkpoint::rotate_checkpoints_at_end;
use crate::trainer::storage::state::TrainOutput;

impl Trainer {
    /// Trains to the end (resuming from `resume` if given: a `checkpoint-N` folder), saves the final adapter in
    /// `output_dir` — with `load_best_model_at_end`, the best checkpoint's, loaded back into the model first — with
    /// the log, a loss plot and `train_results.json`, and prints a summary.
    pub fn train(&mut self, resume: Option<&Path>) -> Result<TrainOutput> {
        let mut run = self.setup(resume)?;
        let first_step = self.state.global_step;
        if run.args.eval_on_start && self.state.global_step == 0 && self.method.has_eval() {
            self.evaluate_and_log(&mut run)?;
        }
        let accumulation = run.args.gradient_accumulation_steps;
        let windows = run.plan.batches_per_epoch.div_ceil(accumulation);
        // Micro-batches of all ranks: a window holds `accumulation` of each rank's.
        let mut micro = 0usize;
        'epochs: for epoch in 0.. {
            if self.state.global_step >= run.total || run.control.should_training_stop {
                break;
            }
            let batches = run.plan.batches(epoch, &run.args);
            for (w, window) in batches
                .chunks(accumulation * run.shard.world_size)
                .enumerate()
            {
                let first_micro = micro;
                micro += window.len();
                if epoch * windows + w < self.state.global_step {
                    continue; // done before the checkpoint this run resumed from
                }
                if self.state.global_step >= run.total {
                    break 'epochs;
                }
                let epoch_done = epoch as f64 + (w + 1) as f64 / windows as f64;
                let next = self.state.global_step + 1;
                let device = self.model.device().clone();
                let tracing = trace::trace_if(run.args.trace_steps.contains(&next), || {
                    Box::new(move || {
                        // Spans of a traced step time the device's work (a GPU runs it asynchronously).
                        device.synchronize().ok()?;
                        crate::memory::stats(&device).allocated
                    })
                });
                let step_span = trace::span_with(|| format!("step {next}"), "step");
                let entry = self.step(&mut run, window, first_micro, epoch_done)?;
                let after = trace::span("log, evaluate, save", "log");
                self.after_step(&mut run, entry, micro, w + 1 == windows)?;
                drop(after);
                drop((step_span, tracing));
                if run.control.should_training_stop {
                    break 'epochs;
                }
            }
        }
        run.progress.finish();
        if let Some(sharding) = self.model.sharding().filter(|s| s.world_size() > 1) {
            let (all, ahead) = sharding.all_gathers();
            // One write, as the rank's loading report (see `shard_onto`).
            let line = format!(
                "fsdp: rank {} of {} started {ahead} of its {all} all-gathers ahead of use (beside the layer before)\n",
                sharding.rank(),
                sharding.world_size()
            );
            let _ = std::io::Write::write_all(&mut std::io::stderr(), line.as_bytes());
        }
        // Every step skipped (a loss never finite, below the limit of max_consecutive_nonfinite_losses or with it
        // off): the adapter is the one the run began with, which is no result to save.
        let steps = self.state.global_step - first_step;
        if steps > 0 && self.state.consecutive_nonfinite_losses >= steps {
            return Err(self.nonfinite_error(
                &run.args,
                &format!(
                    "the loss was not finite at any of this run's {steps} step(s), so every update was skipped and \
                     the adapter did not change (none is saved as the result)"
                ),
                "",
            ));
        }
        // As transformers: the best model is loaded after the last step, before the final model is saved.
        if run.args.load_best_model_at_end {
            run.loaded_best = self.load_best_model(&run.progress)?;
        }
        if run.writes() {
            save_adapter(
                &self.model,
                ADAPTER,
                &run.out,
                self.base_model_name.as_deref(),
            )?;
            let best = self.state.best_model_checkpoint.as_deref().map(Path::new);
            rotate_checkpoints_at_end(&run.out, run.args.save_total_limit, best)?;
            write_profiles(&run.out, &run.memory.timeline, run.snapshot.is_some())?;
        }
        run.snapshot = None;
        let output = self.finish(&run, self.state.global_step < run.total)?;
        self.each_callback(|cb, a, s| cb.on_train_end(a, s))?;
        Ok(output)
    }

    /// The run's result, with `train_results.json`, the loss plot and the printed summary (rank 0's).
    fn finish(&self, run: &Run, stopped_early: bool) -> Result<TrainOutput> {
        let losses = self.state.train_losses();
        let runtime = run.started.elapsed().as_secs_f64();
        let output = TrainOutput {
            global_step: self.state.global_step,
            training_loss: losses.iter().sum::<f64>() / losses.len().max(1) as f64,
            train_runtime: runtime,
            train_tokens_per_second: (self.state.num_input_tokens_seen - run.tokens_at_start)
                as f64
                / runtime.max(1e-9),
            peak_memory_bytes: process_memory().peak_rss,
            stopped_early,
            log_history: self.state.log_history.clone(),
        };
        if !run.writes() {
            return Ok(output);
        }
        write_results(
            &run.out,
            &self.state,
            &output,
            &run.memory.timeline,
            run.loaded_best.as_deref(),
            run.args.memory_snapshot,
        )?;
        Ok(output)
    }
}
