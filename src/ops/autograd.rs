//! Attaching a hand-written backward to a value computed without a graph.
//!
//! `attach1(x, value, backward)` returns a tensor equal to `value` whose gradient with respect to `x` is
//! `backward(x, grad_of_output)`. The forward runs once, on detached inputs; the attached op only copies the value
//! into the graph (one memcpy of the output). When no input needs a gradient, `value` is returned as is: no graph.

use std::sync::{Arc, Mutex};

use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, CustomOp2, CustomOp3, Device, Layout, Result,
    Shape, Storage, Tensor, WithDType,
};

/// Backward of a one-input op: `(input, grad_output) -> grad_input`. Tensors arrive detached.
pub type Backward1 = Box<dyn Fn(&Tensor, &Tensor) -> Result<Option<Tensor>> + Send + Sync>;
/// Backward of a two-input op: `(a, b, grad_output, [a needs a gradient, b needs a gradient])`. Tensors arrive
/// detached; return `None` for an input that needs no gradient.
pub type Backward2 = Box<
    dyn Fn(&Tensor, &Tensor, &Tensor, [bool; 2]) -> Result<(Option<Tensor>, Option<Tensor>)>
        + Send
        + Sync,
>;
/// Backward of a three-input op (see [`Backward2`]).
pub type Backward3 = Box<
    dyn Fn(
            &Tensor,
            &Tensor,
            &Tensor,
            &Tensor,
            [bool; 3],
        ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)>
        + Send
        + Sync,
>;

/// A precomputed output: a tensor, or a CPU buffer that is moved into the graph without a copy.
enum Output {
    Tensor(Tensor),
    Cpu(CpuStorage, Shape),
}

/// Holds the precomputed output until the graph node is created.
struct Value {
    name: &'static str,
    value: Mutex<Option<Output>>,
}

impl Value {
    fn of(name: &'static str, output: Output) -> Self {
        Value {
            name,
            value: Mutex::new(Some(output)),
        }
    }

    /// The output, once: the graph node's forward takes it.
    fn take(&self) -> Result<Output> {
        self.value
            .lock()
            .map_err(|_| candle_core::Error::Msg(format!("{}: poisoned value", self.name)))?
            .take()
            .ok_or_else(|| candle_core::Error::Msg(format!("{}: forward ran twice", self.name)))
    }

    fn take_cpu(&self) -> Result<(CpuStorage, Shape)> {
        let value = match self.take()? {
            Output::Cpu(storage, shape) => return Ok((storage, shape)),
            Output::Tensor(t) => t,
        };
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cpu(cpu) => Ok((contiguous_copy(cpu, layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{}: value is not on the CPU", self.name),
        }
    }

    /// The value's device storage, for a graph node on a CUDA device (one device-to-device copy).
    #[cfg(feature = "cuda")]
    fn take_cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        let Output::Tensor(value) = self.take()? else {
            candle_core::bail!("{}: a CPU value on a CUDA graph node", self.name)
        };
        // Cloning a CUDA storage copies all of it: start from a tensor that is exactly its storage.
        let value = if value.is_contiguous() && value.layout().start_offset() == 0 {
            value
        } else {
            value.copy()?
        };
        let (storage, layout) = value.storage_and_layout();
        match &*storage {
            Storage::Cuda(cuda) => Ok((cuda.try_clone(layout)?, layout.shape().clone())),
            _ => candle_core::bail!("{}: value is not on the CUDA device", self.name),
        }
    }
}

/// A contiguous copy of the elements `layout` addresses.
fn contiguous_copy(storage: &CpuStorage, layout: &Layout) -> Result<CpuStorage> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        // Strided values are rare (callers pass contiguous results); copy through Candle in that case.
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

struct Attach1 {
    value: Value,
    backward: Backward1,
}

impl CustomOp1 for Attach1 {
    fn name(&self) -> &'static str {
        self.value.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.value.take_cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.value.take_cuda()
    }
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        (self.backward)(&arg.detach(), &grad.detach())
    }
}

struct Attach2 {
    value: Value,
    backward: Backward2,
}

impl CustomOp2 for Attach2 {
    fn name(&self) -> &'static str {
        self.value.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.value.take_cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.value.take_cuda()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        (self.backward)(
            &a.detach(),
            &b.detach(),
            &grad.detach(),
            [a.track_op(), b.track_op()],
        )
    }
}

struct Attach3 {
    value: Value,
    backward: Backward3,
}

impl CustomOp3 for Attach3 {
    fn name(&self) -> &'static str {
        self.value.name
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
        self.value.take_cpu()
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
        self.value.take_cuda()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let needs = [a.track_op(), b.track_op(), c.track_op()];
        (self.backward)(&a.detach(), &b.detach(), &c.detach(), &grad.detach(), needs)
    }
}

/// `value` (computed from `x` without a graph) with `backward` as its gradient rule.
pub fn attach1(
    name: &'static str,
    x: &Tensor,
    value: Tensor,
    backward: Backward1,
) -> Result<Tensor> {
    if !x.track_op() {
        return Ok(value);
    }
    node1(name, x, Output::Tensor(value), backward)
}

fn node1(name: &'static str, x: &Tensor, output: Output, backward: Backward1) -> Result<Tensor> {
    x.apply_op1_arc(Arc::new(Box::new(Attach1 {
        value: Value::of(name, output),
        backward,
    })))
}

fn node2(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    output: Output,
    backward: Backward2,
) -> Result<Tensor> {
    a.apply_op2_arc(
        b,
        Arc::new(Box::new(Attach2 {
            value: Value::of(name, output),
            backward,
        })),
    )
}

fn node3(
    name: &'static str,
    [a, b, c]: [&Tensor; 3],
    output: Output,
    backward: Backward3,
) -> Result<Tensor> {
    a.apply_op3_arc(
        b,
        c,
        Arc::new(Box::new(Attach3 {
            value: Value::of(name, output),
            backward,
        })),
    )
}

/// A CPU buffer as the output of a graph node.
fn cpu_output<T: WithDType>(data: Vec<T>, shape: Shape) -> Output {
    Output::Cpu(T::to_cpu_storage_owned(data), shape)
}

/// [`attach1`] for two inputs.
pub fn attach2(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    value: Tensor,
    backward: Backward2,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() {
        return Ok(value);
    }
    node2(name, a, b, Output::Tensor(value), backward)
}

/// [`attach1`] for three inputs.
pub fn attach3(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    value: Tensor,
    backward: Backward3,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() && !c.track_op() {
        return Ok(value);
    }
    node3(name, [a, b, c], Output::Tensor(value), backward)
}

/// [`attach3`] for a value computed into a CPU buffer: `data` (row-major, of `shape`) becomes the output's storage
/// without a copy.
pub fn attach3_cpu<T: WithDType>(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    data: Vec<T>,
    shape: Shape,
    backward: Backward3,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() && !c.track_op() {
        return Tensor::from_vec(data, shape, &Device::Cpu);
    }
    node3(name, [a, b, c], cpu_output(data, shape), backward)
}

/// [`attach2`] for a value computed into a CPU buffer (see [`attach3_cpu`]).
pub fn attach2_cpu<T: WithDType>(
    name: &'static str,
    a: &Tensor,
    b: &Tensor,
    data: Vec<T>,
    shape: Shape,
    backward: Backward2,
) -> Result<Tensor> {
    if !a.track_op() && !b.track_op() {
        return Tensor::from_vec(data, shape, &Device::Cpu);
    }
    node2(name, a, b, cpu_output(data, shape), backward)
}

/// [`attach1`] for a value computed into a CPU buffer (see [`attach3_cpu`]).
pub fn attach1_cpu<T: WithDType>(
    name: &'static str,
    x: &Tensor,
    data: Vec<T>,
    shape: Shape,
    backward: Backward1,
) -> Result<Tensor> {
    if !x.track_op() {
        return Tensor::from_vec(data, shape, &Device::Cpu);
    }
    node1(name, x, cpu_output(data, shape), backward)
}
