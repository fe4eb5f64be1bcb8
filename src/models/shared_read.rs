//! Reading a sharded model's weights from their files in parts (FSDP's `cpu_ram_efficient_loading`): each of the
//! job's N ranks reads about 1/N of a weight's bytes — a run of whole 4-bit blocks — and quantizes them (on its GPU,
//! by the kernel with the CPU kernel's arithmetic: [`quantize_blocks_on`]), and one all-gather gives every rank the
//! whole weight, which its layer then shards as any other ([`super::FlatShards`]).
//!
//! A 4-bit block's codes and absmax depend on its own elements alone, so the parts quantize to the bytes they have
//! in the whole weight; the double quantization of the absmax (whose offset is the mean over the whole weight)
//! runs after the gather, on every block's absmax in one process's order. The weight is the one a single process
//! makes, bit for bit. A weight stored in 4 bits (a bitsandbytes folder) is read as stored: each rank its blocks'
//! codes and scales, gathered, the weight's small state (maps, nested scales) whole. The host holds a rank's part
//! of one weight and that weight's 4-bit codes, never the model.

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};

use super::shard::Sharding;
use crate::error::Result;
use crate::ops::frozen_linear::{DeferredWeight, StoredBlocks};
use crate::ops::FrozenWeight;
use crate::quant::{quantize_blocks_on, Nf4Tensor};

/// `weight` (left in its file) whole on `device`, each rank of `sharding` having read its part of it; `None` when
/// the ranks cannot share the reading (one rank alone, or no exchange attached yet): then the caller reads it
/// whole. `what` names the weight in errors.
pub(crate) fn read_shared(
    weight: &dyn DeferredWeight,
    sharding: &Sharding,
    device: &Device,
    what: &str,
) -> Result<Option<FrozenWeight>> {
    if !sharding.gathers_now() {
        return Ok(None);
    }
    let (rows, cols) = weight.dims2();
    let n = rows * cols;
    let (rank, world) = (sharding.rank(), sharding.world_size());
    // Parts of whole blocks (of one element for a dense weight), as many on every rank, the last ones short.
    let quantization = weight.quantization();
    let block = quantization.map_or(1, |q| q.blocksize);
    let all_blocks = n.div_ceil(block);
    let blocks_per_rank = all_blocks.div_ceil(world);
    let blocks =
        (rank * blocks_per_rank).min(all_blocks)..((rank + 1) * blocks_per_rank).min(all_blocks);
    let part = (blocks.start * block).min(n)..(blocks.end * block).min(n);
    let gather = |mine: Tensor, len: usize, whole: usize| -> Result<Tensor> {
        let zeros = Tensor::zeros(len - mine.elem_count(), mine.dtype(), mine.device())?;
        let mine = match (mine.elem_count(), zeros.elem_count()) {
            (_, 0) => mine,
            (0, _) => zeros,
            _ => Tensor::cat(&[mine, zeros], 0)?,
        };
        let gathered = sharding.gather_now(&mine.to_device(device)?, what)?;
        Ok(gathered.narrow(0, 0, whole)?)
    };
    // A 4-bit weight: the rank's blocks as stored (packed codes and scales), or quantized from its elements; then
    // gathered, and the weight put together on the host.
    let stored = match weight.read_4bit_blocks(blocks.clone())? {
        Some(stored) => {
            let scale_size = stored.scales.dtype().size_in_bytes();
            sharding.note_read(
                stored.packed.elem_count() + blocks.len() * scale_size,
                n.div_ceil(2) + all_blocks * scale_size,
            );
            stored
        }
        None => {
            let Some(values) = weight.read_elements(part.clone())? else {
                return Ok(None);
            };
            let dtype = values.dtype();
            sharding.note_read(
                weight.bytes_in_file(part.clone())?,
                weight.bytes_in_file(0..n)?,
            );
            let Some(config) = quantization else {
                let whole = gather(values, blocks_per_rank, n)?.reshape((rows, cols))?;
                return Ok(Some(FrozenWeight::Dense(whole)));
            };
            // On the rank's GPU when it has one.
            let (packed, absmax) = match part.is_empty() {
                true => (
                    Tensor::zeros(0, DType::U8, device)?,
                    Tensor::zeros(0, DType::F32, device)?,
                ),
                false => quantize_blocks_on(&values, device, &config, what)?,
            };
            StoredBlocks {
                packed,
                scales: absmax,
                rebuild: Box::new(move |packed, absmax| {
                    let absmax = absmax.to_vec1::<f32>()?;
                    Nf4Tensor::from_codes_and_absmax(packed, absmax, &[rows, cols], dtype, &config)
                        .map_err(candle_core::Error::wrap)
                }),
            }
        }
    };
    let packed = gather(stored.packed, blocks_per_rank * block / 2, n.div_ceil(2))?;
    let scales = gather(stored.scales, blocks_per_rank, all_blocks)?;
    let q = (stored.rebuild)(
        packed.to_device(&Device::Cpu)?.to_vec1::<u8>()?,
        scales.to_device(&Device::Cpu)?,
    )?;
    Ok(Some(FrozenWeight::Nf4(Arc::new(q)).to_device(device)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::shard::LocalRanks;
    use crate::quant::QuantConfig;
    use candle_core::DType;

    /// A weight held in memory, read in parts as a file's would be.
    #[derive(Debug)]
    struct InMemory {
        values: Tensor,
        quant: Option<QuantConfig>,
    }

    impl DeferredWeight for InMemory {
        fn dims2(&self) -> (usize, usize) {
            self.values.dims2().unwrap()
        }

        fn read(&self) -> candle_core::Result<FrozenWeight> {
            Ok(match &self.quant {
                Some(q) => FrozenWeight::Nf4(Arc::new(
                    Nf4Tensor::quantize(&self.values, q).map_err(candle_core::Error::wrap)?,
                )),
                None => FrozenWeight::Dense(self.values.clone()),
            })
        }

        fn quantization(&self) -> Option<QuantConfig> {
            self.quant
        }

        fn read_4bit_blocks(
            &self,
            _: std::ops::Range<usize>,
        ) -> candle_core::Result<Option<StoredBlocks>> {
            Ok(None)
        }

        fn read_elements(
            &self,
            range: std::ops::Range<usize>,
        ) -> candle_core::Result<Option<Tensor>> {
            let flat = self.values.flatten_all()?;
            Ok(Some(flat.narrow(0, range.start, range.len())?))
        }

        fn bytes_in_file(&self, range: std::ops::Range<usize>) -> candle_core::Result<usize> {
            Ok(range.len() * self.values.dtype().size_in_bytes())
        }
    }

    /// A 3 × 71 weight (4 blocks of 64, the last short; an odd count of codes) read over 1 to 6 ranks — more ranks
    /// than blocks too, some reading nothing — is the weight read whole, bit for bit: dense, NF4 with and without
    /// double quantization.
    #[test]
    fn parts_read_over_any_number_of_ranks_make_the_whole_weight() {
        let values = Tensor::randn(0f32, 1.0, (3, 71), &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let single = QuantConfig {
            double_quant: false,
            ..QuantConfig::nf4()
        };
        for quant in [None, Some(QuantConfig::nf4()), Some(single)] {
            let weight = InMemory {
                values: values.clone(),
                quant,
            };
            let expected = weight.read().unwrap();
            for world in 1..=6 {
                let read: Vec<Option<FrozenWeight>> = std::thread::scope(|s| {
                    let handles: Vec<_> = LocalRanks::handles(world)
                        .into_iter()
                        .map(|rank| {
                            let weight = &weight;
                            s.spawn(move || {
                                let sharding = Sharding::new(rank.rank(), world, false).unwrap();
                                sharding.attach(Arc::new(rank));
                                read_shared(weight, &sharding, &Device::Cpu, "w").unwrap()
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                });
                for (rank, got) in read.into_iter().enumerate() {
                    match (&expected, got) {
                        (_, None) => assert_eq!(world, 1, "rank {rank} of {world} read nothing"),
                        (FrozenWeight::Nf4(a), Some(FrozenWeight::Nf4(b))) => {
                            assert!(
                                a.as_ref() == b.as_ref(),
                                "{quant:?}, rank {rank} of {world}"
                            )
                        }
                        (FrozenWeight::Dense(a), Some(FrozenWeight::Dense(b))) => {
                            let bits = |t: &Tensor| {
                                t.flatten_all().unwrap().to_vec1::<half::bf16>().unwrap()
                            };
                            assert_eq!(bits(a), bits(&b), "rank {rank} of {world}")
                        }
                        (a, b) => panic!("rank {rank} of {world}: {a:?} against {b:?}"),
                    }
                }
            }
        }
    }
}
