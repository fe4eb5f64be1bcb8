//! The out-of-memory report: when an allocation fails (the CUDA allocator's `out of memory`, recognized by
//! [`crate::memory::is_out_of_memory`]), training stops with what was live by category, where it happened, and
//! the changes to the `TrainingArguments` that would fit, cheapest first.

use super::args::TrainingArguments;
use crate::memory::{human_bytes, Breakdown, Phase};

/// The report: `live` bytes by category at the failure, the step and phase, and the next steps in order of cost
/// (each says what it saves, estimated from the breakdown).
pub fn oom_report(live: &Breakdown, step: usize, phase: Phase, args: &TrainingArguments) -> String {
    let mut lines = vec![
        format!("out of memory at step {step}, {phase:?} phase; live memory by category:"),
        live.table(),
        "what would fit, cheapest first:".to_string(),
    ];
    let mut n = 0;
    let mut suggest = |text: String| {
        n += 1;
        lines.push(format!("  {n}. {text}"));
    };
    let batch = args.per_device_train_batch_size;
    if batch > 1 {
        suggest(format!(
            "per_device_train_batch_size = {} with gradient_accumulation_steps = {} (same effective batch; \
             activations about halve, ≈ {} less)",
            batch / 2,
            args.gradient_accumulation_steps * 2,
            human_bytes(live.activations / 2)
        ));
    }
    if !args.gradient_checkpointing {
        suggest(format!(
            "gradient_checkpointing = true (keeps only each layer's input; activations drop by most of {}, at \
             about one extra forward per step)",
            human_bytes(live.activations)
        ));
    }
    if !args.optim.is_8bit() && live.optimizer > 0 {
        suggest(format!(
            "optim = \"paged_adamw_8bit\" (8-bit moments: optimizer state {} → about {})",
            human_bytes(live.optimizer),
            human_bytes(live.optimizer / 4)
        ));
    }
    suggest(
        "a shorter [data] max_length (activations scale with tokens per micro-batch)".to_string(),
    );
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::OptimizerName;

    #[test]
    fn suggestions_come_cheapest_first_and_skip_what_is_already_on() {
        let live = Breakdown {
            base_weights: 4 << 30,
            lora: 80 << 20,
            optimizer: 160 << 20,
            gradients: 80 << 20,
            activations: 10 << 30,
            other: 0,
        };
        let args = TrainingArguments {
            per_device_train_batch_size: 8,
            gradient_accumulation_steps: 2,
            optim: OptimizerName::AdamWTorch,
            ..Default::default()
        };
        let r = oom_report(&live, 12, Phase::Backward, &args);
        assert!(r.contains("step 12, Backward"), "{r}");
        let order: Vec<usize> = [
            "per_device_train_batch_size = 4 with gradient_accumulation_steps = 4",
            "gradient_checkpointing = true",
            "paged_adamw_8bit",
            "max_length",
        ]
        .iter()
        .map(|s| r.find(s).unwrap_or_else(|| panic!("{s} missing in {r}")))
        .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{r}");

        let done = TrainingArguments {
            per_device_train_batch_size: 1,
            gradient_checkpointing: true,
            optim: OptimizerName::PagedAdamW8bit,
            ..Default::default()
        };
        let r = oom_report(&live, 1, Phase::Forward, &done);
        assert!(r.contains("1. a shorter [data] max_length"), "{r}");
    }
}
