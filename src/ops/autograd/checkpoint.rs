//! Gradient checkpointing with non-reentrant semantics: a block runs without keeping its graph; in the backward
//! it is recomputed from its saved input and differentiated then. A chain of blocks (a model's layers) is one graph
//! node whose inputs the op itself keeps, so they can wait in pinned host memory ([`ActivationOffload`]) instead of
//! the device's. Only block inputs stay alive between forward and backward, and the gradients equal the plain
//! run's up to summation order (the block must be a pure function of its input: dropout masks must come from seeds
//! the block captures, so the recomputation replays them).
//!
//! Parameter gradients found during recomputation go to a [`GradSink`]; merge it into the main `GradStore` after
//! `loss.backward()` with [`GradSink::merge_into`].

use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{Result, Tensor, Var};

use super::offload::{ActivationOffload, Saved};
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

/// A checkpointed block and its name in step traces (`model.layers.3`: its recomputation and backward nest under
/// it).
#[derive(Clone)]
pub struct LabeledBlock {
    /// The block.
    pub block: Block,
    /// Its name in step traces.
    pub label: String,
}

/// The checkpoint op over a chain of blocks, each one's output the next one's input: inputs `[x, anchor]`, or
/// `[anchor]` alone when `x` needs no gradient (the anchor is a parameter the blocks use, so they are differentiated
/// even when `x` needs no gradient). The forward keeps the input of every block but the one the graph holds (`x`,
/// when it is an input of the node; in `offload`'s pinned host memory when given); the backward walks the chain from
/// its end, recomputing each block from its input and differentiating it, the gradient of its input handed to the
/// block before.
struct CheckpointChain {
    blocks: Vec<LabeledBlock>,
    params: Vec<Var>,
    sink: GradSink,
    offload: Option<ActivationOffload>,
    /// The chain's input when it is not an input of the graph node (it needs no gradient): saved as the other
    /// blocks' inputs are, so nothing holds it on the device between the forward and the backward. Taken by the
    /// forward.
    untracked_input: Option<Tensor>,
    /// The inputs of the blocks after the one whose input the graph holds (all of them with `untracked_input`),
    /// filled by the forward, taken by the backward.
    saved: Mutex<Vec<Saved>>,
}

impl CheckpointChain {
    /// Recomputes block `k` from `input` and differentiates it for `grad`, the gradient of its output (let go of
    /// once the block's backward has taken it over): the parameters' gradients go to the sink; returns the input's
    /// (when `input_needs_grad`).
    fn backward_block(
        &self,
        k: usize,
        input: Tensor,
        grad: Tensor,
        input_needs_grad: bool,
    ) -> Result<Option<Tensor>> {
        let LabeledBlock { block, label } = &self.blocks[k];
        // Candle's variable is a copy: the input itself is let go (when the chain alone holds it) before the
        // block is recomputed.
        let (var, input) = if input_needs_grad {
            let var = Var::from_tensor(&input)?;
            drop(input);
            let tracked = var.as_tensor().clone();
            (Some(var), tracked)
        } else {
            (None, input)
        };
        let _span = trace::span_with(|| label.clone(), "backward");
        let (y, extra) = {
            let _phase = snapshot_context::phase(SnapshotPhase::Recompute);
            let _span = trace::span("recompute", "recompute");
            block(&input, Pass::Recompute)?
        };
        let _span = trace::span("backward", "backward");
        let seed = OutputGradient::new(grad).apply([&y])?;
        drop(y);
        let grads = match extra {
            None => seed.backward()?,
            Some(e) => (seed.to_dtype(e.dtype())? + e)?.backward()?,
        };
        for p in &self.params {
            if let Some(g) = grads.get(p) {
                self.sink.add(p, g)?;
            }
        }
        Ok(var.and_then(|v| grads.get(&v).cloned()))
    }

    /// Runs the blocks from `x`, saving the input of each block from `first_saved` on.
    fn forward(&mut self, x: &Tensor, first_saved: usize) -> Result<Value> {
        let saved = self
            .saved
            .get_mut()
            .map_err(|_| candle_core::Error::Msg("checkpoint: poisoned inputs".into()))?;
        let mut h = x.detach();
        for (k, LabeledBlock { block, .. }) in self.blocks.iter().enumerate() {
            // The copy to the host runs while the block computes; the block's input is let go once it has run.
            let input = match (k >= first_saved, &self.offload) {
                (false, _) => None,
                (true, Some(offload)) => Some(offload.save(&h)?),
                (true, None) => Some(Saved::Kept(h.clone())),
            };
            h = block(&h, Pass::Forward)?.0.detach();
            if let Some(mut input) = input {
                input.release_source()?;
                saved.push(input);
            }
        }
        Ok(Value::Tensor(h))
    }

    /// Walks the chain back from `grad`, the gradient of its output: each saved input is brought back while the
    /// block after it is recomputed. Then block 0 from `held`, the input the graph holds (when it does), and
    /// returns its input's gradient when `needs_x`.
    fn backward(
        &self,
        held: Option<&Tensor>,
        grad: &Tensor,
        needs_x: bool,
    ) -> Result<Option<Tensor>> {
        let mut saved = std::mem::take(
            &mut *self
                .saved
                .lock()
                .map_err(|_| candle_core::Error::Msg("checkpoint: poisoned inputs".into()))?,
        );
        let first_saved = usize::from(held.is_some());
        if saved.len() + first_saved != self.blocks.len() {
            candle_core::bail!("checkpoint: the backward ran twice");
        }
        // Block k's input is brought back while block k + 1 is recomputed.
        let mut next = saved.pop().map(Saved::load).transpose()?;
        let mut grad = grad.clone();
        for k in (first_saved..self.blocks.len()).rev() {
            let input = match next.take() {
                Some(loading) => loading.wait()?,
                None => candle_core::bail!("checkpoint: block {k}'s input is missing"),
            };
            next = saved.pop().map(Saved::load).transpose()?;
            if k == 0 {
                return self.backward_block(0, input, grad, needs_x);
            }
            // A block whose output does not depend on its input passes no gradient on.
            let (shape, dtype, device) =
                (input.shape().clone(), input.dtype(), input.device().clone());
            grad = match self.backward_block(k, input, grad, true)? {
                Some(g) => g,
                None => Tensor::zeros(shape, dtype, &device)?,
            };
        }
        match held {
            Some(x) => self.backward_block(0, x.clone(), grad, needs_x),
            None => Ok(None),
        }
    }
}

/// The root of a recomputed block's backward: a scalar (zero) whose backward hands the block's output `y` the
/// gradient it was given. Candle starts a backward from ones; the product `y·grad` would hold the product, the ones
/// and a gradient for `grad` itself (three activation-sized tensors) through the block's whole backward. The
/// gradient is handed over once and not kept: Candle adds it into a buffer of its own, and what the caller no longer
/// holds is freed then. The tiled op seeds each slice's backward so too.
pub(crate) struct OutputGradient {
    /// The gradient of the block's output, until the backward takes it.
    grad: Mutex<Option<Tensor>>,
}

impl OutputGradient {
    /// The root that hands `grad` to the output it is applied to.
    pub(crate) fn new(grad: Tensor) -> Self {
        OutputGradient {
            grad: Mutex::new(Some(grad)),
        }
    }
}

impl Op<1> for OutputGradient {
    const NAME: &'static str = "checkpoint";

    fn fwd(&mut self, [y]: [&Tensor; 1]) -> Result<Value> {
        Ok(Value::Tensor(Tensor::zeros((), y.dtype(), y.device())?))
    }

    fn bwd(&self, _: [&Tensor; 1], _: &Tensor, _: [bool; 1]) -> Result<[Option<Tensor>; 1]> {
        let grad = self
            .grad
            .lock()
            .map_err(|_| candle_core::Error::Msg("checkpoint: poisoned output gradient".into()))?
            .take();
        match grad {
            Some(g) => Ok([Some(g)]),
            None => candle_core::bail!("checkpoint: the output gradient was handed over twice"),
        }
    }
}

impl Op<2> for CheckpointChain {
    const NAME: &'static str = "checkpoint";

    fn fwd(&mut self, [x, _anchor]: [&Tensor; 2]) -> Result<Value> {
        self.forward(x, 1)
    }

    fn bwd(
        &self,
        [x, _anchor]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        Ok([self.backward(Some(x), grad, needs[0])?, None])
    }
}

impl Op<1> for CheckpointChain {
    const NAME: &'static str = "checkpoint";

    fn fwd(&mut self, _anchor: [&Tensor; 1]) -> Result<Value> {
        let x = self
            .untracked_input
            .take()
            .ok_or_else(|| candle_core::Error::Msg("checkpoint: the forward ran twice".into()))?;
        self.forward(&x, 0)
    }

    fn bwd(
        &self,
        _anchor: [&Tensor; 1],
        grad: &Tensor,
        _: [bool; 1],
    ) -> Result<[Option<Tensor>; 1]> {
        self.backward(None, grad, false)?;
        Ok([None])
    }
}

/// Runs `block` on `x` checkpointed. `params` are the trainable variables the block uses; their gradients go to
/// `sink`. `x` itself need not require a gradient (its gradient is returned only if it does).
pub fn checkpoint(x: &Tensor, block: Block, params: &[Var], sink: &GradSink) -> Result<Tensor> {
    let block = LabeledBlock {
        block,
        label: "block".into(),
    };
    checkpoint_chain(x, vec![block], params, sink, None)
}

/// Runs `blocks` one after the other from `x`, checkpointed as a chain: only the blocks' inputs are kept for the
/// backward (in `offload`'s pinned host memory when given; `x` stays in the graph when it needs a gradient), each
/// block recomputed there in turn. Gradients equal those of checkpointing each block on its own; `params` and
/// `sink` as for [`checkpoint`].
pub fn checkpoint_chain(
    x: &Tensor,
    blocks: Vec<LabeledBlock>,
    params: &[Var],
    sink: &GradSink,
    offload: Option<ActivationOffload>,
) -> Result<Tensor> {
    // The graph node hangs on a parameter, so the blocks are differentiated even when `x` needs no gradient.
    let anchor = match params.first() {
        Some(p) => p.as_tensor().clone(),
        None if x.track_op() => x.clone(),
        None => {
            let mut h = x.detach();
            for LabeledBlock { block, .. } in &blocks {
                h = block(&h, Pass::Forward)?.0.detach();
            }
            return Ok(h);
        }
    };
    if blocks.is_empty() {
        return Ok(x.clone());
    }
    let mut chain = CheckpointChain {
        blocks,
        params: params.to_vec(),
        sink: sink.clone(),
        offload,
        untracked_input: None,
        saved: Mutex::new(Vec::new()),
    };
    // An input that needs no gradient is saved as the blocks' inputs are, rather than held by the graph (with
    // offload, the embeddings leave the device as the other layer inputs do).
    if x.track_op() {
        chain.apply([x, &anchor])
    } else {
        chain.untracked_input = Some(x.clone());
        chain.apply([&anchor])
    }
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

    /// A chain of blocks, its inputs kept or offloaded (on the CPU they stay where they are), gives the gradients
    /// of checkpointing each block on its own, bit for bit; its backward runs once.
    #[test]
    fn a_chain_equals_blocks_checkpointed_one_by_one() {
        let a = Var::from_tensor(&rand_f64(&[6, 4], 11)).unwrap();
        let b = Var::from_tensor(&rand_f64(&[6, 4], 12)).unwrap();
        let norm = (rand_f64(&[4], 13) + 1.0).unwrap();
        let f = block(a.clone(), b.clone(), norm);
        let params = [a.clone(), b.clone()];
        let x = Var::from_tensor(&rand_f64(&[2, 3, 4], 14)).unwrap();
        let one_by_one = {
            let sink = GradSink::new();
            let mut h = x.as_tensor().clone();
            for _ in 0..3 {
                h = checkpoint(&h, f.clone(), &params, &sink).unwrap();
            }
            let loss = h.sqr().unwrap().sum_all().unwrap();
            let mut grads = loss.backward().unwrap();
            sink.merge_into(&mut grads).unwrap();
            (loss.to_scalar::<f64>().unwrap(), grads)
        };
        for offload in [None, Some(ActivationOffload::new())] {
            let sink = GradSink::new();
            let blocks = vec![
                LabeledBlock {
                    block: f.clone(),
                    label: String::new()
                };
                3
            ];
            let h =
                checkpoint_chain(x.as_tensor(), blocks, &params, &sink, offload.clone()).unwrap();
            let loss = h.sqr().unwrap().sum_all().unwrap();
            assert_eq!(loss.to_scalar::<f64>().unwrap(), one_by_one.0);
            let mut grads = loss.backward().unwrap();
            sink.merge_into(&mut grads).unwrap();
            for v in [&a, &b, &x] {
                assert_eq!(
                    max_abs_diff(grads.get(v).unwrap(), one_by_one.1.get(v).unwrap()),
                    0.0
                );
            }
            // Nothing is pinned on the CPU.
            if let Some(offload) = &offload {
                assert_eq!(offload.host_bytes(), 0);
            }
            let err = loss.backward().unwrap_err().to_string();
            assert!(err.contains("backward ran twice"), "{err}");
        }
    }
}
