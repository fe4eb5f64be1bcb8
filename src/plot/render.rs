//! Test helpers: render a chart's SVG with resvg (proof that a real renderer reads it) and read its labels from
//! the SVG's `<text>` elements (the raster has no text: the tests load no fonts).

use plotters::style::RGBColor;
use resvg::tiny_skia::Pixmap;
use resvg::usvg::{roxmltree, Options, Tree};

use super::chart::SIZE;

/// Parses `svg` with usvg and rasterizes it with resvg; panics where either fails or where the canvas is not
/// covered by the white background.
pub(super) fn render(svg: &str) -> Pixmap {
    let tree = Tree::from_str(svg, &Options::default()).expect("usvg parses the chart");
    let size = tree.size();
    assert_eq!(
        (size.width(), size.height()),
        (SIZE.0 as f32, SIZE.1 as f32)
    );
    let mut pixmap = Pixmap::new(SIZE.0, SIZE.1).expect("a non-empty canvas");
    resvg::render(&tree, Default::default(), &mut pixmap.as_mut());
    assert!(
        pixmap.pixels().iter().all(|p| p.alpha() == 255),
        "the white background covers the canvas"
    );
    pixmap
}

/// How many pixels of `pixmap` are exactly `color`.
pub(super) fn pixels_of(pixmap: &Pixmap, color: RGBColor) -> usize {
    let RGBColor(r, g, b) = color;
    pixmap
        .pixels()
        .iter()
        .filter(|p| (p.red(), p.green(), p.blue()) == (r, g, b))
        .count()
}

/// The text of every `<text>` element of `svg`, with its `text-anchor`, in document order.
fn texts(svg: &str) -> Vec<(String, String)> {
    let doc = roxmltree::Document::parse(svg).expect("the chart is well-formed XML");
    doc.descendants()
        .filter(|n| n.has_tag_name("text"))
        .map(|n| {
            let anchor = n.attribute("text-anchor").unwrap_or("start").to_string();
            (anchor, n.text().unwrap_or_default().trim().to_string())
        })
        .collect()
}

/// The tick labels of `svg`, in drawing order (left to right, bottom to top): `x` under the plot (centered),
/// `left` and `right` beside it (ending at, starting from the axis).
#[derive(Debug, Default, PartialEq)]
pub(super) struct Ticks {
    pub x: Vec<String>,
    pub left: Vec<String>,
    pub right: Vec<String>,
}

/// The tick labels of `svg` (the texts that are numbers, by their anchor).
pub(super) fn ticks(svg: &str) -> Ticks {
    let mut ticks = Ticks::default();
    for (anchor, text) in texts(svg) {
        if text.parse::<f64>().is_err() {
            continue;
        }
        match anchor.as_str() {
            "middle" => ticks.x.push(text),
            "end" => ticks.left.push(text),
            _ => ticks.right.push(text),
        }
    }
    ticks
}

/// The texts of `svg` that are not numbers: title, axis names, legend.
pub(super) fn words(svg: &str) -> Vec<String> {
    texts(svg)
        .into_iter()
        .map(|(_, text)| text)
        .filter(|text| text.parse::<f64>().is_err())
        .collect()
}
