//! The memory chart (`memory.svg`): for each phase of each step (forward and backward of each micro-batch, the
//! optimizer) the peak inside it, one named series per phase, the bytes live at its end, and the estimate's
//! line.

use std::io;

use super::axis::Axis;
use super::{chart_svg, draw_line, value_axis, Marker, COLORS, GREY};

/// One phase of a training step as the memory chart draws it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryPoint<'a> {
    /// Optimizer step (1-based).
    pub step: usize,
    /// The phase's name (`forward`, `backward`, `optimizer`): a series and a legend entry of its own.
    pub phase: &'a str,
    /// Highest bytes live during the phase.
    pub peak: u64,
    /// Bytes live at the end of the phase.
    pub live: u64,
}

/// Binary units, largest first.
const UNITS: [(&str, u64); 4] = [
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("B", 1),
];

/// The largest unit in which the span from `lo` to `hi` bytes is at least one (so ticks need few decimals:
/// 4.5 to 6 GiB in GiB, 5200 to 5300 MiB in MiB).
fn unit(lo: u64, hi: u64) -> (&'static str, f64) {
    let span = (hi - lo).max(hi / 10);
    let (name, bytes) = UNITS
        .into_iter()
        .find(|(_, b)| span >= *b)
        .unwrap_or(UNITS[UNITS.len() - 1]);
    (name, bytes as f64)
}

/// Where each point goes on the step axis: the phases of step `s` share out the width from `s - 0.5` to
/// `s + 0.5` in order, so the tick `s` stands under them.
fn positions(points: &[MemoryPoint]) -> Vec<f64> {
    points
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let same_step = |q: &&MemoryPoint| q.step == p.step;
            let before = points[..i].iter().filter(same_step).count();
            let all = before + points[i..].iter().filter(same_step).count();
            p.step as f64 - 0.5 + (before as f64 + 0.5) / all as f64
        })
        .collect()
}

/// The memory chart of `points` (in order) as SVG, measured from `source` (the title says which), with `estimate`
/// (the bytes the memory estimate predicts for the run) as a dashed line where given.
pub fn memory_svg(
    source: &str,
    points: &[MemoryPoint],
    estimate: Option<u64>,
) -> io::Result<String> {
    let bytes = points.iter().flat_map(|p| [p.peak, p.live]).chain(estimate);
    let (lo, hi) = bytes.fold((u64::MAX, 0), |(lo, hi), b| (lo.min(b), hi.max(b)));
    let (unit_name, unit) = unit(lo.min(hi), hi);
    let in_unit = |b: u64| b as f64 / unit;
    let first = points.iter().map(|p| p.step).min().unwrap_or(1);
    let last = points.iter().map(|p| p.step).max().unwrap_or(1);
    let x = Axis::steps(first as f64 - 0.5, last as f64 + 0.5);
    let y = value_axis(in_unit(lo.min(hi)), in_unit(hi));
    let xs = positions(points);
    let mut phases: Vec<&str> = vec![];
    for p in points {
        if !phases.contains(&p.phase) {
            phases.push(p.phase);
        }
    }
    let (x_lo, x_hi) = (first as f64 - 0.5, last as f64 + 0.5);
    chart_svg(
        &format!("Memory per phase ({source})"),
        (x, "step"),
        (y, unit_name),
        None,
        |chart| {
            if let Some(e) = estimate {
                let line = [(x_lo, in_unit(e)), (x_hi, in_unit(e))];
                draw_line(chart, &line, (COLORS[3], Marker::None, true), "estimate")?;
            }
            if !points.is_empty() {
                let live: Vec<(f64, f64)> = xs
                    .iter()
                    .zip(points)
                    .map(|(x, p)| (*x, in_unit(p.live)))
                    .collect();
                let style = (GREY, Marker::None, false);
                draw_line(chart, &live, style, "live at phase end")?;
            }
            let markers = [Marker::Circle, Marker::Triangle, Marker::Cross];
            for (i, phase) in phases.iter().enumerate() {
                let peaks: Vec<(f64, f64)> = xs
                    .iter()
                    .zip(points)
                    .filter(|(_, p)| p.phase == *phase)
                    .map(|(x, p)| (*x, in_unit(p.peak)))
                    .collect();
                let style = (COLORS[i % COLORS.len()], markers[i % markers.len()], false);
                draw_line(chart, &peaks, style, &format!("{phase} peak"))?;
            }
            Ok(estimate.is_some() || !points.is_empty())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::render::{pixels_of, render, ticks, words};
    use crate::plot::GREY;

    const MIB: u64 = 1 << 20;

    /// The old failure: a one-step run without accumulation, its forward, backward and optimizer around 5250 MiB
    /// (the hand-written chart read "0.6000000000000001" on its step axis and "5250.000" on its MiB axis).
    fn one_step() -> Vec<MemoryPoint<'static>> {
        [
            ("forward", 5262, 5231),
            ("backward", 5281, 5240),
            ("optimizer", 5249, 5236),
        ]
        .into_iter()
        .map(|(phase, peak, live)| MemoryPoint {
            step: 1,
            phase,
            peak: peak * MIB,
            live: live * MIB,
        })
        .collect()
    }

    #[test]
    fn a_one_step_run_has_whole_mib_ticks_one_step_tick_and_named_phases() {
        let svg = memory_svg("heap", &one_step(), Some(5300 * MIB)).unwrap();
        let pixmap = render(&svg);
        let t = ticks(&svg);
        assert_eq!(t.x, ["1"]);
        assert_eq!(
            t.left,
            ["5220", "5240", "5260", "5280", "5300", "5320", "5340"]
        );
        assert!(t.right.is_empty(), "{t:?}");
        assert_eq!(
            words(&svg),
            [
                "Memory per phase (heap)",
                "MiB",
                "step",
                "estimate",
                "live at phase end",
                "forward peak",
                "backward peak",
                "optimizer peak"
            ]
        );
        // The estimate's dashed line, the live line and each phase's marker are drawn.
        for color in [COLORS[3], GREY, COLORS[0], COLORS[1], COLORS[2]] {
            assert!(pixels_of(&pixmap, color) > 20, "{color:?}");
        }
    }

    #[test]
    fn without_an_estimate_there_is_no_estimate_line() {
        let svg = memory_svg("heap", &one_step(), None).unwrap();
        let pixmap = render(&svg);
        assert!(!words(&svg).contains(&"estimate".to_string()));
        assert_eq!(pixels_of(&pixmap, COLORS[3]), 0);
    }

    #[test]
    fn phases_share_out_their_step_in_order() {
        let points = one_step();
        let xs = positions(&points);
        let expected = [1.0 - 1.0 / 3.0, 1.0, 1.0 + 1.0 / 3.0];
        assert!(
            xs.iter().zip(expected).all(|(x, e)| (x - e).abs() < 1e-12),
            "{xs:?}"
        );
        // Two micro-batches: forward, backward, forward, backward, optimizer in each step.
        let phases = ["forward", "backward", "forward", "backward", "optimizer"];
        let points: Vec<MemoryPoint> = (1..=2)
            .flat_map(|step| {
                phases.map(|phase| MemoryPoint {
                    step,
                    phase,
                    peak: 1,
                    live: 1,
                })
            })
            .collect();
        let xs = positions(&points);
        assert_eq!(xs.len(), 10);
        assert!(
            (xs[0] - 0.6).abs() < 1e-12 && (xs[4] - 1.4).abs() < 1e-12,
            "{xs:?}"
        );
        assert!(
            (xs[5] - 1.6).abs() < 1e-12 && (xs[9] - 2.4).abs() < 1e-12,
            "{xs:?}"
        );
    }

    #[test]
    fn the_unit_is_the_largest_the_span_fills() {
        assert_eq!(unit(5200 * MIB, 5300 * MIB).0, "MiB");
        assert_eq!(unit(70 << 30, 75 << 30).0, "GiB");
        assert_eq!(unit(0, 3 << 10).0, "KiB");
        assert_eq!(unit(0, 0).0, "B");
        // A tenth of the value at least: a flat line at 80 GiB is drawn in GiB.
        assert_eq!(unit(80 << 30, 80 << 30).0, "GiB");
    }

    #[test]
    fn a_long_run_on_a_gpu_reads_in_gib() {
        let points: Vec<MemoryPoint> = (1..=500usize)
            .flat_map(|step| {
                let base = (70 << 30) + (step as u64 % 7) * 30 * MIB;
                [("forward", 900), ("backward", 1400), ("optimizer", 300)].map(|(phase, extra)| {
                    MemoryPoint {
                        step,
                        phase,
                        peak: base + extra * MIB,
                        live: base,
                    }
                })
            })
            .collect();
        let svg = memory_svg("device pool", &points, Some(75 << 30)).unwrap();
        let pixmap = render(&svg);
        let t = ticks(&svg);
        assert_eq!(t.x, ["100", "200", "300", "400", "500"]);
        assert_eq!(t.left, ["70", "72", "74", "76", "78"]);
        assert!(words(&svg).contains(&"GiB".to_string()));
        // Too many points for markers: lines only (the one circle is the forward's in the legend).
        assert_eq!(svg.matches("<circle").count(), 1);
        assert!(pixels_of(&pixmap, COLORS[1]) > 500);
    }

    #[test]
    fn an_empty_timeline_still_renders() {
        let svg = memory_svg("unavailable", &[], None).unwrap();
        render(&svg);
        assert_eq!(ticks(&svg).x, ["1"]);
        assert_eq!(words(&svg), ["Memory per phase (unavailable)", "B", "step"]);
    }
}
