//! Sampling as transformers' `generate(do_sample=True)` does it for TRL's GRPO settings: one row of float32 logits
//! goes through `RepetitionPenaltyLogitsProcessor`, `TemperatureLogitsWarper`, `TopKLogitsWarper`,
//! `TopPLogitsWarper` and `MinPLogitsWarper` (transformers 4.57, `generation/logits_process.py`, in the order
//! `GenerationMixin._get_logits_processor` appends them, each only where it would append it), and a token is drawn
//! from what is left with a counter-based uniform number (`crate::rng`), so a draw is a pure function of
//! `(seed, index)`. `tests/data/sampling/warpers.json` (`scripts/golden_sampling.py`) holds transformers' own
//! results.

use crate::error::{Error, Result};
use crate::rng::uniform;

/// How GRPO samples completions (TRL's `GRPOConfig` names and conventions). The default is TRL's: temperature 1,
/// no top-k, top-p or min-p filtering, no repetition penalty.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// Logits are divided by it (finite, more than 0; 1 leaves them).
    pub temperature: f64,
    /// Nucleus sampling: keep the most likely tokens whose probabilities add up to `top_p` (in (0, 1]; 1 = off).
    pub top_p: f64,
    /// Keep the `top_k` highest logits, and every token tied with the k-th (0 = off, as TRL passes it).
    pub top_k: usize,
    /// Drop tokens less likely than `min_p` times the most likely one (in [0, 1]; `None` = off).
    pub min_p: Option<f64>,
    /// CTRL's penalty on every token of the history (prompt and completion so far): a logit below 0 is multiplied
    /// by it, any other divided (more than 0; 1 = off, below 1 rewards repeats).
    pub repetition_penalty: f64,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        SamplingConfig {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: None,
            repetition_penalty: 1.0,
        }
    }
}

/// The counter index of the draw for `row`'s token `step` of a group (see [`SamplingConfig::sample`]):
/// `row << 32 | step`. It depends on nothing else (not on which rows are still generating), so a row's completion
/// is the same in a group of any size.
pub fn draw_index(row: usize, step: usize) -> u64 {
    ((row as u64) << 32) | (step as u64 & 0xFFFF_FFFF)
}

impl SamplingConfig {
    /// Checks the settings as transformers' processors do: a finite temperature above 0, `top_p` in (0, 1],
    /// `min_p` in [0, 1], a finite repetition penalty above 0.
    pub fn validate(&self) -> Result<()> {
        match self.problem() {
            Some(m) => Err(Error::InvalidInput(format!("sampling: {m}"))),
            None => Ok(()),
        }
    }

    /// What [`SamplingConfig::validate`] refuses, named by the setting (`temperature = 0: …`), if anything.
    pub fn problem(&self) -> Option<String> {
        if !(self.temperature.is_finite() && self.temperature > 0.0) {
            return Some(format!(
                "temperature = {}: must be finite and more than 0 (1 leaves the logits as they are)",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Some(format!(
                "top_p = {}: must be in (0, 1] (1 keeps every token)",
                self.top_p
            ));
        }
        if let Some(min_p) = self.min_p.filter(|m| !(0.0..=1.0).contains(m)) {
            return Some(format!(
                "min_p = {min_p}: must be in [0, 1] (or unset to keep every token)"
            ));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Some(format!(
                "repetition_penalty = {}: must be finite and more than 0 (1 = no penalty)",
                self.repetition_penalty
            ));
        }
        None
    }

    /// Applies the processors to one row of logits in place, as transformers does for `input_ids = [history]`:
    /// a removed token's score becomes −∞. Each step is float32 as in torch; where torch's result depends on it,
    /// the order of operations is torch's on the CPU (top-p's cumulative sum accumulates in float64 and rounds each
    /// partial sum to float32; ties in its ascending sort go in index order).
    pub fn process_logits(&self, scores: &mut [f32], history: &[u32]) -> Result<()> {
        let vocab = scores.len();
        if vocab == 0 {
            return Err(Error::InvalidInput(
                "sampling: the logits row is empty".into(),
            ));
        }
        if self.repetition_penalty != 1.0 {
            let penalty = self.repetition_penalty as f32;
            let mut seen = history.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                let s = scores.get_mut(t as usize).ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "sampling: token {t} of the history is outside the vocabulary of {vocab} logits"
                    ))
                })?;
                *s = if *s < 0.0 { *s * penalty } else { *s / penalty };
            }
        }
        if self.temperature != 1.0 {
            let t = self.temperature as f32;
            scores.iter_mut().for_each(|s| *s /= t);
        }
        if self.top_k != 0 {
            top_k(scores, self.top_k.min(vocab));
        }
        if self.top_p < 1.0 {
            top_p(scores, self.top_p);
        }
        if let Some(min_p) = self.min_p {
            min_p_filter(scores, min_p);
        }
        Ok(())
    }

    /// Processes `scores` ([`SamplingConfig::process_logits`], in place) and draws a token with the uniform number
    /// `crate::rng::uniform(seed, index)` ([`draw`]).
    pub fn sample(
        &self,
        scores: &mut [f32],
        history: &[u32],
        seed: u64,
        index: u64,
    ) -> Result<u32> {
        self.process_logits(scores, history)?;
        draw(scores, uniform(seed, index)).map(|i| i as u32).ok_or_else(|| {
            Error::InvalidInput(
                "sampling: no token left to draw (every logit is −∞ or NaN); check the model's output".into(),
            )
        })
    }
}

/// `TopKLogitsWarper`: removes `scores < kth`, the k-th largest (so every token tied with it stays).
fn top_k(scores: &mut [f32], k: usize) {
    let mut sorted = scores.to_vec();
    // Descending, NaN first as torch.topk ranks it.
    let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let kth = *kth;
    scores
        .iter_mut()
        .filter(|s| **s < kth)
        .for_each(|s| *s = f32::NEG_INFINITY);
}

/// torch's float32 softmax of a row (up to summation order): `exp(x − max) / Σ`.
fn softmax_f32(scores: &[f32]) -> Vec<f32> {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = scores
        .iter()
        .map(|&s| ((s - max) as f64).exp() as f32)
        .collect();
    let sum = exps.iter().map(|&e| e as f64).sum::<f64>() as f32;
    exps.into_iter().map(|e| e / sum).collect()
}

/// `TopPLogitsWarper`: sorts ascending, takes the cumulative float32 softmax, removes where it is ≤ `1 − top_p`,
/// always keeping the last (most likely) token. Tokens already at −∞ have probability 0 and are removed anyway, so
/// only the others are sorted (their partial sums are the same).
fn top_p(scores: &mut [f32], top_p: f64) {
    let probs = softmax_f32(scores);
    let mut order: Vec<usize> = (0..scores.len())
        .filter(|&i| scores[i] != f32::NEG_INFINITY)
        .collect();
    order.sort_unstable_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
    let threshold = (1.0 - top_p) as f32;
    let mut cumulative = 0f64;
    let last = order.len().saturating_sub(1);
    for (rank, &i) in order.iter().enumerate() {
        cumulative += probs[i] as f64;
        if rank < last && cumulative as f32 <= threshold {
            scores[i] = f32::NEG_INFINITY;
        }
    }
}

/// `MinPLogitsWarper`: removes tokens whose float32 probability is below `min_p` times the largest, keeping the
/// highest-scored token.
fn min_p_filter(scores: &mut [f32], min_p: f64) {
    let probs = softmax_f32(scores);
    let top = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let threshold = min_p as f32 * top;
    let best = (0..scores.len()).reduce(|a, b| if scores[b] > scores[a] { b } else { a });
    for (i, (s, p)) in scores.iter_mut().zip(&probs).enumerate() {
        if *p < threshold && Some(i) != best {
            *s = f32::NEG_INFINITY;
        }
    }
}

/// The token the uniform number `u` in [0, 1) picks from processed `scores`: the inverse of the cumulative
/// distribution `softmax(scores)` (float64) over the kept tokens in index order — the first token whose cumulative
/// weight exceeds `u` times the total. `None` when no score is above −∞ (or every one is NaN).
pub fn draw(scores: &[f32], u: f64) -> Option<usize> {
    let max = scores
        .iter()
        .copied()
        .filter(|s| !s.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return None;
    }
    if max == f32::INFINITY {
        return scores.iter().position(|&s| s == f32::INFINITY);
    }
    let weight = |s: f32| {
        if s.is_nan() {
            0.0
        } else {
            (s as f64 - max as f64).exp()
        }
    };
    let total: f64 = scores.iter().map(|&s| weight(s)).sum();
    let target = u * total;
    let mut cumulative = 0.0;
    let mut last = None;
    for (i, &s) in scores.iter().enumerate() {
        let w = weight(s);
        if w > 0.0 {
            cumulative += w;
            last = Some(i);
            if cumulative > target {
                return Some(i);
            }
        }
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const GOLDEN: &str = include_str!("../../tests/data/sampling/warpers.json");

    fn config(case: &Value) -> SamplingConfig {
        SamplingConfig {
            temperature: case["temperature"].as_f64().unwrap(),
            top_p: case["top_p"].as_f64().unwrap(),
            top_k: case["top_k"].as_u64().unwrap() as usize,
            min_p: case["min_p"].as_f64(),
            repetition_penalty: case["repetition_penalty"].as_f64().unwrap(),
        }
    }

    fn floats(v: &Value) -> Vec<Option<f32>> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().map(|x| x as f32))
            .collect()
    }

    /// transformers' processors (scripts/golden_sampling.py): the same kept tokens, the same scores within float32
    /// rounding.
    #[test]
    fn matches_transformers_processors() {
        let golden: Value = serde_json::from_str(GOLDEN).unwrap();
        let cases = golden["cases"].as_array().unwrap();
        assert!(cases.len() >= 12);
        for case in cases {
            let name = case["name"].as_str().unwrap();
            let cfg = config(case);
            cfg.validate().unwrap();
            let mut scores: Vec<f32> = floats(&case["logits"])
                .into_iter()
                .map(Option::unwrap)
                .collect();
            let history: Vec<u32> = case["history"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as u32)
                .collect();
            cfg.process_logits(&mut scores, &history).unwrap();
            let kept: Vec<usize> = (0..scores.len())
                .filter(|&i| scores[i].is_finite())
                .collect();
            let want: Vec<usize> = case["kept"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t.as_u64().unwrap() as usize)
                .collect();
            assert_eq!(kept, want, "{name}: kept tokens");
            for (i, (got, want)) in scores.iter().zip(floats(&case["scores"])).enumerate() {
                match want {
                    None => assert_eq!(*got, f32::NEG_INFINITY, "{name}: token {i}"),
                    Some(w) => assert!(
                        (got - w).abs() <= 1e-6 * w.abs().max(1.0),
                        "{name}: token {i}: {got} vs transformers' {w}"
                    ),
                }
            }
        }
    }

    #[test]
    fn validate_names_the_setting() {
        let ok = SamplingConfig::default();
        ok.validate().unwrap();
        let cases = [
            (
                SamplingConfig {
                    temperature: 0.0,
                    ..ok.clone()
                },
                "temperature = 0",
            ),
            (
                SamplingConfig {
                    temperature: f64::INFINITY,
                    ..ok.clone()
                },
                "temperature = inf",
            ),
            (
                SamplingConfig {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "top_p = 0",
            ),
            (
                SamplingConfig {
                    top_p: 1.5,
                    ..ok.clone()
                },
                "top_p = 1.5",
            ),
            (
                SamplingConfig {
                    min_p: Some(-0.1),
                    ..ok.clone()
                },
                "min_p = -0.1",
            ),
            (
                SamplingConfig {
                    repetition_penalty: 0.0,
                    ..ok.clone()
                },
                "repetition_penalty = 0",
            ),
        ];
        for (cfg, want) in cases {
            let err = cfg.validate().unwrap_err().to_string();
            assert!(err.contains(want), "{err}");
        }
    }

    #[test]
    fn history_outside_vocabulary_is_an_error() {
        let cfg = SamplingConfig {
            repetition_penalty: 1.2,
            ..Default::default()
        };
        let err = cfg
            .process_logits(&mut [0.0; 4], &[1, 4])
            .unwrap_err()
            .to_string();
        assert!(err.contains("token 4"), "{err}");
    }

    /// The draw is a pure function of (seed, index), follows the distribution, and never picks a removed token.
    #[test]
    fn draws_follow_the_distribution() {
        let cfg = SamplingConfig {
            top_k: 3,
            ..Default::default()
        };
        let logits = [0.0f32, (2.0f32).ln(), -5.0, (3.0f32).ln(), -9.0];
        let mut counts = [0usize; 5];
        let n = 20_000;
        for index in 0..n {
            let token = cfg.sample(&mut logits.clone(), &[], 7, index).unwrap();
            assert_eq!(
                token,
                cfg.sample(&mut logits.clone(), &[], 7, index).unwrap()
            );
            counts[token as usize] += 1;
        }
        assert_eq!((counts[2], counts[4]), (0, 0));
        for (token, p) in [(0, 1.0 / 6.0), (1, 2.0 / 6.0), (3, 3.0 / 6.0)] {
            let f = counts[token] as f64 / n as f64;
            assert!((f - p).abs() < 0.015, "token {token}: {f} vs {p}");
        }
        let other: Vec<u32> = (0..32)
            .map(|i| cfg.sample(&mut logits.clone(), &[], 8, i).unwrap())
            .collect();
        let same: Vec<u32> = (0..32)
            .map(|i| cfg.sample(&mut logits.clone(), &[], 7, i).unwrap())
            .collect();
        assert_ne!(other, same);
        assert_eq!(draw(&[f32::NEG_INFINITY; 3], 0.5), None);
        assert_eq!(
            draw(&[f32::NEG_INFINITY, 1.0, f32::NEG_INFINITY], 0.999),
            Some(1)
        );
    }

    #[test]
    fn draw_index_separates_rows_and_steps() {
        assert_eq!(draw_index(0, 5), 5);
        assert_eq!(draw_index(3, 5), (3 << 32) | 5);
        assert_ne!(draw_index(1, 0), draw_index(0, 1));
    }
}
