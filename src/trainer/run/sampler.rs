//! The order of the data: micro-batches per epoch as a pure function of (`data_seed`, epoch) — shuffled,
//! sequential or grouped by length — and where a run stands in that stream.

use crate::trainer::settings::args::{SamplingStrategy, TrainingArguments};
use crate::trainer::storage::position::{DataFingerprint, DataPosition};
use crate::trainer::window::batches::PromptGroups;

/// `0..n` in a seeded order: Fisher–Yates with a counter-based generator, a pure function of (`seed`, `epoch`).
fn shuffled(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut state = seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    for i in (1..n).rev() {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let j = ((state >> 33) as usize) % (i + 1);
        order.swap(i, j);
    }
    order
}

/// The micro-batches of `epoch` for prompts dealt in groups (see [`PromptGroups`]): every micro-batch of a
/// generation batch lists its prompts.
fn grouped_batches(n: usize, groups: PromptGroups, seed: u64, epoch: usize) -> Vec<Vec<usize>> {
    let order = match groups.shuffle {
        true => shuffled(n, seed, epoch),
        false => (0..n).collect(),
    };
    order
        .chunks_exact(groups.prompts_per_generation)
        .flat_map(|chunk| std::iter::repeat_n(chunk.to_vec(), groups.micro_batches))
        .collect()
}

/// Micro-batches of example indices for `epoch` (seeded shuffle, or length-grouped).
fn epoch_batches(
    n: usize,
    batch: usize,
    seed: u64,
    epoch: usize,
    lengths: &[usize],
    strategy: SamplingStrategy,
    drop_last: bool,
) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = match strategy {
        SamplingStrategy::Sequential => (0..n).collect(),
        _ => shuffled(n, seed, epoch),
    };
    if strategy == SamplingStrategy::GroupByLength {
        // Length-sorted within chunks of 50 batches, as transformers' LengthGroupedSampler does.
        for chunk in order.chunks_mut(batch * 50) {
            chunk.sort_by_key(|i| std::cmp::Reverse(lengths[*i]));
        }
    }
    let mut batches: Vec<Vec<usize>> = order.chunks(batch).map(|c| c.to_vec()).collect();
    if drop_last && batches.last().is_some_and(|b| b.len() < batch) {
        batches.pop();
    }
    batches
}

/// `batches` made a multiple of `world_size` long by repeating its first batches (accelerate's `even_batches`), so
/// every rank of a distributed run takes as many; rank `r` takes batches `r`, `r + world_size`, … (accelerate's
/// `BatchSamplerShard`, which the HF Trainer's data loader uses). One process's window of `accumulation × world_size`
/// consecutive batches is then the union of the ranks' windows of `accumulation`.
fn even_out(mut batches: Vec<Vec<usize>>, world_size: usize) -> Vec<Vec<usize>> {
    let short = (world_size - batches.len() % world_size) % world_size;
    let filler: Vec<Vec<usize>> = batches.iter().cycle().take(short).cloned().collect();
    batches.extend(filler);
    batches
}

/// How the data is walked: fixed once per run.
pub(super) struct DataPlan {
    lengths: Vec<usize>,
    data: DataFingerprint,
    /// Prompts dealt in groups (GRPO), instead of items one by one.
    groups: Option<PromptGroups>,
    strategy: SamplingStrategy,
    data_seed: u64,
    /// Processes of the run; each takes every `world_size`-th micro-batch.
    pub world_size: usize,
    /// Micro-batches in one epoch, of one rank.
    pub batches_per_epoch: usize,
}

impl DataPlan {
    /// The plan over training items of `lengths` (tokens each, for `group_by_length`) holding `data`, dealt in
    /// `groups` when the items are prompts sampled in groups.
    pub(super) fn new(
        lengths: Vec<usize>,
        data: DataFingerprint,
        groups: Option<PromptGroups>,
        args: &TrainingArguments,
        world_size: usize,
    ) -> Self {
        let strategy = args.sampling();
        let data_seed = args.data_seed.unwrap_or(args.seed);
        let mut plan = DataPlan {
            lengths,
            data,
            groups,
            strategy,
            data_seed,
            world_size,
            batches_per_epoch: 0,
        };
        plan.batches_per_epoch = plan.batches(0, args).len() / world_size;
        plan
    }

    /// The micro-batches of `epoch`, of all ranks: micro-batch `i` is rank `i % world_size`'s (see [`even_out`]).
    pub(super) fn batches(&self, epoch: usize, args: &TrainingArguments) -> Vec<Vec<usize>> {
        if let Some(groups) = self.groups {
            return grouped_batches(self.lengths.len(), groups, self.data_seed, epoch);
        }
        let batches = epoch_batches(
            self.lengths.len(),
            args.per_device_train_batch_size,
            self.data_seed,
            epoch,
            &self.lengths,
            self.strategy,
            args.dataloader_drop_last,
        );
        even_out(batches, self.world_size)
    }

    /// Where the data stream stands after `micro_batches_done` micro-batches (of all ranks).
    pub(super) fn position(
        &self,
        args: &TrainingArguments,
        micro_batches_done: usize,
    ) -> DataPosition {
        DataPosition {
            seed: args.seed,
            data_seed: self.data_seed,
            sampling: self.strategy,
            per_device_train_batch_size: args.per_device_train_batch_size,
            gradient_accumulation_steps: args.gradient_accumulation_steps,
            train_rows: self.lengths.len(),
            micro_batches_done,
            epoch: micro_batches_done / (self.batches_per_epoch * self.world_size).max(1),
            world_size: self.world_size,
            data: Some(self.data.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_cover_every_example_once_in_a_seeded_order() {
        let lengths: Vec<usize> = (0..23).map(|i| (i * 7) % 31 + 1).collect();
        for strategy in SamplingStrategy::ALL.iter().copied() {
            let a = epoch_batches(23, 4, 9, 0, &lengths, strategy, false);
            let mut all: Vec<usize> = a.iter().flatten().copied().collect();
            all.sort();
            assert_eq!(all, (0..23).collect::<Vec<_>>(), "{strategy}");
            assert_eq!(a, epoch_batches(23, 4, 9, 0, &lengths, strategy, false));
            if strategy == SamplingStrategy::Random {
                assert_ne!(a, epoch_batches(23, 4, 9, 1, &lengths, strategy, false));
            }
        }
        assert_eq!(
            epoch_batches(23, 4, 9, 0, &lengths, SamplingStrategy::Random, true).len(),
            5
        );
    }

    #[test]
    fn ranks_share_an_epoch_evenly_and_together_make_the_single_process_windows() {
        let lengths = vec![5; 10];
        let single = epoch_batches(10, 2, 4, 0, &lengths, SamplingStrategy::Random, false);
        assert_eq!(even_out(single.clone(), 1), single);
        // 5 batches on 2 ranks: the first batch again, so each rank takes 3.
        let two = even_out(single.clone(), 2);
        assert_eq!(two.len(), 6);
        assert_eq!(two[5], single[0]);
        let rank1: Vec<&Vec<usize>> = two.iter().skip(1).step_by(2).collect();
        assert_eq!(rank1, vec![&single[1], &single[3], &single[0]]);
        // 3 batches on 4 ranks: cycled.
        let four = even_out(single[..3].to_vec(), 4);
        assert_eq!(
            four,
            vec![
                single[0].clone(),
                single[1].clone(),
                single[2].clone(),
                single[0].clone()
            ]
        );
        assert_eq!(even_out(single[..4].to_vec(), 4).len(), 4);
    }

    /// TRL's RepeatSampler: 7 prompts in generation batches of 3 (the incomplete last dropped), each dealt as 4
    /// micro-batches listing its prompts; shuffled per epoch with the seed, or in order.
    #[test]
    fn prompt_groups_deal_whole_generation_batches() {
        let groups = |shuffle| PromptGroups {
            prompts_per_generation: 3,
            micro_batches: 4,
            shuffle,
        };
        let ordered = grouped_batches(7, groups(false), 5, 0);
        assert_eq!(ordered.len(), 8);
        assert!(ordered[..4].iter().all(|b| b == &vec![0, 1, 2]));
        assert!(ordered[4..].iter().all(|b| b == &vec![3, 4, 5]));
        let shuffled = grouped_batches(7, groups(true), 5, 0);
        assert_eq!(shuffled, grouped_batches(7, groups(true), 5, 0));
        assert_ne!(shuffled, grouped_batches(7, groups(true), 5, 1));
        assert!(shuffled.chunks(4).all(|g| g.iter().all(|b| b == &g[0])));
    }

    #[test]
    fn group_by_length_puts_similar_lengths_together() {
        // 400 examples, lengths 1..=400 shuffled; a batch of 8 within a 400-example chunk is length-sorted, so
        // neighbours differ little, unlike random batches.
        let lengths: Vec<usize> = (0..400).map(|i| (i * 173) % 400 + 1).collect();
        let spread = |batches: &[Vec<usize>]| -> f64 {
            let total: usize = batches
                .iter()
                .map(|b| {
                    let ls: Vec<usize> = b.iter().map(|i| lengths[*i]).collect();
                    ls.iter().max().unwrap() - ls.iter().min().unwrap()
                })
                .sum();
            total as f64 / batches.len() as f64
        };
        let grouped = epoch_batches(
            400,
            8,
            3,
            0,
            &lengths,
            SamplingStrategy::GroupByLength,
            false,
        );
        let random = epoch_batches(400, 8, 3, 0, &lengths, SamplingStrategy::Random, false);
        assert!(
            spread(&grouped) * 10.0 < spread(&random),
            "{} vs {}",
            spread(&grouped),
            spread(&random)
        );
        // The longest example comes first, as transformers' sampler puts it (out-of-memory shows up at once).
        assert_eq!(lengths[grouped[0][0]], 400);
    }
}
