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
}

/// This process's place in a sharded job, shared by all of a model's sharded layers: its rank, the number of
/// ranks, where the shards live, and the exchange that gathers (attached once the job's communicator exists; one
/// rank alone needs none).
pub struct Sharding {
    rank: usize,
    world_size: usize,
    offload: bool,
    exchange: RwLock<Option<Arc<dyn ShardExchange>>>,
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

    /// Sets the exchange the layers gather through (the job's communicator).
    pub fn attach(&self, exchange: Arc<dyn ShardExchange>) {
        *self.exchange.write().unwrap() = Some(exchange);
    }

    /// Every rank's `shard` end to end: `shard` itself for one rank alone.
    fn all_gather(&self, shard: &Tensor, what: &str) -> Result<Tensor> {
        if self.world_size == 1 {
            return Ok(shard.clone());
        }
        let exchange = self.exchange.read().unwrap().clone();
        match exchange {
            Some(exchange) => exchange.all_gather(shard, what),
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

/// One flat buffer: this rank's slice of it.
#[derive(Clone, Debug)]
struct Buffer {
    /// `[slice_len]`: elements `rank · slice_len ..` of the whole buffer, on the device or (offloaded) the host.
    mine: Tensor,
}

/// A list of tensors held as this rank's share ([`Sharding`]), gathered back whole by [`FlatShards::gather`].
#[derive(Clone, Debug)]
pub struct FlatShards {
    sharding: Arc<Sharding>,
    /// Where the gathered tensors are used (the tensors' device).
    device: Device,
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
            let mine = match sharding.offload {
                true => mine.to_device(&Device::Cpu)?,
                false => mine,
            };
            buffers.push(Buffer { mine });
        }
        let whole_bytes = tensors
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        Ok(FlatShards {
            sharding,
            device,
            buffers,
            pieces,
            whole_bytes,
        })
    }

    /// The tensors again, whole and flat (views of the gathered buffers), in the order given to
    /// [`FlatShards::new`]; `what` names them in errors ("layer 3's weights").
    pub fn gather(&self, what: &str) -> Result<Vec<Tensor>> {
        let whole: Vec<Tensor> = self
            .buffers
            .iter()
            .map(|b| {
                let mine = b.mine.to_device(&self.device)?;
                self.sharding.all_gather(&mine, what)
            })
            .collect::<Result<_>>()?;
        self.pieces
            .iter()
            .map(|p| Ok(whole[p.buffer].narrow(0, p.offset, p.len)?))
            .collect()
    }

    /// Bytes this rank holds (on the host when offloaded).
    pub fn shard_bytes(&self) -> usize {
        self.buffers
            .iter()
            .map(|b| b.mine.elem_count() * b.mine.dtype().size_in_bytes())
            .sum()
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
