//! The charts written at the end of a run, as SVG drawn with `plotters`: the loss plot (training and evaluation
//! loss, the learning rate on a second axis) and the memory timeline (memory over each step, stacked by category,
//! the estimate's line and the measured peak). Ticks sit at round values and are labelled with the decimals they
//! need (`axis`).

mod axis;
mod chart;
mod loss;
mod memory;
#[cfg(test)]
mod render;

pub use loss::{loss_svg, LossCurves};
pub use memory::{memory_svg, MemoryPoint};
