//! The optimizers' updates on a CUDA device (`kernels/adamw.cu`): each parameter is updated in place by one kernel,
//! with no copy of the parameter or its gradient to the host. The kernels repeat the host loops' float32 operations
//! in order (no fused multiply-adds), so the state and parameters are those of the same update on the CPU.
//!
//! The state lives in device memory, or — for the paged optimizers — in pinned host memory: before a parameter's
//! update its state is copied into a staging buffer on the device (asynchronously, on the compute stream), updated
//! there, and copied back, so the device holds only the largest parameter's state at a time. The copies and the
//! kernel run in stream order, one parameter after another; the host never waits for them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaContext, CudaSlice, CudaViewMut, DeviceRepr, PinnedHostSlice, PushKernelArg,
    ValidAsZeroBits,
};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{CpuStorage, CudaStorage, DType, InplaceOp2, Layout, Result, Tensor, Var};

use super::adamw::TorchStep;
use super::adamw8bit::{Adam8bitState, BnbStep, BLOCK};
use super::config::{OptimizerConfig, OptimizerName};
use super::state::ParamState;
use crate::cuda::{grid, kernel, run, ADAMW};
use crate::quant::dynamic_map::{signed_map, unsigned_map};

/// The buffers of one parameter's AdamW state: float32 buffers `F` and byte buffers `B`.
pub(crate) enum Moments<F, B> {
    /// Float32 moments.
    Adam32 { m: F, v: F },
    /// bitsandbytes' 8-bit moments and their absmax per 256 elements.
    Adam8 {
        state1: B,
        state2: B,
        absmax1: F,
        absmax2: F,
    },
}

impl<F, B> Moments<F, B> {
    /// The same state with each buffer mapped by `f` (float32) or `b` (bytes).
    fn map<F2, B2>(
        self,
        mut f: impl FnMut(F) -> Result<F2>,
        mut b: impl FnMut(B) -> Result<B2>,
    ) -> Result<Moments<F2, B2>> {
        Ok(match self {
            Moments::Adam32 { m, v } => Moments::Adam32 { m: f(m)?, v: f(v)? },
            Moments::Adam8 {
                state1,
                state2,
                absmax1,
                absmax2,
            } => Moments::Adam8 {
                state1: b(state1)?,
                state2: b(state2)?,
                absmax1: f(absmax1)?,
                absmax2: f(absmax2)?,
            },
        })
    }

    /// References to the buffers.
    fn as_ref(&self) -> Moments<&F, &B> {
        match self {
            Moments::Adam32 { m, v } => Moments::Adam32 { m, v },
            Moments::Adam8 {
                state1,
                state2,
                absmax1,
                absmax2,
            } => Moments::Adam8 {
                state1,
                state2,
                absmax1,
                absmax2,
            },
        }
    }

    /// Mutable references to the buffers.
    fn as_mut(&mut self) -> Moments<&mut F, &mut B> {
        match self {
            Moments::Adam32 { m, v } => Moments::Adam32 { m, v },
            Moments::Adam8 {
                state1,
                state2,
                absmax1,
                absmax2,
            } => Moments::Adam8 {
                state1,
                state2,
                absmax1,
                absmax2,
            },
        }
    }

    /// Bytes held, from the element counts `f` and `b` give of a float32 and a byte buffer.
    fn bytes(&self, f: impl Fn(&F) -> usize, b: impl Fn(&B) -> usize) -> usize {
        match self {
            Moments::Adam32 { m, v } => 4 * (f(m) + f(v)),
            Moments::Adam8 {
                state1,
                state2,
                absmax1,
                absmax2,
            } => b(state1) + b(state2) + 4 * (f(absmax1) + f(absmax2)),
        }
    }
}

/// The host state as moments (`None` for SGD, which has none here).
fn host_moments(state: &ParamState) -> Option<Moments<&[f32], &[u8]>> {
    Some(match state {
        ParamState::Adam32 { m, v } => Moments::Adam32 { m, v },
        ParamState::Adam8(s) => Moments::Adam8 {
            state1: &s.state1,
            state2: &s.state2,
            absmax1: &s.absmax1,
            absmax2: &s.absmax2,
        },
        ParamState::Adam64 { .. } | ParamState::Sgd(_) => return None,
    })
}

/// Moments read back into a host state.
fn to_param_state(moments: Moments<Vec<f32>, Vec<u8>>) -> ParamState {
    match moments {
        Moments::Adam32 { m, v } => ParamState::Adam32 { m, v },
        Moments::Adam8 {
            state1,
            state2,
            absmax1,
            absmax2,
        } => ParamState::Adam8(Adam8bitState {
            state1,
            state2,
            absmax1,
            absmax2,
        }),
    }
}

/// One parameter's AdamW state for updates on a CUDA device.
pub(crate) enum CudaState {
    /// In device memory.
    Resident(Moments<CudaSlice<f32>, CudaSlice<u8>>),
    /// In pinned host memory, staged through the device for each update (the paged optimizers).
    Paged(Moments<PinnedHostSlice<f32>, PinnedHostSlice<u8>>),
}

impl CudaState {
    /// `state` placed for updates on the device of `var` (in pinned host memory when `paged`), when the update
    /// runs there: a float32 parameter on a CUDA device and an AdamW state. `None` keeps the state on the host.
    pub(crate) fn place(state: &ParamState, var: &Var, paged: bool) -> Result<Option<Self>> {
        let candle_core::Device::Cuda(device) = var.device() else {
            return Ok(None);
        };
        if var.elem_count() == 0 {
            return Ok(None); // nothing to update (and no zero-byte pinned allocation)
        }
        let Some(host) = host_moments(state).filter(|_| var.dtype() == DType::F32) else {
            return Ok(None);
        };
        if !paged {
            return Ok(Some(CudaState::Resident(
                host.map(|f| device.clone_htod(f), |b| device.clone_htod(b))?,
            )));
        }
        let context = device.cuda_stream().context().clone();
        fn pinned<T: Copy + DeviceRepr + ValidAsZeroBits>(
            context: &Arc<CudaContext>,
            values: &[T],
        ) -> Result<PinnedHostSlice<T>> {
            // SAFETY: every element is written below before the buffer is read.
            let mut slice = unsafe { context.alloc_pinned_with_flags::<T>(values.len(), 0) }
                .map_err(candle_core::Error::wrap)?;
            slice
                .as_mut_slice()
                .map_err(candle_core::Error::wrap)?
                .copy_from_slice(values);
            Ok(slice)
        }
        Ok(Some(CudaState::Paged(
            host.map(|f| pinned(&context, f), |b| pinned(&context, b))?,
        )))
    }

    /// The state copied back to the host (to save it).
    pub(crate) fn download(&self, device: &CudaDevice) -> Result<ParamState> {
        let moments = match self {
            CudaState::Resident(m) => m
                .as_ref()
                .map(|f| device.clone_dtoh(f), |b| device.clone_dtoh(b))?,
            CudaState::Paged(m) => m.as_ref().map(
                |f| Ok(f.as_slice().map_err(candle_core::Error::wrap)?.to_vec()),
                |b| Ok(b.as_slice().map_err(candle_core::Error::wrap)?.to_vec()),
            )?,
        };
        Ok(to_param_state(moments))
    }

    /// Bytes of state (device memory when resident, pinned host memory when paged).
    pub(crate) fn bytes(&self) -> usize {
        match self {
            CudaState::Resident(m) => m.bytes(|s| s.len(), |s| s.len()),
            CudaState::Paged(m) => m.bytes(|s| s.len(), |s| s.len()),
        }
    }
}

/// The device buffers paged states are staged through (one per buffer of a state), each grown to the largest
/// parameter's, on the device of the last update.
#[derive(Default)]
pub(crate) struct Staging {
    device: Option<DeviceId>,
    floats: [Option<CudaSlice<f32>>; 2],
    bytes: [Option<CudaSlice<u8>>; 2],
}

impl Staging {
    /// Views of the staging buffers shaped like `pinned`, filled with its values (queued on the stream).
    fn stage_in<'a>(
        &'a mut self,
        device: &CudaDevice,
        pinned: &Moments<PinnedHostSlice<f32>, PinnedHostSlice<u8>>,
    ) -> Result<Moments<CudaViewMut<'a, f32>, CudaViewMut<'a, u8>>> {
        if self.device != Some(device.id()) {
            // Parameters on another device: its own buffers.
            *self = Staging {
                device: Some(device.id()),
                ..Default::default()
            };
        }
        let [f0, f1] = &mut self.floats;
        let [b0, b1] = &mut self.bytes;
        let (mut floats, mut bytes) = ([f0, f1].into_iter(), [b0, b1].into_iter());
        pinned.as_ref().map(
            |from| stage(floats.next().expect("two float buffers"), device, from),
            |from| stage(bytes.next().expect("two byte buffers"), device, from),
        )
    }
}

/// `from` copied into `buffer` (grown if it is smaller), as a view of its length.
fn stage<'a, T: DeviceRepr + 'static>(
    buffer: &'a mut Option<CudaSlice<T>>,
    device: &CudaDevice,
    from: &PinnedHostSlice<T>,
) -> Result<CudaViewMut<'a, T>> {
    let len = from.len();
    if buffer.as_ref().is_none_or(|b| b.len() < len) {
        *buffer = None; // free the old buffer before the larger one is allocated
                        // SAFETY: only the part the copy below fills is read.
        *buffer = Some(unsafe { device.alloc::<T>(len.max(1))? });
    }
    let mut view = buffer.as_mut().expect("allocated above").slice_mut(..len);
    device.memcpy_htod(from, &mut view)?;
    Ok(view)
}

/// Update `step` (from 1) of `var` with its gradient `grad` and learning rate `lr`, in place on the device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn update(
    var: &Var,
    grad: &Tensor,
    state: &mut CudaState,
    staging: &mut Staging,
    config: &OptimizerConfig,
    step: u64,
    lr: f64,
    weight_decay: f64,
) -> Result<()> {
    let is_adam32 = matches!(
        state,
        CudaState::Resident(Moments::Adam32 { .. }) | CudaState::Paged(Moments::Adam32 { .. })
    );
    let rule = if is_adam32 && config.name == OptimizerName::AdamWTorch {
        Rule::Torch(TorchStep::new(
            step,
            lr,
            (config.beta1, config.beta2),
            config.eps,
            weight_decay,
        ))
    } else {
        Rule::Bnb(BnbStep::new(
            step,
            lr as f32,
            (config.beta1 as f32, config.beta2 as f32),
            config.eps as f32,
            weight_decay as f32,
        ))
    };
    let grad = grad.to_dtype(DType::F32)?.contiguous()?;
    let device = var.device().as_cuda_device()?.clone();
    let apply = |views| {
        let op = Update {
            views: Mutex::new(views),
            rule,
        };
        var.as_tensor().inplace_op2(&grad, &op)?;
        op.views
            .into_inner()
            .map_err(|_| candle_core::Error::Msg("optimizer state lock poisoned".into()))
    };
    match state {
        CudaState::Resident(moments) => {
            apply(
                moments
                    .as_mut()
                    .map(|f| Ok(f.slice_mut(..)), |b| Ok(b.slice_mut(..)))?,
            )?;
        }
        CudaState::Paged(pinned) => {
            let staged = apply(staging.stage_in(&device, pinned)?)?;
            // Back to the pinned buffers, queued after the kernel (host reads of them wait for the copies).
            match (&staged, pinned) {
                (Moments::Adam32 { m, v }, Moments::Adam32 { m: pm, v: pv }) => {
                    device.memcpy_dtoh(m, pm)?;
                    device.memcpy_dtoh(v, pv)?;
                }
                (
                    Moments::Adam8 {
                        state1,
                        state2,
                        absmax1,
                        absmax2,
                    },
                    Moments::Adam8 {
                        state1: p1,
                        state2: p2,
                        absmax1: a1,
                        absmax2: a2,
                    },
                ) => {
                    device.memcpy_dtoh(state1, p1)?;
                    device.memcpy_dtoh(state2, p2)?;
                    device.memcpy_dtoh(absmax1, a1)?;
                    device.memcpy_dtoh(absmax2, a2)?;
                }
                _ => unreachable!("staged like the pinned state"),
            }
        }
    }
    Ok(())
}

/// Which update the kernel applies.
#[derive(Clone, Copy)]
enum Rule {
    Torch(TorchStep),
    Bnb(BnbStep),
}

/// The in-place update of a parameter (the op's first tensor) by its gradient (the second), with the state in
/// `views`.
struct Update<'a> {
    views: Mutex<Moments<CudaViewMut<'a, f32>, CudaViewMut<'a, u8>>>,
    rule: Rule,
}

impl InplaceOp2 for Update<'_> {
    fn name(&self) -> &'static str {
        "optimizer-update"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("the device optimizer update takes CUDA tensors")
    }

    fn cuda_fwd(
        &self,
        p: &mut CudaStorage,
        p_layout: &Layout,
        g: &CudaStorage,
        g_layout: &Layout,
    ) -> Result<()> {
        let n = p_layout.shape().elem_count();
        if !p_layout.is_contiguous()
            || !g_layout.is_contiguous()
            || g_layout.shape().elem_count() != n
        {
            candle_core::bail!(
                "optimizer update: parameter and gradient must be contiguous and of one size"
            );
        }
        let device = p.device().clone();
        let gv = g
            .as_cuda_slice::<f32>()?
            .slice(g_layout.start_offset()..g_layout.start_offset() + n);
        let start = p_layout.start_offset();
        let mut pv = p.as_cuda_slice_mut::<f32>()?.slice_mut(start..start + n);
        let mut views = self
            .views
            .lock()
            .map_err(|_| candle_core::Error::Msg("optimizer state lock poisoned".into()))?;
        let n64 = n as u64;
        let decay = |d: Option<f32>| (d.unwrap_or(1.0), i32::from(d.is_some()));
        match (&mut *views, self.rule) {
            (Moments::Adam32 { m, v }, Rule::Torch(s)) => {
                let k = kernel(&device, &ADAMW, "adamw_torch")?;
                let (decay, decays) = decay(s.decay);
                let mut args = k.builder();
                args.arg(&mut pv).arg(&gv).arg(m).arg(v).arg(&n64);
                args.arg(&s.w1)
                    .arg(&s.b2)
                    .arg(&s.w2)
                    .arg(&s.step_size)
                    .arg(&s.bc2);
                args.arg(&s.eps).arg(&decay).arg(&decays);
                run(&mut args, grid(n64))
            }
            (Moments::Adam32 { m, v }, Rule::Bnb(s)) => {
                let k = kernel(&device, &ADAMW, "adamw_bnb32")?;
                let (decay, decays) = decay(s.decay);
                let mut args = k.builder();
                args.arg(&mut pv).arg(&gv).arg(m).arg(v).arg(&n64);
                args.arg(&s.b1)
                    .arg(&s.b2)
                    .arg(&s.step_size)
                    .arg(&s.denom_eps);
                args.arg(&decay).arg(&decays);
                run(&mut args, grid(n64))
            }
            (
                Moments::Adam8 {
                    state1,
                    state2,
                    absmax1,
                    absmax2,
                },
                Rule::Bnb(s),
            ) => {
                let maps = quantization_maps(&device)?;
                let k = kernel(&device, &ADAMW, "adamw8bit")?;
                let (decay, decays) = decay(s.decay);
                let mut args = k.builder();
                args.arg(&mut pv)
                    .arg(&gv)
                    .arg(state1)
                    .arg(state2)
                    .arg(absmax1)
                    .arg(absmax2);
                args.arg(&maps.0).arg(&maps.1).arg(&n64);
                args.arg(&s.b1)
                    .arg(&s.b2)
                    .arg(&s.step_size)
                    .arg(&s.denom_eps);
                args.arg(&decay).arg(&decays);
                // One block of 256 threads per absmax block, grid-stride beyond the grid.
                const _: () = assert!(BLOCK == 256);
                run(&mut args, grid(n64))
            }
            (Moments::Adam8 { .. }, Rule::Torch(_)) => {
                candle_core::bail!("optimizer update: 8-bit state under torch AdamW")
            }
        }
    }
}

/// The signed and unsigned 8-bit dynamic maps on `device`, uploaded once per device.
fn quantization_maps(device: &CudaDevice) -> Result<Arc<(CudaSlice<f32>, CudaSlice<f32>)>> {
    type Maps = Mutex<HashMap<DeviceId, Arc<(CudaSlice<f32>, CudaSlice<f32>)>>>;
    static MAPS: OnceLock<Maps> = OnceLock::new();
    let mut maps = MAPS
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg("quantization map cache poisoned".into()))?;
    if let Some(m) = maps.get(&device.id()) {
        return Ok(m.clone());
    }
    let m = Arc::new((
        device.clone_htod(&signed_map()[..])?,
        device.clone_htod(&unsigned_map()[..])?,
    ));
    maps.insert(device.id(), m.clone());
    Ok(m)
}
