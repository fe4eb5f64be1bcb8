//! What a finished run writes besides the adapter — `train_results.json`, the loss plot, the memory timeline and
//! chart, the trace of `trace_steps`, the memory snapshot — and the summary it prints naming them.

use std::path::Path;

use super::memory::MEMORY_SNAPSHOT_FILE;
use super::progress::summary;
use crate::error::{Error, Result};
use crate::memory::snapshot::write_snapshot;
use crate::memory::MemoryTimeline;
use crate::plot::{loss_svg, LossCurves};
use crate::profile::trace;
use crate::trainer::storage::log::LOG_FILE;
use crate::trainer::storage::state::{LogEntry, TrainOutput, TrainerState};

/// The loss plot in `output_dir`.
const PLOT_FILE: &str = "loss.svg";
/// The run's figures in `output_dir`.
const RESULTS_FILE: &str = "train_results.json";
/// The Chrome trace of the steps `trace_steps` names, for Perfetto.
pub const TRACE_FILE: &str = "trace.json";

/// Writes the memory timeline (`memory_timeline.json`, `memory.svg`), the trace of the steps traced (if any) and,
/// when allocations were `recorded`, the memory snapshot into `out`.
pub(crate) fn write_profiles(out: &Path, timeline: &MemoryTimeline, recorded: bool) -> Result<()> {
    timeline.write(out)?;
    let events = trace::take_events();
    if !events.is_empty() {
        trace::write_chrome_trace(&out.join(TRACE_FILE), &events)?;
    }
    if recorded {
        write_snapshot(&out.join(MEMORY_SNAPSHOT_FILE))?;
    }
    Ok(())
}

/// Writes `train_results.json` and the loss plot of the run whose `state` ended in `output` into `out`, and prints
/// the summary: the peak memory per phase of `timeline`, the best evaluation, and the files (the adapter — the
/// best checkpoint's when `loaded_best` — the log, the plots, the snapshot when `memory_snapshot`).
pub(crate) fn write_results(
    out: &Path,
    state: &TrainerState,
    output: &TrainOutput,
    timeline: &MemoryTimeline,
    loaded_best: Option<&Path>,
    memory_snapshot: bool,
) -> Result<()> {
    let by_step = |value: fn(&LogEntry) -> Option<f64>| -> Vec<(usize, f64)> {
        let history = state.log_history.iter();
        history.filter_map(|e| Some((e.step, value(e)?))).collect()
    };
    let train = by_step(|e| e.loss);
    let learning_rate = by_step(|e| e.learning_rate);
    let eval = state.eval_losses();
    let plot = out.join(PLOT_FILE);
    let svg = loss_svg(&LossCurves {
        train: &train,
        eval: &eval,
        learning_rate: &learning_rate,
    })
    .map_err(|e| Error::io("cannot draw", &plot, e))?;
    std::fs::write(&plot, svg).map_err(|e| Error::io("cannot write", &plot, e))?;
    let results = out.join(RESULTS_FILE);
    let json = serde_json::json!({
        "epoch": state.epoch,
        "global_step": output.global_step,
        "train_loss": output.training_loss,
        "train_runtime": output.train_runtime,
        "train_tokens_per_second": output.train_tokens_per_second,
        "peak_memory_bytes": output.peak_memory_bytes,
        "best_metric": state.best_metric,
    });
    std::fs::write(
        &results,
        serde_json::to_string_pretty(&json).unwrap_or_default(),
    )
    .map_err(|e| Error::io("cannot write", &results, e))?;
    let best = state.best_global_step.zip(state.best_metric);
    if let Some(peak) = timeline.summary() {
        eprintln!("{peak}");
    }
    let from_best = match loaded_best {
        Some(best) => format!(" (the best model's, from {})", best.display()),
        None => String::new(),
    };
    let mut files = vec![
        format!(
            "adapter: {}{from_best}",
            out.join("adapter_model.safetensors").display()
        ),
        format!("log: {}", out.join(LOG_FILE).display()),
        format!("loss plot: {}", plot.display()),
        format!(
            "memory timeline: {} and memory.svg",
            out.join("memory_timeline.json").display()
        ),
    ];
    if memory_snapshot {
        files.push(format!(
            "memory snapshot: {} (open it in pytorch.org/memory_viz)",
            out.join(MEMORY_SNAPSHOT_FILE).display()
        ));
    }
    eprintln!("{}", summary(output, best, &files));
    Ok(())
}
