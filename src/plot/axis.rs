//! A linear axis with ticks at round values (1, 2, 2.5 or 5 times a power of ten), each labelled with only the
//! decimals it needs, as a plotters coordinate.

use std::ops::Range;

use plotters::coord::ranged1d::{
    KeyPointHint, KeyPointWeight, NoDefaultFormatting, ValueFormatter,
};
use plotters::prelude::Ranged;

/// About this many ticks per axis.
const TICKS: usize = 5;

/// Below this tick spacing the labels are written in scientific notation (`5e-5`, `1.5e-4`).
const SCIENTIFIC_BELOW: f64 = 1e-3;

/// A linear axis from `lo` to `hi` with ticks at `first + k * step` (k = 0, 1, …) up to `hi`.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Axis {
    lo: f64,
    hi: f64,
    /// Distance between ticks: 1, 2, 2.5 or 5 times a power of ten.
    step: f64,
    /// The first tick, in steps (`first * step` is its value).
    first: i64,
    /// Decimals that any multiple of `step` needs.
    decimals: usize,
}

/// `(lo, hi)` made usable: finite, and apart when they were equal.
fn spread(lo: f64, hi: f64) -> (f64, f64) {
    if !(lo.is_finite() && hi.is_finite()) || lo > hi {
        return (0.0, 1.0);
    }
    if hi > lo {
        return (lo, hi);
    }
    if lo == 0.0 {
        return (0.0, 1.0);
    }
    let pad = lo.abs() * 0.05;
    (lo - pad, hi + pad)
}

/// The round step (1, 2, 2.5 or 5 times a power of ten; 1, 2 or 5 and at least 1 when `integer`) that cuts
/// `span` into at most about [`TICKS`] parts.
fn round_step(span: f64, integer: bool) -> f64 {
    let raw = span / TICKS as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let multiples: &[f64] = if integer {
        &[1.0, 2.0, 5.0, 10.0]
    } else {
        &[1.0, 2.0, 2.5, 5.0, 10.0]
    };
    let step = multiples
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw * (1.0 - 1e-9))
        .unwrap_or(10.0 * magnitude);
    if integer {
        step.max(1.0)
    } else {
        step
    }
}

/// The fewest decimals that write every multiple of `step` exactly.
fn decimals(step: f64) -> usize {
    (0..17)
        .find(|d| {
            let scaled = step * 10f64.powi(*d as i32);
            (scaled - scaled.round()).abs() <= 1e-6 * scaled
        })
        .unwrap_or(17)
}

/// `value` with at most `decimals` decimals and no trailing zeros: `0.5`, `1`, `5250`; in scientific notation
/// (`5e-5`, `1.5e-4`) when `scientific`.
pub(super) fn format_tick(value: f64, decimals: usize, scientific: bool) -> String {
    let fixed = format!("{value:.decimals$}");
    let fixed = if fixed.contains('.') {
        fixed.trim_end_matches('0').trim_end_matches('.')
    } else {
        &fixed
    };
    let fixed = if fixed == "-0" { "0" } else { fixed };
    match fixed.parse::<f64>() {
        // Rust's `{:e}` writes the shortest digits that read back as the (rounded) value.
        Ok(v) if scientific && v != 0.0 => format!("{v:e}"),
        _ => fixed.to_string(),
    }
}

impl Axis {
    /// An axis over data from `lo` to `hi`, widened to the round ticks on either side.
    pub(super) fn around(lo: f64, hi: f64) -> Self {
        let (lo, hi) = spread(lo, hi);
        let step = round_step(hi - lo, false);
        let (first, last) = ((lo / step).floor(), (hi / step).ceil());
        Axis {
            lo: first * step,
            hi: last * step,
            step,
            first: first as i64,
            decimals: decimals(step),
        }
    }

    /// An axis of steps from `lo` to `hi` exactly, with ticks at round whole numbers inside.
    pub(super) fn steps(lo: f64, hi: f64) -> Self {
        let (lo, hi) = spread(lo, hi);
        let step = round_step(hi - lo, true);
        Axis {
            lo,
            hi,
            step,
            first: (lo / step).ceil() as i64,
            decimals: 0,
        }
    }

    /// The tick values, lowest first.
    pub(super) fn ticks(&self) -> Vec<f64> {
        (self.first..)
            .map(|k| k as f64 * self.step)
            .take_while(|v| *v <= self.hi + self.step * 1e-9)
            .collect()
    }

    /// Where `value` of this axis falls on `other` (the same share of the way from its low end to its high end):
    /// a series read against a second axis is drawn in the first one's coordinates.
    pub(super) fn onto(&self, other: &Axis, value: f64) -> f64 {
        other.lo + (value - self.lo) / (self.hi - self.lo) * (other.hi - other.lo)
    }

    /// The label of tick `value`.
    pub(super) fn label(&self, value: f64) -> String {
        format_tick(value, self.decimals, self.step < SCIENTIFIC_BELOW)
    }
}

impl Ranged for Axis {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let share = (value - self.lo) / (self.hi - self.lo);
        (f64::from(limit.0) + share * f64::from(limit.1 - limit.0)).round() as i32
    }

    /// The ticks for the labelled grid lines; no light grid lines between them.
    fn key_points<Hint: KeyPointHint>(&self, hint: Hint) -> Vec<f64> {
        match hint.weight() {
            KeyPointWeight::Bold => self.ticks(),
            KeyPointWeight::Any => vec![],
        }
    }

    fn range(&self) -> Range<f64> {
        self.lo..self.hi
    }
}

impl ValueFormatter<f64> for Axis {
    fn format_ext(&self, value: &f64) -> String {
        self.label(*value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(axis: &Axis) -> Vec<String> {
        axis.ticks().iter().map(|t| axis.label(*t)).collect()
    }

    #[test]
    fn ticks_are_round_and_printed_with_the_decimals_they_need() {
        let a = Axis::around(0.0, 1.0);
        assert_eq!(labels(&a), ["0", "0.2", "0.4", "0.6", "0.8", "1"]);
        assert_eq!(
            labels(&Axis::around(1.23, 1.87)),
            ["1.2", "1.4", "1.6", "1.8", "2"]
        );
        assert_eq!(
            labels(&Axis::around(2.2, 2.45)),
            ["2.2", "2.25", "2.3", "2.35", "2.4", "2.45"]
        );
        let a = Axis::around(0.0, 10.0);
        assert_eq!(labels(&a), ["0", "2", "4", "6", "8", "10"]);
        assert_eq!(
            labels(&Axis::around(0.0, 2.4)),
            ["0", "0.5", "1", "1.5", "2", "2.5"]
        );
        assert_eq!(
            labels(&Axis::around(0.1, 1.3)),
            ["0", "0.25", "0.5", "0.75", "1", "1.25", "1.5"]
        );
    }

    #[test]
    fn the_old_failures_read_as_round_numbers() {
        // 3 × 0.2 is 0.6000000000000001 in floating point.
        assert_eq!(format_tick(3.0 * 0.2, decimals(0.2), false), "0.6");
        // A memory axis around 5250 MiB: whole MiB, no "5250.000".
        let a = Axis::around(5210.4, 5281.7);
        assert_eq!(labels(&a), ["5200", "5220", "5240", "5260", "5280", "5300"]);
        // Around a constant value the axis still has room and round ticks.
        assert_eq!(
            labels(&Axis::around(5250.0, 5250.0)),
            ["4800", "5000", "5200", "5400", "5600"]
        );
    }

    #[test]
    fn step_axes_tick_whole_steps_only() {
        assert_eq!(labels(&Axis::steps(0.5, 1.5)), ["1"]);
        assert_eq!(labels(&Axis::steps(0.0, 1.0)), ["0", "1"]);
        assert_eq!(labels(&Axis::steps(0.5, 3.5)), ["1", "2", "3"]);
        assert_eq!(labels(&Axis::steps(0.0, 7.0)), ["0", "2", "4", "6"]);
        assert_eq!(
            labels(&Axis::steps(0.5, 1000.5)),
            ["200", "400", "600", "800", "1000"]
        );
        assert_eq!(Axis::steps(0.5, 3.5).range(), 0.5..3.5);
    }

    #[test]
    fn small_values_are_written_in_scientific_notation() {
        let a = Axis::around(0.0, 2e-4);
        assert_eq!(labels(&a), ["0", "5e-5", "1e-4", "1.5e-4", "2e-4"]);
        assert_eq!(
            labels(&Axis::around(1e-5, 1.1e-5)),
            ["1e-5", "1.02e-5", "1.04e-5", "1.06e-5", "1.08e-5", "1.1e-5"]
        );
    }

    #[test]
    fn unusable_ranges_fall_back_to_zero_to_one() {
        assert_eq!(Axis::around(f64::NAN, 1.0).range(), 0.0..1.0);
        assert_eq!(
            Axis::around(f64::INFINITY, f64::NEG_INFINITY).range(),
            0.0..1.0
        );
        assert_eq!(Axis::around(0.0, 0.0).range(), 0.0..1.0);
        assert_eq!(
            labels(&Axis::around(-3.0, -3.0)),
            ["-3.2", "-3.1", "-3", "-2.9", "-2.8"]
        );
        assert_eq!(format_tick(-0.0001, 2, false), "0");
    }

    #[test]
    fn maps_linearly_onto_the_pixels() {
        let a = Axis::steps(0.5, 1.5);
        assert_eq!(a.map(&0.5, (100, 200)), 100);
        assert_eq!(a.map(&1.0, (100, 200)), 150);
        assert_eq!(a.map(&1.5, (200, 100)), 100);
        assert_eq!(
            Axis::around(0.0, 2e-4).onto(&Axis::around(1.0, 2.0), 1e-4),
            1.5
        );
    }
}
