//! FSDP's full sharding of the frozen base: each of a job's `world_size` ranks keeps `1/world_size` of a layer's
//! storage, and gathers the rest from the others just before the layer runs.
//!
//! A layer's storage tensors (its linear weights: dense, or a 4-bit weight's codes and scales) are laid end to end
//! in one flat buffer per dtype — each tensor starting on a [`ALIGN_BYTES`] boundary, as the kernels' vector loads
//! want, the whole padded to a multiple of `world_size` — and rank `r` keeps the `r`-th slice of each buffer
//! ([`FlatShards`]). One all-gather per buffer ([`ShardExchange::all_gather`]) gives every rank the whole buffer, of
//! which each tensor is a view; the views live as long as the graph of the layer's run that uses them, so a
//! checkpointed layer's gathered weights are freed after its forward and gathered again for its recomputation,
//! as FSDP's `reshard_after_forward` does.
//!
//! A gather may be started ahead of its use ([`FlatShards::prefetch`]: the next layer's while this one runs, FSDP's
//! forward and backward prefetch): on GPUs the exchange runs it on a stream of its own, and the compute stream waits
//! for it (an event, not the host) only when the layer starts ([`Gathering`]). At most one prefetched gather waits
//! at a time, so a rank holds at most two gathered layers (FSDP's `limit_all_gathers`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex, RwLock};

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// Where each tensor of a flat buffer starts: a multiple of this many bytes (the allocator's alignment on GPUs).
pub const ALIGN_BYTES: usize = 256;

/// The collective a sharded model needs: every rank's `shard` (1-D, the same length on every rank) laid end to end
/// in rank order, on every rank. `what` names the tensors for the error when a rank fails.
pub trait ShardExchange: Send + Sync {
    /// The concatenation of every rank's `shard`, in rank order.
    fn all_gather(&self, shard: &Tensor, what: &str) -> Result<Tensor>;

    /// Starts [`ShardExchange::all_gather`] of `shard` without waiting for it, where the exchange can (GPUs: on a
    /// stream of its own); by default it gathers at once.
    fn start_all_gather(&self, shard: ShardSource<'_>, what: &str) -> Result<Gathering> {
        Ok(Gathering::finished(
            self.all_gather(&shard.to_device()?, what)?,
        ))
    }
}

/// A rank's shard as an exchange reads it.
pub enum ShardSource<'a> {
    /// A tensor on the device where the gathered tensors are used (for ranks without a GPU, the CPU).
    Tensor(&'a Tensor),
    /// An offloaded shard in pinned host memory, which the gather first copies to its device.
    #[cfg(feature = "cuda")]
    Pinned(&'a PinnedShard),
}

impl ShardSource<'_> {
    /// The shard on its device; a pinned one is copied there on the compute stream.
    pub fn to_device(&self) -> Result<Tensor> {
        match self {
            ShardSource::Tensor(t) => Ok((*t).clone()),
            #[cfg(feature = "cuda")]
            ShardSource::Pinned(p) => p.to_device(),
        }
    }
}

/// An offloaded shard in pinned host memory (page-locked, so copies to the GPU run asynchronously at full speed).
#[cfg(feature = "cuda")]
pub struct PinnedShard {
    pinned: crate::cuda::side_stream::Pinned,
    device: candle_core::cuda_backend::CudaDevice,
}

#[cfg(feature = "cuda")]
impl PinnedShard {
    fn new(host: &Tensor, device: &candle_core::cuda_backend::CudaDevice) -> Result<Self> {
        Ok(PinnedShard {
            pinned: crate::cuda::side_stream::Pinned::from_host(
                device,
                host,
                "an offloaded shard",
            )?,
            device: device.clone(),
        })
    }

    /// Its elements.
    pub fn len(&self) -> usize {
        self.pinned.len()
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.pinned.len() == 0
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        self.pinned.dtype()
    }

    /// Starts copying it to a new tensor on its device, on `stream` (see [`crate::cuda::side_stream::Pinned`]).
    pub(crate) fn copy_on(
        &self,
        stream: &Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    ) -> Result<Tensor> {
        // SAFETY: a shard's buffer is written once, when made, and only read afterwards.
        Ok(unsafe {
            self.pinned
                .copy_to_device(&self.device, stream, self.len().into())?
        })
    }

    /// A copy on its device, made on the compute stream.
    fn to_device(&self) -> Result<Tensor> {
        self.copy_on(&self.device.cuda_stream())
    }

    /// Starts copying it to its device on `stream`, beside the compute stream, which waits for the copy (an
    /// event, not the host) when the gathering is waited for: one rank alone's gather of an offloaded share.
    fn start_copy(
        &self,
        stream: &Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
    ) -> Result<Gathering> {
        use crate::cuda::side_stream::{mark, wait};
        let copy = self.copy_on(stream)?;
        let done = mark(stream)?;
        let device = self.device.clone();
        Ok(Gathering::pending(copy, move || {
            Ok(wait(&device.cuda_stream(), &done)?)
        }))
    }
}

/// A gather under way: the whole buffer, and what makes the compute stream wait for it (and then lets go of what
/// the gather reads). Dropped unused, it still orders the compute stream after the gather, so the buffer's memory
/// is not reused while the gather writes it.
pub struct Gathering {
    whole: Tensor,
    ready: Option<Box<dyn FnOnce() -> Result<()> + Send + Sync>>,
}

impl Gathering {
    /// A gather already finished: `whole` may be used at once.
    pub fn finished(whole: Tensor) -> Self {
        Gathering { whole, ready: None }
    }

    /// A gather that finishes on the device: `ready` makes the compute stream wait for it.
    pub fn pending(
        whole: Tensor,
        ready: impl FnOnce() -> Result<()> + Send + Sync + 'static,
    ) -> Self {
        Gathering {
            whole,
            ready: Some(Box::new(ready)),
        }
    }

    /// The whole buffer, for work queued from now on.
    pub fn wait(mut self) -> Result<Tensor> {
        if let Some(ready) = self.ready.take() {
            ready()?;
        }
        Ok(self.whole.clone())
    }
}

impl Drop for Gathering {
    fn drop(&mut self) {
        if let Some(ready) = self.ready.take() {
            // Nothing better can be done with an error in a drop; the stream's own order then stands.
            let _ = ready();
        }
    }
}

/// This process's place in a sharded job, shared by all of a model's sharded layers: its rank, the number of
/// ranks, where the shards live, and the exchange that gathers (attached once the job's communicator exists; one
/// rank alone needs none).
pub struct Sharding {
    rank: usize,
    world_size: usize,
    offload: bool,
    exchange: RwLock<Option<Arc<dyn ShardExchange>>>,
    /// The gather started ahead of its use, and the [`FlatShards::id`] it is for.
    prefetched: Mutex<Option<(u64, Vec<Gathering>)>>,
    /// Whether the next layer is gathered while one runs: in the forward (FSDP's `forward_prefetch`), in the
    /// backward's recomputation (`backward_prefetch`).
    prefetch_forward: AtomicBool,
    prefetch_backward: AtomicBool,
    /// All-gathers started (one per flat buffer of a gather), and those of them started ahead of use.
    all_gathers: AtomicU64,
    all_gathers_ahead: AtomicU64,
    /// Bytes of the model's files this rank read for the layers' weights it read in parts while loading, and
    /// those weights' whole stored bytes.
    bytes_read: AtomicU64,
    bytes_stored: AtomicU64,
    /// One rank alone's stream for the copies of its offloaded shares (made at the first).
    #[cfg(feature = "cuda")]
    copy_stream: std::sync::OnceLock<Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>>,
}

impl std::fmt::Debug for Sharding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Sharding(rank {} of {})", self.rank, self.world_size)
    }
}

impl Sharding {
    /// Rank `rank` of `world_size`, without an exchange yet; with `offload` the shards live in host memory and
    /// travel to the device for each gather (FSDP's `offload_params`), otherwise on the device.
    pub fn new(rank: usize, world_size: usize, offload: bool) -> Result<Arc<Self>> {
        if world_size == 0 || rank >= world_size {
            return Err(Error::InvalidInput(format!(
                "rank {rank} of {world_size}: a rank is below the number of ranks"
            )));
        }
        Ok(Arc::new(Sharding {
            rank,
            world_size,
            offload,
            exchange: RwLock::new(None),
            prefetched: Mutex::new(None),
            prefetch_forward: AtomicBool::new(true),
            prefetch_backward: AtomicBool::new(true),
            all_gathers: AtomicU64::new(0),
            all_gathers_ahead: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_stored: AtomicU64::new(0),
            #[cfg(feature = "cuda")]
            copy_stream: std::sync::OnceLock::new(),
        }))
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks sharing the model.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Whether the shards live in host memory.
    pub fn offload(&self) -> bool {
        self.offload
    }

    /// Whether a layer's forward starts gathering the next layer (true unless [`Sharding::set_prefetch`] said
    /// otherwise).
    pub fn prefetch_forward(&self) -> bool {
        self.prefetch_forward.load(Ordering::Relaxed)
    }

    /// Whether a layer's recomputation in the backward starts gathering the layer before it.
    pub fn prefetch_backward(&self) -> bool {
        self.prefetch_backward.load(Ordering::Relaxed)
    }

    /// Where the layers gather the next one ahead: in the forward, in the backward. Every rank must say the same.
    pub fn set_prefetch(&self, forward: bool, backward: bool) {
        self.prefetch_forward.store(forward, Ordering::Relaxed);
        self.prefetch_backward.store(backward, Ordering::Relaxed);
    }

    /// All-gathers this rank has started (one per flat buffer of a gather; none for one rank alone), and how many
    /// of them were started ahead of their use ([`FlatShards::prefetch`]).
    pub fn all_gathers(&self) -> (u64, u64) {
        (
            self.all_gathers.load(Ordering::Relaxed),
            self.all_gathers_ahead.load(Ordering::Relaxed),
        )
    }

    /// Sets the exchange the layers gather through (the job's communicator).
    pub fn attach(&self, exchange: Arc<dyn ShardExchange>) {
        *self.exchange.write().unwrap() = Some(exchange);
    }

    /// Whether the ranks can gather now: several of them, an exchange attached.
    pub(crate) fn gathers_now(&self) -> bool {
        self.world_size > 1 && self.exchange.read().unwrap().is_some()
    }

    /// Every rank's `part` (1-D, as long on every rank, on the device the result is used on) end to end, gathered
    /// now ([`Sharding::gathers_now`] must say they can): for loading, not counted with the layers' gathers.
    pub(crate) fn gather_now(&self, part: &Tensor, what: &str) -> Result<Tensor> {
        let exchange = self.exchange.read().unwrap().clone();
        let exchange = exchange.ok_or_else(|| {
            Error::Distributed(format!("{what}: no exchange is attached to gather through"))
        })?;
        exchange
            .start_all_gather(ShardSource::Tensor(part), what)?
            .wait()
    }

    /// Notes that loading read `read` bytes of a weight whose whole stored bytes are `stored`.
    pub(crate) fn note_read(&self, read: usize, stored: usize) {
        self.bytes_read.fetch_add(read as u64, Ordering::Relaxed);
        self.bytes_stored
            .fetch_add(stored as u64, Ordering::Relaxed);
    }

    /// Bytes of the model's files this rank read for the weights it read in parts while loading, and those
    /// weights' whole stored bytes (a rank of N reads about 1/N).
    pub fn bytes_read(&self) -> (u64, u64) {
        (
            self.bytes_read.load(Ordering::Relaxed),
            self.bytes_stored.load(Ordering::Relaxed),
        )
    }

    /// Starts gathering every rank's `shard` end to end: `shard` itself (on its device) for one rank alone, an
    /// offloaded one copied there on a stream of its own (so a prefetched copy runs beside the compute).
    fn start_all_gather(&self, shard: ShardSource<'_>, what: &str) -> Result<Gathering> {
        if self.world_size == 1 {
            #[cfg(feature = "cuda")]
            if let ShardSource::Pinned(p) = shard {
                let stream = crate::cuda::side_stream::made_once(&self.copy_stream, &p.device)?;
                return p.start_copy(&stream);
            }
            return Ok(Gathering::finished(shard.to_device()?));
        }
        self.all_gathers.fetch_add(1, Ordering::Relaxed);
        let exchange = self.exchange.read().unwrap().clone();
        match exchange {
            Some(exchange) => exchange.start_all_gather(shard, what),
            None => Err(Error::Distributed(format!(
                "rank {} of {}: {what} must be gathered from the other ranks, but no communicator is attached to the \
                 sharded model",
                self.rank, self.world_size
            ))),
        }
    }
}

/// Where one tensor lies in its flat buffer.
#[derive(Clone, Debug)]
struct Piece {
    /// The buffer (one per dtype, in order of first use).
    buffer: usize,
    /// Its first element there.
    offset: usize,
    /// Its elements.
    len: usize,
}

/// One flat buffer: this rank's slice of it, `[slice_len]` elements `rank · slice_len ..` of the whole buffer.
enum Buffer {
    /// On the device, or (offloaded without a GPU) in host memory.
    Tensor(Tensor),
    /// Offloaded to pinned host memory, for a GPU.
    #[cfg(feature = "cuda")]
    Pinned(PinnedShard),
}

impl Buffer {
    fn source(&self) -> ShardSource<'_> {
        match self {
            Buffer::Tensor(t) => ShardSource::Tensor(t),
            #[cfg(feature = "cuda")]
            Buffer::Pinned(p) => ShardSource::Pinned(p),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Buffer::Tensor(t) => t.elem_count() * t.dtype().size_in_bytes(),
            #[cfg(feature = "cuda")]
            Buffer::Pinned(p) => p.len() * p.dtype().size_in_bytes(),
        }
    }
}

impl std::fmt::Debug for FlatShards {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FlatShards({} tensors, {} of {} bytes held)",
            self.pieces.len(),
            self.shard_bytes(),
            self.whole_bytes
        )
    }
}

/// The next [`FlatShards::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// A list of tensors held as this rank's share ([`Sharding`]), gathered back whole by [`FlatShards::gather`].
pub struct FlatShards {
    /// Names this share for a prefetched gather (unique in the process, unlike an address that may be reused).
    id: u64,
    sharding: Arc<Sharding>,
    buffers: Vec<Buffer>,
    pieces: Vec<Piece>,
    /// Bytes of the whole tensors (what one rank alone would hold).
    whole_bytes: usize,
}

impl FlatShards {
    /// This rank's share of `tensors` (each taken flat, in order). The tensors themselves are not kept: the share
    /// is a copy, so the whole tensors are freed when the caller drops them.
    pub fn new(tensors: &[Tensor], sharding: Arc<Sharding>) -> Result<Self> {
        let mut dtypes: Vec<DType> = Vec::new();
        let mut lengths: Vec<usize> = Vec::new();
        let mut pieces = Vec::with_capacity(tensors.len());
        for t in tensors {
            let buffer = match dtypes.iter().position(|d| *d == t.dtype()) {
                Some(b) => b,
                None => {
                    dtypes.push(t.dtype());
                    lengths.push(0);
                    dtypes.len() - 1
                }
            };
            let align = (ALIGN_BYTES / t.dtype().size_in_bytes()).max(1);
            let offset = lengths[buffer].next_multiple_of(align);
            pieces.push(Piece {
                buffer,
                offset,
                len: t.elem_count(),
            });
            lengths[buffer] = offset + t.elem_count();
        }
        let (rank, world) = (sharding.rank, sharding.world_size);
        let device = tensors.first().map_or(Device::Cpu, |t| t.device().clone());
        let mut buffers = Vec::with_capacity(dtypes.len());
        for (b, (&dtype, &len)) in dtypes.iter().zip(&lengths).enumerate() {
            let slice_len = len.div_ceil(world).max(1);
            let (start, end) = (rank * slice_len, (rank + 1) * slice_len);
            // This rank's slice: the parts of the tensors that overlap it, zeros where it has none.
            let mut parts: Vec<Tensor> = Vec::new();
            let mut at = start;
            for (t, p) in tensors.iter().zip(&pieces).filter(|(_, p)| p.buffer == b) {
                let (from, to) = (p.offset.max(start), (p.offset + p.len).min(end));
                if from >= to {
                    continue;
                }
                if from > at {
                    parts.push(Tensor::zeros(from - at, dtype, t.device())?);
                }
                parts.push(t.flatten_all()?.narrow(0, from - p.offset, to - from)?);
                at = to;
            }
            if end > at {
                parts.push(Tensor::zeros(end - at, dtype, &device)?);
            }
            // A compact copy of its own, so no view keeps the whole tensors' storage alive (Candle's `copy` and a
            // one-tensor `cat` would: they keep the view's whole storage).
            let mine = match parts.as_slice() {
                [one] => one.force_contiguous()?,
                _ => Tensor::cat(&parts, 0)?,
            };
            buffers.push(match (sharding.offload, &device) {
                #[cfg(feature = "cuda")]
                (true, Device::Cuda(cuda)) => {
                    Buffer::Pinned(PinnedShard::new(&mine.to_device(&Device::Cpu)?, cuda)?)
                }
                (true, _) => Buffer::Tensor(mine.to_device(&Device::Cpu)?),
                (false, _) => Buffer::Tensor(mine),
            });
        }
        let whole_bytes = tensors
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        Ok(FlatShards {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            sharding,
            buffers,
            pieces,
            whole_bytes,
        })
    }

    /// The tensors again, whole and flat (views of the gathered buffers), in the order given to
    /// [`FlatShards::new`]; `what` names them in errors ("layer 3's weights"). A gather [`FlatShards::prefetch`]
    /// started is used if it is for these tensors (and let go otherwise).
    pub fn gather(&self, what: &str) -> Result<Vec<Tensor>> {
        let prefetched = self.sharding.prefetched.lock().unwrap().take();
        let gatherings = match prefetched {
            Some((id, gatherings)) if id == self.id => gatherings,
            other => {
                // Another's prefetch is let go first, so no more than two gathers are held at once.
                drop(other);
                self.start_gather(what)?
            }
        };
        let whole: Vec<Tensor> = gatherings
            .into_iter()
            .map(Gathering::wait)
            .collect::<Result<_>>()?;
        self.pieces
            .iter()
            .map(|p| Ok(whole[p.buffer].narrow(0, p.offset, p.len)?))
            .collect()
    }

    /// Starts gathering these tensors for a [`FlatShards::gather`] to come (the next layer's, while this one runs),
    /// in place of an earlier prefetch not used. Every rank must prefetch the same tensors in the same order, as
    /// for gathers.
    pub fn prefetch(&self, what: &str) -> Result<()> {
        let gatherings = self.start_gather(what)?;
        if self.sharding.world_size > 1 {
            let started = gatherings.len() as u64;
            self.sharding
                .all_gathers_ahead
                .fetch_add(started, Ordering::Relaxed);
        }
        let earlier = self
            .sharding
            .prefetched
            .lock()
            .unwrap()
            .replace((self.id, gatherings));
        drop(earlier);
        Ok(())
    }

    /// One gather per buffer, started.
    fn start_gather(&self, what: &str) -> Result<Vec<Gathering>> {
        self.buffers
            .iter()
            .map(|b| self.sharding.start_all_gather(b.source(), what))
            .collect()
    }

    /// The ranks these tensors are shared over.
    pub fn sharding(&self) -> &Sharding {
        &self.sharding
    }

    /// Bytes this rank holds (on the host when offloaded).
    pub fn shard_bytes(&self) -> usize {
        self.buffers.iter().map(Buffer::bytes).sum()
    }

    /// Bytes of the tensors themselves (what one process alone holds).
    pub fn whole_bytes(&self) -> usize {
        self.whole_bytes
    }
}

/// A job's ranks as threads of one process ([`LocalRanks::handles`] gives each its [`LocalRank`]): an all-gather
/// waits for every rank's shard, then hands each the concatenation. For sharded models without GPUs or NCCL
/// (tests, and trying the sharding on a CPU).
pub struct LocalRanks {
    slots: Mutex<Vec<Option<Tensor>>>,
    barrier: Barrier,
}

/// One rank's handle on [`LocalRanks`], to [`Sharding::attach`] on the thread that runs the rank.
pub struct LocalRank {
    rank: usize,
    shared: Arc<LocalRanks>,
}

impl LocalRanks {
    /// Handles for `world_size` ranks, in rank order.
    pub fn handles(world_size: usize) -> Vec<LocalRank> {
        let shared = Arc::new(LocalRanks {
            slots: Mutex::new(vec![None; world_size]),
            barrier: Barrier::new(world_size),
        });
        (0..world_size)
            .map(|rank| LocalRank {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }
}

impl LocalRank {
    /// This handle's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
}

impl ShardExchange for LocalRank {
    fn all_gather(&self, shard: &Tensor, _what: &str) -> Result<Tensor> {
        let s = &self.shared;
        s.slots.lock().unwrap()[self.rank] = Some(shard.clone());
        s.barrier.wait();
        let all: Vec<Tensor> = s.slots.lock().unwrap().iter().flatten().cloned().collect();
        // Nobody writes its next shard before every rank has read this round's.
        s.barrier.wait();
        Ok(Tensor::cat(&all, 0)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tensors of three dtypes and awkward lengths, split over 1 to 5 ranks: every rank holds about its share and
    /// the gather gives every tensor back bit for bit, each starting on an aligned offset.
    #[test]
    fn shards_gather_back_to_the_tensors() {
        let cpu = Device::Cpu;
        let tensors = vec![
            Tensor::arange(0u8, 200, &cpu).unwrap(),
            Tensor::randn(0f32, 1.0, (7, 13), &cpu).unwrap(),
            Tensor::arange(0u8, 3, &cpu).unwrap(),
            Tensor::randn(0f32, 1.0, 1000, &cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
            Tensor::randn(0f32, 1.0, 5, &cpu).unwrap(),
        ];
        let flat = |t: &Tensor| -> Vec<f64> {
            t.flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        for world in 1..=5 {
            let ranks = LocalRanks::handles(world);
            let gathered: Vec<(Vec<Vec<f64>>, usize, Vec<usize>)> = std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .into_iter()
                    .map(|r| {
                        let tensors = &tensors;
                        s.spawn(move || {
                            let sharding = Sharding::new(r.rank, world, false).unwrap();
                            sharding.attach(Arc::new(r));
                            let shards = FlatShards::new(tensors, sharding).unwrap();
                            let back = shards.gather("test tensors").unwrap();
                            let offsets = shards.pieces.iter().map(|p| p.offset).collect();
                            (
                                back.iter().map(flat).collect(),
                                shards.shard_bytes(),
                                offsets,
                            )
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            for (back, shard_bytes, offsets) in &gathered {
                assert_eq!(back, &tensors.iter().map(flat).collect::<Vec<_>>());
                // Buffers: u8 (200, then 3 at 256), f32 (91, then 5 at 128), bf16 (1000).
                assert_eq!(offsets, &vec![0, 0, 256, 0, 128]);
                let whole: usize = 259 + 133 * 4 + 1000 * 2;
                let bound = whole.div_ceil(world) + 3 * 4;
                assert!(
                    *shard_bytes <= bound,
                    "{world} ranks: {shard_bytes} > {bound}"
                );
            }
        }
    }

    /// A prefetched gather is used by the gather of the same tensors and let go by another's (which gathers its own);
    /// either way every gather gives the tensors back, and the counts say how many all-gathers started ahead.
    #[test]
    fn a_prefetched_gather_serves_its_own_tensors_only() {
        let cpu = Device::Cpu;
        let a = vec![
            Tensor::arange(0u8, 77, &cpu).unwrap(),
            Tensor::randn(0f32, 1.0, 33, &cpu).unwrap(),
        ];
        let b = vec![Tensor::randn(0f32, 1.0, 50, &cpu).unwrap()];
        let flat = |ts: &[Tensor]| -> Vec<Vec<f64>> {
            ts.iter()
                .map(|t| t.to_dtype(DType::F64).unwrap().to_vec1().unwrap())
                .collect()
        };
        let counts: Vec<(u64, u64)> = std::thread::scope(|s| {
            let handles: Vec<_> = LocalRanks::handles(2)
                .into_iter()
                .map(|r| {
                    let (a, b) = (&a, &b);
                    s.spawn(move || {
                        let sharding = Sharding::new(r.rank, 2, false).unwrap();
                        sharding.attach(Arc::new(r));
                        let shards_a = FlatShards::new(a, sharding.clone()).unwrap();
                        let shards_b = FlatShards::new(b, sharding.clone()).unwrap();
                        shards_a.prefetch("a").unwrap();
                        assert_eq!(flat(&shards_b.gather("b").unwrap()), flat(b));
                        assert!(sharding.prefetched.lock().unwrap().is_none());
                        shards_a.prefetch("a").unwrap();
                        assert_eq!(flat(&shards_a.gather("a").unwrap()), flat(a));
                        assert!(sharding.prefetched.lock().unwrap().is_none());
                        sharding.all_gathers()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // `a` has two buffers (u8, f32), `b` one: a prefetch, b's gather, a prefetch again.
        assert_eq!(counts, vec![(5, 4); 2]);
    }

    /// One rank alone gathers without an exchange; more ranks without one get an error naming what is missing.
    #[test]
    fn gathering_without_an_exchange_needs_one_rank() {
        let t = [Tensor::arange(0f32, 10., &Device::Cpu).unwrap()];
        let alone = FlatShards::new(&t, Sharding::new(0, 1, false).unwrap()).unwrap();
        assert_eq!(
            alone.gather("x").unwrap()[0]
                .to_vec1::<f32>()
                .unwrap()
                .len(),
            10
        );
        let two = FlatShards::new(&t, Sharding::new(1, 2, false).unwrap()).unwrap();
        let err = two.gather("layer 0's weights").unwrap_err().to_string();
        assert!(
            err.contains("rank 1 of 2") && err.contains("no communicator"),
            "{err}"
        );
        assert!(Sharding::new(2, 2, false).is_err());
    }
}
