//! GRPO's arithmetic on the host, in float64, as TRL 1.16's `GRPOTrainer` computes it: the advantages of a
//! generation batch from its rewards ([`advantages`]), and a micro-batch's loss from its completions' per-token
//! log-probabilities ([`micro_batch_loss`]) — the clipped importance-weighted objective, the KL term against the
//! reference, the entropy mask, the aggregation of each `loss_type` — with the loss's gradient with respect to each
//! log-probability (PyTorch's autograd rules, a tie of `min` halved and `clamp` passing its bounds) and TRL's
//! metrics. The model's side is then one backward of `Σ gradient · log-probability`.

use crate::trainer::settings::grpo::{
    GrpoConfig, GrpoLossType, ImportanceSamplingLevel, ScaleRewards,
};

/// TRL's `nanmean`: the mean of the values that are not NaN (NaN when none is).
pub(crate) fn nanmean(values: &[f64]) -> f64 {
    let kept: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    match kept.len() {
        0 => f64::NAN,
        n => kept.iter().sum::<f64>() / n as f64,
    }
}

/// TRL's `nanstd`: the standard deviation of the values that are not NaN, with Bessel's correction (NaN for fewer
/// than two).
pub(crate) fn nanstd(values: &[f64]) -> f64 {
    let mean = nanmean(values);
    let kept: Vec<f64> = values.iter().copied().filter(|v| !v.is_nan()).collect();
    if kept.len() < 2 {
        return f64::NAN;
    }
    let n = kept.len() as f64;
    let variance = kept.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    (variance * n / (n - 1.0)).sqrt()
}

/// The rewards of a generation batch and what follows from them.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Scored {
    /// Each completion's weighted reward sum (NaN where every reward skipped it).
    pub rewards: Vec<f64>,
    /// Each completion's advantage (0 where unscorable).
    pub advantages: Vec<f64>,
    /// Whether the standard deviation that scaled each completion's advantage is zero (TRL's `isclose`).
    pub std_is_zero: Vec<bool>,
}

/// The advantages of `per_func[completion][reward]` (NaN: skipped) for groups of `group` consecutive completions,
/// weighted by `weights`, as TRL's `_generate_and_score_completions` (`sum_then_normalize`).
pub(crate) fn advantages(
    per_func: &[Vec<f64>],
    weights: &[f64],
    group: usize,
    scale: ScaleRewards,
) -> Scored {
    let rewards: Vec<f64> = per_func
        .iter()
        .map(|row| {
            if row.iter().all(|r| r.is_nan()) {
                return f64::NAN;
            }
            row.iter()
                .zip(weights)
                .map(|(r, w)| r * w)
                .filter(|x| !x.is_nan())
                .sum()
        })
        .collect();
    let n = rewards.len();
    let mut mean = vec![0.0; n];
    let mut std = vec![0.0; n];
    for (g, chunk) in rewards.chunks(group).enumerate() {
        let (m, s) = (nanmean(chunk), nanstd(chunk));
        for i in 0..chunk.len() {
            mean[g * group + i] = m;
            std[g * group + i] = s;
        }
    }
    if scale == ScaleRewards::Batch {
        std = vec![nanstd(&rewards); n];
    }
    let advantages = (0..n)
        .map(|i| {
            let mut a = rewards[i] - mean[i];
            if scale != ScaleRewards::None {
                a /= std[i] + 1e-4;
            }
            if a.is_nan() {
                0.0
            } else {
                a
            }
        })
        .collect();
    // torch.isclose(std, 0): |std| ≤ atol (1e-8); NaN is not close.
    let std_is_zero = std.iter().map(|s| s.abs() <= 1e-8).collect();
    Scored {
        rewards,
        advantages,
        std_is_zero,
    }
}

/// One completion of a micro-batch, as the loss sees it.
pub(crate) struct LossRow<'a> {
    /// The policy's log-probability of each completion token (now, with the adapter being trained).
    pub logps: &'a [f64],
    /// The entropy of the policy's distribution at each completion token.
    pub entropies: &'a [f64],
    /// The log-probabilities when the completions were generated (`None`: the policy's own, detached).
    pub old_logps: Option<&'a [f64]>,
    /// The reference's log-probabilities (with `beta` ≠ 0).
    pub ref_logps: Option<&'a [f64]>,
    /// The completion's advantage.
    pub advantage: f64,
    /// Whether its tokens count (false for a truncated completion with `mask_truncated_completions`).
    pub counted: bool,
}

/// How a micro-batch's token losses are normalized, beyond the micro-batch itself.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Normalization {
    /// `gradient_accumulation_steps`.
    pub accumulation: usize,
    /// `steps_per_generation`.
    pub steps_per_generation: usize,
    /// The generation batch's counted completion tokens (`dapo`'s `num_items_in_batch`).
    pub generation_tokens: usize,
    /// Whether this is training (an evaluation neither accumulates nor splits its batch).
    pub training: bool,
}

/// The names of the metrics a micro-batch gives, in [`MicroLoss::metrics`]' order (`kl` only with `beta` ≠ 0).
pub(crate) const LOSS_METRICS: [&str; 6] = [
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
];

/// A micro-batch's loss, its gradient with respect to each row's log-probabilities, and TRL's metrics.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct MicroLoss {
    /// The loss as TRL's `compute_loss` returns it (already divided for accumulation).
    pub loss: f64,
    /// `∂loss/∂logps[row][token]`.
    pub gradients: Vec<Vec<f64>>,
    /// The values of [`LOSS_METRICS`] (NaN where TRL's would be: no row to take a minimum over).
    pub metrics: [f64; 6],
    /// The mean KL over counted tokens (with `beta` ≠ 0).
    pub kl: Option<f64>,
}

/// `−min(a, b)`'s gradients with respect to `a` and `b` (PyTorch halves a tie).
fn neg_min_gradients(a: f64, b: f64) -> (f64, f64) {
    if a < b {
        (-1.0, 0.0)
    } else if a > b {
        (0.0, -1.0)
    } else {
        (-0.5, -0.5)
    }
}

/// The entropy threshold of `top_entropy_quantile`: `torch.quantile(entropies of counted tokens, 1 − q)` (linear
/// interpolation), `None` when every token trains.
fn entropy_threshold(rows: &[LossRow<'_>], quantile: f64) -> Option<f64> {
    if quantile >= 1.0 {
        return None;
    }
    let mut all: Vec<f64> = rows
        .iter()
        .filter(|r| r.counted)
        .flat_map(|r| r.entropies.iter().copied())
        .collect();
    if all.is_empty() {
        return Some(f64::INFINITY); // TRL masks every token then
    }
    all.sort_by(f64::total_cmp);
    let at = (1.0 - quantile) * (all.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    Some(all[lo] + (all[hi] - all[lo]) * (at - lo as f64))
}

/// The loss of one micro-batch of `rows`, as TRL 1.16's `_compute_loss`.
pub(crate) fn micro_batch_loss(
    rows: &[LossRow<'_>],
    config: &GrpoConfig,
    normalization: Normalization,
) -> MicroLoss {
    let (eps_low, eps_high) = (config.epsilon, config.epsilon_high());
    let beta = config.beta;
    let sequence = config.importance_sampling_level == ImportanceSamplingLevel::Sequence;
    let threshold = entropy_threshold(rows, config.top_entropy_quantile);
    let counted = |r: &LossRow<'_>| if r.counted { r.logps.len() } else { 0 };
    let batch_tokens: usize = rows.iter().map(counted).sum();
    let accumulation = if normalization.training {
        normalization.accumulation as f64
    } else {
        1.0
    };
    // The weight of each counted token of a row in the loss.
    let token_weight = |row_tokens: usize| -> f64 {
        match config.loss_type {
            GrpoLossType::Grpo => {
                1.0 / (row_tokens.max(1) as f64 * rows.len() as f64) / accumulation
            }
            GrpoLossType::Bnpo => 1.0 / batch_tokens.max(1) as f64 / accumulation,
            GrpoLossType::DrGrpo => {
                1.0 / (rows.len() * config.max_completion_length) as f64 / accumulation
            }
            GrpoLossType::Dapo => {
                let mut normalizer = normalization.generation_tokens.max(1) as f64;
                if normalization.training {
                    normalizer *= accumulation / normalization.steps_per_generation as f64;
                }
                1.0 / normalizer
            }
        }
    };
    let mut loss = 0.0;
    let mut gradients = Vec::with_capacity(rows.len());
    let (mut kl_sum, mut entropy_sum) = (0.0, 0.0);
    let (mut low_sum, mut high_sum, mut region_sum, mut clip_count) = (0.0, 0.0, 0.0, 0.0);
    let (mut low_min, mut high_max) = (f64::NAN, f64::NAN);
    for row in rows {
        let n = row.logps.len();
        let mask = if row.counted { 1.0 } else { 0.0 };
        let row_tokens = counted(row);
        let weight = token_weight(row_tokens) * mask;
        let a = row.advantage;
        let log_ratio: Vec<f64> = match row.old_logps {
            Some(old) => row.logps.iter().zip(old).map(|(l, o)| l - o).collect(),
            None => vec![0.0; n],
        };
        // The sequence-level log-weight is the mean log-ratio over counted tokens.
        let sequence_log_weight = log_ratio.iter().sum::<f64>() * mask / (row_tokens.max(1) as f64);
        let keep: Vec<f64> = row
            .entropies
            .iter()
            .map(|e| match threshold {
                Some(t) if *e * mask < t => 0.0,
                _ => 1.0,
            })
            .collect();
        let mut grad = vec![0.0; n];
        // ∂loss/∂ratio of the sequence-level ratio (summed over the row's tokens).
        let mut sequence_ratio_gradient = 0.0;
        // The clipped term of one ratio `c1`: its value, its gradient, and the clipped-region flags.
        let clipped = |c1: f64| {
            let c2 = c1.clamp(1.0 - eps_low, 1.0 + eps_high);
            let c2_passes = c1 >= 1.0 - eps_low && c1 <= 1.0 + eps_high;
            let (c1_bounded, c1_passes) = match config.delta {
                Some(d) => (c1.min(d), c1 <= d),
                None => (c1, true),
            };
            let (g1, g2) = neg_min_gradients(c1_bounded * a, c2 * a);
            let value = -(c1_bounded * a).min(c2 * a);
            let gradient =
                g1 * a * f64::from(u8::from(c1_passes)) + g2 * a * f64::from(u8::from(c2_passes));
            let low = c1_bounded < 1.0 - eps_low && a < 0.0;
            let high = c1_bounded > 1.0 + eps_high && a > 0.0;
            (value, gradient, low, high)
        };
        let sequence_clip = sequence.then(|| clipped(sequence_log_weight.exp()));
        let (mut row_low, mut row_high) = (0.0, 0.0);
        for t in 0..n {
            let c1 = if sequence {
                sequence_log_weight.exp()
            } else {
                log_ratio[t].exp()
            };
            let (value, ratio_gradient, low, high) = sequence_clip.unwrap_or_else(|| clipped(c1));
            let mut token_loss = value * keep[t];
            let mut d_ratio = ratio_gradient * keep[t];
            let mut d_logp = 0.0;
            if beta != 0.0 {
                let reference = row.ref_logps.map_or(0.0, |r| r[t]);
                let d = reference - row.logps[t];
                let raw = d.exp() - d - 1.0;
                let raw_gradient = 1.0 - d.exp();
                let (kl, kl_gradient) = if config.use_bias_correction_kl {
                    d_ratio += beta * raw;
                    (raw * c1, raw_gradient * c1)
                } else {
                    (raw, raw_gradient)
                };
                token_loss += beta * kl;
                d_logp += beta * kl_gradient;
                kl_sum += kl * mask;
            }
            loss += weight * token_loss;
            entropy_sum += row.entropies[t] * mask;
            if sequence {
                sequence_ratio_gradient += weight * d_ratio;
                grad[t] = weight * d_logp;
            } else {
                // ∂c1/∂logp = c1 (the old log-probabilities are constants).
                grad[t] = weight * (d_ratio * c1 + d_logp);
                let (l, h) = (f64::from(u8::from(low)), f64::from(u8::from(high)));
                low_sum += l * mask;
                high_sum += h * mask;
                region_sum += l.max(h) * mask;
                row_low += l;
                row_high += h;
            }
        }
        if let Some((_, _, low, high)) = sequence_clip {
            let c1 = sequence_log_weight.exp();
            for g in grad.iter_mut() {
                *g += sequence_ratio_gradient * c1 * mask / row_tokens.max(1) as f64;
            }
            let (l, h) = (f64::from(u8::from(low)), f64::from(u8::from(high)));
            // One value per sequence, every row counted (TRL's `x.shape[1] == 1` branch).
            low_sum += l;
            high_sum += h;
            region_sum += l.max(h);
            clip_count += 1.0;
            low_min = low_min.min(l);
            high_max = high_max.max(h);
        } else if row_tokens > 0 {
            // TRL's masked per-sequence means; a row with no counted token is NaN, which nanmin skips.
            low_min = low_min.min(row_low / row_tokens as f64);
            high_max = high_max.max(row_high / row_tokens as f64);
        }
        gradients.push(grad);
    }
    let tokens = batch_tokens as f64;
    let count = if sequence { clip_count } else { tokens };
    let mean = |sum: f64, count: f64| sum / count.max(1.0);
    MicroLoss {
        loss,
        gradients,
        metrics: [
            mean(entropy_sum, tokens),
            mean(low_sum, count),
            low_min,
            mean(high_sum, count),
            high_max,
            mean(region_sum, count),
        ],
        kl: (beta != 0.0).then(|| mean(kl_sum, tokens)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(text: &str) -> GrpoConfig {
        toml::from_str(text).unwrap()
    }

    const TRAIN: Normalization = Normalization {
        accumulation: 2,
        steps_per_generation: 2,
        generation_tokens: 7,
        training: true,
    };

    /// Two rows with old and reference log-probabilities, one row's ratios inside the clip range and one's outside.
    fn rows_at<'a>(
        logps: &'a [Vec<f64>],
        old: &'a [Vec<f64>],
        reference: &'a [Vec<f64>],
        entropies: &'a [Vec<f64>],
    ) -> Vec<LossRow<'a>> {
        (0..logps.len())
            .map(|i| LossRow {
                logps: &logps[i],
                entropies: &entropies[i],
                old_logps: Some(&old[i]),
                ref_logps: Some(&reference[i]),
                advantage: [0.8, -1.3, 0.5][i],
                counted: i != 2,
            })
            .collect()
    }

    /// The gradient equals central differences of the loss, for every loss type, level and option; ties avoided
    /// (old log-probabilities differ from the current ones).
    #[test]
    fn gradients_equal_finite_differences() {
        let logps = vec![vec![-1.2, -0.4, -2.0], vec![-0.3, -3.1], vec![-0.9]];
        let old = vec![vec![-1.0, -0.7, -1.1], vec![-0.35, -2.5], vec![-1.0]];
        let reference = vec![vec![-1.5, -0.2, -2.2], vec![-0.1, -2.9], vec![-0.5]];
        let entropies = vec![vec![0.5, 2.0, 1.0], vec![1.5, 0.2], vec![3.0]];
        for text in [
            "loss_type = \"dapo\"",
            "loss_type = \"grpo\"\nbeta = 0.04",
            "loss_type = \"dr_grpo\"\nmax_completion_length = 4\nbeta = 0.1\nuse_bias_correction_kl = false",
            "loss_type = \"bnpo\"\nimportance_sampling_level = \"sequence\"\nbeta = 0.04",
            "importance_sampling_level = \"sequence\"\ndelta = 1.1\nepsilon_high = 0.28",
            "top_entropy_quantile = 0.5\nbeta = 0.2\ndelta = 1.05",
        ] {
            let c = config(text);
            let base = micro_batch_loss(&rows_at(&logps, &old, &reference, &entropies), &c, TRAIN);
            for i in 0..logps.len() {
                for t in 0..logps[i].len() {
                    let h = 1e-6;
                    let shifted = |by: f64| {
                        let mut l = logps.clone();
                        l[i][t] += by;
                        micro_batch_loss(&rows_at(&l, &old, &reference, &entropies), &c, TRAIN).loss
                    };
                    let numeric = (shifted(h) - shifted(-h)) / (2.0 * h);
                    let analytic = base.gradients[i][t];
                    assert!(
                        (numeric - analytic).abs() <= 1e-7 * (1.0 + numeric.abs()),
                        "{text}: row {i} token {t}: {analytic} vs {numeric}"
                    );
                }
            }
        }
    }

    #[test]
    fn on_policy_ratios_are_one_and_the_loss_is_the_negative_advantage() {
        let logps = [vec![-1.0, -2.0], vec![-0.5]];
        let entropies = [vec![1.0, 1.0], vec![1.0]];
        let rows: Vec<LossRow<'_>> = (0..2)
            .map(|i| LossRow {
                logps: &logps[i],
                entropies: &entropies[i],
                old_logps: None,
                ref_logps: None,
                advantage: [1.0, -1.0][i],
                counted: true,
            })
            .collect();
        let one = Normalization {
            accumulation: 1,
            steps_per_generation: 1,
            generation_tokens: 3,
            training: true,
        };
        let m = micro_batch_loss(&rows, &config(""), one);
        // dapo: (−1 −1 +1) / 3; the tie of min splits the gradient in halves that add up to −A.
        assert!((m.loss - (-1.0 / 3.0)).abs() < 1e-15);
        assert_eq!(m.gradients, vec![vec![-1.0 / 3.0; 2], vec![1.0 / 3.0]]);
        assert_eq!(m.metrics[1], 0.0);
        assert!(m.kl.is_none());
    }

    #[test]
    fn advantages_follow_trl() {
        // Two groups of 3; the second all equal (zero std); one completion unscorable.
        let nan = f64::NAN;
        let per_func = vec![
            vec![1.0, 0.5],
            vec![0.0, 0.5],
            vec![nan, nan],
            vec![1.0, 1.0],
            vec![1.0, 1.0],
            vec![1.0, 1.0],
        ];
        let s = advantages(&per_func, &[1.0, 2.0], 3, ScaleRewards::Group);
        assert_eq!(s.rewards[0], 2.0);
        assert!(s.rewards[2].is_nan());
        let std = nanstd(&[2.0, 1.0]);
        assert!((s.advantages[0] - 0.5 / (std + 1e-4)).abs() < 1e-12);
        assert_eq!(s.advantages[2], 0.0);
        assert_eq!(&s.advantages[3..], &[0.0; 3]);
        assert_eq!(s.std_is_zero, vec![false, false, false, true, true, true]);
        let none = advantages(&per_func, &[1.0, 2.0], 3, ScaleRewards::None);
        assert_eq!(none.advantages[0], 0.5);
        let batch = advantages(&per_func, &[1.0, 1.0], 3, ScaleRewards::Batch);
        let all = nanstd(&batch.rewards);
        assert!((batch.advantages[0] - (1.5 - 1.0) / (all + 1e-4)).abs() < 1e-12);
    }
}
