//! A row-wise block run over slices of its token rows (ALST's TiledMLP): the forward computes each slice without a
//! graph, the backward recomputes and differentiates one slice at a time, so the block's intermediates (an MLP's
//! gate, up and activation, `tokens × intermediate` each) exist for one slice only — in the forward, in a
//! checkpointed layer's recomputation and in the backward.
//!
//! The block must treat rows independently (an MLP does): then every row's output and input gradient go through
//! the same operations as the untiled block's — in the same order where the block's matrix products compute a row
//! alike whatever the number of rows (the CPU's may not: their blocking can order a row's dot product by its place)
//! — and the parameter gradients, sums over rows, are accumulated slice by slice (another order). Those go to a
//! [`GradSink`], as a checkpointed block's do.

use std::sync::Arc;

use candle_core::{Result, Tensor, Var};

use super::checkpoint::{GradSink, OutputGradient, Pass};
use super::op::{Apply, Op, Value};

/// A row-wise block over `[rows, in]` slices: `(x, residual added to the output, pass) → [rows, out]`. In a
/// [`Pass::Recompute`] with a residual, the output's value may be left uncomputed (only its graph is differentiated).
pub type RowBlock = Arc<dyn Fn(&Tensor, Option<&Tensor>, Pass) -> Result<Tensor> + Send + Sync>;

/// The tiled op: inputs `[x, anchor]` or `[x, residual, anchor]` (the anchor is a parameter the block uses, so the
/// block is differentiated even when `x` needs no gradient).
struct Tiled {
    block: RowBlock,
    /// At most this many rows per slice (see [`slices`]).
    slice_rows: usize,
    params: Vec<Var>,
    sink: GradSink,
    pass: Pass,
}

/// `t: [..., d]` as `[rows, d]` (a view when contiguous).
fn as_rows(t: &Tensor) -> Result<Tensor> {
    let d = t.dims().last().copied().unwrap_or(1);
    t.reshape((t.elem_count() / d.max(1), d))
}

/// The `(start, len)` of each slice of `rows` rows: `⌈rows / slice_rows⌉` slices as even as whole rows allow (the
/// lengths differ by one at most), so no short remainder is left over — a one-row slice would take a
/// matrix–vector product, whose sums run in another order than the matrix product's.
fn slices(rows: usize, slice_rows: usize) -> Vec<(usize, usize)> {
    let n = rows.div_ceil(slice_rows.max(1)).max(1);
    let (base, longer) = (rows / n, rows % n);
    let mut start = 0;
    (0..n)
        .map(|i| {
            let len = base + usize::from(i < longer);
            start += len;
            (start - len, len)
        })
        .filter(|&(_, len)| len > 0)
        .collect()
}

/// `[rows, out]` back to `x`'s leading dims.
fn unflatten(y: &Tensor, x: &Tensor) -> Result<Tensor> {
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = y.dim(1)?;
    }
    y.reshape(dims)
}

impl Tiled {
    fn forward(&self, x: &Tensor, residual: Option<&Tensor>) -> Result<Value> {
        if let (Pass::Recompute, Some(r)) = (self.pass, residual) {
            // The value of a recomputed output is never read; the backward recomputes each slice itself.
            return Value::unread(r.shape(), r);
        }
        let (xs, rs) = (as_rows(&x.detach())?, residual.map(as_rows).transpose()?);
        let mut outs = Vec::new();
        for (start, len) in slices(xs.dim(0)?, self.slice_rows) {
            let r = rs.as_ref().map(|r| r.narrow(0, start, len)).transpose()?;
            let y = (self.block)(&xs.narrow(0, start, len)?, r.as_ref(), Pass::Forward)?;
            outs.push(y.detach());
        }
        Ok(Value::Tensor(unflatten(&Tensor::cat(&outs, 0)?, x)?))
    }

    /// The gradient of `x` (when `needs_x`), the parameters' going to the sink, slice by slice.
    fn backward(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        grad: &Tensor,
        needs_x: bool,
    ) -> Result<Option<Tensor>> {
        let xs = as_rows(x)?;
        let rs = residual.map(as_rows).transpose()?;
        let gs = as_rows(&grad.contiguous()?)?;
        let mut dxs = Vec::new();
        for (start, len) in slices(xs.dim(0)?, self.slice_rows) {
            let x_slice = xs.narrow(0, start, len)?;
            let input = if needs_x {
                Some(Var::from_tensor(&x_slice)?)
            } else {
                None
            };
            // The residual only adds: its gradient is `grad` itself, so its slice goes in untracked.
            let r = rs.as_ref().map(|r| r.narrow(0, start, len)).transpose()?;
            let y = (self.block)(
                input.as_ref().map(|v| v.as_tensor()).unwrap_or(&x_slice),
                r.as_ref(),
                Pass::Recompute,
            )?;
            // The slice's output gradient handed to `y` by a one-element root (as a recomputed block's is).
            let grad = gs.narrow(0, start, len)?.copy()?;
            let grads = OutputGradient::new(grad).apply([&y])?.backward()?;
            for p in &self.params {
                if let Some(g) = grads.get(p) {
                    self.sink.add(p, g)?;
                }
            }
            if let Some(v) = input {
                dxs.push(match grads.get(&v) {
                    Some(g) => g.clone(),
                    None => v.as_tensor().zeros_like()?,
                });
            }
        }
        if !needs_x {
            return Ok(None);
        }
        Ok(Some(unflatten(&Tensor::cat(&dxs, 0)?, x)?))
    }
}

impl Op<2> for Tiled {
    const NAME: &'static str = "tiled";

    fn fwd(&mut self, [x, _anchor]: [&Tensor; 2]) -> Result<Value> {
        self.forward(x, None)
    }

    fn bwd(
        &self,
        [x, _anchor]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        Ok([self.backward(x, None, grad, needs[0])?, None])
    }
}

impl Op<3> for Tiled {
    const NAME: &'static str = "tiled";

    fn fwd(&mut self, [x, residual, _anchor]: [&Tensor; 3]) -> Result<Value> {
        self.forward(x, Some(&residual.detach()))
    }

    fn bwd(
        &self,
        [x, residual, _anchor]: [&Tensor; 3],
        grad: &Tensor,
        needs: [bool; 3],
    ) -> Result<[Option<Tensor>; 3]> {
        let dx = self.backward(x, Some(residual), grad, needs[0])?;
        Ok([dx, needs[1].then(|| grad.clone()), None])
    }
}

/// Runs the row-wise `block` on `x: [..., in]` (plus `residual: [..., out]`, added by the block) over even slices
/// of at most `slice_rows` rows of `x` flattened to `[rows, in]`, for `pass`. `params` are the trainable variables the block
/// uses; their gradients go to `sink` (merge it after the backward, [`GradSink::merge_into`]). The output and the
/// gradients of `x` and `residual` equal the untiled block's row for row up to the order of each row's dot products
/// (bit for bit where the block's products compute a row alike whatever the number of rows; the CPU's may order
/// them by the row's place in their blocking, and a one-row slice takes a matrix–vector product). The parameter
/// gradients equal the untiled ones up to summation order.
pub fn tiled_rows(
    x: &Tensor,
    residual: Option<&Tensor>,
    slice_rows: usize,
    block: RowBlock,
    params: &[Var],
    sink: &GradSink,
    pass: Pass,
) -> Result<Tensor> {
    if slice_rows == 0 {
        candle_core::bail!("a tiled block needs at least one row per slice");
    }
    if x.elem_count() == 0 {
        return block(x, residual, pass);
    }
    let op = Tiled {
        block,
        slice_rows,
        params: params.to_vec(),
        sink: sink.clone(),
        pass,
    };
    // The graph node hangs on a parameter, so the block is differentiated even when no input needs a gradient.
    let tracked = x.track_op() || residual.is_some_and(|r| r.track_op());
    let anchor = match params.first() {
        Some(p) => p.as_tensor().clone(),
        None if tracked => x.clone(),
        None => return op.forward(x, residual)?.into_tensor(),
    };
    match residual {
        Some(r) => op.apply([x, r, &anchor]),
        None => op.apply([x, &anchor]),
    }
}
