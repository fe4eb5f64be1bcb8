//! The float32 mean bitsandbytes takes of the block absmax (`absmax.mean()` in double quantization), summed in
//! the exact order of PyTorch's CPU reduction so that the stored `nested_offset` is bit-identical.
//!
//! PyTorch sums a contiguous float32 vector with `vectorized_inner_sum` (SumKernel.cpp): 8-lane vectors (AVX2)
//! accumulated by `row_sum` in 4 interleaved streams, each a 4-level cascade (`multi_row_sum`), then the scalar
//! tail, then the 8 lanes; `mean` is that sum divided by the count. This is the single-threaded order.

const LANES: usize = 8;
type Lane = [f32; LANES];

fn add(acc: &mut Lane, v: &Lane) {
    for (a, b) in acc.iter_mut().zip(v) {
        *a += *b;
    }
}

/// `c10::utils::CeilLog2`.
fn ceil_log2(x: usize) -> u32 {
    if x <= 2 {
        1
    } else {
        (usize::BITS - (x - 1).leading_zeros() - 1) + 1
    }
}

/// Four vectors: one "row" of `multi_row_sum`.
type Row = [Lane; 4];

fn add_row(acc: &mut Row, row: &Row) {
    for (a, v) in acc.iter_mut().zip(row) {
        add(a, v);
    }
}

/// `multi_row_sum<Vectorized<float>, 4>`: rows of 4 vectors summed with a 4-level cascade.
fn multi_row_sum(rows: &[Row]) -> Row {
    const LEVELS: usize = 4;
    let level_power = (ceil_log2(rows.len()) / LEVELS as u32).max(4);
    let level_step = 1usize << level_power;
    let level_mask = level_step - 1;
    let mut acc = [[[0.0f32; LANES]; 4]; LEVELS];
    let mut i = 0usize;
    while i + level_step <= rows.len() {
        for row in &rows[i..i + level_step] {
            add_row(&mut acc[0], row);
        }
        i += level_step;
        for j in 1..LEVELS {
            let lower = std::mem::replace(&mut acc[j - 1], [[0.0; LANES]; 4]);
            add_row(&mut acc[j], &lower);
            let mask = level_mask << (j as u32 * level_power);
            if i & mask != 0 {
                break;
            }
        }
    }
    for row in &rows[i..] {
        add_row(&mut acc[0], row);
    }
    for j in 1..LEVELS {
        let upper = acc[j];
        add_row(&mut acc[0], &upper);
    }
    acc[0]
}

fn lane(chunk: &[f32]) -> Lane {
    let mut l = [0.0; LANES];
    l.copy_from_slice(chunk);
    l
}

/// Sum of `values` in PyTorch's CPU (AVX2, one thread) order.
pub fn torch_sum_f32(values: &[f32]) -> f32 {
    let n_vec = values.len() / LANES;
    let vectors: Vec<Lane> = values[..n_vec * LANES]
        .chunks_exact(LANES)
        .map(lane)
        .collect();
    let n_rows = n_vec / 4;
    let rows: Vec<Row> = vectors[..n_rows * 4]
        .chunks_exact(4)
        .map(|c| [c[0], c[1], c[2], c[3]])
        .collect();
    let mut partial = multi_row_sum(&rows);
    for v in &vectors[n_rows * 4..] {
        add(&mut partial[0], v);
    }
    let [mut first, second, third, fourth] = partial;
    for p in [second, third, fourth] {
        add(&mut first, &p);
    }
    let mut total = 0.0f32;
    for x in &values[n_vec * LANES..] {
        total += *x;
    }
    for x in first {
        total += x;
    }
    total
}

/// `tensor.mean()` of a contiguous float32 tensor on CPU, bit for bit (one thread, AVX2).
pub fn torch_mean_f32(values: &[f32]) -> f32 {
    torch_sum_f32(values) / values.len() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_small_inputs_exactly() {
        assert_eq!(torch_sum_f32(&[]), 0.0);
        assert_eq!(torch_sum_f32(&[1.0, 2.0, 3.0]), 6.0);
        let v: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        assert_eq!(torch_sum_f32(&v), 499_500.0);
        assert_eq!(torch_mean_f32(&v), 499.5);
    }

    #[test]
    fn ceil_log2_matches_c10() {
        assert_eq!(ceil_log2(0), 1);
        assert_eq!(ceil_log2(2), 1);
        assert_eq!(ceil_log2(3), 2);
        assert_eq!(ceil_log2(4), 2);
        assert_eq!(ceil_log2(5), 3);
        assert_eq!(ceil_log2(1 << 20), 20);
    }
}
