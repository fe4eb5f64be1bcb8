//! Saving a checkpoint: refused for a state that is not finite (the newest earlier one stands), the best
//! checkpoint tracked, the callbacks' state gathered, the folder written by rank 0 (adapter, the method's files,
//! the optimizer, the JSON state) and rotated, and the callbacks' `on_save`.

use std::path::{Path, PathBuf};

use super::setup::Run;
use super::trainer::{Trainer, ADAPTER};
use crate::adapter::{save_adapter, Adapters};
use crate::error::Result;
use crate::files::first_non_finite;
use crate::optim::Optimizer;
use crate::trainer::storage::checkpoint::{
    latest_checkpoint, rotate_checkpoints, write_checkpoint, CheckpointFiles,
};
use crate::trainer::storage::position::{DataPosition, SchedulerState};
use crate::trainer::storage::state::TRAINER_STATE;

impl Trainer {
    /// Writes `checkpoint-{step}` (see [`crate::trainer::storage::checkpoint`]) and applies `save_total_limit`; returns its folder,
    /// or the newest earlier one when this state is not finite and is not saved.
    pub(super) fn save_checkpoint(
        &mut self,
        run: &Run,
        data: &DataPosition,
        scheduler: &SchedulerState,
    ) -> Result<Option<PathBuf>> {
        let (out, optimizer) = (&run.out, &run.optimizer);
        let step = self.state.global_step;
        // A diverged run's state is not worth keeping, and saving it would rotate a good checkpoint out.
        if let Some(what) = self.non_finite_state(optimizer)? {
            eprintln!(
                "warning: checkpoint-{step} not saved: {what} is not finite (the checkpoints before it are kept)"
            );
            return Ok(latest_checkpoint(out));
        }
        // As transformers 5: with metric_for_best_model (which load_best_model_at_end defaults to the loss), the
        // checkpoint of the best evaluation's step once saved.
        if let Some(best) = self
            .state
            .best_global_step
            .filter(|_| self.args.best_model_metric().is_some())
        {
            let dir = out.join(format!("checkpoint-{best}"));
            if best == step || dir.join(TRAINER_STATE).exists() {
                self.state.best_model_checkpoint = Some(dir.display().to_string());
            }
        }
        self.state.stateful_callbacks = self
            .callbacks
            .iter()
            .filter_map(|cb| Some((cb.name().to_string(), cb.state()?)))
            .collect();
        let files = CheckpointFiles {
            state: &self.state,
            data,
            scheduler,
            args: &self.args,
            run_config: self.run_config.as_deref(),
            base_model: &run.base_model,
        };
        // Rank 0 writes the checkpoint; the ranks' states are the same (checked before), and so is their RNG, a
        // function of the seed and the micro-batch index.
        let dir = if run.writes() {
            let dir = write_checkpoint(out, step, &files, |tmp| {
                save_adapter(&self.model, ADAPTER, tmp, self.base_model_name.as_deref())?;
                self.method.save(&self.model, tmp)?;
                optimizer.save(tmp)
            })?;
            let best = self.state.best_model_checkpoint.as_deref().map(Path::new);
            rotate_checkpoints(out, self.args.save_total_limit, best)?;
            dir
        } else {
            out.join(format!("checkpoint-{step}"))
        };
        for cb in &mut self.callbacks {
            cb.on_save(&self.args, &self.state, &dir)?;
        }
        Ok(Some(dir))
    }

    /// What holds a NaN or an infinity — an adapter weight or a parameter's optimizer state — if anything does.
    fn non_finite_state(&self, optimizer: &Optimizer) -> Result<Option<String>> {
        for (name, var) in self.model.adapter_parameters(ADAPTER)? {
            if first_non_finite(var.as_tensor())?.is_some() {
                return Ok(Some(format!("adapter weight `{name}`")));
            }
        }
        Ok(optimizer
            .first_non_finite()?
            .map(|name| format!("the optimizer state of `{name}`")))
    }
}
