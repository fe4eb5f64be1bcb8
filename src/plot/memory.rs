//! The memory chart (`memory.svg`): memory over the run, stacked by category, as PyTorch's memory_viz timeline
//! draws it — at the resolution of phases. Each phase of each step (a micro-batch's forward or backward, the
//! optimizer) spans its share of the step's time and stands at its peak, split into categories drawn bottom to
//! top; the estimate is a dashed line and the highest peak is marked.

use std::collections::HashMap;
use std::io;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::axis::Axis;
use super::chart::{chart_svg, draw_line, Marker, COLORS, FONT, GREY, MARKERS_UP_TO};

/// One phase of a training step as the memory chart draws it.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPoint<'a> {
    /// Optimizer step (1-based).
    pub step: usize,
    /// The phase's name (`forward`, `backward`, `optimizer`).
    pub phase: &'a str,
    /// How long the phase ran: its width within the step.
    pub seconds: f64,
    /// Bytes of each category at the phase's peak, in the order of the chart's categories (bottom to top); they
    /// sum to the peak.
    pub bytes: Vec<u64>,
}

impl MemoryPoint<'_> {
    /// The phase's peak: the sum of its categories.
    fn total(&self) -> u64 {
        self.bytes.iter().sum()
    }
}

/// The fill of each category, bottom to top (more categories than colors reuse them).
const CATEGORY_COLORS: [RGBColor; 4] = [COLORS[0], GREY, COLORS[2], COLORS[1]];
/// The estimate's dashed line.
const ESTIMATE_COLOR: RGBColor = COLORS[3];
/// The marker of the measured peak.
const PEAK_COLOR: RGBColor = BLACK;
/// The data stay below this share of the value axis, leaving the rest to the legend above them.
const DATA_SHARE: f64 = 0.55;

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

/// `bytes` with three significant digits in the largest unit it fills (`487 MiB`, `5.25 GiB`), for the legend.
fn short_bytes(bytes: u64) -> String {
    let (name, size) = UNITS
        .into_iter()
        .find(|(_, b)| bytes >= *b)
        .unwrap_or(UNITS[UNITS.len() - 1]);
    let value = bytes as f64 / size as f64;
    let decimals = match value {
        v if v >= 99.95 => 0,
        v if v >= 9.995 => 1,
        _ => 2,
    };
    if size == 1 {
        format!("{bytes} B")
    } else {
        format!("{value:.decimals$} {name}")
    }
}

/// Where each phase lies on the step axis, `(start, end)`: the phases of step `s` share out the width from
/// `s - 0.5` to `s + 0.5` in order, each in proportion to its time (equally where the step's time is unknown), so
/// the tick `s` stands under the step.
fn spans(points: &[MemoryPoint]) -> Vec<(f64, f64)> {
    let seconds = |p: &MemoryPoint| {
        if p.seconds.is_finite() {
            p.seconds.max(0.0)
        } else {
            0.0
        }
    };
    // Per step: its phases' total time and count, then the time and phases already placed.
    let mut steps: HashMap<usize, (f64, usize)> = HashMap::new();
    for p in points {
        let (time, count) = steps.entry(p.step).or_default();
        *time += seconds(p);
        *count += 1;
    }
    let mut placed: HashMap<usize, (f64, usize)> = HashMap::new();
    points
        .iter()
        .map(|p| {
            let (total, count) = steps[&p.step];
            let (time_before, before) = placed.entry(p.step).or_default();
            let (start, width) = if total > 0.0 {
                (*time_before / total, seconds(p) / total)
            } else {
                (*before as f64 / count as f64, 1.0 / count as f64)
            };
            *time_before += seconds(p);
            *before += 1;
            let left = p.step as f64 - 0.5 + start;
            (left, left + width)
        })
        .collect()
}

/// The phases of the first step, in order (`forward, backward, optimizer`): the order of the blocks in every step.
fn first_step_phases(points: &[MemoryPoint]) -> String {
    let first = points.first().map(|p| p.step);
    let phases: Vec<&str> = points
        .iter()
        .take_while(|p| Some(p.step) == first)
        .map(|p| p.phase)
        .collect();
    phases.join(", ")
}

/// The outline of category `k` over `points` placed at `spans`, in `unit`s: one polygon per run of adjacent phases,
/// along the category's top from left to right and back along its bottom.
fn category_outlines(
    points: &[MemoryPoint],
    spans: &[(f64, f64)],
    k: usize,
    unit: f64,
) -> Vec<Vec<(f64, f64)>> {
    let mut outlines: Vec<Vec<(f64, f64)>> = vec![];
    let mut bottoms: Vec<Vec<(f64, f64)>> = vec![];
    let mut last_end = f64::NAN;
    for (p, (start, end)) in points.iter().zip(spans) {
        let below: u64 = p.bytes.iter().take(k).sum();
        let top = below + p.bytes.get(k).copied().unwrap_or(0);
        if (start - last_end).abs() > 1e-9 || outlines.is_empty() {
            outlines.push(vec![]);
            bottoms.push(vec![]);
        }
        let (outline, bottom) = (outlines.last_mut(), bottoms.last_mut());
        if let (Some(outline), Some(bottom)) = (outline, bottom) {
            outline.extend([(*start, top as f64 / unit), (*end, top as f64 / unit)]);
            bottom.extend([(*start, below as f64 / unit), (*end, below as f64 / unit)]);
        }
        last_end = *end;
    }
    outlines
        .into_iter()
        .zip(bottoms)
        .map(|(mut outline, bottom)| {
            outline.extend(bottom.into_iter().rev());
            outline
        })
        .collect()
}

/// The memory chart of `points` (in order) as SVG, measured from `source` (the title says which): each phase's
/// peak split into `categories` (bottom to top, as [`MemoryPoint::bytes`]), `estimate` (the bytes the memory
/// estimate predicts for the run) as a dashed line where given, and the highest peak marked.
pub fn memory_svg(
    source: &str,
    categories: &[&str],
    points: &[MemoryPoint],
    estimate: Option<u64>,
) -> io::Result<String> {
    // The first of equal peaks.
    let peak = points
        .iter()
        .enumerate()
        .max_by_key(|(i, p)| (p.total(), std::cmp::Reverse(*i)));
    let hi = peak
        .map_or(0, |(_, p)| p.total())
        .max(estimate.unwrap_or(0));
    let (unit_name, unit) = unit(0, hi);
    let in_unit = |b: u64| b as f64 / unit;
    let first = points.iter().map(|p| p.step).min().unwrap_or(1);
    let last = points.iter().map(|p| p.step).max().unwrap_or(1);
    let (x_lo, x_hi) = (first as f64 - 0.5, last as f64 + 0.5);
    let x = Axis::steps(x_lo, x_hi);
    let y = Axis::around(0.0, in_unit(hi) / DATA_SHARE);
    let spans = spans(points);
    let phases = first_step_phases(points);
    let x_desc = if phases.is_empty() {
        "step".to_string()
    } else {
        format!("step ({phases})")
    };
    chart_svg(
        &format!("Memory by category at each phase's peak ({source})"),
        (x, &x_desc),
        (y, unit_name),
        None,
        |chart| {
            for (k, name) in categories.iter().enumerate() {
                let color = CATEGORY_COLORS[k % CATEGORY_COLORS.len()];
                let outlines = category_outlines(points, &spans, k, unit);
                chart
                    .draw_series(
                        outlines
                            .into_iter()
                            .map(|outline| Polygon::new(outline, color.filled())),
                    )?
                    .label(*name)
                    .legend(move |(x, y)| {
                        Rectangle::new([(x, y - 6), (x + 20, y + 6)], color.filled())
                    });
            }
            // Where one phase ends and the next begins, up to the lower of the two (where there are few enough to
            // see).
            if points.len() <= MARKERS_UP_TO {
                let edges =
                    points
                        .windows(2)
                        .zip(spans.iter().skip(1))
                        .map(|(pair, (start, _))| {
                            let top = pair[0].total().min(pair[1].total());
                            PathElement::new(
                                vec![(*start, 0.0), (*start, in_unit(top))],
                                WHITE.stroke_width(1),
                            )
                        });
                chart.draw_series(edges)?;
            }
            if let Some(e) = estimate {
                let line = [(x_lo, in_unit(e)), (x_hi, in_unit(e))];
                let label = format!("estimate {}", short_bytes(e));
                draw_line(chart, &line, (ESTIMATE_COLOR, Marker::None, true), &label)?;
            }
            if let Some((i, p)) = peak {
                let at = ((spans[i].0 + spans[i].1) / 2.0, in_unit(p.total()));
                chart
                    .draw_series(std::iter::once(Circle::new(at, 5, PEAK_COLOR.filled())))?
                    .label(format!("measured peak {}", short_bytes(p.total())))
                    .legend(|(x, y)| Circle::new((x + 10, y), 5, PEAK_COLOR.filled()));
                // Where the peak was, also above the marker: in which step and phase.
                let note = format!("step {} {}", p.step, p.phase);
                let style = TextStyle::from((FONT, 13)).pos(Pos::new(HPos::Center, VPos::Bottom));
                let above = EmptyElement::at(at) + Text::new(note, (0, -8), style);
                chart.draw_series(std::iter::once(above))?;
            }
            Ok(estimate.is_some() || !points.is_empty())
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plot::render::{pixels_of, render, ticks, words};

    const MIB: u64 = 1 << 20;
    const CATEGORIES: [&str; 4] = ["base weights", "other", "adapter", "activations"];

    /// A phase of step 1 taking `seconds`, with `activations` MiB on top of 5000 MiB of weights, 100 of other and
    /// 50 of adapter.
    fn phase(phase: &'static str, seconds: f64, activations: u64) -> MemoryPoint<'static> {
        MemoryPoint {
            step: 1,
            phase,
            seconds,
            bytes: vec![5000 * MIB, 100 * MIB, 50 * MIB, activations * MIB],
        }
    }

    /// A one-step run without accumulation around 5250 MiB, its backward twice as long as its forward (the old
    /// failure: the hand-written chart read "0.6000000000000001" on its step axis and "5250.000" on its MiB axis).
    fn one_step() -> Vec<MemoryPoint<'static>> {
        vec![
            phase("forward", 1.0, 112),
            phase("backward", 2.0, 131),
            phase("optimizer", 0.25, 99),
        ]
    }

    #[test]
    fn a_one_step_run_stacks_its_categories_under_the_estimate_and_marks_the_peak() {
        let svg = memory_svg("heap", &CATEGORIES, &one_step(), Some(5300 * MIB)).unwrap();
        let pixmap = render(&svg);
        let t = ticks(&svg);
        assert_eq!(t.x, ["1"]);
        // From 0, in whole GiB, with room above the data for the legend.
        assert_eq!(t.left, ["0", "2", "4", "6", "8", "10"]);
        assert!(t.right.is_empty(), "{t:?}");
        assert_eq!(
            words(&svg),
            [
                "Memory by category at each phase's peak (heap)",
                "GiB",
                "step (forward, backward, optimizer)",
                "step 1 backward",
                "base weights",
                "other",
                "adapter",
                "activations",
                "estimate 5.18 GiB",
                "measured peak 5.16 GiB",
            ]
        );
        // Each category's fill, the estimate's dashed line and the peak's marker are drawn.
        for color in [
            COLORS[0],
            GREY,
            COLORS[2],
            COLORS[1],
            ESTIMATE_COLOR,
            PEAK_COLOR,
        ] {
            assert!(pixels_of(&pixmap, color) > 20, "{color:?}");
        }
        // One outline per category: the phases of a step join into one shape.
        assert_eq!(svg.matches("<polygon").count(), 4);
    }

    #[test]
    fn without_an_estimate_there_is_no_estimate_line() {
        let svg = memory_svg("heap", &CATEGORIES, &one_step(), None).unwrap();
        let pixmap = render(&svg);
        assert!(!words(&svg).iter().any(|w| w.starts_with("estimate")));
        assert_eq!(pixels_of(&pixmap, ESTIMATE_COLOR), 0);
    }

    #[test]
    fn phases_share_out_their_step_by_time() {
        let xs = spans(&one_step());
        let expected = [
            (0.5, 0.5 + 1.0 / 3.25),
            (0.5 + 1.0 / 3.25, 0.5 + 3.0 / 3.25),
            (0.5 + 3.0 / 3.25, 1.5),
        ];
        for (x, e) in xs.iter().zip(expected) {
            assert!(
                (x.0 - e.0).abs() < 1e-12 && (x.1 - e.1).abs() < 1e-12,
                "{xs:?}"
            );
        }
        // Two micro-batches of unknown time: forward, backward, forward, backward, optimizer share each step
        // equally.
        let phases = ["forward", "backward", "forward", "backward", "optimizer"];
        let points: Vec<MemoryPoint> = (1..=2)
            .flat_map(|step| {
                phases.map(|phase| MemoryPoint {
                    step,
                    phase,
                    seconds: 0.0,
                    bytes: vec![1],
                })
            })
            .collect();
        let xs = spans(&points);
        assert_eq!(xs.len(), 10);
        for (i, (start, end)) in xs.iter().enumerate() {
            let left = 0.5 + i as f64 * 0.2;
            assert!(
                (start - left).abs() < 1e-12 && (end - left - 0.2).abs() < 1e-12,
                "{xs:?}"
            );
        }
        assert_eq!(
            first_step_phases(&points),
            "forward, backward, forward, backward, optimizer"
        );
    }

    /// A category's outline runs along its top over every phase and back along its bottom; a gap between steps
    /// (a run resumed after step 1) starts a new outline.
    #[test]
    fn outlines_follow_each_phase_and_break_at_gaps() {
        let points = vec![
            MemoryPoint {
                step: 1,
                phase: "forward",
                seconds: 1.0,
                bytes: vec![2, 3],
            },
            MemoryPoint {
                step: 1,
                phase: "backward",
                seconds: 1.0,
                bytes: vec![2, 5],
            },
            MemoryPoint {
                step: 3,
                phase: "forward",
                seconds: 1.0,
                bytes: vec![2, 1],
            },
        ];
        let outlines = category_outlines(&points, &spans(&points), 1, 1.0);
        assert_eq!(
            outlines,
            [
                vec![
                    (0.5, 5.0),
                    (1.0, 5.0),
                    (1.0, 7.0),
                    (1.5, 7.0),
                    (1.5, 2.0),
                    (1.0, 2.0),
                    (1.0, 2.0),
                    (0.5, 2.0)
                ],
                vec![(2.5, 3.0), (3.5, 3.0), (3.5, 2.0), (2.5, 2.0)],
            ]
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
        assert_eq!(short_bytes(487 * MIB + MIB / 3), "487 MiB");
        assert_eq!(short_bytes(5400 * MIB), "5.27 GiB");
        assert_eq!(short_bytes(70 << 30), "70.0 GiB");
        assert_eq!(short_bytes(999), "999 B");
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
                        seconds: 0.1,
                        bytes: vec![base, 0, 0, extra * MIB],
                    }
                })
            })
            .collect();
        let svg = memory_svg("device pool", &CATEGORIES, &points, Some(75 << 30)).unwrap();
        let pixmap = render(&svg);
        let t = ticks(&svg);
        assert_eq!(t.x, ["100", "200", "300", "400", "500"]);
        assert_eq!(t.left, ["0", "50", "100", "150"]);
        let words = words(&svg);
        assert!(words.contains(&"GiB".to_string()), "{words:?}");
        // The first of the highest peaks (every seventh step's backward) is the one marked.
        assert!(words.contains(&"step 6 backward".to_string()), "{words:?}");
        // Still one outline per category however many phases: the SVG stays small.
        assert_eq!(svg.matches("<polygon").count(), 4);
        assert!(svg.len() < 400_000, "{} bytes", svg.len());
        assert!(pixels_of(&pixmap, COLORS[1]) > 500);
    }

    #[test]
    fn an_empty_timeline_still_renders() {
        let svg = memory_svg("unavailable", &CATEGORIES, &[], None).unwrap();
        render(&svg);
        assert_eq!(ticks(&svg).x, ["1"]);
        assert_eq!(
            words(&svg),
            [
                "Memory by category at each phase's peak (unavailable)",
                "B",
                "step"
            ]
        );
    }
}
