//! What the ops' CPU paths are built from: matrix products on slices ([`gemm`]), vectorized element-wise loops and
//! reductions ([`vector`], [`fastmath`]), the product of a few rows with a 4-bit or bfloat16 weight read in place
//! ([`nf4_matvec`], [`bf16_matvec`], for decoding), and access to a tensor's elements as a slice.
//!
//! An op takes its CPU path when its inputs are on the CPU in one float type the kernels are written for (f32 in
//! training, f64 in gradient checks): [`slice_dtype`] says which.

pub mod bf16_matvec;
pub mod fastmath;
pub mod gemm;
pub mod nf4_matvec;
pub mod vector;

use candle_core::{DType, Result, Shape, Storage, Tensor, WithDType};

use fastmath::{exp_f32, tanh_f32};

/// Element types the slice kernels run on.
pub trait CpuFloat: WithDType + Copy + Default + Send + Sync + 'static {
    /// `e^self`: float32 through [`exp_f32`] (vectorizable), float64 through libm.
    fn exp(self) -> Self;
    /// `tanh(self)`: float32 through [`tanh_f32`] (vectorizable), float64 through libm.
    fn tanh(self) -> Self;
}

impl CpuFloat for f32 {
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }

    #[inline(always)]
    fn tanh(self) -> Self {
        tanh_f32(self)
    }
}

impl CpuFloat for f64 {
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }

    #[inline(always)]
    fn tanh(self) -> Self {
        f64::tanh(self)
    }
}

/// The element type of the slice kernels for `tensors` — f32 or f64 when all are on the CPU in that dtype —, or
/// `None` when an op must compose Candle's ops instead.
pub fn slice_dtype(tensors: &[&Tensor]) -> Option<DType> {
    let dtype = tensors.first()?.dtype();
    let fits = tensors
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == dtype);
    (fits && matches!(dtype, DType::F32 | DType::F64)).then_some(dtype)
}

/// Runs `f` on the elements of a CPU tensor of element type `T`, made contiguous first (a no-op when it is).
pub fn with_slice<T: CpuFloat, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    with_slices([t], |[s]| f(s))
}

/// [`with_slice`] for several tensors at once.
pub fn with_slices<T: CpuFloat, R, const N: usize>(
    tensors: [&Tensor; N],
    f: impl FnOnce([&[T]; N]) -> Result<R>,
) -> Result<R> {
    with_elements(tensors, f)
}

/// [`with_slices`] for any element type Candle stores (bf16 weights read in place, say).
pub fn with_elements<T: WithDType, R, const N: usize>(
    tensors: [&Tensor; N],
    f: impl FnOnce([&[T]; N]) -> Result<R>,
) -> Result<R> {
    let contiguous = tensors
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let guards: Vec<_> = contiguous.iter().map(|t| t.storage_and_layout()).collect();
    let slices = guards
        .iter()
        .map(|(storage, layout)| -> Result<&[T]> {
            let Storage::Cpu(cpu) = &**storage else {
                candle_core::bail!("slice kernel: tensor is not on the CPU");
            };
            let all: &[T] = T::cpu_storage_as_slice(cpu)?;
            let (start, end) = layout.contiguous_offsets().ok_or_else(|| {
                candle_core::Error::Msg("slice kernel: layout not contiguous".into())
            })?;
            Ok(&all[start..end])
        })
        .collect::<Result<Vec<_>>>()?;
    let slices: [&[T]; N] = slices
        .try_into()
        .map_err(|_| candle_core::Error::Msg("slice kernel: input count".into()))?;
    f(slices)
}

/// A gradient computed on slices as a CPU tensor of `shape` (`None` where it was not computed).
pub fn gradient<T: CpuFloat>(values: Option<Vec<T>>, shape: &Shape) -> Result<Option<Tensor>> {
    values
        .map(|v| Tensor::from_vec(v, shape, &candle_core::Device::Cpu))
        .transpose()
}
