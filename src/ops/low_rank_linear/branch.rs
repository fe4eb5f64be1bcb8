//! What a call of the op is made of: the low-rank branch (its factors, scale and dropout), whether the output's
//! value is wanted, the dropout mask (a pure function of its seed), and the shapes of the call.

use candle_core::{DType, Device, Result, Tensor};

use crate::ops::frozen_linear::FrozenLinear;
use crate::rng::uniform;

/// The low-rank branch of a projection: `scaling · (dropout(x)·Aᵀ)·Bᵀ`.
#[derive(Clone, Copy, Debug)]
pub struct LowRank<'a> {
    /// `A`: `[r, in_features]`, trainable.
    pub a: &'a Tensor,
    /// `B`: `[out_features, r]`, trainable.
    pub b: &'a Tensor,
    /// The update's scale (`lora_alpha / r` for LoRA).
    pub scaling: f64,
    /// Dropout on the branch's input, when training with it.
    pub dropout: Option<BranchDropout>,
}

/// Dropout on the branch's input: probability and mask seed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BranchDropout {
    /// Probability of dropping an element.
    pub p: f64,
    /// Seed of the mask.
    pub seed: u64,
}

/// Whether [`low_rank_linear`](crate::ops::low_rank_linear::low_rank_linear) computes its output's value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputValue {
    /// The output holds `x·Wᵀ (+ b) + s·(dropout(x)·Aᵀ)·Bᵀ`.
    Computed,
    /// The output's value is not computed — it takes no memory and must not be read — and only its gradients are
    /// right: for a recomputation whose output value nobody reads ([`crate::ops::Pass::Recompute`], whose
    /// backward starts from the output's gradient). Honoured by the CPU slice path; the composed path computes the
    /// value anyway.
    Skipped,
}

/// The `n` values of the inverted-dropout mask (`0` or `1/(1−p)`) for stream `seed`.
pub(super) fn mask_values<T: candle_core::WithDType>(seed: u64, p: f64, n: usize) -> Vec<T> {
    let keep = 1.0 - p;
    let kept = T::from_f64((1.0 / keep) as f32 as f64);
    (0..n as u64)
        .map(|i| {
            if uniform(seed, i) < keep {
                kept
            } else {
                T::zero()
            }
        })
        .collect()
}

/// The inverted-dropout mask (`0` or `1/(1−p)`) of `dims` for stream `seed`: a pure function of its arguments,
/// made where it is used (on a CUDA device by a kernel, bit-identical to the CPU's).
pub fn dropout_mask(
    seed: u64,
    p: f64,
    dims: &[usize],
    dtype: DType,
    device: &Device,
) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return match dtype {
            DType::F32 => cuda_mask::<f32>(cuda, seed, p, dims, dtype),
            DType::BF16 => cuda_mask::<half::bf16>(cuda, seed, p, dims, dtype),
            DType::F16 => cuda_mask::<half::f16>(cuda, seed, p, dims, dtype),
            other => cuda_mask::<f32>(cuda, seed, p, dims, DType::F32)?.to_dtype(other),
        };
    }
    Tensor::from_vec(mask_values::<f32>(seed, p, n), dims, device)?.to_dtype(dtype)
}

/// [`dropout_mask`] made on a CUDA device (`kernels/dropout.cu`).
#[cfg(feature = "cuda")]
fn cuda_mask<T>(
    device: &candle_core::CudaDevice,
    seed: u64,
    p: f64,
    dims: &[usize],
    dtype: DType,
) -> Result<Tensor>
where
    T: candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
{
    use crate::cuda::{alloc, grid, kernel, run, suffix, tensor, DROPOUT};
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    let n: usize = dims.iter().product();
    let (keep, count) = (1.0 - p, n as u64);
    let mut out = alloc::<T>(device, n)?;
    let func = kernel(device, &DROPOUT, &format!("dropout_mask{}", suffix(dtype)?))?;
    let mut args = func.builder();
    args.arg(&seed).arg(&keep).arg(&count).arg(&mut out);
    run(&mut args, grid(count))?;
    Ok(tensor(out, device, dims))
}

/// The shapes of a call on `x: [..., in]`.
#[derive(Clone, Debug)]
pub(super) struct CallShapes {
    /// `x`'s dims.
    pub(super) dims: Vec<usize>,
    /// Input features.
    pub(super) inp: usize,
    /// Rows of the flattened input.
    pub(super) rows: usize,
    /// Output features.
    pub(super) out: usize,
    /// The output's dims.
    pub(super) out_dims: Vec<usize>,
}

impl CallShapes {
    /// The shapes of a call on `dims` through `base`.
    pub(super) fn of_dims(dims: &[usize], base: &FrozenLinear) -> Result<Self> {
        let dims = dims.to_vec();
        let inp = *dims.last().unwrap_or(&0);
        let rows: usize = dims[..dims.len().saturating_sub(1)].iter().product();
        let (out, _) = base.weight.dims2()?;
        let mut out_dims = dims.clone();
        if let Some(last) = out_dims.last_mut() {
            *last = out;
        }
        Ok(CallShapes {
            dims,
            inp,
            rows,
            out,
            out_dims,
        })
    }
}
