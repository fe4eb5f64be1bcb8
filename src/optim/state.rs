//! The optimizer state of one parameter.

use super::adamw8bit::Adam8bitState;

/// Per-parameter optimizer state.
#[derive(Clone, Debug, PartialEq)]
pub enum ParamState {
    /// Float32 moments (AdamW torch and bitsandbytes 32-bit).
    Adam32 {
        /// First moment.
        m: Vec<f32>,
        /// Second moment.
        v: Vec<f32>,
    },
    /// Float64 moments: AdamW torch on float64 parameters.
    Adam64 {
        /// First moment.
        m: Vec<f64>,
        /// Second moment.
        v: Vec<f64>,
    },
    /// bitsandbytes 8-bit moments.
    Adam8(Adam8bitState),
    /// SGD momentum buffer.
    Sgd(Option<Vec<f32>>),
}

impl ParamState {
    /// Bytes of state.
    pub(super) fn bytes(&self) -> usize {
        match self {
            ParamState::Adam32 { m, v } => 4 * (m.len() + v.len()),
            ParamState::Adam64 { m, v } => 8 * (m.len() + v.len()),
            ParamState::Adam8(st) => st.size_in_bytes(),
            ParamState::Sgd(b) => b.as_ref().map(|b| 4 * b.len()).unwrap_or(0),
        }
    }
}
