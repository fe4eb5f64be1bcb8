//! The gated MLP of a decoder layer (`down(act(gate(x)) · up(x))`), the building block of dense layers and of each
//! expert of a mixture-of-experts block.

use candle_core::{Result, Tensor, D};

use crate::ops::{gated_activation, GateActivation, Pass};

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
}

/// The gated MLP of one layer: `down(act(gate(x)) · up(x))`.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// Gate and up projections.
    pub gate_up: GateUpProjections,
    /// Down projection.
    pub down_proj: Linear,
    pub(super) activation: GateActivation,
}

impl Mlp {
    /// A gated MLP `down(act(gate(x)) · up(x))`.
    pub fn new(gate_up: GateUpProjections, down_proj: Linear, activation: GateActivation) -> Self {
        Mlp {
            gate_up,
            down_proj,
            activation,
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
        let (gate, up) = match &self.gate_up {
            GateUpProjections::Separate { gate_proj, up_proj } => {
                (gate_proj.forward(x)?, up_proj.forward(x)?)
            }
            GateUpProjections::Fused { gate_up_proj } => {
                let y = gate_up_proj.forward(x)?;
                let width = y.dim(D::Minus1)? / 2;
                (
                    y.narrow(D::Minus1, 0, width)?.contiguous()?,
                    y.narrow(D::Minus1, width, width)?.contiguous()?,
                )
            }
        };
        let hidden = gated_activation(&gate, &up, self.activation)?;
        match residual {
            Some(r) => self.down_proj.forward_plus(&hidden, r, pass),
            None => self.down_proj.forward(&hidden),
        }
    }
}
