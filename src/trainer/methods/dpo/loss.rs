//! The preference losses of TRL 1.16's `DPOTrainer` and its reward metrics, from the sequence log-probabilities of
//! the policy and the reference.
//!
//! With `r_c = log π(chosen) − log π_ref(chosen)`, `r_r` the same for the rejected completion, `Δ = r_c − r_r`,
//! `ls = log σ` and `ε = label_smoothing`, each pair's loss is:
//!
//! | `loss_type` | per pair |
//! |---|---|
//! | `sigmoid` | `−ls(βΔ)` |
//! | `hinge` | `relu(1 − βΔ)` |
//! | `ipo` | `(r_c/n_c − r_r/n_r − 1/(2β))²`, `n` the completion's tokens |
//! | `robust` | `(−(1−ε)·ls(βΔ) + ε·ls(−βΔ)) / (1 − 2ε)` |
//! | `bco_pair` | `−ls(β r_c) − ls(−β r_r)` |
//! | `sppo_hard` | `(r_c − 1/(2β))² + (r_r + 1/(2β))²` |
//! | `nca_pair` | `−ls(β r_c) − ½ ls(−β r_c) − ½ ls(−β r_r)` |
//! | `apo_zero` | `1 − σ(β r_c) + σ(β r_r)` |
//! | `apo_down` | `σ(β r_c) + 1 − σ(βΔ)` |
//! | `sft` | the mean negative log-likelihood of the chosen completions' tokens (one value for the batch) |
//!
//! The batch's loss is `Σ weight · mean(per pair)`. Rewards are `β·r`; the metrics are batch means, as TRL logs them.

use candle_core::{DType, Tensor};

use crate::data::TokenizedExample;
use crate::error::Result;
use crate::ops::IGNORE_INDEX;
use crate::trainer::settings::dpo::{DpoConfig, LossType};

/// The metrics of a batch, in the order [`preference_loss`] returns them, under TRL's names.
pub const METRICS: [&str; 6] = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
];

/// `log σ(x)`, its value as `−relu(−x) − log(1 + e^{−|x|})` (stable for large |x|) and its derivative `σ(−x)`
/// attached as `value + (x − x̄)·σ(−x̄)` (x̄ detached): composing `relu` and `abs` would get the derivative at 0 wrong,
/// where every pair starts (the policy equals the reference), as their one-sided derivatives there add up to 1.5.
fn log_sigmoid(x: &Tensor) -> Result<Tensor> {
    let stable = |x: &Tensor| -> Result<Tensor> {
        let tail = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
        Ok((x.neg()?.relu()?.neg()? - tail)?)
    };
    let fixed = x.detach();
    let value = stable(&fixed)?;
    let slope = stable(&fixed.neg()?)?.exp()?;
    Ok((value + (x - &fixed)?.mul(&slope)?)?)
}

/// Tokens of each completion: `completion` labelled, `predicted` of them after the shift (the loss's).
#[derive(Clone, Debug)]
pub struct CompletionTokens {
    /// Labelled tokens of each sequence, chosen rows then rejected rows.
    pub completion: Vec<usize>,
    /// Of those, the tokens a position predicts (all but a completion's first token when it starts the sequence).
    pub predicted: Vec<usize>,
}

impl CompletionTokens {
    /// The completion tokens of `rows` (chosen rows then rejected rows).
    pub fn of(rows: &[&TokenizedExample]) -> Self {
        CompletionTokens {
            completion: rows
                .iter()
                .map(|r| r.labels.iter().filter(|l| **l != IGNORE_INDEX).count())
                .collect(),
            predicted: rows.iter().map(|r| r.learned_tokens()).collect(),
        }
    }
}

/// The loss of a batch of `n` pairs (a scalar in `policy`'s dtype, differentiable through it) and its metrics (a
/// float64 `[6]` tensor, [`METRICS`]), from the sequence log-probabilities `[2n]` of the chosen rows then the
/// rejected rows under the policy and the reference.
pub fn preference_loss(
    config: &DpoConfig,
    policy: &Tensor,
    reference: &Tensor,
    tokens: &CompletionTokens,
) -> Result<(Tensor, Tensor)> {
    let n = policy.dim(0)? / 2;
    let device = policy.device();
    let beta = config.beta;
    let (chosen, rejected) = (policy.narrow(0, 0, n)?, policy.narrow(0, n, n)?);
    let reference = reference.to_dtype(policy.dtype())?;
    let r_c = (&chosen - reference.narrow(0, 0, n)?)?;
    let r_r = (&rejected - reference.narrow(0, n, n)?)?;
    let delta = (&r_c - &r_r)?;
    let sigmoid = |x: &Tensor| -> Result<Tensor> { Ok(log_sigmoid(x)?.exp()?) };
    let counts = |counts: &[usize], clamp: bool| -> Result<Tensor> {
        let v: Vec<f32> = counts
            .iter()
            .map(|&c| if clamp { c.max(1) } else { c } as f32)
            .collect();
        Ok(Tensor::from_vec(v, counts.len(), device)?.to_dtype(policy.dtype())?)
    };
    let mut loss: Option<Tensor> = None;
    for (kind, weight) in config.weighted_losses() {
        let per_pair = match kind {
            LossType::Sigmoid => log_sigmoid(&(&delta * beta)?)?.neg()?,
            LossType::Hinge => (1.0 - (&delta * beta)?)?.relu()?,
            LossType::Ipo => {
                let lengths = counts(&tokens.completion, true)?;
                let average = |r: &Tensor, at: usize| -> Result<Tensor> {
                    Ok(r.div(&lengths.narrow(0, at, n)?)?)
                };
                ((average(&r_c, 0)? - average(&r_r, n)?)? - 1.0 / (2.0 * beta))?.sqr()?
            }
            LossType::Robust => {
                let eps = config.label_smoothing;
                let clean = (log_sigmoid(&(&delta * beta)?)? * -(1.0 - eps))?;
                let flipped = (log_sigmoid(&(&delta * -beta)?)? * eps)?;
                ((clean + flipped)? / (1.0 - 2.0 * eps))?
            }
            LossType::BcoPair => {
                (log_sigmoid(&(&r_c * beta)?)?.neg()? - log_sigmoid(&(&r_r * -beta)?)?)?
            }
            LossType::SppoHard => ((&r_c - 0.5 / beta)?.sqr()? + (&r_r + 0.5 / beta)?.sqr()?)?,
            LossType::NcaPair => {
                ((log_sigmoid(&(&r_c * beta)?)?.neg()? - (log_sigmoid(&(&r_c * -beta)?)? * 0.5)?)?
                    - (log_sigmoid(&(&r_r * -beta)?)? * 0.5)?)?
            }
            LossType::ApoZero => ((1.0 - sigmoid(&(&r_c * beta)?)?)? + sigmoid(&(&r_r * beta)?)?)?,
            LossType::ApoDown => {
                ((sigmoid(&(&r_c * beta)?)? + 1.0)? - sigmoid(&(&delta * beta)?)?)?
            }
            LossType::Sft => {
                let predicted: usize = tokens.predicted[..n].iter().sum();
                (chosen.sum_all()? / -(predicted.max(1) as f64))?.reshape(1)?
            }
        };
        let term = (per_pair.mean_all()? * weight)?;
        loss = Some(match loss {
            Some(total) => (total + term)?,
            None => term,
        });
    }
    let loss = loss.expect("a validated config has a loss type");
    let (rewards_c, rewards_r) = ((r_c.detach() * beta)?, (r_r.detach() * beta)?);
    let mean = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(DType::F64)?.mean_all()?) };
    let metrics = Tensor::stack(
        &[
            mean(&rewards_c)?,
            mean(&rewards_r)?,
            mean(&rewards_c.gt(&rewards_r)?)?,
            mean(&(&rewards_c - &rewards_r)?)?,
            mean(&chosen.detach())?,
            mean(&rejected.detach())?,
        ],
        0,
    )?;
    Ok((loss, metrics))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// Each loss of TRL's formulas in plain f64, per pair, for `(r_c, r_r, n_c, n_r)`.
    fn reference_loss(
        kind: LossType,
        beta: f64,
        eps: f64,
        r_c: f64,
        r_r: f64,
        n: (f64, f64),
    ) -> f64 {
        let ls = |x: f64| -(1.0 + (-x).exp()).ln();
        let s = |x: f64| 1.0 / (1.0 + (-x).exp());
        let d = r_c - r_r;
        match kind {
            LossType::Sigmoid => -ls(beta * d),
            LossType::Hinge => (1.0 - beta * d).max(0.0),
            LossType::Ipo => (r_c / n.0 - r_r / n.1 - 1.0 / (2.0 * beta)).powi(2),
            LossType::Robust => {
                (-(1.0 - eps) * ls(beta * d) + eps * ls(-beta * d)) / (1.0 - 2.0 * eps)
            }
            LossType::BcoPair => -ls(beta * r_c) - ls(-beta * r_r),
            LossType::SppoHard => (r_c - 0.5 / beta).powi(2) + (r_r + 0.5 / beta).powi(2),
            LossType::NcaPair => -ls(beta * r_c) - 0.5 * ls(-beta * r_c) - 0.5 * ls(-beta * r_r),
            LossType::ApoZero => 1.0 - s(beta * r_c) + s(beta * r_r),
            LossType::ApoDown => s(beta * r_c) + 1.0 - s(beta * d),
            LossType::Sft => unreachable!(),
        }
    }

    #[test]
    fn every_loss_matches_its_formula_and_has_the_gradient_of_finite_differences() {
        let dev = Device::Cpu;
        let policy = [-3.0, -7.5, -20.0, -4.0, -6.0, -25.0];
        let refs = [-3.5, -7.0, -18.0, -3.0, -6.5, -24.0];
        let tokens = CompletionTokens {
            completion: vec![3, 5, 1, 2, 4, 6],
            predicted: vec![3, 5, 1, 2, 4, 6],
        };
        for &kind in LossType::ALL.iter().filter(|k| **k != LossType::Sft) {
            let config = DpoConfig {
                loss_type: vec![kind],
                beta: 0.3,
                label_smoothing: 0.1,
                ..Default::default()
            };
            let var = Var::from_vec(policy.map(|x| x as f32).to_vec(), 6, &dev).unwrap();
            let reference = Tensor::from_vec(refs.map(|x| x as f32).to_vec(), 6, &dev).unwrap();
            let (loss, _) = preference_loss(&config, var.as_tensor(), &reference, &tokens).unwrap();
            let value = |p: &[f64]| -> f64 {
                (0..3)
                    .map(|i| {
                        let n = (tokens.completion[i] as f64, tokens.completion[i + 3] as f64);
                        reference_loss(kind, 0.3, 0.1, p[i] - refs[i], p[i + 3] - refs[i + 3], n)
                    })
                    .sum::<f64>()
                    / 3.0
            };
            let got = loss.to_scalar::<f32>().unwrap() as f64;
            assert!(
                (got - value(&policy)).abs() < 1e-5 * (1.0 + got.abs()),
                "{kind}: {got} vs {}",
                value(&policy)
            );
            let grad = loss
                .backward()
                .unwrap()
                .get(&var)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            for i in 0..6 {
                let (mut up, mut down) = (policy, policy);
                up[i] += 1e-4;
                down[i] -= 1e-4;
                let fd = (value(&up) - value(&down)) / 2e-4;
                assert!(
                    (grad[i] as f64 - fd).abs() < 1e-3 * (1.0 + fd.abs()),
                    "{kind} d/d{i}: {} vs {fd}",
                    grad[i]
                );
            }
        }
    }

    #[test]
    fn log_sigmoid_has_the_derivative_of_the_sigmoid_at_zero_and_is_stable_far_out() {
        let x = Var::from_vec(vec![0.0f32, -200.0, 200.0, 1.5], 4, &Device::Cpu).unwrap();
        let y = log_sigmoid(x.as_tensor()).unwrap();
        let v = y.to_vec1::<f32>().unwrap();
        assert_eq!(v[..3], [-std::f32::consts::LN_2, -200.0, 0.0]);
        let g = y
            .sum_all()
            .unwrap()
            .backward()
            .unwrap()
            .get(&x)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let sigmoid = |x: f32| 1.0 / (1.0 + (-x).exp());
        assert_eq!(g[..3], [0.5, 1.0, 0.0]);
        assert!((g[3] - sigmoid(-1.5)).abs() < 1e-7);
    }

    #[test]
    fn metrics_are_rewards_accuracies_margins_and_log_probabilities() {
        let dev = Device::Cpu;
        let policy = Tensor::new(&[-3.0f32, -5.0, -4.0, -4.0], &dev).unwrap();
        let reference = Tensor::new(&[-4.0f32, -5.0, -4.0, -3.0], &dev).unwrap();
        let tokens = CompletionTokens {
            completion: vec![2, 2, 2, 2],
            predicted: vec![2, 2, 2, 2],
        };
        let config = DpoConfig {
            beta: 0.5,
            rpo_alpha: Some(2.0),
            ..Default::default()
        };
        let (loss, metrics) = preference_loss(&config, &policy, &reference, &tokens).unwrap();
        let m = metrics.to_vec1::<f64>().unwrap();
        // rewards chosen (0.5, 0), rejected (0, −0.5): both pairs right, margins (0.5 + 0.5)/2.
        assert_eq!(m, vec![0.25, -0.25, 1.0, 0.5, -4.0, -4.0]);
        let ls = |x: f64| -(1.0f64 + (-x).exp()).ln();
        let sigmoid = -(ls(0.5) + ls(0.5)) / 2.0;
        let sft = 8.0 / 4.0;
        let got = loss.to_scalar::<f32>().unwrap() as f64;
        assert!((got - (sigmoid + 2.0 * sft)).abs() < 1e-6, "{got}");
    }
}
