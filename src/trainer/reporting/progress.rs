//! What the user sees while training: a one-line progress bar on a terminal (step, loss, learning rate, tokens/s,
//! memory, ETA), plain log lines otherwise, and the summary at the end.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::time::Instant;

use crate::memory::human_bytes;
use crate::trainer::storage::state::TrainOutput;

/// The progress line of a run.
pub struct Progress {
    total: usize,
    first_step: usize,
    started: Instant,
    bar: bool,
    /// Prints nothing (a rank other than 0 of a distributed run).
    quiet: bool,
}

/// Figures shown for the latest step.
pub struct StepFigures {
    /// Step done.
    pub step: usize,
    /// Its loss.
    pub loss: f64,
    /// Its learning rate.
    pub lr: f64,
    /// Input tokens per second since the start of this run.
    pub tokens_per_second: f64,
    /// Resident memory, if known.
    pub memory: Option<u64>,
}

fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

impl Progress {
    /// Progress over `total` steps, starting after `first_step` (a resume); a bar only when stderr is a terminal
    /// and `disabled` is false.
    pub fn new(total: usize, first_step: usize, disabled: bool) -> Self {
        Progress {
            total,
            first_step,
            started: Instant::now(),
            bar: !disabled && std::io::stderr().is_terminal(),
            quiet: false,
        }
    }

    /// Progress that shows nothing: the other ranks of a distributed run leave the terminal to rank 0.
    pub fn quiet(total: usize, first_step: usize) -> Self {
        Progress {
            bar: false,
            quiet: true,
            ..Progress::new(total, first_step, true)
        }
    }

    /// Redraws the bar (terminal only).
    pub fn update(&self, f: &StepFigures) {
        if !self.bar {
            return;
        }
        let done = f.step.saturating_sub(self.first_step).max(1) as f64;
        let elapsed = self.started.elapsed().as_secs_f64();
        let eta = elapsed / done * self.total.saturating_sub(f.step) as f64;
        let width = 24;
        let filled = (width * f.step / self.total.max(1)).min(width);
        let memory = f.memory.map(human_bytes).unwrap_or_else(|| "?".into());
        eprint!(
            "\r\x1b[2K[{}{}] {}/{} loss {:.4} lr {:.2e} {:.0} tok/s mem {memory} ETA {}",
            "#".repeat(filled),
            "-".repeat(width - filled),
            f.step,
            self.total,
            f.loss,
            f.lr,
            f.tokens_per_second,
            duration(eta)
        );
        let _ = std::io::stderr().flush();
    }

    /// Prints a log line above the bar (or alone without one).
    pub fn println(&self, line: &str) {
        if self.quiet {
            return;
        }
        if self.bar {
            eprint!("\r\x1b[2K");
        }
        eprintln!("{line}");
    }

    /// Ends the bar's line.
    pub fn finish(&self) {
        if self.bar {
            eprintln!();
        }
    }
}

/// The end-of-run summary, one fact per line.
pub fn summary(out: &TrainOutput, best_eval: Option<(usize, f64)>, files: &[String]) -> String {
    let losses: Vec<f64> = out.log_history.iter().filter_map(|e| e.loss).collect();
    let mut lines = vec![format!(
        "trained {} steps in {} ({:.0} tokens/s){}",
        out.global_step,
        duration(out.train_runtime),
        out.train_tokens_per_second,
        if out.stopped_early {
            ", stopped early"
        } else {
            ""
        }
    )];
    if let (Some(first), Some(last)) = (losses.first(), losses.last()) {
        lines.push(format!(
            "train loss {first:.4} → {last:.4} (mean {:.4})",
            out.training_loss
        ));
    }
    if let Some((step, loss)) = best_eval {
        // A DPO evaluation's loss is the preference loss, which has no perplexity.
        let perplexity = match out.log_history.iter().any(|e| e.eval_perplexity.is_some()) {
            true => format!(" (perplexity {:.3})", loss.exp()),
            false => String::new(),
        };
        lines.push(format!(
            "best eval loss {loss:.4}{perplexity} at step {step}"
        ));
    }
    if let Some(peak) = out.peak_memory_bytes {
        lines.push(format!("peak resident memory {}", human_bytes(peak)));
    }
    lines.extend(files.iter().cloned());
    lines.join("\n")
}

/// The metrics of `names` that `metrics` holds, for a progress line (`"  rewards/accuracies 0.750  rewards/margins
/// 0.120"`, with `prefix` before each name, e.g. `eval_`), or nothing when it holds none of them.
pub(crate) fn metric_figures(
    metrics: &BTreeMap<String, f64>,
    names: &[&str],
    prefix: &str,
) -> String {
    names
        .iter()
        .filter_map(|name| {
            let value = metrics.get(*name)?;
            Some(format!("  {prefix}{name} {value:.3}"))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(42.4), "42s");
        assert_eq!(duration(125.0), "2m05s");
        assert_eq!(duration(3.0 * 3600.0 + 65.0), "3h01m");
    }
}
