//! What every chart shares: the canvas, colors and fonts, the frame with its axes and legend (`chart_svg`), and
//! lines with markers (`draw_line`).

use std::io;

use plotters::chart::DualCoordChartContext;
use plotters::coord::Shift;
use plotters::prelude::*;

use super::axis::Axis;

/// Canvas size in pixels.
pub(super) const SIZE: (u32, u32) = (800, 450);
/// The font of every label (the SVG names it; the viewer picks the face).
pub(super) const FONT: &str = "sans-serif";
/// Series colors, in order (matplotlib's first four).
pub(super) const COLORS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
];
/// A color of context: the memory chart's `other` category.
pub(super) const GREY: RGBColor = RGBColor(140, 140, 140);
/// Room left above the data for the legend, as a share of the data's span.
const LEGEND_ROOM: f64 = 0.35;
/// Series with more points than this are drawn without markers, and memory charts without their phase edges.
pub(super) const MARKERS_UP_TO: usize = 60;

/// The error of drawing into an SVG string.
type DrawingError = DrawingAreaErrorKind<io::Error>;

/// A chart: x and y axes, and a second y axis on the right (drawn only where one is asked for).
type Chart<'a> =
    DualCoordChartContext<'a, SVGBackend<'a>, Cartesian2d<Axis, Axis>, Cartesian2d<Axis, Axis>>;

/// An axis and its name.
type Named<'a> = (Axis, &'a str);

/// An axis for values from `lo` to `hi`, with room above them for the legend (in the upper right corner).
pub(super) fn value_axis(lo: f64, hi: f64) -> Axis {
    Axis::around(lo, hi + LEGEND_ROOM * (hi - lo).max(0.0))
}

/// The SVG of a chart titled `title` with axes `x` and `y`, and `right` as a second y axis where given: `draw`
/// adds the series (each with a legend entry) and says whether it drew any; the legend, where there is one, goes
/// in the upper right corner.
pub(super) fn chart_svg(
    title: &str,
    x: Named,
    y: Named,
    right: Option<Named>,
    draw: impl FnOnce(&mut Chart<'_>) -> Result<bool, DrawingError>,
) -> io::Result<String> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        draw_chart(&root, title, x, y, right, draw)
            .and_then(|()| root.present())
            .map_err(|e| io::Error::other(format!("cannot draw the chart {title:?}: {e}")))?;
    }
    Ok(svg)
}

/// [`chart_svg`] on the canvas `root`.
fn draw_chart<'a>(
    root: &DrawingArea<SVGBackend<'a>, Shift>,
    title: &str,
    (x, x_desc): Named,
    (y, y_desc): Named,
    right: Option<Named>,
    draw: impl FnOnce(&mut Chart<'a>) -> Result<bool, DrawingError>,
) -> Result<(), DrawingError> {
    root.fill(&WHITE)?;
    let mut builder = ChartBuilder::on(root);
    builder
        .caption(title, (FONT, 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .right_y_label_area_size(if right.is_some() { 80 } else { 0 });
    // Without a right axis the second coordinate system is a placeholder nothing is drawn in.
    let second = right
        .as_ref()
        .map_or_else(|| Axis::around(0.0, 1.0), |r| r.0.clone());
    let mut chart = builder
        .build_cartesian_2d(x.clone(), y)?
        .set_secondary_coord(x, second);
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 17))
        .draw()?;
    if let Some((_, right_desc)) = right {
        chart
            .configure_secondary_axes()
            .y_desc(right_desc)
            .label_style((FONT, 15))
            .axis_desc_style((FONT, 17))
            .draw()?;
    }
    if !draw(&mut chart)? {
        return Ok(());
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.3))
        .draw()
}

/// How the points of a series are marked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Marker {
    /// No marker: a plain line.
    None,
    /// A filled circle.
    Circle,
    /// A filled triangle.
    Triangle,
    /// A cross.
    Cross,
}

/// Marker sizes in pixels: the circle's radius, the triangle's and the cross's half width.
const MARKER_SIZE: (i32, i32, i32) = (4, 6, 4);

/// Draws `points` as a line in `color` (dashed where `dashed`) with `marker` on each point (where there are
/// few enough to see), in the legend as `label`.
pub(super) fn draw_line<'a>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, Cartesian2d<Axis, Axis>>,
    points: &[(f64, f64)],
    (color, marker, dashed): (RGBColor, Marker, bool),
    label: &str,
) -> Result<(), DrawingError> {
    let line = color.stroke_width(2);
    let anno = if dashed {
        chart.draw_series(DashedLineSeries::new(points.to_vec(), 8, 5, line))?
    } else {
        chart.draw_series(LineSeries::new(points.to_vec(), line))?
    };
    anno.label(label);
    // The legend's line: two strokes, apart where the series is dashed.
    let gap = if dashed { 3 } else { 0 };
    let path = move |c| {
        EmptyElement::at(c)
            + PathElement::new(vec![(0, 0), (10 - gap, 0)], line)
            + PathElement::new(vec![(10 + gap, 0), (20, 0)], line)
    };
    let (circle, triangle, cross) = MARKER_SIZE;
    match marker {
        Marker::None => anno.legend(path),
        Marker::Circle => {
            anno.legend(move |c| path(c) + Circle::new((10, 0), circle, color.filled()))
        }
        Marker::Triangle => {
            anno.legend(move |c| path(c) + TriangleMarker::new((10, 0), triangle, color.filled()))
        }
        Marker::Cross => {
            anno.legend(move |c| path(c) + Cross::new((10, 0), cross, color.stroke_width(2)))
        }
    };
    if points.len() > MARKERS_UP_TO {
        return Ok(());
    }
    let points = points.iter().copied();
    match marker {
        Marker::None => {}
        Marker::Circle => {
            chart.draw_series(points.map(|p| Circle::new(p, circle, color.filled())))?;
        }
        Marker::Triangle => {
            chart.draw_series(points.map(|p| TriangleMarker::new(p, triangle, color.filled())))?;
        }
        Marker::Cross => {
            chart.draw_series(points.map(|p| Cross::new(p, cross, color.stroke_width(2))))?;
        }
    }
    Ok(())
}
