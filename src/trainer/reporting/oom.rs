//! The out-of-memory report: when an allocation fails (the CUDA allocator's `out of memory`, recognized by
//! [`crate::memory::is_out_of_memory`]), training stops with what was live by category, where it happened, and
//! the changes to the `TrainingArguments` that would fit, cheapest first.

use crate::memory::{human_bytes, Breakdown, Phase};
use crate::optim::OptimizerName;
use crate::trainer::settings::args::TrainingArguments;

/// The report: `live` bytes by category at the failure, the step and phase, and the next steps in order of cost
/// (each says what it saves, estimated from the breakdown). An out-of-memory error is a GPU allocator's: the fixes
/// are a GPU's.
pub fn oom_report(live: &Breakdown, step: usize, phase: Phase, args: &TrainingArguments) -> String {
    let mut lines = vec![
        format!("out of memory at step {step}, {phase:?} phase; live memory by category:"),
        live.table(),
        "what would fit, cheapest first:".to_string(),
    ];
    for (n, fix) in memory_fixes(args, Some(live), true).iter().enumerate() {
        lines.push(format!("  {}. {fix}", n + 1));
    }
    lines.join("\n")
}

/// The changes to `args` that lower a run's memory, cheapest first — only those it has not made already (a
/// micro-batch that can still shrink, checkpointing that is off, the MLP untiled, layer inputs kept on the GPU
/// (`on_gpu`: offload only moves a GPU's), 32-bit AdamW moments); each with what it saves when the `live`
/// breakdown is known.
pub(crate) fn memory_fixes(
    args: &TrainingArguments,
    live: Option<&Breakdown>,
    on_gpu: bool,
) -> Vec<String> {
    let saves = |what: String| live.map_or(String::new(), |_| what);
    let mut fixes = Vec::new();
    let batch = args.per_device_train_batch_size;
    // Divide the micro-batch by its smallest factor (itself when prime) and accumulate as many more, so the
    // effective batch stays.
    if batch > 1 {
        let factor = (2..)
            .take_while(|f| *f <= batch / f)
            .find(|f| batch % f == 0)
            .unwrap_or(batch);
        let activations = live.map_or(0, |l| l.activations);
        fixes.push(format!(
            "per_device_train_batch_size = {} with gradient_accumulation_steps = {} (same effective batch; \
             activations drop to about 1/{factor}{})",
            batch / factor,
            args.gradient_accumulation_steps.saturating_mul(factor),
            saves(format!(
                ", ≈ {} less",
                human_bytes(activations - activations / factor as u64)
            ))
        ));
    }
    if !args.checkpointing() {
        fixes.push(format!(
            "gradient_checkpointing = true (keeps only each layer's input; activations drop by most{}, at about \
             one extra forward per step)",
            saves(format!(
                " of {}",
                human_bytes(live.map_or(0, |l| l.activations))
            ))
        ));
    }
    if !args.tiled_mlp {
        fixes.push(
            "tiled_mlp = true (the MLP's intermediates exist for one slice of the tokens at a time; the same \
             gradients; no LoRA dropout on the MLP's projections)"
                .to_string(),
        );
    }
    if on_gpu && !args.activation_offloading {
        fixes.push(
            "activation_offloading = true (with checkpointing, the layer inputs wait in pinned host memory and the \
             GPU keeps three of them)"
                .to_string(),
        );
    }
    // 8-bit moments in place of AdamW's 32-bit ones (SGD's state is another algorithm's, not a cheaper AdamW).
    let adamw_32bit = matches!(
        args.optim,
        OptimizerName::AdamWTorch | OptimizerName::PagedAdamW32bit
    );
    if adamw_32bit && live.is_none_or(|l| l.optimizer > 0) {
        let optimizer = live.map_or(0, |l| l.optimizer);
        fixes.push(format!(
            "optim = \"paged_adamw_8bit\" (8-bit moments{})",
            saves(format!(
                ": optimizer state {} → about {}",
                human_bytes(optimizer),
                human_bytes(optimizer / 4)
            ))
        ));
    }
    fixes.push(
        "a shorter [data] max_length (activations scale with tokens per micro-batch)".to_string(),
    );
    fixes
}

#[cfg(test)]
mod tests {
    use super::*;

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
            "tiled_mlp = true",
            "activation_offloading = true",
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
            tiled_mlp: true,
            activation_offloading: true,
            optim: OptimizerName::PagedAdamW8bit,
            ..Default::default()
        };
        let r = oom_report(&live, 1, Phase::Forward, &done);
        assert!(r.contains("1. a shorter [data] max_length"), "{r}");
    }

    #[test]
    fn each_fix_keeps_the_effective_batch_and_the_algorithm() {
        // An odd micro-batch: 3 × 2 accumulated becomes 1 × 6, not 1 × 4 (which would train on fewer examples).
        let odd = TrainingArguments {
            per_device_train_batch_size: 3,
            gradient_accumulation_steps: 2,
            gradient_checkpointing: true,
            optim: OptimizerName::Sgd,
            ..Default::default()
        };
        let fixes = memory_fixes(&odd, None, false);
        assert_eq!(
            fixes[0],
            "per_device_train_batch_size = 1 with gradient_accumulation_steps = 6 (same effective batch; \
             activations drop to about 1/3)"
        );
        // SGD is not offered an AdamW, the CPU no offload, and without a breakdown no sizes are guessed.
        assert_eq!(fixes.len(), 3, "{fixes:?}");
        assert!(fixes[1].starts_with("tiled_mlp = true"), "{fixes:?}");
        assert!(
            !fixes.iter().any(|f| f.contains('≈') || f.contains("optim")),
            "{fixes:?}"
        );
    }
}
