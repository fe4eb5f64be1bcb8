//! The gated MLP of a decoder layer (`down(act(gate(x)) · up(x))`), the building block of dense layers and of each
//! expert of a mixture-of-experts block (gpt-oss's experts: one projection with gate and up interleaved, and its
//! clamped SwiGLU).

use std::sync::Arc;

use candle_core::{Result, Tensor, Var, D};

use crate::ops::{
    clamped_swiglu, gated_activation, tiled_rows, ClampedSwiglu, GateActivation, GradSink, Pass,
    RowBlock,
};

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

/// How a training forward tiles a dense MLP: its forward and backward run over slices of the token rows (ALST's
/// TiledMLP), so the gate, up and activation intermediates exist for one slice at a time (see
/// [`crate::ops::tiled_rows`]).
#[derive(Clone)]
pub struct MlpTiling {
    /// Receives the MLP's parameter gradients (the forward's checkpoint sink, merged after the backward).
    pub sink: GradSink,
    /// The trainable parameters.
    pub params: Vec<Var>,
    /// Rows per slice; `None` chooses [`mlp_slice_rows`].
    pub slice_rows: Option<usize>,
}

/// Rows per slice of a tiled MLP over `rows` token rows of width `hidden`: `rows` split into
/// `⌈rows / hidden⌉` even slices (ALST's shard count), so a slice has at most `hidden` rows and its intermediates
/// (`3 × rows × intermediate`) stay under `3 × hidden × intermediate` elements — the MLP's own weight count —
/// whatever the sequence length, while each slice's products stay `hidden` rows tall (as efficient as the
/// untiled ones).
pub fn mlp_slice_rows(rows: usize, hidden: usize) -> usize {
    let slices = rows.div_ceil(hidden.max(1)).max(1);
    rows.div_ceil(slices).max(1)
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

    /// [`Mlp::forward`] over slices of the rows of `x` as `tiling` says (untiled when one slice holds them all).
    /// Refused while an MLP projection's adapter draws dropout: its mask is a function of the whole input.
    pub(super) fn forward_tiled(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        pass: Pass,
        tiling: &MlpTiling,
    ) -> Result<Tensor> {
        let hidden = x.dim(D::Minus1)?;
        let rows = x.elem_count() / hidden.max(1);
        let slice_rows = tiling
            .slice_rows
            .unwrap_or_else(|| mlp_slice_rows(rows, hidden));
        if self.linears().iter().any(|l| l.dropout_active()) {
            candle_core::bail!(
                "tiled_mlp = true cannot run with lora_dropout > 0 on an MLP projection (the dropout mask is \
                 drawn over the whole input): set lora_dropout = 0, leave the MLP projections out of \
                 target_modules, or set tiled_mlp = false"
            );
        }
        if rows <= slice_rows {
            return self.forward(x, residual, pass);
        }
        let mlp = self.clone();
        let block: RowBlock =
            Arc::new(move |x: &Tensor, r: Option<&Tensor>, pass| mlp.forward(x, r, pass));
        tiled_rows(
            x,
            residual,
            slice_rows,
            block,
            &tiling.params,
            &tiling.sink,
            pass,
        )
    }

    /// The gate/up projections and the down projection.
    fn linears(&self) -> Vec<&Linear> {
        let mut out = match &self.gate_up {
            GateUpProjections::Separate { gate_proj, up_proj } => vec![gate_proj, up_proj],
            GateUpProjections::Fused { gate_up_proj }
            | GateUpProjections::Interleaved { gate_up_proj } => vec![gate_up_proj],
        };
        out.push(&self.down_proj);
        out
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::backprop::GradStore;
    use candle_core::{Tensor, Var};

    use super::*;
    use crate::lora::{LoraAdapter, LoraLinear};
    use crate::ops::autograd::gradcheck::{max_abs_diff, rand_f64};
    use crate::ops::{checkpoint, Block, FrozenLinear, FrozenWeight};

    const HIDDEN: usize = 6;
    const WIDTH: usize = 10;
    const RANK: usize = 3;

    /// A frozen projection with a LoRA adapter whose factors are random (B is not PEFT's zeros, so every
    /// gradient is non-trivial), `dropout` its dropout probability.
    fn adapted(out: usize, inp: usize, seed: u64, dropout: f64) -> (Linear, [Var; 2]) {
        let mut l = LoraLinear::new(Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(rand_f64(&[out, inp], seed)),
            None,
        )));
        let a = Var::from_tensor(&rand_f64(&[RANK, inp], seed + 1)).unwrap();
        let b = Var::from_tensor(&rand_f64(&[out, RANK], seed + 2)).unwrap();
        let runtime = Arc::new(crate::lora::LoraRuntime::default());
        runtime.set_training(true);
        l.adapters.insert(
            "default".into(),
            Arc::new(LoraAdapter {
                a: a.clone(),
                b: b.clone(),
                scaling: 0.75,
                dropout,
                magnitude: None,
                module_id: seed,
                runtime,
            }),
        );
        l.active = Some("default".into());
        (l, [a, b])
    }

    /// An MLP with adapters on gate, up and down (separate or fused gate/up), and its six (or four) factors.
    fn mlp(fused: bool, dropout: f64) -> (Mlp, Vec<Var>) {
        let (down, [da, db]) = adapted(HIDDEN, WIDTH, 30, dropout);
        if fused {
            let (gate_up_proj, [a, b]) = adapted(2 * WIDTH, HIDDEN, 10, dropout);
            let m = Mlp::new(
                GateUpProjections::Fused { gate_up_proj },
                down,
                GateActivation::Silu,
            );
            return (m, vec![a, b, da, db]);
        }
        let (gate_proj, [ga, gb]) = adapted(WIDTH, HIDDEN, 10, dropout);
        let (up_proj, [ua, ub]) = adapted(WIDTH, HIDDEN, 20, dropout);
        let m = Mlp::new(
            GateUpProjections::Separate { gate_proj, up_proj },
            down,
            GateActivation::Silu,
        );
        (m, vec![ga, gb, ua, ub, da, db])
    }

    /// `mlp` (tiled with `slice_rows`, or plain) as a block, checkpointed or not, and the objective
    /// `Σ (y ⊙ w)` with its gradients (the sink merged in).
    fn run(
        mlp: &Mlp,
        params: &[Var],
        x: &Tensor,
        residual: Option<&Tensor>,
        slice_rows: Option<usize>,
        checkpointed: bool,
    ) -> (Tensor, GradStore) {
        let sink = GradSink::new();
        let tiling = slice_rows.map(|rows| MlpTiling {
            sink: sink.clone(),
            params: params.to_vec(),
            slice_rows: Some(rows),
        });
        let (m, r) = (mlp.clone(), residual.cloned());
        let block: Block = Arc::new(move |x: &Tensor, pass| {
            let y = match &tiling {
                Some(t) => m.forward_tiled(x, r.as_ref(), pass, t)?,
                None => m.forward(x, r.as_ref(), pass)?,
            };
            Ok((y, None))
        });
        let y = if checkpointed {
            checkpoint(x, block, params, &sink).unwrap()
        } else {
            block(x, Pass::Forward).unwrap().0
        };
        let w = rand_f64(y.dims(), 99);
        let objective = (&y * &w).unwrap().sum_all().unwrap();
        let mut grads = objective.backward().unwrap();
        sink.merge_into(&mut grads).unwrap();
        (y, grads)
    }

    /// The tiled MLP equals the plain one within 1e-12 in float64, for even and uneven slices (14 rows in slices
    /// of at most 1, 3, 5, 7 or 13: 14 × 1, 3+3+3+3+2, 5+5+4, 7+7, 7+7), with and without a residual, checkpointed
    /// or not, separate or fused gate/up, and `x` frozen or trainable. Every row goes through the same operations,
    /// but not always in the same order: the adapters' gradients are sums over the rows, accumulated slice by slice,
    /// and the CPU's matrix products may order a row's K-term dot products by where the row falls in their blocking
    /// (one-row slices take a matrix–vector product; here the fused 20-wide gate/up differs by ~2e-15 between 14-
    /// and 7-row products). Two orders of n terms differ by at most 2·γₙ·Σ|terms| (γₙ ≈ n·u); with n ≤ 20 terms of
    /// size O(1) and u = 1.1e-16 that is ~5e-15 per sum, ~1e-14 through the chain: 1e-12 holds on any CPU.
    #[test]
    fn tiled_mlp_equals_the_plain_mlp() {
        for fused in [false, true] {
            let (m, params) = mlp(fused, 0.0);
            let residual = rand_f64(&[2, 7, HIDDEN], 5);
            for (checkpointed, with_residual, x_trains) in [
                (false, false, true),
                (false, true, true),
                (true, true, true),
                (true, false, true),
                (true, true, false),
                (false, true, false),
            ] {
                let x = Var::from_tensor(&rand_f64(&[2, 7, HIDDEN], 4)).unwrap();
                let input = if x_trains {
                    x.as_tensor().clone()
                } else {
                    x.as_detached_tensor()
                };
                let r = with_residual.then_some(&residual);
                let (y0, g0) = run(&m, &params, &input, r, None, checkpointed);
                for slice_rows in [1, 3, 5, 7, 13] {
                    let case = format!(
                        "fused {fused}, checkpointed {checkpointed}, residual {with_residual}, \
                         x trains {x_trains}, {slice_rows} rows per slice"
                    );
                    let (y, g) = run(&m, &params, &input, r, Some(slice_rows), checkpointed);
                    let diff = max_abs_diff(&y0, &y);
                    assert!(diff < 1e-12, "output: {diff:e}, {case}");
                    assert_eq!(g.get(&x).is_some(), x_trains, "{case}");
                    if x_trains {
                        let (d0, d) = (g0.get(&x).unwrap(), g.get(&x).unwrap());
                        let diff = max_abs_diff(d0, d);
                        assert!(diff < 1e-12, "input gradient: {diff:e}, {case}");
                    }
                    for (i, p) in params.iter().enumerate() {
                        let (d0, d) = (g0.get(p).unwrap(), g.get(p).unwrap());
                        let diff = max_abs_diff(d0, d);
                        assert!(diff < 1e-12, "factor {i}: {diff:e}, {case}");
                    }
                }
            }
        }
    }

    /// The rule: at most `hidden` rows per slice, the slices as even as whole rows allow.
    #[test]
    fn slice_rows_follow_the_hidden_size() {
        assert_eq!(mlp_slice_rows(10, 64), 10);
        assert_eq!(mlp_slice_rows(64, 64), 64);
        assert_eq!(mlp_slice_rows(65, 64), 33);
        assert_eq!(mlp_slice_rows(131_072, 4096), 4096);
        assert_eq!(mlp_slice_rows(131_073, 4096), 3972);
        assert_eq!(mlp_slice_rows(0, 64), 1);
    }

    /// Dropout's mask is drawn over the whole input, so a tiled MLP with dropout is refused, not run with other
    /// masks.
    #[test]
    fn tiling_refuses_dropout() {
        let (m, params) = mlp(false, 0.1);
        let tiling = MlpTiling {
            sink: GradSink::new(),
            params,
            slice_rows: Some(2),
        };
        let x = rand_f64(&[1, 5, HIDDEN], 4);
        let err = m
            .forward_tiled(&x, None, Pass::Forward, &tiling)
            .unwrap_err()
            .to_string();
        assert!(err.contains("lora_dropout"), "{err}");
    }
}
