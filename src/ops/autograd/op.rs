//! An `Op` computes its forward without a graph and brings its own backward; `Apply::apply` turns the two into one
//! node of Candle's graph. The forward runs once, on the inputs' values; the graph node only hands that value over
//! (a CPU buffer is moved into the graph without a copy). When no input needs a gradient the value is returned as
//! is, with no graph.

use std::sync::{Arc, Mutex};

use crate::profile::context as snapshot_context;
use crate::profile::trace;

use candle_core::op::BackpropOp;
use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape,
    Storage, Tensor, WithDType,
};

/// A differentiable op with `N` tensor inputs (Candle's graph takes one to three).
///
/// `fwd` computes the output's value from the inputs (on CPU slices, or composed of Candle ops on any device) and
/// may record in `self` what the backward needs; `bwd` returns the gradients of the inputs marked in `needs`.
pub(crate) trait Op<const N: usize>: Send + Sync + Sized + 'static {
    /// The op's name in the graph and in its errors.
    const NAME: &'static str;

    /// The output's value for `inputs` (which may be tracked: `track_op` tells which need gradients).
    fn fwd(&mut self, inputs: [&Tensor; N]) -> Result<Value>;

    /// The gradients of the inputs marked in `needs` for the output gradient `grad` (all tensors detached);
    /// `None` for the others.
    fn bwd(
        &self,
        inputs: [&Tensor; N],
        grad: &Tensor,
        needs: [bool; N],
    ) -> Result<[Option<Tensor>; N]>;

    /// [`Op::bwd`] for an op that also reads its own output (attention's `Δ = rowsum(dO ⊙ O)`); the default
    /// ignores it.
    fn bwd_with_output(
        &self,
        inputs: [&Tensor; N],
        _output: &Tensor,
        grad: &Tensor,
        needs: [bool; N],
    ) -> Result<[Option<Tensor>; N]> {
        self.bwd(inputs, grad, needs)
    }
}

/// Runs an [`Op`]: its forward, with its backward attached when an input needs a gradient.
pub(crate) trait Apply<const N: usize> {
    /// The op's output for `inputs`.
    fn apply(self, inputs: [&Tensor; N]) -> Result<Tensor>;
}

/// An op's forward value: a tensor, or a CPU buffer that becomes the output's storage without a copy.
pub(crate) enum Value {
    /// A tensor computed by Candle's ops.
    Tensor(Tensor),
    /// A row-major CPU buffer and its shape.
    Cpu(CpuStorage, Shape),
    /// A device buffer a CUDA kernel wrote, and its shape (handed to the graph without a copy).
    #[cfg(feature = "cuda")]
    Cuda(candle_core::CudaStorage, Shape),
    /// An output only differentiated, its value never read (a checkpointed block's recomputed output, see
    /// [`super::Pass::Recompute`]): as a graph node it has `shape` over a one-element buffer (`zero`), so it
    /// takes no memory; without a graph it is `zero` broadcast to `shape`.
    Unread {
        /// The output's shape.
        shape: Shape,
        /// One zero of the output's dtype on its device.
        zero: Tensor,
    },
}

impl Value {
    /// A CPU buffer of `shape` (row-major).
    pub(crate) fn cpu<T: WithDType>(data: Vec<T>, shape: impl Into<Shape>) -> Self {
        Value::Cpu(T::to_cpu_storage_owned(data), shape.into())
    }

    /// An [`Value::Unread`] output of `shape`, `like`'s dtype and device.
    pub(crate) fn unread(shape: &Shape, like: &Tensor) -> Result<Self> {
        Ok(Value::Unread {
            shape: shape.clone(),
            zero: Tensor::zeros(1, like.dtype(), like.device())?,
        })
    }

    /// The value as a tensor (when no graph is built).
    pub(crate) fn into_tensor(self) -> Result<Tensor> {
        match self {
            Value::Tensor(t) => Ok(t),
            Value::Unread { shape, zero } => zero.reshape(())?.broadcast_as(shape),
            Value::Cpu(storage, shape) => Ok(Tensor::from_storage(
                Storage::Cpu(storage),
                shape,
                BackpropOp::none(),
                false,
            )),
            #[cfg(feature = "cuda")]
            Value::Cuda(storage, shape) => Ok(Tensor::from_storage(
                Storage::Cuda(storage),
                shape,
                BackpropOp::none(),
                false,
            )),
        }
    }
}

/// A graph node: the op (for its backward) and its forward value, handed over once.
struct Node<O> {
    op: O,
    value: Mutex<Option<Value>>,
}

impl<O> Node<O> {
    fn new(op: O, value: Value) -> Self {
        Node {
            op,
            value: Mutex::new(Some(value)),
        }
    }

    /// The value, once: the node's forward takes it.
    fn take(&self, name: &str) -> Result<Value> {
        self.value
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{name}: poisoned value")))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{name}: forward ran twice")))
    }

    fn take_cpu(&self, name: &str) -> Result<(CpuStorage, Shape)> {
        let (value, shape) = match self.take(name)? {
            Value::Cpu(storage, shape) => return Ok((storage, shape)),
            Value::Tensor(t) => {
                let shape = t.shape().clone();
                (t, shape)
            }
            // The node's shape over a one-element buffer: nothing reads it.
            Value::Unread { shape, zero } => (zero, shape),
            #[cfg(feature = "cuda")]
            Value::Cuda(..) => candle_core::bail!("{name}: a CUDA value on a CPU graph node"),
        };
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cpu(cpu) => Ok((contiguous_copy(cpu, layout)?, shape)),
            _ => candle_core::bail!("{name}: value is not on the CPU"),
        }
    }

    /// The value's device storage, for a graph node on a CUDA device (one device-to-device copy).
    #[cfg(feature = "cuda")]
    fn take_cuda(&self, name: &str) -> Result<(candle_core::CudaStorage, Shape)> {
        let (value, shape) = match self.take(name)? {
            Value::Cuda(storage, shape) => return Ok((storage, shape)),
            Value::Tensor(value) => {
                let shape = value.shape().clone();
                (value, shape)
            }
            // The node's shape over a one-element buffer: nothing reads it.
            Value::Unread { shape, zero } => (zero, shape),
            Value::Cpu(..) => candle_core::bail!("{name}: a CPU value on a CUDA graph node"),
        };
        // Cloning a CUDA storage copies all of it: start from a tensor that is exactly its storage.
        let value = if value.is_contiguous() && value.layout().start_offset() == 0 {
            value
        } else {
            value.copy()?
        };
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cuda(cuda) => Ok((cuda.try_clone(layout)?, shape)),
            _ => candle_core::bail!("{name}: value is not on the CUDA device"),
        }
    }
}

/// A contiguous copy of the elements `layout` addresses.
fn contiguous_copy(storage: &CpuStorage, layout: &Layout) -> Result<CpuStorage> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        // Strided values are rare (ops return contiguous results); copy through Candle in that case.
        return storage.try_clone(layout);
    };
    Ok(match storage {
        CpuStorage::F32(v) => CpuStorage::F32(v[start..end].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[start..end].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[start..end].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[start..end].to_vec()),
        other => other.try_clone(layout)?,
    })
}

// Candle's custom-op traits, one per arity: the forward hands over the value, the backward calls `Op::bwd` on
// detached tensors.

/// An op's scope: its name in the memory snapshot's context and, while a step is traced, a span of the trace
/// (category `cat`: "op" for the forward, "op backward").
fn op_scope(name: &'static str, cat: &'static str) -> (snapshot_context::Scope, trace::Span) {
    (snapshot_context::op(name), trace::span(name, cat))
}

impl<O: Op<1>> CustomOp1 for Node<O> {
    fn name(&self) -> &'static str {
        O::NAME
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.take_cpu(O::NAME)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.take_cuda(O::NAME)
    }
    fn bwd(&self, x: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let _op = op_scope(O::NAME, "op backward");
        let [gx] = self
            .op
            .bwd_with_output([&x.detach()], &res.detach(), &grad.detach(), [true])?;
        Ok(gx)
    }
}

impl<O: Op<2>> CustomOp2 for Node<O> {
    fn name(&self) -> &'static str {
        O::NAME
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.take_cpu(O::NAME)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.take_cuda(O::NAME)
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let _op = op_scope(O::NAME, "op backward");
        let needs = [a.track_op(), b.track_op()];
        let inputs = [&a.detach(), &b.detach()];
        let [ga, gb] = self
            .op
            .bwd_with_output(inputs, &res.detach(), &grad.detach(), needs)?;
        Ok((ga, gb))
    }
}

impl<O: Op<3>> CustomOp3 for Node<O> {
    fn name(&self) -> &'static str {
        O::NAME
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.take_cpu(O::NAME)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.take_cuda(O::NAME)
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let _op = op_scope(O::NAME, "op backward");
        let needs = [a.track_op(), b.track_op(), c.track_op()];
        let inputs = [&a.detach(), &b.detach(), &c.detach()];
        let [ga, gb, gc] = self
            .op
            .bwd_with_output(inputs, &res.detach(), &grad.detach(), needs)?;
        Ok((ga, gb, gc))
    }
}

impl<O: Op<1>> Apply<1> for O {
    fn apply(mut self, [x]: [&Tensor; 1]) -> Result<Tensor> {
        let value = {
            let _op = op_scope(O::NAME, "op");
            self.fwd([x])?
        };
        if !x.track_op() {
            return value.into_tensor();
        }
        x.apply_op1_arc(Arc::new(Box::new(Node::new(self, value))))
    }
}

impl<O: Op<2>> Apply<2> for O {
    fn apply(mut self, [a, b]: [&Tensor; 2]) -> Result<Tensor> {
        let value = {
            let _op = op_scope(O::NAME, "op");
            self.fwd([a, b])?
        };
        if !a.track_op() && !b.track_op() {
            return value.into_tensor();
        }
        a.apply_op2_arc(b, Arc::new(Box::new(Node::new(self, value))))
    }
}

impl<O: Op<3>> Apply<3> for O {
    fn apply(mut self, [a, b, c]: [&Tensor; 3]) -> Result<Tensor> {
        let value = {
            let _op = op_scope(O::NAME, "op");
            self.fwd([a, b, c])?
        };
        if !a.track_op() && !b.track_op() && !c.track_op() {
            return value.into_tensor();
        }
        a.apply_op3_arc(b, c, Arc::new(Box::new(Node::new(self, value))))
    }
}
