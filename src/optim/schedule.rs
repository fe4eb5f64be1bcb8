//! Learning-rate schedules with transformers' formulas (`transformers/optimization.py`): a multiplier `λ(s)` of the
//! base learning rate, where `s` counts scheduler steps taken so far, so optimizer update `k` (from 1) uses
//! `λ(k − 1)` — with warmup the very first update runs at learning rate 0, as in transformers.

use std::f64::consts::PI;

use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::names::named_enum;

named_enum! {
    /// transformers' learning-rate schedules (`lr_scheduler_type`).
    pub enum SchedulerType ("lr_scheduler_type") {
        /// Linear warmup, then linear decay to 0.
        Linear = "linear",
        /// Linear warmup, then half a cosine (`num_cycles`, default 0.5) to 0.
        Cosine = "cosine",
        /// Cosine with hard restarts (`num_cycles`, default 1).
        CosineWithRestarts = "cosine_with_restarts",
        /// Polynomial decay to `lr_end` (default 1e-7) with `power` (default 1).
        Polynomial = "polynomial",
        /// Constant.
        Constant = "constant",
        /// Linear warmup, then constant.
        ConstantWithWarmup = "constant_with_warmup",
        /// Linear warmup, then `1/sqrt` decay (`timescale`, default the warmup or 10 000).
        InverseSqrt = "inverse_sqrt",
        /// Cosine to a floor (`min_lr` or `min_lr_rate`).
        CosineWithMinLr = "cosine_with_min_lr",
        /// Warmup, stable, decay (`num_decay_steps`, `num_stable_steps`, `warmup_type` (linear), `decay_type`
        /// (cosine), `min_lr_ratio`).
        WarmupStableDecay = "warmup_stable_decay",
    }
}

/// `TrainingArguments.get_warmup_steps`: a value ≥ 1 is a step count, a value in [0, 1) a ratio of `total`.
pub fn warmup_steps(warmup: f64, total: usize) -> usize {
    if warmup >= 1.0 {
        warmup as usize
    } else {
        (total as f64 * warmup).ceil() as usize
    }
}

/// A learning-rate schedule.
#[derive(Clone, Debug)]
pub struct Schedule {
    kind: SchedulerType,
    base_lr: f64,
    warmup: usize,
    total: usize,
    kwargs: Map<String, Value>,
}

impl Schedule {
    /// A schedule of `total` optimizer steps with `warmup` warmup steps and `lr_scheduler_kwargs`.
    pub fn new(
        kind: SchedulerType,
        base_lr: f64,
        warmup: usize,
        total: usize,
        kwargs: Option<&Value>,
    ) -> Result<Self> {
        let kwargs = match kwargs {
            None | Some(Value::Null) => Map::new(),
            Some(Value::Object(m)) => m.clone(),
            Some(other) => {
                return Err(Error::InvalidInput(format!(
                    "lr_scheduler_kwargs must be a table, got {other}"
                )))
            }
        };
        let allowed: &[&str] = match kind {
            SchedulerType::Cosine | SchedulerType::CosineWithRestarts => &["num_cycles"],
            SchedulerType::Polynomial => &["lr_end", "power"],
            SchedulerType::InverseSqrt => &["timescale"],
            SchedulerType::CosineWithMinLr => &["num_cycles", "min_lr", "min_lr_rate"],
            SchedulerType::WarmupStableDecay => &[
                "num_decay_steps",
                "num_stable_steps",
                "warmup_type",
                "decay_type",
                "min_lr_ratio",
                "num_cycles",
            ],
            _ => &[],
        };
        if let Some(k) = kwargs.keys().find(|k| !allowed.contains(&k.as_str())) {
            return Err(Error::InvalidInput(format!(
                "lr_scheduler_kwargs: `{k}` does not apply to {kind:?} (it takes {allowed:?})"
            )));
        }
        let s = Schedule {
            kind,
            base_lr,
            warmup,
            total,
            kwargs,
        };
        let has = |k: &str| s.num(k).is_some();
        if kind == SchedulerType::CosineWithMinLr && has("min_lr") == has("min_lr_rate") {
            return Err(Error::InvalidInput(
                "cosine_with_min_lr needs exactly one of lr_scheduler_kwargs.min_lr and min_lr_rate".into(),
            ));
        }
        if kind == SchedulerType::WarmupStableDecay && s.num("num_decay_steps").is_none() {
            return Err(Error::InvalidInput(
                "warmup_stable_decay needs lr_scheduler_kwargs.num_decay_steps".into(),
            ));
        }
        if kind == SchedulerType::Polynomial && s.num("lr_end").unwrap_or(1e-7) > base_lr {
            return Err(Error::InvalidInput(
                "polynomial: lr_end must not exceed the learning rate".into(),
            ));
        }
        Ok(s)
    }

    fn num(&self, k: &str) -> Option<f64> {
        self.kwargs.get(k).and_then(Value::as_f64)
    }

    fn text(&self, k: &str, default: &str) -> String {
        self.kwargs
            .get(k)
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_string()
    }

    /// The multiplier `λ(s)` after `s` scheduler steps.
    pub fn multiplier(&self, s: usize) -> f64 {
        let (w, t) = (self.warmup, self.total);
        let warm = |s: usize| s as f64 / w.max(1) as f64;
        let progress = |s: usize| (s - w) as f64 / (t.saturating_sub(w)).max(1) as f64;
        let in_warmup = s < w;
        match self.kind {
            SchedulerType::Constant => 1.0,
            SchedulerType::ConstantWithWarmup => {
                if in_warmup {
                    warm(s)
                } else {
                    1.0
                }
            }
            SchedulerType::Linear => {
                if in_warmup {
                    warm(s)
                } else {
                    (t as f64 - s as f64).max(0.0) / (t.saturating_sub(w)).max(1) as f64
                }
            }
            SchedulerType::Cosine => {
                if in_warmup {
                    return warm(s);
                }
                let cycles = self.num("num_cycles").unwrap_or(0.5);
                (0.5 * (1.0 + (PI * cycles * 2.0 * progress(s)).cos())).max(0.0)
            }
            SchedulerType::CosineWithRestarts => {
                if in_warmup {
                    return warm(s);
                }
                let p = progress(s);
                if p >= 1.0 {
                    return 0.0;
                }
                let cycles = self.num("num_cycles").unwrap_or(1.0);
                (0.5 * (1.0 + (PI * ((cycles * p) % 1.0)).cos())).max(0.0)
            }
            SchedulerType::Polynomial => {
                if in_warmup {
                    return warm(s);
                }
                let lr_end = self.num("lr_end").unwrap_or(1e-7);
                let power = self.num("power").unwrap_or(1.0);
                if s > t {
                    return lr_end / self.base_lr;
                }
                let range = self.base_lr - lr_end;
                let decay_steps = (t - w) as f64;
                let remaining = 1.0 - (s - w) as f64 / decay_steps;
                (range * remaining.powf(power) + lr_end) / self.base_lr
            }
            SchedulerType::InverseSqrt => {
                if in_warmup {
                    return warm(s);
                }
                let timescale =
                    self.num("timescale")
                        .unwrap_or(if w > 0 { w as f64 } else { 10_000.0 });
                let shift = timescale - w as f64;
                1.0 / ((s as f64 + shift) / timescale).sqrt()
            }
            SchedulerType::CosineWithMinLr => {
                if in_warmup {
                    return warm(s);
                }
                let rate = match self.num("min_lr") {
                    Some(min_lr) => min_lr / self.base_lr,
                    None => self.num("min_lr_rate").unwrap_or(0.0),
                };
                let cycles = self.num("num_cycles").unwrap_or(0.5);
                let factor = 0.5 * (1.0 + (PI * cycles * 2.0 * progress(s)).cos());
                (factor * (1.0 - rate) + rate).max(0.0)
            }
            SchedulerType::WarmupStableDecay => {
                let decay = self.num("num_decay_steps").unwrap_or(0.0) as usize;
                let stable = self
                    .num("num_stable_steps")
                    .map(|x| x as usize)
                    .unwrap_or_else(|| t.saturating_sub(w.saturating_add(decay)));
                let min_ratio = self.num("min_lr_ratio").unwrap_or(0.0);
                let cycles = self.num("num_cycles").unwrap_or(0.5);
                let shape = |kind: &str, p: f64, rising: bool| -> f64 {
                    match (kind, rising) {
                        ("cosine", true) => 0.5 * (1.0 - (PI * p).cos()),
                        ("cosine", false) => 0.5 * (1.0 + (PI * cycles * 2.0 * p).cos()),
                        ("1-sqrt", true) => 1.0 - (1.0 - p).sqrt(),
                        ("1-sqrt", false) => 1.0 - p.sqrt(),
                        (_, true) => p,
                        (_, false) => 1.0 - p,
                    }
                };
                if s < w {
                    let f = shape(&self.text("warmup_type", "linear"), warm(s), true);
                    return (f * (1.0 - min_ratio) + min_ratio).max(0.0);
                }
                // Step counts from the kwargs may be huge (`num_decay_steps = 1e300` is `usize::MAX`): add saturating.
                if s < w.saturating_add(stable) {
                    return 1.0;
                }
                if s < w.saturating_add(stable).saturating_add(decay) {
                    let p = (s - w - stable) as f64 / decay.max(1) as f64;
                    let f = shape(&self.text("decay_type", "cosine"), p, false);
                    return (f * (1.0 - min_ratio) + min_ratio).max(0.0);
                }
                min_ratio
            }
        }
    }

    /// The learning rate of optimizer update `k` (counting from 1): `base_lr · λ(k − 1)`.
    pub fn lr_for_update(&self, k: usize) -> f64 {
        self.base_lr * self.multiplier(k.saturating_sub(1))
    }

    /// Total optimizer steps.
    pub fn total(&self) -> usize {
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_kwargs_are_clear_errors() {
        let kw = serde_json::json!({"num_cycles": 2});
        let err = Schedule::new(SchedulerType::Linear, 1e-4, 0, 10, Some(&kw))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("num_cycles") && err.contains("Linear"),
            "{err}"
        );
        let kw = serde_json::json!({"min_lr": 1e-6, "min_lr_rate": 0.1});
        assert!(Schedule::new(SchedulerType::CosineWithMinLr, 1e-4, 0, 10, Some(&kw)).is_err());
        assert!(Schedule::new(SchedulerType::WarmupStableDecay, 1e-4, 0, 10, None).is_err());
        assert!("cosine_annealing"
            .parse::<SchedulerType>()
            .unwrap_err()
            .to_string()
            .contains("warmup_stable_decay"));
    }

    #[test]
    fn warmup_ratio_rounds_up_like_transformers() {
        assert_eq!(warmup_steps(0.07, 100), 8);
        assert_eq!(warmup_steps(0.3, 10), 3);
        assert_eq!(warmup_steps(5.0, 100), 5);
        let s = Schedule::new(SchedulerType::Linear, 2e-4, 2, 10, None).unwrap();
        assert_eq!(
            s.lr_for_update(1),
            0.0,
            "the first update runs at lr 0 with warmup"
        );
    }
}
