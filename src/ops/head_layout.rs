//! The two layouts of attention rows — token-major `[b, t, h, d]`, as a projection writes them, and head-major
//! `[b, h, t, d]`, as attention reads them ([`HeadDims`]) — and moving `d`-rows from one to the other on CPU slices
//! ([`permute_rows`]), each copied or rotated on the way.

use rayon::prelude::*;

/// The sizes of a `[b, t, h, d]` ↔ `[b, h, t, d]` permutation.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HeadDims {
    pub b: usize,
    pub t: usize,
    pub h: usize,
    pub d: usize,
}

impl HeadDims {
    /// Offset of row `(batch, head, position)` in the `[b, t, h, d]` layout.
    pub fn token_major(&self, batch: usize, head: usize, position: usize) -> usize {
        ((batch * self.t + position) * self.h + head) * self.d
    }

    /// Offset of row `(batch, head, position)` in the `[b, h, t, d]` layout.
    pub fn head_major(&self, batch: usize, head: usize, position: usize) -> usize {
        ((batch * self.h + head) * self.t + position) * self.d
    }
}

/// `[b, t, h, d]` → `[b, h, t, d]` (`to_heads`) or back, `row(out_row, in_row)` writing each `d`-row (a copy, or a
/// rotation). One parallel task per output `(batch, head)` or `(batch, position)` block.
pub(crate) fn permute_rows<T: Copy + Send + Sync + Default>(
    x: &[T],
    dims: HeadDims,
    to_heads: bool,
    row: impl Fn(&mut [T], &[T], usize, usize) + Sync,
) -> Vec<T> {
    let HeadDims { t, h, d, .. } = dims;
    let mut out = vec![T::default(); x.len()];
    if to_heads {
        out.par_chunks_mut(t * d).enumerate().for_each(|(bh, o)| {
            let (batch, head) = (bh / h, bh % h);
            for (position, o) in o.chunks_mut(d).enumerate() {
                let i = dims.token_major(batch, head, position);
                row(o, &x[i..i + d], batch, position);
            }
        });
    } else {
        out.par_chunks_mut(h * d).enumerate().for_each(|(bt, o)| {
            let (batch, position) = (bt / t, bt % t);
            for (head, o) in o.chunks_mut(d).enumerate() {
                let i = dims.head_major(batch, head, position);
                row(o, &x[i..i + d], batch, position);
            }
        });
    }
    out
}

/// A [`permute_rows`] row that copies.
pub(crate) fn copy_row<T: Copy>(o: &mut [T], x: &[T], _: usize, _: usize) {
    o.copy_from_slice(x);
}
