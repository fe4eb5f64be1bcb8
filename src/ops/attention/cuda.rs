//! Causal attention on a CUDA device: `kernels/attention.cu` (tensor cores, FlashAttention-2 style) for bf16/f16
//! heads of 64 or 128, with the causal, packed-row and sliding-window masks, the score soft-cap and the attention
//! sinks computed in the kernels.

use candle_core::cuda_backend::cudarc::driver::{
    result::DriverError, sys::CUfunction_attribute, LaunchConfig, PushKernelArg,
};
use candle_core::{DType, Result, Tensor};

use super::cpu::Dims;
use super::spec::{dq_kv_heads_per_launch, AttentionSpec, Segments, CUDA_HEAD_DIMS};
use crate::cuda::{alloc, device_of, grid, hold, kernel, run, storage, suffix, tensor, ATTENTION};
use crate::ops::autograd::op::Value;

/// Threads per block of the attention kernels (4 warps).
const THREADS: u32 = 128;
/// Query rows per forward block, keys per backward block (16 per warp); queries per backward tile.
const FWD_ROWS: usize = 64;
const FWD_KEYS: usize = 64;
const BWD_KEYS: usize = 64;
const BWD_QUERIES: usize = 32;

/// Whether the kernels take these inputs: bf16 or f16 on a GPU, one dtype, heads of 64 or 128.
pub(super) fn applies(q: &Tensor, k: &Tensor, v: &Tensor, dims: Dims) -> bool {
    q.device().is_cuda()
        && crate::cuda::fused_kernels()
        && matches!(q.dtype(), DType::BF16 | DType::F16)
        && k.dtype() == q.dtype()
        && v.dtype() == q.dtype()
        && CUDA_HEAD_DIMS.contains(&dims.d)
        && tiles_fit(q, dims.d)
}

/// Whether both kernels' tiles for head dim `d` fit the GPU's shared memory per block (with the opt-in): a T4
/// (64 KiB) has no room for the backward's tiles of heads of 128 (67 KiB), which then take the composed path.
fn tiles_fit(q: &Tensor, d: usize) -> bool {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    let Ok(device) = device_of(q) else {
        return false;
    };
    let limit = device
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_or(0, |b| b.max(0) as usize);
    fwd_shared_bytes(d).max(bwd_shared_bytes(d)) <= limit
}

/// Dynamic shared memory of the forward kernel for head dim `d` (the layout at the top of `attn_fwd`; the score
/// and probability tiles' rows are padded by 4 floats and 8 halves against bank conflicts).
fn fwd_shared_bytes(d: usize) -> usize {
    (FWD_ROWS * d + 2 * FWD_KEYS * d) * 2
        + FWD_ROWS * (FWD_KEYS + 4) * 4
        + FWD_ROWS * (FWD_KEYS + 8) * 2
}

/// Dynamic shared memory of the backward kernel for head dim `d` (the layout at the top of `attn_bwd`, padded as
/// the forward's).
fn bwd_shared_bytes(d: usize) -> usize {
    let halves = 2 * BWD_KEYS * d + 2 * BWD_QUERIES * d + 2 * BWD_KEYS * (BWD_QUERIES + 8);
    let floats = 4 * 16 * (BWD_QUERIES + 4) + 2 * BWD_QUERIES;
    halves * 2 + floats * 4
}

/// The segment starts on the device (u32 `[b · len]`), or a one-element placeholder without segments.
fn starts_on(segments: Option<&Segments>, like: &Tensor) -> Result<(Tensor, i32)> {
    Ok(match segments {
        Some(s) => {
            let starts = match s.on_device.get() {
                Some(t) if t.device().same_device(like.device()) => t.clone(),
                _ => {
                    let t = Tensor::new(s.starts.as_slice(), like.device())?;
                    // A batch's segments serve one device; should another ask, it gets its own upload.
                    let _ = s.on_device.set(t.clone());
                    t
                }
            };
            (starts, 1)
        }
        None => (Tensor::zeros(1, DType::U32, like.device())?, 0),
    })
}

/// The sinks on the device (f32 `[hq]`), or a one-element placeholder without sinks.
fn sinks_on(spec: &AttentionSpec, like: &Tensor) -> Result<(Tensor, i32)> {
    Ok(match &spec.sinks {
        Some(s) => {
            let sinks = match s.on_device.get() {
                Some(t) if t.device().same_device(like.device()) => t.clone(),
                _ => {
                    let t = Tensor::new(s.values(), like.device())?;
                    // A model's sinks serve one device; should another ask, it gets its own upload.
                    let _ = s.on_device.set(t.clone());
                    t
                }
            };
            (sinks, 1)
        }
        None => (Tensor::zeros(1, DType::F32, like.device())?, 0),
    })
}

/// The kernels' `window` (0: none) and `cap` (0: none) arguments.
fn window_and_cap(spec: &AttentionSpec) -> (u64, f32) {
    (
        spec.sliding_window.map_or(0, |w| w as u64),
        spec.softcap.map_or(0.0, |c| c as f32),
    )
}

/// Allows a kernel `bytes` of dynamic shared memory (above the 48 KiB default where needed).
fn allow_shared(func: &crate::cuda::Kernel, bytes: usize) -> Result<()> {
    func.function()
        .set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e: DriverError| candle_core::Error::wrap(e))
}

/// The attention output and each query row's log-sum-exp (float32 `[b, hq, t]`).
pub(super) fn forward(
    [q, k, v]: [&Tensor; 3],
    dims: Dims,
    spec: &AttentionSpec,
    segments: Option<&Segments>,
) -> Result<(Value, Tensor)> {
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let device = device_of(&q)?;
    let Dims { b, hkv, g, t, s, d } = dims;
    let hq = hkv * g;
    let (starts, has_starts) = starts_on(segments, &q)?;
    let (sinks, has_sinks) = sinks_on(spec, &q)?;
    let name = format!("attn_fwd{}_d{d}", suffix(q.dtype())?);
    let func = kernel(&device, &ATTENTION, &name)?;
    let shared = fwd_shared_bytes(d);
    allow_shared(&func, shared)?;
    let cfg = LaunchConfig {
        grid_dim: (t.div_ceil(FWD_ROWS) as u32, hq as u32, b as u32),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let (hq_u, hkv_u, t_u, s_u, scale) =
        (hq as u64, hkv as u64, t as u64, s as u64, spec.scale as f32);
    let (window, cap) = window_and_cap(spec);
    let mut lse = alloc::<f32>(&device, b * hq * t)?;
    let out = crate::cuda::with_float_type!(q.dtype(), T => {
        let mut out = alloc::<T>(&device, q.elem_count())?;
        let held = [hold(&q)?, hold(&k)?, hold(&v)?];
        let [qv, kv, vv] = [0, 1, 2].map(|i| held[i].view::<T>());
        let (qv, kv, vv) = (qv?, kv?, vv?);
        let (sh, nh) = (hold(&starts)?, hold(&sinks)?);
        let (sv, nv) = (sh.view::<u32>()?, nh.view::<f32>()?);
        let mut args = func.builder();
        args.arg(&qv)
            .arg(&kv)
            .arg(&vv)
            .arg(&sv)
            .arg(&has_starts)
            .arg(&nv)
            .arg(&has_sinks)
            .arg(&hq_u)
            .arg(&hkv_u)
            .arg(&t_u)
            .arg(&s_u)
            .arg(&scale)
            .arg(&window)
            .arg(&cap)
            .arg(&mut out)
            .arg(&mut lse);
        run(&mut args, cfg)?;
        storage(out, &device)
    });
    Ok((
        Value::Cuda(out, q.shape().clone()),
        tensor(lse, &device, (b, hq, t)),
    ))
}

/// Gradients of q, k and v (each when `needs` it) from the output `out`, its gradient and the saved log-sum-exp.
///
/// Sinks need nothing here: the log-sum-exp includes them (so `P = exp(S − lse)` is the forward's), and
/// `Δ = rowsum(dO ⊙ O) = rowsum(P ⊙ dP)` sums over the real keys, as `dS = P ⊙ (dP − Δ)` wants.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    [q, k, v]: [&Tensor; 3],
    out: &Tensor,
    grad: &Tensor,
    lse: &Tensor,
    dims: Dims,
    spec: &AttentionSpec,
    segments: Option<&Segments>,
    needs: [bool; 3],
) -> Result<[Option<Tensor>; 3]> {
    let dtype = q.dtype();
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (out, grad) = (out.contiguous()?, grad.to_dtype(dtype)?.contiguous()?);
    let device = device_of(&q)?;
    let Dims { b, hkv, g, t, s, d } = dims;
    let hq = hkv * g;
    let (starts, has_starts) = starts_on(segments, &q)?;
    let (rows, d_u) = ((b * hq * t) as u64, d as u64);
    let (hq_u, hkv_u, t_u, s_u, scale) =
        (hq as u64, hkv as u64, t as u64, s as u64, spec.scale as f32);
    let (window, cap) = window_and_cap(spec);
    let delta_fn = kernel(
        &device,
        &ATTENTION,
        &format!("attn_delta{}", suffix(dtype)?),
    )?;
    let bwd_fn = kernel(
        &device,
        &ATTENTION,
        &format!("attn_bwd{}_d{d}", suffix(dtype)?),
    )?;
    let shared = bwd_shared_bytes(d);
    allow_shared(&bwd_fn, shared)?;
    // The float32 dQ of `launch_heads` kv heads' query heads at a time (all of them unless the sequence is long),
    // each launch's turned into the compute dtype: the whole dQ, or its part of it.
    let launch_heads = dq_kv_heads_per_launch(b * t, hkv, g, d);
    let mut delta = alloc::<f32>(&device, b * hq * t)?;
    let (dq, dk, dv) = crate::cuda::with_float_type!(dtype, T => {
        let mut dk = alloc::<T>(&device, k.elem_count())?;
        let mut dv = alloc::<T>(&device, v.elem_count())?;
        // Several launches write their heads into the whole dQ (every head by one of them); one launch's is it.
        let whole = if launch_heads < hkv {
            Some(tensor(alloc::<T>(&device, q.elem_count())?, &device, q.shape().clone()))
        } else {
            None
        };
        let mut single = None;
        let held = [hold(&q)?, hold(&k)?, hold(&v)?, hold(&out)?, hold(&grad)?];
        let [qv, kv, vv, ov, gv] = [0, 1, 2, 3, 4].map(|i| held[i].view::<T>());
        let (qv, kv, vv, ov, gv) = (qv?, kv?, vv?, ov?, gv?);
        {
            let mut args = delta_fn.builder();
            args.arg(&gv).arg(&ov).arg(&rows).arg(&d_u).arg(&mut delta);
            run(&mut args, grid(rows))?;
        }
        let (lh, sh) = (hold(lse)?, hold(&starts)?);
        let (lv, sv) = (lh.view::<f32>()?, sh.view::<u32>()?);
        for hk0 in (0..hkv).step_by(launch_heads) {
            let heads = launch_heads.min(hkv - hk0);
            let mut dq_part = device.alloc_zeros::<f32>(b * heads * g * t * d)?;
            let hk0_u = hk0 as u64;
            let mut args = bwd_fn.builder();
            args.arg(&qv)
                .arg(&kv)
                .arg(&vv)
                .arg(&gv)
                .arg(&lv)
                .arg(&delta)
                .arg(&sv)
                .arg(&has_starts)
                .arg(&hq_u)
                .arg(&hkv_u)
                .arg(&t_u)
                .arg(&s_u)
                .arg(&scale)
                .arg(&window)
                .arg(&cap)
                .arg(&hk0_u)
                .arg(&mut dq_part)
                .arg(&mut dk)
                .arg(&mut dv);
            let cfg = LaunchConfig {
                grid_dim: (s.div_ceil(BWD_KEYS) as u32, heads as u32, b as u32),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: shared as u32,
            };
            run(&mut args, cfg)?;
            let part = tensor(dq_part, &device, (b, heads * g, t, d)).to_dtype(dtype)?;
            match &whole {
                Some(dq) => dq.slice_set(&part, 1, hk0 * g)?,
                None => single = Some(part),
            }
        }
        let dq = whole.or(single).ok_or_else(|| candle_core::Error::Msg("attention: no kv head".into()))?;
        (dq, tensor(dk, &device, k.shape().clone()), tensor(dv, &device, v.shape().clone()))
    });
    Ok([
        needs[0].then_some(dq),
        needs[1].then_some(dk),
        needs[2].then_some(dv),
    ])
}
