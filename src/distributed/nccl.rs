//! The NCCL communicator of a data-parallel job (feature `nccl`): one per process, over its GPU, created from the
//! rendezvous's unique id. Collectives run under a watchdog, as torch's ProcessGroupNCCL does: a peer that exited
//! (NCCL's asynchronous error) or a collective that has not finished within `ddp_timeout` aborts the communicator,
//! which ends the waiting call, and the error names the rank and what it was doing.
//!
//! An all-gather of a sharded model's weights may be started without waiting ([`Communicator::start_all_gather`]):
//! it runs on the communicator's own stream (as torch's process group does) after the compute stream's work so far,
//! the compute stream waits for it on an event when the gathered weights are used, and the watchdog follows it
//! until the event completes. Once that stream exists every collective runs there (one order of NCCL calls per
//! communicator); until then — a data-parallel job, which only all-reduces and waits — on the compute stream, so
//! data-parallel training adds no stream (cudarc records an event per buffer access once a device has two).

use std::collections::VecDeque;
use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::cuda_backend::cudarc::driver::{
    CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr,
};
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::{DType, Tensor};

use super::env::WorldEnv;
use super::rendezvous::share_from_rank0;
use crate::cuda::side_stream::{after_compute, made_once, mark, wait};
use crate::error::{Error, Result};
use crate::models::{Gathering, ShardExchange, ShardSource};

/// How [`Communicator::all_reduce`] combines the ranks' elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// The sum, in rank order.
    Sum,
    /// The largest.
    Max,
    /// The smallest.
    Min,
}

/// One NCCL collective: `(input, output, input elements, NCCL's dtype, communicator, stream)`. The caller
/// ([`Communicator::collective`]) passes device pointers to buffers of those sizes on the communicator's device and
/// stream, of the element type NCCL is told.
type NcclCall<'a> = Box<
    dyn FnOnce(
            *const std::ffi::c_void,
            *mut std::ffi::c_void,
            usize,
            sys::ncclDataType_t,
            sys::ncclComm_t,
            sys::cudaStream_t,
        ) -> std::result::Result<result::NcclStatus, result::NcclError>
        + 'a,
>;

/// A job's communicator on this process's GPU.
pub struct Communicator {
    shared: Arc<Shared>,
    watchdog: Option<JoinHandle<()>>,
}

/// What the caller and the watchdog share.
struct Shared {
    comm: Comm,
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    /// The communicator's own stream, made by the first all-gather started without waiting.
    stream: std::sync::OnceLock<Arc<CudaStream>>,
    timeout: Duration,
    state: Mutex<State>,
    aborted: AtomicBool,
}

#[derive(Default)]
struct State {
    /// The collective in flight: when it started and what it is ("the all-reduce of step 3's gradients").
    current: Option<(Instant, String)>,
    /// Collectives started without waiting, oldest first, until their event completes.
    started: VecDeque<(Instant, String, Arc<CudaEvent>)>,
    /// Why the watchdog aborted the communicator.
    fault: Option<String>,
    closed: bool,
}

/// NCCL's communicator handle. NCCL allows a communicator's abort from another thread while a call waits on it
/// (that is what the abort is for); every other call is made by the owning thread.
struct Comm(sys::ncclComm_t);
// SAFETY: see `Comm`: the watchdog thread only queries the asynchronous error and aborts.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Communicator {
    /// The communicator of `env`'s job on `device` (this rank's GPU): rank 0 makes NCCL's unique id and the
    /// rendezvous at `MASTER_ADDR:MASTER_PORT` hands it to the others; then every rank joins. `timeout`
    /// (`ddp_timeout`) bounds the rendezvous and every later collective.
    pub fn new(device: &CudaDevice, env: &WorldEnv, timeout: Duration) -> Result<Self> {
        let id_bytes = if env.is_main() {
            let id = result::get_uniqueid()
                .map_err(|e| nccl_error(env.rank, "ncclGetUniqueId", e, None))?;
            let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
            share_from_rank0(env, Some(&bytes), timeout)?
        } else {
            share_from_rank0(env, None, timeout)?
        };
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        if id_bytes.len() != id.internal.len() {
            return Err(Error::Distributed(format!(
                "rank {}: the rendezvous gave {} bytes, not an NCCL unique id (128)",
                env.rank,
                id_bytes.len()
            )));
        }
        for (dst, src) in id.internal.iter_mut().zip(&id_bytes) {
            *dst = *src as _;
        }
        device
            .cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(candle_core::Error::wrap)?;
        let mut comm = std::mem::MaybeUninit::uninit();
        // SAFETY: `comm` is written by a successful init; the id is rank 0's, the sizes checked by `WorldEnv`.
        let comm = unsafe {
            result::comm_init_rank(
                comm.as_mut_ptr(),
                env.world_size as i32,
                id,
                env.rank as i32,
            )
            .map_err(|e| nccl_error(env.rank, "joining the communicator", e, None))?;
            comm.assume_init()
        };
        let shared = Arc::new(Shared {
            comm: Comm(comm),
            rank: env.rank,
            world_size: env.world_size,
            device: device.clone(),
            stream: std::sync::OnceLock::new(),
            timeout,
            state: Mutex::new(State::default()),
            aborted: AtomicBool::new(false),
        });
        let watched = shared.clone();
        let watchdog = std::thread::Builder::new()
            .name(format!("nccl-watchdog-{}", env.rank))
            .spawn(move || watch(&watched))
            .map_err(|e| {
                Error::Distributed(format!("rank {}: cannot start the watchdog: {e}", env.rank))
            })?;
        Ok(Communicator {
            shared,
            watchdog: Some(watchdog),
        })
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }

    /// The number of ranks.
    pub fn world_size(&self) -> usize {
        self.shared.world_size
    }

    /// `t` reduced element-wise over all ranks by `op` (f64, f32, bf16 or f16, on this rank's GPU), finished when
    /// this returns; every rank gets the same bits. `what` says what it is for ("step 3's gradients"), for the
    /// error when a rank fails.
    pub fn all_reduce(&self, t: &Tensor, op: Reduce, what: &str) -> Result<Tensor> {
        if t.dtype() == DType::U8 {
            return Err(Error::Distributed(format!(
                "all-reduce of {what}: u8 tensors are not reduced (f64, f32, bf16 or f16)"
            )));
        }
        let op = match op {
            Reduce::Sum => sys::ncclRedOp_t::ncclSum,
            Reduce::Max => sys::ncclRedOp_t::ncclMax,
            Reduce::Min => sys::ncclRedOp_t::ncclMin,
        };
        let what = format!("the all-reduce of {what}");
        let call: NcclCall<'_> = Box::new(move |src, dst, n, dtype, comm, stream| {
            // SAFETY: see `NcclCall`.
            unsafe { result::all_reduce(src, dst, n, dtype, op, comm, stream) }
        });
        let s = &*self.shared;
        let stream = self.stream();
        self.begin(&what)?;
        self.end(
            self.collective(&stream, t, 1, &what, call)
                .and_then(|reduced| {
                    stream
                        .synchronize()
                        .map_err(|e| Error::Distributed(format!("rank {}: {what}: {e}", s.rank)))?;
                    Ok(reduced)
                }),
        )
    }

    /// The stream collectives run on: the communicator's own once made, else the compute stream.
    fn stream(&self) -> Arc<CudaStream> {
        let s = &*self.shared;
        s.stream
            .get()
            .cloned()
            .unwrap_or_else(|| s.device.cuda_stream())
    }

    /// The communicator's own stream (made on first use).
    fn own_stream(&self) -> Result<Arc<CudaStream>> {
        Ok(made_once(&self.shared.stream, &self.shared.device)?)
    }

    /// Every rank's `t` (1-D, the same length on every rank; u8, f64, f32, bf16 or f16) laid end to end in rank
    /// order, on every rank, finished when this returns. `what` names it for the error when a rank fails.
    pub fn all_gather(&self, t: &Tensor, what: &str) -> Result<Tensor> {
        let whole = self.start_all_gather(ShardSource::Tensor(t), what)?.wait();
        // The watchdog follows the gather while the host waits.
        self.end(whole.and_then(|whole| {
            self.stream().synchronize().map_err(|e| {
                Error::Distributed(format!(
                    "rank {}: the all-gather of {what}: {e}",
                    self.rank()
                ))
            })?;
            Ok(whole)
        }))
    }

    /// Starts [`Communicator::all_gather`] of `shard` on the communicator's stream and returns at once (a pinned
    /// shard is first copied to the device there); the compute stream waits for it when [`Gathering::wait`] is
    /// called. The watchdog follows the gather until it completes.
    pub fn start_all_gather(&self, shard: ShardSource<'_>, what: &str) -> Result<Gathering> {
        let what = format!("the all-gather of {what}");
        let s = &*self.shared;
        let stream = self.own_stream()?;
        self.begin(&what)?;
        let started = self
            .issue_all_gather(&stream, shard, &what)
            .and_then(|(whole, input)| {
                let done = match mark(&stream) {
                    Ok(done) => Arc::new(done),
                    Err(e) => return Err(settled(&stream, e.into())),
                };
                s.state.lock().unwrap().started.push_back((
                    Instant::now(),
                    what.clone(),
                    done.clone(),
                ));
                let device = s.device.clone();
                Ok(Gathering::pending(whole, move || {
                    wait(&device.cuda_stream(), &done)?;
                    // The input may be freed (stream-ordered, on the compute stream) once the compute stream has
                    // waited for the gather that reads it.
                    drop(input);
                    Ok(())
                }))
            });
        self.end(started)
    }

    /// Queues the all-gather of `shard` on the communicator's stream: the output (and a pinned shard's device
    /// copy) are allocated on the compute stream, so the communicator's stream first waits for the compute
    /// stream's work so far. Returns the output and the input it reads.
    fn issue_all_gather(
        &self,
        stream: &Arc<CudaStream>,
        shard: ShardSource<'_>,
        what: &str,
    ) -> Result<(Tensor, Tensor)> {
        let input = match shard {
            ShardSource::Tensor(t) => t.flatten_all()?.contiguous()?,
            ShardSource::Pinned(p) => p.copy_on(stream)?,
        };
        let call: NcclCall<'_> = Box::new(|src, dst, n, dtype, comm, stream| {
            // SAFETY: see `NcclCall`; the output holds `world_size` times the input's `n` elements.
            unsafe { result::all_gather(src, dst, n, dtype, comm, stream) }
        });
        // A copy queued before a failed gather may still read or write the input: it is freed after the stream.
        let whole = self
            .collective(stream, &input, self.world_size(), what, call)
            .map_err(|e| settled(stream, e))?;
        Ok((whole, input))
    }

    /// Runs `call` on `stream` over `t` (made contiguous) and an output of `out_factor` times its elements, after
    /// the compute stream's work so far, without waiting for it.
    fn collective(
        &self,
        stream: &Arc<CudaStream>,
        t: &Tensor,
        out_factor: usize,
        what: &str,
        call: NcclCall<'_>,
    ) -> Result<Tensor> {
        use sys::ncclDataType_t as Nccl;
        match t.dtype() {
            DType::U8 => {
                self.collective_typed::<u8>(stream, t, Nccl::ncclUint8, out_factor, what, call)
            }
            DType::F64 => {
                self.collective_typed::<f64>(stream, t, Nccl::ncclFloat64, out_factor, what, call)
            }
            DType::F32 => {
                self.collective_typed::<f32>(stream, t, Nccl::ncclFloat32, out_factor, what, call)
            }
            DType::BF16 => self.collective_typed::<half::bf16>(
                stream,
                t,
                Nccl::ncclBfloat16,
                out_factor,
                what,
                call,
            ),
            DType::F16 => self.collective_typed::<half::f16>(
                stream,
                t,
                Nccl::ncclFloat16,
                out_factor,
                what,
                call,
            ),
            other => Err(Error::Distributed(format!(
                "{what}: {other:?} tensors are not exchanged (u8, f64, f32, bf16 or f16)"
            ))),
        }
    }

    fn collective_typed<T: CudaDType + DeviceRepr>(
        &self,
        stream: &Arc<CudaStream>,
        t: &Tensor,
        dtype: sys::ncclDataType_t,
        out_factor: usize,
        what: &str,
        call: NcclCall<'_>,
    ) -> Result<Tensor> {
        let s = &*self.shared;
        let t = t.contiguous()?;
        let n = t.elem_count();
        let held = crate::cuda::hold(&t)?;
        let input = held.view::<T>()?;
        let mut out = crate::cuda::alloc::<T>(&s.device, n * out_factor)?;
        after_compute(&s.device, stream)?;
        {
            let (src, _read) = input.device_ptr(stream);
            let (dst, _write) = out.device_ptr_mut(stream);
            // Both buffers are on this communicator's device, of the sizes `call` is told.
            call(
                src as *const _,
                dst as *mut _,
                n,
                dtype,
                s.comm.0,
                stream.cu_stream() as _,
            )
        }
        .map_err(|e| nccl_error(s.rank, what, e, Some(&s.comm)))?;
        let shape = match out_factor {
            1 => t.shape().clone(),
            k => candle_core::Shape::from(n * k),
        };
        Ok(crate::cuda::tensor(out, &s.device, shape))
    }

    /// Marks `what` in flight (the watchdog's clock starts), or the fault that already stopped the communicator.
    fn begin(&self, what: &str) -> Result<()> {
        let mut state = self.shared.state.lock().unwrap();
        if let Some(fault) = &state.fault {
            return Err(Error::Distributed(fault.clone()));
        }
        state.current = Some((Instant::now(), what.to_string()));
        Ok(())
    }

    /// Ends the collective in flight: its outcome, unless the watchdog aborted it, whose reason comes first.
    fn end<R>(&self, outcome: Result<R>) -> Result<R> {
        let mut state = self.shared.state.lock().unwrap();
        state.current = None;
        match (&state.fault, outcome) {
            (Some(fault), _) => Err(Error::Distributed(fault.clone())),
            (None, outcome) => outcome,
        }
    }
}

/// `error`, once the work queued on `stream` has finished (what it reads or writes may then be freed on the compute
/// stream); a failed synchronization leaves the error as it is.
fn settled(stream: &CudaStream, error: Error) -> Error {
    let _ = stream.synchronize();
    error
}

impl ShardExchange for Communicator {
    fn all_gather(&self, shard: &Tensor, what: &str) -> Result<Tensor> {
        Communicator::all_gather(self, shard, what)
    }

    fn start_all_gather(&self, shard: ShardSource<'_>, what: &str) -> Result<Gathering> {
        Communicator::start_all_gather(self, shard, what)
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        let unfinished = {
            let mut state = self.shared.state.lock().unwrap();
            state.closed = true;
            state
                .started
                .iter()
                .any(|(_, _, done)| !matches!(done.try_is_complete(), Ok(true)))
        };
        if let Some(dog) = self.watchdog.take() {
            let _ = dog.join();
        }
        if !self.shared.aborted.swap(true, Ordering::SeqCst) {
            // SAFETY: the watchdog has stopped and no call is in flight: the handle is ours alone. A gather still
            // running (left by an error) would make the destroy wait for peers that may be gone: it is aborted.
            unsafe {
                let _ = match unfinished {
                    true => result::comm_abort(self.shared.comm.0),
                    false => result::comm_destroy(self.shared.comm.0),
                };
            }
        }
    }
}

/// The watchdog: every 10 ms, NCCL's asynchronous error (a peer exited or aborted) and the age of the collective in
/// flight; on either, the reason is recorded and the communicator aborted, which ends the waiting call.
fn watch(s: &Shared) {
    loop {
        std::thread::sleep(Duration::from_millis(10));
        let mut state = s.state.lock().unwrap();
        if state.closed {
            return;
        }
        let mut failed = None;
        while let Some((_, what, done)) = state.started.front() {
            match done.try_is_complete() {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => failed = Some(format!("rank {}: {what} failed on the GPU: {e}", s.rank)),
            }
            state.started.pop_front();
        }
        // The oldest collective not finished: the one the host waits in, or one started earlier.
        let current = state.current.as_ref().map(|(t, what)| (*t, what));
        let started = state.started.front().map(|(t, what, _)| (*t, what));
        let oldest = [current, started]
            .into_iter()
            .flatten()
            .min_by_key(|(t, _)| *t);
        let doing = oldest.map_or_else(
            || "between collectives".to_string(),
            |(_, what)| format!("in {what}"),
        );
        let mut async_error = sys::ncclResult_t::ncclSuccess;
        // SAFETY: querying the asynchronous error is allowed from any thread.
        unsafe { sys::ncclCommGetAsyncError(s.comm.0, &mut async_error) };
        let fault = if failed.is_some() {
            failed
        } else if async_error != sys::ncclResult_t::ncclSuccess
            && async_error != sys::ncclResult_t::ncclInProgress
        {
            Some(format!(
                "rank {} stopped {doing}: {}; every rank stops (a checkpoint, if any, is the place to resume)",
                s.rank,
                last_error(&s.comm).unwrap_or_else(|| format!("NCCL reports {async_error:?}"))
            ))
        } else {
            match oldest {
                Some((start, what)) if start.elapsed() > s.timeout => Some(format!(
                    "rank {}: {what} did not finish within ddp_timeout ({} s): another rank died or hangs; every \
                     rank stops",
                    s.rank,
                    s.timeout.as_secs_f64()
                )),
                _ => None,
            }
        };
        if let Some(fault) = fault {
            eprintln!("{fault}");
            state.fault = Some(fault);
            drop(state);
            if !s.aborted.swap(true, Ordering::SeqCst) {
                // SAFETY: NCCL's abort is meant to be called while another thread waits on the communicator.
                unsafe {
                    let _ = result::comm_abort(s.comm.0);
                }
            }
            return;
        }
    }
}

/// NCCL's last error message for `comm` (or the process), if it has one.
fn last_error(comm: &Comm) -> Option<String> {
    // SAFETY: NCCL returns a NUL-terminated string it owns, valid until its next call on this thread.
    let text = unsafe { sys::ncclGetLastError(comm.0) };
    if text.is_null() {
        return None;
    }
    let message = unsafe { CStr::from_ptr(text) }
        .to_string_lossy()
        .trim()
        .to_string();
    (!message.is_empty()).then_some(message)
}

fn nccl_error(rank: usize, what: &str, e: result::NcclError, comm: Option<&Comm>) -> Error {
    let detail = comm
        .and_then(last_error)
        .map_or(String::new(), |m| format!(": {m}"));
    Error::Distributed(format!("rank {rank}: {what}: NCCL {:?}{detail}", e.0))
}
