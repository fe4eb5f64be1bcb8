//! The gated MLP of a decoder layer (`down(act(gate(x)) · up(x))`), the building block of dense layers and of each
//! expert of a mixture-of-experts block (gpt-oss's experts: one projection with gate and up interleaved, and its
//! clamped SwiGLU).

use candle_core::{Result, Tensor, D};

use crate::ops::{clamped_swiglu, gated_activation, ClampedSwiglu, GateActivation, Pass};

/// A linear projection of the model: a frozen base with optional LoRA adapters.
pub type Linear = crate::lora::LoraLinear;

/// The gate and up projections of a layer's MLP: two, or one fused (Phi-3's `gate_up_proj`, rows gate, up).
#[derive(Clone, Debug)]
pub enum GateUpProjections {
    /// `gate_proj`, `up_proj`.
    Separate {
        /// Gate projection.
        gate_proj: Linear,
        /// Up projection.
        up_proj: Linear,
    },
    /// `gate_up_proj`.
    Fused {
        /// The two projections' rows stacked.
        gate_up_proj: Linear,
    },
    /// gpt-oss's `gate_up_proj`: rows alternate gate, up.
    Interleaved {
        /// The two projections' rows interleaved.
        gate_up_proj: Linear,
    },
}

/// What joins the gate and up projections.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum MlpActivation {
    /// `act(gate) · up`.
    Gated(GateActivation),
    /// gpt-oss's clamped SwiGLU (interleaved projections).
    Clamped(ClampedSwiglu),
}

/// The gated MLP of one layer: `down(act(gate(x)) · up(x))`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Gate and up projections.
    pub gate_up: GateUpProjections,
    /// Down projection.
    pub down_proj: Linear,
    pub(super) activation: MlpActivation,
}

impl Mlp {
    /// A gated MLP `down(act(gate(x)) · up(x))`.
    pub fn new(gate_up: GateUpProjections, down_proj: Linear, activation: GateActivation) -> Self {
        Mlp {
            gate_up,
            down_proj,
            activation: MlpActivation::Gated(activation),
        }
    }

    /// gpt-oss's expert: `down(clamped_swiglu(gate_up(x)))` over an interleaved `gate_up_proj`.
    pub fn clamped(gate_up_proj: Linear, down_proj: Linear, activation: ClampedSwiglu) -> Self {
        Mlp {
            gate_up: GateUpProjections::Interleaved { gate_up_proj },
            down_proj,
            activation: MlpActivation::Clamped(activation),
        }
    }

    /// `mlp(x)`.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        self.forward(x, None, Pass::Forward)
    }

    /// `mlp(x)`, plus `residual` when given: then in a [`Pass::Recompute`] the last projection's value is not
    /// computed (only its graph is differentiated).
    pub(super) fn forward(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        pass: Pass,
    ) -> Result<Tensor> {
        let hidden = match (&self.gate_up, self.activation) {
            (GateUpProjections::Interleaved { gate_up_proj }, MlpActivation::Clamped(c)) => {
                clamped_swiglu(&gate_up_proj.forward(x)?, c)?
            }
            (GateUpProjections::Separate { gate_proj, up_proj }, MlpActivation::Gated(act)) => {
                gated_activation(&gate_proj.forward(x)?, &up_proj.forward(x)?, act)?
            }
            (GateUpProjections::Fused { gate_up_proj }, MlpActivation::Gated(act)) => {
                let y = gate_up_proj.forward(x)?;
                let width = y.dim(D::Minus1)? / 2;
                let gate = y.narrow(D::Minus1, 0, width)?.contiguous()?;
                let up = y.narrow(D::Minus1, width, width)?.contiguous()?;
                gated_activation(&gate, &up, act)?
            }
            _ => {
                candle_core::bail!("an MLP's clamped SwiGLU goes with interleaved projections only")
            }
        };
        match residual {
            Some(r) => self.down_proj.forward_plus(&hidden, r, pass),
            None => self.down_proj.forward(&hidden),
        }
    }
}
