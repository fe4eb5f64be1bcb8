//! Frozen linear layer `y = x·Wᵀ (+ b)` with `W` dense or 4-bit: the gradient flows to `x` only.
//!
//! `W` never enters the autograd graph. A 4-bit `W` is dequantized inside the op for the forward and again in the
//! backward, so only one layer's dequantized weight exists at a time. In [`InferenceMode`] (generation) a CPU 4-bit
//! or bfloat16 `W` times a few float32 rows is computed from the stored values directly (the kernels in
//! `ops/cpu/nf4_matvec.rs` and `ops/cpu/bf16_matvec.rs`) instead.

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use super::autograd::op::{Apply, Op, Value};
use super::cpu::bf16_matvec::bf16_matvec;
use super::cpu::nf4_matvec::{nf4_matvec, MAX_ROWS};
use super::cpu::{with_elements, with_slice};
use crate::quant::{DeviceNf4, Nf4Tensor, QuantConfig};

thread_local! {
    /// Whether this thread is in [`InferenceMode`].
    static INFERENCE: Cell<bool> = const { Cell::new(false) };
}

/// Inference mode for the current thread while the guard lives (it restores the previous mode when dropped).
///
/// In it, a frozen linear with a 4-bit weight on the CPU, a float32 input and at most 8 rows (a decoding step, or
/// a short prompt) multiplies by the 4-bit codes in place instead of dequantizing the whole weight first: the same
/// values up to the order of float sums, several times faster for one row. Outside it every product is
/// bit-identical to dequantize-then-matmul, which training, checkpoint replay and the golden tests rely on; so only
/// generation enters it ([`crate::models::LlamaModel::forward_cached`]). The mode is per thread: a rayon job the
/// thread runs while it waits inside the mode sees it too, which in this crate are kernel pieces only, never a
/// forward pass.
#[must_use = "inference mode ends when the guard is dropped"]
pub struct InferenceMode {
    previous: bool,
    /// The mode is per thread: the guard must be dropped on the thread that made it.
    _not_send: PhantomData<*const ()>,
}

impl InferenceMode {
    /// Enters inference mode on this thread until the returned guard is dropped.
    pub fn enter() -> Self {
        InferenceMode {
            previous: INFERENCE.with(|m| m.replace(true)),
            _not_send: PhantomData,
        }
    }

    /// True while this thread is in inference mode.
    pub fn is_active() -> bool {
        INFERENCE.with(Cell::get)
    }
}

impl Drop for InferenceMode {
    fn drop(&mut self) {
        INFERENCE.with(|m| m.set(self.previous));
    }
}

/// The 4-bit weight to multiply by in place ([`nf4_matvec`]) instead of dequantizing it: when this thread is in
/// [`InferenceMode`], `weight` is a 4-bit weight on the CPU and the input has at most [`MAX_ROWS`] rows. An op with
/// a [`FrozenLinear`] base asks this before dequantizing.
pub(crate) fn decoding_codes(weight: &FrozenWeight, rows: usize) -> Option<&Nf4Tensor> {
    match weight {
        FrozenWeight::Nf4(q) if rows <= MAX_ROWS && InferenceMode::is_active() => Some(q),
        _ => None,
    }
}

/// The 4-bit weight on a GPU to multiply by in place ([`DeviceNf4::matvec`]) instead of dequantizing it: when this
/// thread is in [`InferenceMode`], `x` is on a CUDA device, the weight's codes are there too, the input has at most
/// [`MAX_ROWS`] rows and the fused kernels are on ([`crate::cuda::fused_kernels`]).
#[cfg(feature = "cuda")]
pub(crate) fn decoding_device_codes<'a>(
    weight: &'a FrozenWeight,
    x: &Tensor,
    rows: usize,
) -> Option<&'a DeviceNf4> {
    match weight {
        FrozenWeight::Nf4OnDevice(q)
            if x.device().is_cuda()
                && rows <= MAX_ROWS.min(DeviceNf4::MATVEC_MAX_ROWS)
                && InferenceMode::is_active()
                && crate::cuda::fused_kernels() =>
        {
            Some(q)
        }
        _ => None,
    }
}

/// A weight left in its file until used: each use reads it (and quantizes it, if the model is 4-bit) again. A model
/// so loaded holds almost none of its linear weights, which lets an export stream a model larger than memory.
pub trait DeferredWeight: Send + Sync + std::fmt::Debug {
    /// `(out_features, in_features)`.
    fn dims2(&self) -> (usize, usize);
    /// The weight as a model loaded at once would hold it (dense, or 4-bit).
    fn read(&self) -> Result<FrozenWeight>;
    /// The 4-bit format it is quantized to when read, if any.
    fn quantization(&self) -> Option<QuantConfig>;
    /// Elements `range` of the weight taken flat (row-major), as stored (1-D, on the host), reading no more of
    /// its file than they take: what one rank of a sharded load reads of it. `None` for a weight stored in 4 bits
    /// (see [`DeferredWeight::read_4bit_blocks`]).
    fn read_elements(&self, range: std::ops::Range<usize>) -> Result<Option<Tensor>>;
    /// The bytes of its file that [`DeferredWeight::read_elements`] reads for elements `range` (the rows they lie
    /// in, for a file that stores rows in blocks).
    fn bytes_in_file(&self, range: std::ops::Range<usize>) -> Result<usize>;
    /// 4-bit blocks `blocks` of a weight stored in 4 bits, as stored, reading no more of its file than they take:
    /// what one rank of a sharded load reads of it. `None` for a weight stored as plain elements.
    fn read_4bit_blocks(&self, blocks: std::ops::Range<usize>) -> Result<Option<StoredBlocks>>;
}

/// A run of 4-bit blocks of a weight stored in 4 bits, as stored ([`DeferredWeight::read_4bit_blocks`]).
pub struct StoredBlocks {
    /// Their packed codes, two a byte (u8, 1-D, on any device).
    pub packed: Tensor,
    /// Their scales as stored, 1-D on any device: 8-bit codes (double quantization) or float32 absmax.
    pub scales: Tensor,
    /// The whole weight from every block's packed codes and scales, each joined in order.
    pub rebuild: Box<dyn FnOnce(Vec<u8>, Tensor) -> Result<Nf4Tensor> + Send>,
}

/// A frozen weight `[out_features, in_features]`.
#[derive(Clone, Debug)]
pub enum FrozenWeight {
    /// Stored as is (f32, f16 or bf16).
    Dense(Tensor),
    /// Stored in 4 bits (on the CPU).
    Nf4(Arc<Nf4Tensor>),
    /// Stored in 4 bits on a GPU, dequantized there.
    Nf4OnDevice(Arc<DeviceNf4>),
    /// Read from its file at each use.
    Deferred(Arc<dyn DeferredWeight>),
    /// Held as this rank's share of its layer's storage (FSDP's full sharding): the layer gathers the whole weight
    /// before it runs, and rebuilds it from this frame ([`WeightFrame::rebuild`]); the frame alone computes nothing.
    Sharded(Arc<WeightFrame>),
}

/// What a sharded weight keeps besides its storage: enough to rebuild the weight from the storage gathered from
/// every rank (see [`FrozenWeight::Sharded`]).
#[derive(Clone, Debug)]
pub enum WeightFrame {
    /// A dense weight: its one storage tensor is the flattened weight.
    Dense {
        /// `[out_features, in_features]`.
        shape: (usize, usize),
    },
    /// A 4-bit weight: its storage is [`DeviceNf4::storage`]'s; on the CPU it is rebuilt as an [`Nf4Tensor`].
    Nf4(DeviceNf4),
}

impl WeightFrame {
    /// `weight`'s frame and its storage tensors (1-D), which a rank shares out with its layer's: a dense weight is
    /// its one tensor; a 4-bit weight its codes and scales ([`DeviceNf4::storage`]).
    pub fn split(weight: &FrozenWeight) -> Result<(WeightFrame, Vec<Tensor>)> {
        let device_nf4 = |q: &DeviceNf4| -> Result<(WeightFrame, Vec<Tensor>)> {
            let frame = q.frame().map_err(candle_core::Error::wrap)?;
            Ok((WeightFrame::Nf4(frame), q.storage()))
        };
        match weight {
            FrozenWeight::Dense(t) => Ok((
                WeightFrame::Dense { shape: t.dims2()? },
                vec![t.flatten_all()?],
            )),
            FrozenWeight::Nf4(q) => {
                device_nf4(&DeviceNf4::new(q, &Device::Cpu).map_err(candle_core::Error::wrap)?)
            }
            FrozenWeight::Nf4OnDevice(q) => device_nf4(q),
            FrozenWeight::Deferred(d) => WeightFrame::split(&d.read()?),
            FrozenWeight::Sharded(_) => candle_core::bail!("this weight is sharded already"),
        }
    }

    /// The weight of this frame with `storage` (the tensors [`WeightFrame::split`] gave, gathered whole): on the
    /// CPU a 4-bit weight becomes an [`Nf4Tensor`] again, so the sharded model computes what the whole one does.
    pub fn rebuild(&self, storage: Vec<Tensor>) -> Result<FrozenWeight> {
        match self {
            WeightFrame::Dense { shape } => match <[Tensor; 1]>::try_from(storage) {
                Ok([t]) => Ok(FrozenWeight::Dense(t.reshape(*shape)?)),
                Err(parts) => {
                    candle_core::bail!("a dense weight has one storage tensor, not {}", parts.len())
                }
            },
            WeightFrame::Nf4(frame) => {
                let on_cpu = storage.first().is_some_and(|t| t.device().is_cpu());
                let q = frame
                    .with_storage(storage)
                    .map_err(candle_core::Error::wrap)?;
                Ok(match on_cpu {
                    true => {
                        FrozenWeight::Nf4(Arc::new(q.to_host().map_err(candle_core::Error::wrap)?))
                    }
                    false => FrozenWeight::Nf4OnDevice(Arc::new(q)),
                })
            }
        }
    }

    /// How many storage tensors [`WeightFrame::rebuild`] takes.
    pub fn parts(&self) -> usize {
        match self {
            WeightFrame::Dense { .. } => 1,
            WeightFrame::Nf4(q) => q.storage().len(),
        }
    }

    /// The 4-bit format of the weight, if it is 4-bit.
    pub fn quantization(&self) -> Option<QuantConfig> {
        match self {
            WeightFrame::Dense { .. } => None,
            WeightFrame::Nf4(q) => Some(q.config()),
        }
    }
}

impl FrozenWeight {
    /// `(out_features, in_features)`.
    pub fn dims2(&self) -> Result<(usize, usize)> {
        match self {
            FrozenWeight::Dense(t) => t.dims2(),
            FrozenWeight::Nf4(q) => two_dims(q.shape()),
            FrozenWeight::Nf4OnDevice(q) => two_dims(q.shape()),
            FrozenWeight::Deferred(d) => Ok(d.dims2()),
            FrozenWeight::Sharded(frame) => match frame.as_ref() {
                WeightFrame::Dense { shape } => Ok(*shape),
                WeightFrame::Nf4(q) => two_dims(q.shape()),
            },
        }
    }

    /// The weight as a dense tensor of `dtype` (dequantized for 4-bit weights).
    pub fn to_dense(&self, dtype: DType) -> Result<Tensor> {
        // 4-bit weights dequantize straight to a float dtype, through float32 to any other.
        let via = if matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            dtype
        } else {
            DType::F32
        };
        let dense = match self {
            FrozenWeight::Dense(t) => return t.to_dtype(dtype),
            FrozenWeight::Nf4(q) => q.dequantize(via),
            FrozenWeight::Nf4OnDevice(q) => q.dequantize(via),
            FrozenWeight::Deferred(d) => return d.read()?.to_dense(dtype),
            FrozenWeight::Sharded(_) => return Err(sharded_use()),
        };
        dense.map_err(candle_core::Error::wrap)?.to_dtype(dtype)
    }

    /// The weight on `device`: dense weights are copied there; a 4-bit weight keeps its 4-bit codes, on a GPU as
    /// [`FrozenWeight::Nf4OnDevice`].
    pub fn to_device(&self, device: &Device) -> Result<FrozenWeight> {
        Ok(match self {
            FrozenWeight::Dense(t) => FrozenWeight::Dense(t.to_device(device)?),
            FrozenWeight::Nf4(q) if !device.is_cpu() => FrozenWeight::Nf4OnDevice(Arc::new(
                DeviceNf4::new(q, device).map_err(candle_core::Error::wrap)?,
            )),
            FrozenWeight::Nf4OnDevice(q) if q.device().same_device(device) => self.clone(),
            FrozenWeight::Nf4OnDevice(_) => {
                candle_core::bail!("a 4-bit weight on one GPU cannot move to another device")
            }
            FrozenWeight::Nf4(_) => self.clone(),
            FrozenWeight::Deferred(_) if device.is_cpu() => self.clone(),
            FrozenWeight::Deferred(d) => d.read()?.to_device(device)?,
            FrozenWeight::Sharded(_) => return Err(sharded_use()),
        })
    }

    /// Bytes the stored weight takes in memory (none while it waits in its file; a sharded weight's share is its
    /// layer's).
    pub fn size_in_bytes(&self) -> usize {
        match self {
            FrozenWeight::Dense(t) => t.elem_count() * t.dtype().size_in_bytes(),
            FrozenWeight::Nf4(q) => q.size_in_bytes(),
            FrozenWeight::Nf4OnDevice(q) => q.size_in_bytes(),
            FrozenWeight::Deferred(_) | FrozenWeight::Sharded(_) => 0,
        }
    }
}

/// The error of a sharded weight used outside its layer's gathered run.
fn sharded_use() -> candle_core::Error {
    candle_core::Error::Msg(
        "this weight is sharded across the ranks (FSDP): only its layer's run, which gathers it, uses it".into(),
    )
}

fn two_dims(shape: &[usize]) -> Result<(usize, usize)> {
    match shape {
        [o, i] => Ok((*o, *i)),
        s => candle_core::bail!("4-bit linear weight must be 2-D, got {s:?}"),
    }
}

/// A linear layer whose weight (and bias) are frozen.
#[derive(Clone, Debug)]
pub struct FrozenLinear {
    /// `[out_features, in_features]`.
    pub weight: FrozenWeight,
    /// `[out_features]`, frozen too.
    pub bias: Option<Tensor>,
}

impl FrozenLinear {
    /// A layer from a weight and an optional bias.
    pub fn new(weight: FrozenWeight, bias: Option<Tensor>) -> Self {
        FrozenLinear { weight, bias }
    }

    /// The layer on `device` (see [`FrozenWeight::to_device`]).
    pub fn to_device(&self, device: &Device) -> Result<FrozenLinear> {
        Ok(FrozenLinear {
            weight: self.weight.to_device(device)?,
            bias: self
                .bias
                .as_ref()
                .map(|b| b.to_device(device))
                .transpose()?,
        })
    }

    /// `x·Wᵀ (+ b)` for `x` of shape `[..., in_features]`, differentiable with respect to `x` only.
    pub fn forward(self: &Arc<Self>, x: &Tensor) -> Result<Tensor> {
        frozen_linear(x, self)
    }
}

/// `x·Wᵀ` with `W` as a dense tensor: flattens the leading dimensions into one matmul.
fn matmul_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let k = *dims.last().unwrap_or(&0);
    let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
    let y = x.reshape((rows, k))?.matmul(&w.t()?)?;
    let mut out = dims;
    if let Some(last) = out.last_mut() {
        *last = w.dim(0)?;
    }
    y.reshape(out)
}

/// `x·Wᵀ (+ b)` with a frozen layer (see [`FrozenLinear`]).
pub fn frozen_linear(x: &Tensor, layer: &Arc<FrozenLinear>) -> Result<Tensor> {
    FrozenLinearOp(layer.clone()).apply([x])
}

/// The frozen linear op (input `x`): Candle's matmul with the weight dense in `x`'s dtype, in both directions —
/// or, for a decoding step in [`InferenceMode`], the product with the 4-bit codes ([`decoding_codes`]).
struct FrozenLinearOp(Arc<FrozenLinear>);

impl FrozenLinearOp {
    /// `x·Wᵀ (+ b)` for `x` of a decoding step: from the 4-bit codes where [`decoding_codes`] (a CPU float32 `x`)
    /// or [`decoding_device_codes`] (a GPU) gives them, or from a CPU bfloat16 weight read in place; `None`
    /// elsewhere.
    fn decode_step(&self, x: &Tensor) -> Result<Option<Tensor>> {
        let layer = &self.0;
        if x.rank() == 0 {
            return Ok(None);
        }
        let mut dims = x.dims().to_vec();
        let (rows, inp) = (
            dims[..dims.len() - 1].iter().product(),
            dims[dims.len() - 1],
        );
        let out = layer.weight.dims2()?.0;
        let y = self.decode_rows(x, rows, inp)?;
        let Some(y) = y else { return Ok(None) };
        if let Some(last) = dims.last_mut() {
            *last = out;
        }
        let y = y.reshape(dims)?;
        Ok(Some(match &layer.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(x.dtype())?)?,
            None => y,
        }))
    }

    /// `x·Wᵀ` as `[rows, out_features]` by a decoding kernel (see [`FrozenLinearOp::decode_step`]), if one applies.
    fn decode_rows(&self, x: &Tensor, rows: usize, inp: usize) -> Result<Option<Tensor>> {
        let weight = &self.0.weight;
        #[cfg(feature = "cuda")]
        if let Some(q) = decoding_device_codes(weight, x, rows) {
            return Ok(Some(q.matvec(&x.reshape((rows, inp))?)?));
        }
        if !(x.dtype() == DType::F32 && x.device().is_cpu()) {
            return Ok(None);
        }
        let out = weight.dims2()?.0;
        let y = match (weight, decoding_codes(weight, rows)) {
            (_, Some(q)) => with_slice::<f32, _>(x, |xs| nf4_matvec(q, xs, rows))?,
            (FrozenWeight::Dense(w), None)
                if w.dtype() == DType::BF16
                    && w.device().is_cpu()
                    && rows <= MAX_ROWS
                    && InferenceMode::is_active() =>
            {
                with_slice::<f32, _>(x, |xs| {
                    with_elements([w], |[ws]| bf16_matvec(ws, out, xs, rows))
                })?
            }
            _ => return Ok(None),
        };
        debug_assert_eq!(x.elem_count(), rows * inp);
        Ok(Some(Tensor::from_vec(y, (rows, out), &Device::Cpu)?))
    }
}

impl Op<1> for FrozenLinearOp {
    const NAME: &'static str = "frozen-linear";

    fn fwd(&mut self, [x]: [&Tensor; 1]) -> Result<Value> {
        if let Some(y) = self.decode_step(x)? {
            return Ok(Value::Tensor(y));
        }
        let layer = &self.0;
        let dtype = x.dtype();
        let w = layer.weight.to_dense(dtype)?;
        let y = matmul_t(&x.detach().contiguous()?, &w)?;
        Ok(Value::Tensor(match &layer.bias {
            Some(b) => y.broadcast_add(&b.to_dtype(dtype)?)?,
            None => y,
        }))
    }

    // The backward (never taken in generation) dequantizes as always: gradients do not depend on the forward's path.
    fn bwd(&self, _: [&Tensor; 1], grad: &Tensor, _: [bool; 1]) -> Result<[Option<Tensor>; 1]> {
        let w = self.0.weight.to_dense(grad.dtype())?;
        let dims = grad.dims().to_vec();
        let rows: usize = dims[..dims.len() - 1].iter().product();
        let gx = grad
            .contiguous()?
            .reshape((rows, dims[dims.len() - 1]))?
            .matmul(&w)?;
        let mut out = dims;
        if let Some(last) = out.last_mut() {
            *last = w.dim(1)?;
        }
        Ok([Some(gx.reshape(out)?)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{
        check, f32_chain_bound, max_abs_diff, rand_f64, F32_UNIT_ROUNDOFF,
    };
    use crate::quant::QuantConfig;

    #[test]
    fn dense_gradient_matches_finite_differences_and_composite() {
        let w = rand_f64(&[7, 5], 1);
        let b = rand_f64(&[7], 2);
        let layer = Arc::new(FrozenLinear::new(
            FrozenWeight::Dense(w.clone()),
            Some(b.clone()),
        ));
        let f = move |xs: &[Tensor]| frozen_linear(&xs[0], &layer);
        let reference = move |xs: &[Tensor]| xs[0].broadcast_matmul(&w.t()?)?.broadcast_add(&b);
        check(
            &f,
            &reference,
            &[rand_f64(&[2, 3, 5], 3)],
            &[true],
            30,
            1e-6,
            1e-12,
        );
    }

    #[test]
    fn nf4_weight_is_dequantized_inside_the_op() {
        let w32 = rand_f64(&[64, 32], 4).to_dtype(DType::F32).unwrap();
        let q = Arc::new(Nf4Tensor::quantize(&w32, &QuantConfig::nf4()).unwrap());
        let deq = q
            .dequantize(DType::F32)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let layer = Arc::new(FrozenLinear::new(FrozenWeight::Nf4(q), None));
        let f = move |xs: &[Tensor]| frozen_linear(&xs[0], &layer);
        let reference = move |xs: &[Tensor]| xs[0].broadcast_matmul(&deq.t()?);
        check(
            &f,
            &reference,
            &[rand_f64(&[3, 32], 5)],
            &[true],
            20,
            1e-6,
            1e-12,
        );
    }

    #[test]
    fn inference_mode_multiplies_by_the_codes_and_only_there() {
        let w32 = rand_f64(&[48, 128], 8).to_dtype(DType::F32).unwrap();
        let bias = rand_f64(&[48], 9).to_dtype(DType::F32).unwrap();
        let q = Arc::new(Nf4Tensor::quantize(&w32, &QuantConfig::nf4()).unwrap());
        let deq = q.dequantize(DType::F32).unwrap();
        let layer = Arc::new(FrozenLinear::new(FrozenWeight::Nf4(q), Some(bias.clone())));
        let bits = |t: &Tensor| -> Vec<u32> {
            let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        // Decoding shapes, and a prompt too long for the kernel.
        for dims in [vec![1, 1, 128], vec![2, 4, 128], vec![1, 9, 128]] {
            let x = rand_f64(&dims, 10).to_dtype(DType::F32).unwrap();
            let dense = x
                .broadcast_matmul(&deq.t().unwrap())
                .unwrap()
                .broadcast_add(&bias)
                .unwrap();
            let plain = frozen_linear(&x, &layer).unwrap();
            assert_eq!(
                bits(&plain),
                bits(&dense),
                "outside inference mode: the GEMM's bits"
            );
            let (inner, after) = {
                let _outer = InferenceMode::enter();
                let inner = {
                    let _nested = InferenceMode::enter();
                    frozen_linear(&x, &layer).unwrap()
                };
                assert!(
                    InferenceMode::is_active(),
                    "a nested guard restores the outer mode"
                );
                (inner, frozen_linear(&x, &layer).unwrap())
            };
            assert!(!InferenceMode::is_active());
            assert_eq!(inner.dims(), dense.dims());
            assert_eq!(bits(&inner), bits(&after));
            let diff = max_abs_diff(
                &inner.to_dtype(DType::F64).unwrap(),
                &dense.to_dtype(DType::F64).unwrap(),
            );
            // Two float32 products of the same values (the kernel's order against the GEMM's), each plus the bias
            // (one more rounding of the result).
            let sum = dense
                .to_dtype(DType::F64)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap();
            let added = F32_UNIT_ROUNDOFF * sum.to_scalar::<f64>().unwrap();
            let bound = 2.0 * (f32_chain_bound(&x, &[&deq]) + added);
            assert!(diff <= bound, "{dims:?}: {diff} beyond {bound}");
            let rows: usize = dims[..2].iter().product();
            if rows > super::MAX_ROWS {
                assert_eq!(bits(&inner), bits(&dense), "too many rows: the GEMM");
            } else {
                assert_ne!(
                    bits(&inner),
                    bits(&dense),
                    "{dims:?}: the kernel's own summation order"
                );
            }
        }
    }

    /// A bf16 weight in inference mode is read as stored: the same values as converting it to float32 first (to the
    /// order of the sums), for 1 and 3 rows; more rows than a decoding step take the GEMM.
    #[test]
    fn inference_mode_reads_a_bf16_weight_in_place() {
        let w = Tensor::randn(0f32, 0.5, (70, 96), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let layer = Arc::new(FrozenLinear::new(FrozenWeight::Dense(w.clone()), None));
        for rows in [1, 3, MAX_ROWS + 1] {
            let x = Tensor::randn(0f32, 1.0, (1, rows, 96), &Device::Cpu).unwrap();
            let plain = frozen_linear(&x, &layer).unwrap();
            let decoded = {
                let _mode = InferenceMode::enter();
                frozen_linear(&x, &layer).unwrap()
            };
            assert_eq!(decoded.dims(), plain.dims());
            let diff = max_abs_diff(
                &decoded.to_dtype(DType::F64).unwrap(),
                &plain.to_dtype(DType::F64).unwrap(),
            );
            // Two float32 products of the same values (the bf16 weights hold exactly in float32).
            let bound = 2.0 * f32_chain_bound(&x, &[&w]);
            assert!(diff <= bound, "{rows} rows: {diff} beyond {bound}");
        }
    }

    #[test]
    fn frozen_weight_gets_no_gradient_entry() {
        let w = rand_f64(&[4, 3], 6);
        let layer = Arc::new(FrozenLinear::new(FrozenWeight::Dense(w), None));
        let x = candle_core::Var::from_tensor(&rand_f64(&[2, 3], 7)).unwrap();
        let grads = frozen_linear(&x, &layer)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert_eq!(grads.get_ids().count(), 1, "only the input has a gradient");
    }
}
