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
}

/// Makes a rank's evaluation sums those of the whole run, in place: summed over the ranks of a distributed run, left
/// as they are alone.
pub(crate) type SumOverRanks<'a> = &'a mut dyn FnMut(&mut [f64]) -> Result<()>;
