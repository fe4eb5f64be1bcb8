//! Line charts written at the end of a run (the loss plot, the memory timeline), as self-contained SVG (no
//! plotting dependency; any browser opens it).

use std::fmt::Write;

const WIDTH: f64 = 720.0;
const HEIGHT: f64 = 420.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 48.0;

/// `n` round tick values covering `[lo, hi]`.
fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let raw = (hi - lo) / n.max(1) as f64;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(raw);
    let first = (lo / step).ceil() * step;
    (0..=n * 2)
        .map(|i| first + i as f64 * step)
        .take_while(|v| *v <= hi + step * 1e-9)
        .collect()
}

/// One line of a chart.
pub struct Series<'a> {
    /// Legend text.
    pub label: &'a str,
    /// `(x, y)` points; non-finite ones are left out.
    pub points: Vec<(f64, f64)>,
}

const COLORS: [&str; 4] = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728"];

/// An SVG line chart of `series` against x (from 0), titled `title`, with the x axis named `x_label`.
pub fn line_chart_svg(title: &str, x_label: &str, series: &[Series]) -> String {
    let points: Vec<(f64, f64)> = series
        .iter()
        .flat_map(|s| s.points.iter().copied())
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let max_x = points.iter().map(|p| p.0).fold(1.0, f64::max);
    let (mut lo, mut hi) = points
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
            (a.min(p.1), b.max(p.1))
        });
    if !lo.is_finite() {
        (lo, hi) = (0.0, 1.0);
    }
    let pad = ((hi - lo) * 0.05).max(1e-3);
    let (lo, hi) = (lo - pad, hi + pad);
    let x = |v: f64| LEFT + v / max_x * (WIDTH - LEFT - RIGHT);
    let y = |v: f64| TOP + (hi - v) / (hi - lo) * (HEIGHT - TOP - BOTTOM);
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
<text x="{}" y="24" text-anchor="middle" font-size="15">{title}</text>
"#,
        WIDTH / 2.0
    );
    for t in ticks(lo, hi, 5) {
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{}" y="{:.1}" text-anchor="end">{t:.3}</text>"##,
            WIDTH - RIGHT,
            LEFT - 6.0,
            y(t) + 4.0,
            y = y(t)
        );
    }
    for t in ticks(0.0, max_x, 6) {
        let _ = writeln!(
            svg,
            r#"<text x="{:.1}" y="{}" text-anchor="middle">{t}</text>"#,
            x(t),
            HEIGHT - BOTTOM + 18.0
        );
    }
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="{}" text-anchor="middle">{x_label}</text>
<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{}" stroke="black"/>
<line x1="{LEFT}" x2="{}" y1="{}" y2="{}" stroke="black"/>"#,
        WIDTH / 2.0,
        HEIGHT - 10.0,
        HEIGHT - BOTTOM,
        WIDTH - RIGHT,
        HEIGHT - BOTTOM,
        HEIGHT - BOTTOM
    );
    for (i, line) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let legend_y = TOP + 8.0 + 18.0 * i as f64;
        let pts: Vec<(f64, f64)> = line
            .points
            .iter()
            .filter(|(a, b)| a.is_finite() && b.is_finite())
            .map(|(a, b)| (x(*a), y(*b)))
            .collect();
        if pts.is_empty() {
            continue;
        }
        let coords: Vec<String> = pts.iter().map(|(a, b)| format!("{a:.1},{b:.1}")).collect();
        let _ = writeln!(
            svg,
            r#"<polyline fill="none" stroke="{color}" stroke-width="2" points="{}"/>"#,
            coords.join(" ")
        );
        if pts.len() < 60 {
            for (cx, cy) in &pts {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{cx:.1}" cy="{cy:.1}" r="3" fill="{color}"/>"#
                );
            }
        }
        let _ = writeln!(
            svg,
            r#"<line x1="{}" x2="{}" y1="{legend_y}" y2="{legend_y}" stroke="{color}" stroke-width="3"/><text x="{}" y="{}">{}</text>"#,
            WIDTH - RIGHT - 150.0,
            WIDTH - RIGHT - 130.0,
            WIDTH - RIGHT - 124.0,
            legend_y + 4.0,
            line.label
        );
    }
    svg.push_str("</svg>\n");
    svg
}

/// The loss plot: `train` and `eval` losses (`(step, loss)` pairs) against the step.
pub fn loss_svg(train: &[(usize, f64)], eval: &[(usize, f64)]) -> String {
    let points = |v: &[(usize, f64)]| v.iter().map(|(s, l)| (*s as f64, *l)).collect();
    line_chart_svg(
        "Training loss",
        "step",
        &[
            Series {
                label: "train loss",
                points: points(train),
            },
            Series {
                label: "eval loss",
                points: points(eval),
            },
        ],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(1.23, 1.87, 5);
        assert!(
            t[0] >= 1.23 && *t.last().unwrap() <= 1.87 && t.len() >= 3,
            "{t:?}"
        );
    }

    #[test]
    fn draws_both_series_inside_the_canvas() {
        let train: Vec<(usize, f64)> = (1..=20).map(|s| (s, 3.0 - s as f64 * 0.1)).collect();
        let svg = loss_svg(&train, &[(10, 2.5), (20, 1.5), (21, f64::NAN)]);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains("train loss") && svg.contains("eval loss"));
        for cap in regex::Regex::new(r#"cx="([0-9.]+)" cy="([0-9.]+)""#)
            .unwrap()
            .captures_iter(&svg)
        {
            let (cx, cy): (f64, f64) = (cap[1].parse().unwrap(), cap[2].parse().unwrap());
            assert!((LEFT..=WIDTH - RIGHT).contains(&cx) && (TOP..=HEIGHT - BOTTOM).contains(&cy));
        }
    }
}
