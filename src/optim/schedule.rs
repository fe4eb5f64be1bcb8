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

/// What one `lr_scheduler_kwargs` key holds.
#[derive(Clone, Copy)]
enum Kwarg {
    /// Any finite number.
    Number,
    /// A step count: a finite number, 0 or more.
    Steps,
    /// One of these names.
    Choice(&'static [&'static str]),
}

/// The keyword arguments transformers' schedule function of `kind` takes (its signature in
/// `transformers/optimization.py`, besides the optimizer, warmup and total steps).
fn kwargs_of(kind: SchedulerType) -> &'static [(&'static str, Kwarg)] {
    const SHAPES: Kwarg = Kwarg::Choice(&["linear", "cosine", "1-sqrt"]);
    match kind {
        SchedulerType::Cosine | SchedulerType::CosineWithRestarts => {
            &[("num_cycles", Kwarg::Number)]
        }
        SchedulerType::Polynomial => &[("lr_end", Kwarg::Number), ("power", Kwarg::Number)],
        SchedulerType::InverseSqrt => &[("timescale", Kwarg::Steps)],
        SchedulerType::CosineWithMinLr => &[
            ("num_cycles", Kwarg::Number),
            ("min_lr", Kwarg::Number),
            ("min_lr_rate", Kwarg::Number),
        ],
        SchedulerType::WarmupStableDecay => &[
            ("num_decay_steps", Kwarg::Steps),
            ("num_stable_steps", Kwarg::Steps),
            ("warmup_type", SHAPES),
            ("decay_type", SHAPES),
            ("min_lr_ratio", Kwarg::Number),
            ("num_cycles", Kwarg::Number),
        ],
        SchedulerType::Linear | SchedulerType::Constant | SchedulerType::ConstantWithWarmup => &[],
    }
}

/// A valid `lr_scheduler_kwargs` table for schedule `kind`, in TOML (the keys it needs, at transformers'
/// defaults where there is one), for messages; `None` for a schedule that takes no keyword arguments.
fn example_kwargs(kind: SchedulerType) -> Option<&'static str> {
    match kind {
        SchedulerType::Cosine => Some("{ num_cycles = 0.5 }"),
        SchedulerType::CosineWithRestarts => Some("{ num_cycles = 1 }"),
        SchedulerType::Polynomial => Some("{ lr_end = 1e-7, power = 1.0 }"),
        SchedulerType::InverseSqrt => Some("{ timescale = 10000 }"),
        SchedulerType::CosineWithMinLr => Some("{ min_lr_rate = 0.1 }"),
        SchedulerType::WarmupStableDecay => Some("{ num_decay_steps = 100 }"),
        SchedulerType::Linear | SchedulerType::Constant | SchedulerType::ConstantWithWarmup => None,
    }
}

/// Checks `lr_scheduler_kwargs` for schedule `kind` at learning rate `base_lr` — a table whose every key the
/// schedule takes (transformers' schedule functions raise a `TypeError` on any other), holding a value of its
/// type, with the keys a schedule needs — and returns it. Needs no model or data, so a run checks it before
/// loading anything.
pub fn check_kwargs(
    kind: SchedulerType,
    base_lr: f64,
    kwargs: Option<&Value>,
) -> Result<Map<String, Value>> {
    let name = kind.as_str();
    let bad = |m: String| {
        Err(Error::InvalidInput(format!(
            "lr_scheduler_kwargs{m} (lr_scheduler_type = \"{name}\")"
        )))
    };
    let kwargs = match kwargs {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(m)) => m.clone(),
        Some(other) => {
            return bad(match example_kwargs(kind) {
                Some(example) => format!(" = {other}: must be a table, e.g. {example}"),
                None => format!(" = {other}: this schedule takes none; remove lr_scheduler_kwargs"),
            })
        }
    };
    let takes = kwargs_of(kind);
    for (key, value) in &kwargs {
        let Some((_, kind_of)) = takes.iter().find(|(k, _)| k == key) else {
            let names: Vec<&str> = takes.iter().map(|(k, _)| *k).collect();
            let takes = if names.is_empty() {
                "takes none".to_string()
            } else {
                format!("takes {}", names.join(", "))
            };
            return bad(format!(
                ": `{key}` does not apply to this schedule, which {takes}"
            ));
        };
        let ok = match (kind_of, value) {
            (Kwarg::Number, Value::Number(n)) => n.as_f64().is_some_and(f64::is_finite),
            (Kwarg::Steps, Value::Number(n)) => {
                n.as_f64().is_some_and(|x| x.is_finite() && x >= 0.0)
            }
            (Kwarg::Choice(names), Value::String(s)) => names.contains(&s.as_str()),
            _ => false,
        };
        if !ok {
            let want = match kind_of {
                Kwarg::Number => "a finite number".to_string(),
                Kwarg::Steps => "a number of steps, 0 or more".to_string(),
                Kwarg::Choice(names) => format!("one of \"{}\"", names.join("\", \"")),
            };
            return bad(format!(".{key} = {value}: must be {want}"));
        }
    }
    let has = |k: &str| kwargs.contains_key(k);
    if kind == SchedulerType::CosineWithMinLr && has("min_lr") == has("min_lr_rate") {
        return bad(": cosine_with_min_lr needs exactly one of min_lr and min_lr_rate".into());
    }
    if kind == SchedulerType::WarmupStableDecay && !has("num_decay_steps") {
        return bad(": warmup_stable_decay needs num_decay_steps".into());
    }
    let lr_end = kwargs.get("lr_end").and_then(Value::as_f64).unwrap_or(1e-7);
    if kind == SchedulerType::Polynomial && lr_end > base_lr {
        return bad(format!(
            ".lr_end = {lr_end}: must not exceed the learning rate ({base_lr})"
        ));
    }
    Ok(kwargs)
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
        let kwargs = check_kwargs(kind, base_lr, kwargs)?;
        Ok(Schedule {
            kind,
            base_lr,
            warmup,
            total,
            kwargs,
        })
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
    fn the_example_a_wrong_kwargs_value_gives_is_one_the_schedule_takes() {
        for &kind in SchedulerType::ALL {
            let err = check_kwargs(kind, 1e-3, Some(&serde_json::json!(5)))
                .unwrap_err()
                .to_string();
            match example_kwargs(kind) {
                // The example, read as the config reads TOML, is accepted.
                Some(example) => {
                    let table: toml::Table = format!("kwargs = {example}").parse().unwrap();
                    let kwargs = serde_json::to_value(&table["kwargs"]).unwrap();
                    assert!(err.contains(example), "{kind}: {err}");
                    check_kwargs(kind, 1e-3, Some(&kwargs)).unwrap();
                }
                None => assert!(err.contains("remove lr_scheduler_kwargs"), "{kind}: {err}"),
            }
        }
    }

    #[test]
    fn bad_kwargs_are_clear_errors() {
        let kw = serde_json::json!({"num_cycles": 2});
        let err = Schedule::new(SchedulerType::Linear, 1e-4, 0, 10, Some(&kw))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`num_cycles` does not apply")
                && err.contains("lr_scheduler_type = \"linear\"")
                && err.contains("takes none"),
            "{err}"
        );
        // A value of the wrong type, or a name the schedule does not know, is refused naming the key (it was
        // ignored: the default used instead).
        for (kind, kw, says) in [
            (
                SchedulerType::Cosine,
                serde_json::json!({"num_cycles": "two"}),
                "lr_scheduler_kwargs.num_cycles = \"two\": must be a finite number (lr_scheduler_type = \"cosine\")",
            ),
            (
                SchedulerType::WarmupStableDecay,
                serde_json::json!({"num_decay_steps": 2, "decay_type": "exp"}),
                "decay_type = \"exp\": must be one of \"linear\", \"cosine\", \"1-sqrt\"",
            ),
            (
                SchedulerType::WarmupStableDecay,
                serde_json::json!({"num_decay_steps": -3}),
                "num_decay_steps = -3: must be a number of steps, 0 or more",
            ),
            (
                SchedulerType::Polynomial,
                serde_json::json!({"power": true}),
                "power = true: must be a finite number",
            ),
            (
                SchedulerType::Cosine,
                serde_json::json!({"timescale": 10}),
                "`timescale` does not apply to this schedule, which takes num_cycles",
            ),
            (
                SchedulerType::Cosine,
                serde_json::json!("num_cycles=2"),
                "must be a table",
            ),
        ] {
            let err = check_kwargs(kind, 1e-4, Some(&kw)).unwrap_err().to_string();
            assert!(err.contains(says), "{err}");
        }
        let kw =
            serde_json::json!({"num_decay_steps": 2, "decay_type": "1-sqrt", "min_lr_ratio": 0.1});
        check_kwargs(SchedulerType::WarmupStableDecay, 1e-4, Some(&kw)).unwrap();
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
