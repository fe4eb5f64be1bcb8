//! The metric that picks the best checkpoint (`metric_for_best_model`, `greater_is_better`), as transformers 5 reads
//! them: a name with or without the `eval_` prefix, any metric the method's evaluation logs (DPO's
//! `rewards/accuracies`, … as TRL's evaluation logs them), higher being better unless the name ends in `loss`. The
//! best checkpoint, `load_best_model_at_end` and early stopping all compare by it.

use std::collections::BTreeMap;

use super::args::TrainingArguments;

/// A metric's name as an evaluation computes it: without transformers' `eval_` prefix (`eval_loss` → `loss`).
fn metric_key(name: &str) -> &str {
    name.strip_prefix("eval_").unwrap_or(name)
}

impl TrainingArguments {
    /// The name of the metric that picks the best checkpoint and stops early, as logged (`eval_loss` when none is
    /// set).
    pub fn best_metric_name(&self) -> String {
        format!(
            "eval_{}",
            metric_key(self.best_model_metric().unwrap_or("loss"))
        )
    }

    /// Whether a higher best-model metric is better: `greater_is_better`, else transformers' default — false only
    /// for a name ending in `loss` (and for the loss compared when none is set).
    pub fn greater_is_better_for_best(&self) -> bool {
        self.greater_is_better
            .unwrap_or_else(|| !self.best_model_metric().unwrap_or("loss").ends_with("loss"))
    }

    /// The best-model metric in an evaluation's `loss` and `metrics` (the method's, named without `eval_`, as
    /// [`crate::trainer::EvalReport::metrics`] holds them); `None` when that evaluation does not compute it.
    pub fn best_metric_value(&self, loss: f64, metrics: &BTreeMap<String, f64>) -> Option<f64> {
        match metric_key(self.best_model_metric().unwrap_or("loss")) {
            "loss" => Some(loss),
            key => metrics.get(key).copied(),
        }
    }

    /// Whether `value` of the best-model metric improves on `best` by more than `threshold`, in the direction
    /// [`TrainingArguments::greater_is_better_for_best`] says (transformers' comparison, with early stopping's
    /// threshold); anything improves on no best yet.
    pub fn improves(&self, value: f64, best: Option<f64>, threshold: f64) -> bool {
        best.is_none_or(|b| match self.greater_is_better_for_best() {
            true => value > b + threshold,
            false => value < b - threshold,
        })
    }
}

/// Why `args`' `metric_for_best_model` names no metric the evaluation computes, if it names one: `logged` are the
/// method's evaluation metrics besides the loss. transformers finds out at the first evaluation (a `KeyError`);
/// here it is refused before anything loads.
pub(crate) fn best_metric_problem(args: &TrainingArguments, logged: &[&str]) -> Option<String> {
    let name = args.metric_for_best_model.as_deref()?;
    let key = metric_key(name);
    if key == "loss" || logged.contains(&key) {
        return None;
    }
    let names: Vec<String> = std::iter::once("loss")
        .chain(logged.iter().copied())
        .map(|m| format!("\"eval_{m}\""))
        .collect();
    Some(format!(
        "metric_for_best_model = \"{name}\": this run's evaluation logs no eval_{key}; it logs {} — set \
         metric_for_best_model to one of them",
        names.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_directions_follow_transformers() {
        let args = |metric: Option<&str>, greater: Option<bool>| TrainingArguments {
            metric_for_best_model: metric.map(str::to_string),
            greater_is_better: greater,
            ..Default::default()
        };
        let accuracy = args(Some("eval_rewards/accuracies"), None);
        assert!(accuracy.greater_is_better_for_best());
        assert!(!args(Some("loss"), None).greater_is_better_for_best());
        assert!(!args(Some("rewards/accuracies"), Some(false)).greater_is_better_for_best());
        let metrics = BTreeMap::from([("rewards/accuracies".to_string(), 0.75)]);
        assert_eq!(accuracy.best_metric_value(0.5, &metrics), Some(0.75));
        assert_eq!(args(None, None).best_metric_value(0.5, &metrics), Some(0.5));
        assert_eq!(accuracy.best_metric_name(), "eval_rewards/accuracies");
        assert!(
            accuracy.improves(0.8, Some(0.75), 0.0) && !accuracy.improves(0.7, Some(0.75), 0.0)
        );
        assert!(args(None, None).improves(0.4, Some(0.5), 0.0));
        assert!(best_metric_problem(&accuracy, &["rewards/accuracies"]).is_none());
        let err = best_metric_problem(&accuracy, &[]).unwrap();
        assert!(err.contains("it logs \"eval_loss\""), "{err}");
    }
}
