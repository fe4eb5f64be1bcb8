//! The loss plot (`loss.svg`): training loss and evaluation loss against the step, and the learning rate against
//! a second axis on the right.

use std::io;

use super::axis::Axis;
use super::chart::{chart_svg, draw_line, value_axis, Marker, COLORS};

/// What the loss plot draws, each as `(step, value)` pairs; non-finite values are left out.
#[derive(Clone, Copy, Debug, Default)]
pub struct LossCurves<'a> {
    /// Training loss of the logged steps.
    pub train: &'a [(usize, f64)],
    /// Evaluation loss.
    pub eval: &'a [(usize, f64)],
    /// Learning rate of the logged steps (read against the right axis).
    pub learning_rate: &'a [(usize, f64)],
}

/// `(step, value)` pairs as points, the non-finite values left out.
fn finite(pairs: &[(usize, f64)]) -> Vec<(f64, f64)> {
    pairs
        .iter()
        .filter(|(_, v)| v.is_finite())
        .map(|(s, v)| (*s as f64, *v))
        .collect()
}

/// The lowest and highest of `values` (infinite when there are none).
fn extent(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

/// The loss plot of `curves` as SVG: steps from 0 on x, the losses on the left axis, the learning rate (from 0)
/// on the right one.
pub fn loss_svg(curves: &LossCurves) -> io::Result<String> {
    let (train, eval, lr) = (
        finite(curves.train),
        finite(curves.eval),
        finite(curves.learning_rate),
    );
    let last_step = extent(train.iter().chain(&eval).chain(&lr).map(|p| p.0)).1;
    let x = Axis::steps(0.0, last_step.max(1.0));
    let (lo, hi) = extent(train.iter().chain(&eval).map(|p| p.1));
    let y = value_axis(lo, hi);
    let right = (!lr.is_empty()).then(|| value_axis(0.0, extent(lr.iter().map(|p| p.1)).1));
    let lr_on_y: Vec<(f64, f64)> = match &right {
        Some(r) => lr.iter().map(|(s, v)| (*s, r.onto(&y, *v))).collect(),
        None => vec![],
    };
    chart_svg(
        "Training loss",
        (x, "step"),
        (y, "loss"),
        right.map(|r| (r, "learning rate")),
        |chart| {
            if !lr_on_y.is_empty() {
                let style = (COLORS[2], Marker::Cross, true);
                draw_line(chart, &lr_on_y, style, "learning rate (right axis)")?;
            }
            if !train.is_empty() {
                draw_line(
                    chart,
                    &train,
                    (COLORS[0], Marker::Circle, false),
                    "train loss",
                )?;
            }
            if !eval.is_empty() {
                draw_line(
                    chart,
                    &eval,
                    (COLORS[1], Marker::Triangle, false),
                    "eval loss",
                )?;
            }
            Ok(!(lr_on_y.is_empty() && train.is_empty() && eval.is_empty()))
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::render::{pixels_of, render, ticks, words};

    /// 200 steps: the loss falls from 3 towards 1, evaluated every 50 steps; the learning rate warms up to 2e-4
    /// over 20 steps and decays to 0 on a cosine.
    #[test]
    fn a_run_shows_both_losses_and_the_learning_rate_on_round_ticks() {
        let loss = |s: usize| 2.2 * (-(s as f64) / 60.0).exp() + 0.9;
        let train: Vec<(usize, f64)> = (1..=200).map(|s| (s, loss(s))).collect();
        let eval: Vec<(usize, f64)> = [50, 100, 150, 200].map(|s| (s, loss(s) + 0.15)).to_vec();
        let learning_rate: Vec<(usize, f64)> = (1..=200usize)
            .map(|s| {
                let decay = std::f64::consts::PI * s.saturating_sub(20) as f64 / 180.0;
                (
                    s,
                    2e-4 * (s as f64 / 20.0).min(1.0) * 0.5 * (1.0 + decay.cos()),
                )
            })
            .collect();
        let svg = loss_svg(&LossCurves {
            train: &train,
            eval: &eval,
            learning_rate: &learning_rate,
        })
        .unwrap();
        let pixmap = render(&svg);
        let t = ticks(&svg);
        assert_eq!(t.x, ["0", "50", "100", "150", "200"]);
        assert_eq!(t.left, ["0", "1", "2", "3", "4"]);
        assert_eq!(t.right, ["0", "1e-4", "2e-4", "3e-4"]);
        assert_eq!(
            words(&svg),
            [
                "Training loss",
                "loss",
                "step",
                "learning rate",
                "learning rate (right axis)",
                "train loss",
                "eval loss"
            ]
        );
        for color in [COLORS[0], COLORS[1], COLORS[2]] {
            assert!(pixels_of(&pixmap, color) > 50, "{color:?}");
        }
    }

    #[test]
    fn a_one_step_run_and_non_finite_losses() {
        let svg = loss_svg(&LossCurves {
            train: &[(1, 2.345), (2, f64::NAN)],
            eval: &[(1, f64::INFINITY)],
            learning_rate: &[(1, 2e-4)],
        })
        .unwrap();
        let pixmap = render(&svg);
        let t = ticks(&svg);
        assert_eq!(t.x, ["0", "1"]);
        assert_eq!(t.left, ["2.2", "2.25", "2.3", "2.35", "2.4", "2.45", "2.5"]);
        assert_eq!(t.right, ["0", "1e-4", "2e-4", "3e-4"]);
        assert!(!words(&svg).contains(&"eval loss".to_string()));
        // The single learning rate is marked (a line of one point draws nothing).
        assert!(pixels_of(&pixmap, COLORS[2]) > 10);
    }

    #[test]
    fn without_a_learning_rate_there_is_no_right_axis() {
        let svg = loss_svg(&LossCurves {
            train: &[(1, 3.0), (2, 2.5), (3, 2.0)],
            ..Default::default()
        })
        .unwrap();
        render(&svg);
        let t = ticks(&svg);
        assert_eq!(t.x, ["0", "1", "2", "3"]);
        assert_eq!(t.left, ["2", "2.5", "3", "3.5"]);
        assert!(t.right.is_empty());
        assert_eq!(words(&svg), ["Training loss", "loss", "step", "train loss"]);
        render(&loss_svg(&LossCurves::default()).unwrap());
    }
}
