//! Gradient checkpointing with non-reentrant semantics: a block runs without keeping its graph; in the backward
//! it is recomputed from its saved input and differentiated then. Only block inputs stay alive between forward and
//! backward, and the gradients equal the plain run's up to summation order (the block must be a pure function of its input:
//! dropout masks must come from seeds the block captures, so the recomputation replays them).
//!
//! Parameter gradients found during recomputation go to a [`GradSink`]; merge it into the main `GradStore` after
//! `loss.backward()` with [`GradSink::merge_into`].

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

use super::op::{Apply, Op, Value};
use crate::profile::context::{self as snapshot_context, Phase as SnapshotPhase};
use crate::profile::trace;

/// A block to checkpoint: input hidden states to output hidden states, for a [`Pass`]; and, in a recomputation, an
/// optional scalar the block adds to the objective (a layer's share of an auxiliary loss computed after the
/// forward, such as the mixture-of-experts load-balancing loss): its gradient joins the block's.
pub type Block = Arc<dyn Fn(&Tensor, Pass) -> Result<(Tensor, Option<Tensor>)> + Send + Sync>;

/// Why a checkpointed block runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The forward: the output's value is the block's result.
    Forward,
    /// The backward's recomputation: only the output's graph is differentiated, its value is never read, so a block
    /// may skip computing what only feeds the output's value (e.g. its last projection) as long as the graph — and
    /// so every gradient — is the same.
    Recompute,
}

/// Collects parameter gradients computed while recomputing checkpointed blocks.
#[derive(Clone, Default)]
pub struct GradSink(Arc<Mutex<GradStore>>);

impl GradSink {
    /// An empty sink.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `grad` to `var`'s collected gradient (also for [`super::tiled::tiled_rows`]).
    pub(super) fn add(&self, var: &Var, grad: &Tensor) -> Result<()> {
        let mut store = self
            .0
            .lock()
            .map_err(|_| candle_core::Error::Msg("gradient sink poisoned".into()))?;
        let sum = match store.get(var) {
            Some(old) => (old + grad)?,
            None => grad.clone(),
        };
        store.insert(var, sum);
        Ok(())
    }

    /// Moves the collected gradients into `grads` (adding to gradients already there).
    pub fn merge_into(&self, grads: &mut GradStore) -> Result<()> {
        let collected = std::mem::take(
            &mut *self
                .0
                .lock()
                .map_err(|_| candle_core::Error::Msg("gradient sink poisoned".into()))?,
        );
        grads.extend(collected)
    }
}

/// The checkpoint op: inputs `[x, anchor]` (the anchor is a parameter the block uses, so the block is
/// differentiated even when `x` needs no gradient); the backward recomputes the block and differentiates it.
struct Checkpoint {
    block: Block,
    /// What the block is, for the step trace (`model.layers.3`).
    label: String,
    params: Vec<Var>,
    sink: GradSink,
}

impl Op<2> for Checkpoint {
    const NAME: &'static str = "checkpoint";

    fn fwd(&mut self, [x, _anchor]: [&Tensor; 2]) -> Result<Value> {
        Ok(Value::Tensor(
            (self.block)(&x.detach(), Pass::Forward)?.0.detach(),
        ))
    }

    fn bwd(
        &self,
        [x, _anchor]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let input = if needs[0] {
            Some(Var::from_tensor(x)?)
        } else {
            None
        };
        let _span = trace::span_with(|| self.label.clone(), "backward");
        let (y, extra) = {
            let _phase = snapshot_context::phase(SnapshotPhase::Recompute);
            let _span = trace::span("recompute", "recompute");
            (self.block)(
                input.as_ref().map(|v| v.as_tensor()).unwrap_or(x),
                Pass::Recompute,
            )?
        };
        let _span = trace::span("backward", "backward");
        // The vector-Jacobian product: Candle seeds a backward with ones, so y·grad needs no sum (a reduction on
        // a GPU would upload its layout every layer) unless a scalar joins it.
        let product = (y * grad)?;
        let grads = match extra {
            None => product.backward()?,
            Some(e) => (product.to_dtype(e.dtype())?.sum_all()? + e)?.backward()?,
        };
        for p in &self.params {
            if let Some(g) = grads.get(p) {
                self.sink.add(p, g)?;
            }
        }
        let dx = input.and_then(|v| grads.get(&v).cloned());
        Ok([dx, None])
    }
}

/// Runs `block` on `x` checkpointed. `params` are the trainable variables the block uses; their gradients go to
/// `sink`. `x` itself need not require a gradient (its gradient is returned only if it does).
pub fn checkpoint(x: &Tensor, block: Block, params: &[Var], sink: &GradSink) -> Result<Tensor> {
    checkpoint_labeled(x, block, params, sink, "block".into())
}

/// [`checkpoint`], with the block named `label` in step traces (its recomputation and backward nest under it).
pub fn checkpoint_labeled(
    x: &Tensor,
    block: Block,
    params: &[Var],
    sink: &GradSink,
    label: String,
) -> Result<Tensor> {
    // The graph node hangs on a parameter, so the block is differentiated even when `x` needs no gradient.
    let anchor = match params.first() {
        Some(p) => p.as_tensor().clone(),
        None if x.track_op() => x.clone(),
        None => return Ok(block(&x.detach(), Pass::Forward)?.0.detach()),
    };
    Checkpoint {
        block,
        label,
        params: params.to_vec(),
        sink: sink.clone(),
    }
    .apply([x, &anchor])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{max_abs_diff, rand_f64};
    use crate::ops::{rms_norm, swiglu};

    fn block(a: Var, b: Var, norm: Tensor) -> Block {
        Arc::new(move |x: &Tensor, _| {
            let h = rms_norm(x, &norm, 1e-6)?;
            let up = h.broadcast_matmul(&a.as_tensor().t()?)?;
            let gate = h.broadcast_matmul(&b.as_tensor().t()?)?;
            let y = (x + swiglu(&gate, &up)?.broadcast_matmul(a.as_tensor())?)?;
            Ok((y, None))
        })
    }

    #[test]
    fn gradients_are_identical_to_the_plain_run() {
        let a = Var::from_tensor(&rand_f64(&[6, 4], 1)).unwrap();
        let b = Var::from_tensor(&rand_f64(&[6, 4], 2)).unwrap();
        let norm = (rand_f64(&[4], 3) + 1.0).unwrap();
        let f = block(a.clone(), b.clone(), norm);
        for x_needs_grad in [true, false] {
            let x = Var::from_tensor(&rand_f64(&[2, 3, 4], 4)).unwrap();
            let input = if x_needs_grad {
                x.as_tensor().clone()
            } else {
                x.as_detached_tensor()
            };
            let plain = f(&f(&input, Pass::Forward).unwrap().0, Pass::Forward)
                .unwrap()
                .0
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap();
            let g_plain = plain.backward().unwrap();

            let sink = GradSink::new();
            let params = [a.clone(), b.clone()];
            let h1 = checkpoint(&input, f.clone(), &params, &sink).unwrap();
            let h2 = checkpoint(&h1, f.clone(), &params, &sink).unwrap();
            let ck = h2.sqr().unwrap().sum_all().unwrap();
            assert_eq!(
                plain.to_scalar::<f64>().unwrap(),
                ck.to_scalar::<f64>().unwrap()
            );
            let mut g_ck = ck.backward().unwrap();
            sink.merge_into(&mut g_ck).unwrap();
            // Same math; only the order in which the two blocks' contributions are summed differs.
            for v in [&a, &b] {
                assert!(max_abs_diff(g_plain.get(v).unwrap(), g_ck.get(v).unwrap()) < 1e-12);
            }
            assert_eq!(g_ck.get(&x).is_some(), x_needs_grad);
            if x_needs_grad {
                assert_eq!(
                    max_abs_diff(g_plain.get(&x).unwrap(), g_ck.get(&x).unwrap()),
                    0.0
                );
            }
            // Only the block inputs are in the checkpointed graph: far fewer nodes than the plain one.
            assert!(ck.sorted_nodes().len() < plain.sorted_nodes().len() / 2);
        }
    }
}
