//! A process's share of a run: rank `rank` of `world_size` (0 of 1 alone), which takes every `world_size`-th
//! micro-batch of a window and evaluation batch, and the sum over the ranks that makes an evaluation's shares whole.

use crate::error::Result;

/// Where this process stands in a run: rank `rank` of `world_size` (0 of 1 alone).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shard {
    pub rank: usize,
    pub world_size: usize,
}

impl Shard {
    /// One process alone.
    pub const ALONE: Shard = Shard {
        rank: 0,
        world_size: 1,
    };

    /// Whether this process writes the run's files and prints its progress: alone, or rank 0.
    pub fn is_main(self) -> bool {
        self.rank == 0
    }

    /// This rank's items of `items`: `rank`, `rank + world_size`, … (how micro-batches and evaluation batches are
    /// dealt).
    pub fn share<T>(self, items: impl IntoIterator<Item = T>) -> impl Iterator<Item = T> {
        items.into_iter().skip(self.rank).step_by(self.world_size)
    }

    /// Passes this rank runs after its [`Shard::share`] of `items` (whose results it discards) so that it runs as
    /// many as the busiest rank: with a base sharded over the ranks (`sharded`, FSDP) every pass gathers each layer
    /// from all of them, so the ranks' passes must pair up. Otherwise none.
    pub fn padding_passes(self, items: usize, sharded: bool) -> usize {
        match sharded {
            true => {
                items.div_ceil(self.world_size)
                    - (items + self.world_size - 1 - self.rank) / self.world_size
            }
            false => 0,
        }
    }
}

/// Makes a rank's evaluation sums those of the whole run, in place: summed over the ranks of a distributed run, left
/// as they are alone.
pub(crate) type SumOverRanks<'a> = &'a mut dyn FnMut(&mut [f64]) -> Result<()>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn padding_passes_even_out_the_shares() {
        for world_size in 1..5 {
            for items in 0..11 {
                let passes: Vec<usize> = (0..world_size)
                    .map(|rank| {
                        let shard = Shard { rank, world_size };
                        assert_eq!(shard.padding_passes(items, false), 0);
                        shard.share(0..items).count() + shard.padding_passes(items, true)
                    })
                    .collect();
                assert!(
                    passes.iter().all(|p| *p == items.div_ceil(world_size)),
                    "{passes:?}"
                );
            }
        }
    }
}
