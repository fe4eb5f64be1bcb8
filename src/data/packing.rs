//! Packing: several tokenized examples per row, so no compute goes to padding. Rows carry the examples' lengths;
//! the model restarts positions at each example and keeps attention inside it (`Positions::Packed`), so a packed
//! row computes exactly what its examples would compute one by one.

use super::formats::TokenizedExample;
use crate::ops::IGNORE_INDEX;

/// Packs `examples` into rows of at most `max_length` tokens by best-fit decreasing (TRL's `bfd` strategy):
/// longest first, each into the fullest row that still has room. Examples are never split (they were already
/// truncated to `max_length`). Deterministic: ties keep the input order. The first label of every example becomes
/// −100, so no example learns to predict another (as TRL's flattening collator does).
pub fn pack(examples: &[TokenizedExample], max_length: usize) -> Vec<TokenizedExample> {
    let mut order: Vec<usize> = (0..examples.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(examples[i].input_ids.len()));
    let mut rows: Vec<TokenizedExample> = Vec::new();
    for i in order {
        let e = &examples[i];
        let len = e.input_ids.len();
        if len == 0 {
            continue;
        }
        // The fullest row with room (best fit); a new row when none has.
        let best = rows
            .iter()
            .enumerate()
            .filter(|(_, r)| r.input_ids.len() + len <= max_length)
            .max_by_key(|(k, r)| (r.input_ids.len(), std::cmp::Reverse(*k)))
            .map(|(k, _)| k);
        let row = match best {
            Some(k) => &mut rows[k],
            None => {
                rows.push(TokenizedExample {
                    input_ids: vec![],
                    labels: vec![],
                    truncated: false,
                    segments: vec![],
                });
                rows.last_mut().expect("just pushed")
            }
        };
        row.input_ids.extend_from_slice(&e.input_ids);
        // The loss shifts labels by one: the first token of an example would become the target of the previous
        // example's last position. It is no target when the example stands alone, so it is none here either.
        row.labels.push(IGNORE_INDEX);
        row.labels.extend_from_slice(&e.labels[1..]);
        row.truncated |= e.truncated;
        row.segments.push(len);
    }
    rows
}

/// Positions of a row: `0..len` for a single example, restarting at 0 for each example of a packed row; padding up
/// to `padded` continues the last run (it is labelled −100 and, being last, influences no real token).
pub fn row_positions(example: &TokenizedExample, padded: usize) -> Vec<u32> {
    let mut positions = Vec::with_capacity(padded);
    for &len in &example.segments {
        positions.extend(0..len as u32);
    }
    if example.segments.is_empty() {
        positions.extend(0..example.input_ids.len() as u32);
    }
    let next = positions.last().map_or(0, |p| p + 1);
    let fill = padded.saturating_sub(positions.len()) as u32;
    positions.extend(next..next + fill);
    positions
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(len: usize, first: u32) -> TokenizedExample {
        let ids: Vec<u32> = (first..first + len as u32).collect();
        TokenizedExample::learning_every_token(ids)
    }

    #[test]
    fn best_fit_decreasing_keeps_every_token_once() {
        let examples: Vec<_> = [5, 3, 8, 2, 6, 4]
            .iter()
            .enumerate()
            .map(|(i, &n)| example(n, 100 * i as u32))
            .collect();
        let rows = pack(&examples, 10);
        // 8+2, 6+4, 5+3: three full-ish rows instead of six padded ones.
        let lengths: Vec<Vec<usize>> = rows.iter().map(|r| r.segments.clone()).collect();
        assert_eq!(lengths, vec![vec![8, 2], vec![6, 4], vec![5, 3]]);
        let mut all: Vec<u32> = rows.iter().flat_map(|r| r.input_ids.clone()).collect();
        let mut expected: Vec<u32> = examples.iter().flat_map(|e| e.input_ids.clone()).collect();
        all.sort();
        expected.sort();
        assert_eq!(all, expected);
        for r in &rows {
            assert_eq!(
                r.labels[r.segments[0]], IGNORE_INDEX,
                "second example's first label"
            );
            assert!(r.input_ids.len() <= 10);
            assert_eq!(r.labels.len(), r.input_ids.len());
            assert_eq!(r.segments.iter().sum::<usize>(), r.input_ids.len());
        }
    }

    #[test]
    fn positions_restart_per_example_and_padding_continues() {
        let mut rows = pack(&[example(3, 0), example(2, 10)], 8);
        assert_eq!(row_positions(&rows[0], 7), vec![0, 1, 2, 0, 1, 2, 3]);
        rows[0].segments.clear();
        assert_eq!(row_positions(&rows[0], 6), vec![0, 1, 2, 3, 4, 5]);
    }
}
