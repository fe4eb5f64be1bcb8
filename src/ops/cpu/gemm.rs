//! Matrix products on CPU slices, for ops whose hot path bypasses Candle's op-by-op execution.
//!
//! Candle allocates (and zeroes) a new tensor for every matmul, scale and add. Calling `gemm` directly lets an op
//! write into a buffer it owns and fold `dst + s·A·B` into one pass: scaling and accumulation cost nothing extra.
//! Matrices are row-major slices; a transposed operand is described by strides, never copied.

use super::CpuFloat;

/// A read-only `rows × cols` matrix view of a row-major slice, possibly transposed.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a, T> {
    data: &'a [T],
    rows: usize,
    cols: usize,
    transposed: bool,
}

impl<'a, T> Mat<'a, T> {
    /// `data` as a row-major `rows × cols` matrix.
    pub fn new(data: &'a [T], rows: usize, cols: usize) -> Self {
        assert_eq!(
            data.len(),
            rows * cols,
            "matrix of {rows}×{cols} over {} values",
            data.len()
        );
        Mat {
            data,
            rows,
            cols,
            transposed: false,
        }
    }

    /// The transpose (a view: only the strides change).
    pub fn t(self) -> Self {
        Mat {
            rows: self.cols,
            cols: self.rows,
            transposed: !self.transposed,
            ..self
        }
    }

    /// The logical matrix copied into a new row-major vector (a transposed view comes out transposed in memory).
    pub fn to_vec(self) -> Vec<T>
    where
        T: Copy,
    {
        let (cs, rs) = self.strides();
        let (cs, rs) = (cs as usize, rs as usize);
        (0..self.rows)
            .flat_map(|i| (0..self.cols).map(move |j| self.data[i * rs + j * cs]))
            .collect()
    }

    /// `(column stride, row stride)` of the logical matrix in its slice.
    fn strides(&self) -> (isize, isize) {
        if self.transposed {
            (self.rows as isize, 1)
        } else {
            (1, self.cols as isize)
        }
    }
}

/// `dst = lhs·rhs · scale`, or `dst += lhs·rhs · scale` when `accumulate`; `dst` is row-major `lhs.rows × rhs.cols`.
/// Runs on all of Candle's threads.
pub fn matmul_into<T: CpuFloat>(
    dst: &mut [T],
    lhs: Mat<T>,
    rhs: Mat<T>,
    scale: f64,
    accumulate: bool,
) {
    matmul_with(dst, lhs, rhs, scale, accumulate, candle_threads());
}

/// Candle's thread count, read once: `candle_core::utils::get_num_threads` parses `/proc/cpuinfo` on every call
/// when no thread-count variable is set, which adds up over the thousands of GEMMs of a training step.
fn candle_threads() -> usize {
    static THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *THREADS.get_or_init(candle_core::utils::get_num_threads)
}

/// [`matmul_into`] on the calling thread only: for small products inside tasks that already run in parallel.
pub fn matmul_into_serial<T: CpuFloat>(
    dst: &mut [T],
    lhs: Mat<T>,
    rhs: Mat<T>,
    scale: f64,
    accumulate: bool,
) {
    matmul_with(dst, lhs, rhs, scale, accumulate, 1);
}

fn matmul_with<T: CpuFloat>(
    dst: &mut [T],
    lhs: Mat<T>,
    rhs: Mat<T>,
    scale: f64,
    accumulate: bool,
    threads: usize,
) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(rhs.rows, k, "inner dimensions {k} and {} differ", rhs.rows);
    assert_eq!(
        dst.len(),
        m * n,
        "output of {m}×{n} in {} values",
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            dst.fill(T::zero());
        }
        return;
    }
    let (lhs_cs, lhs_rs) = lhs.strides();
    let (rhs_cs, rhs_rs) = rhs.strides();
    let parallelism = if threads > 1 {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the asserts above bound every index the strides reach: the views cover their slices exactly, and
    // `dst` is `m × n` row-major. `dst` is exclusively borrowed and cannot alias the shared inputs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs_cs,
            lhs_rs,
            rhs.data.as_ptr(),
            rhs_cs,
            rhs_rs,
            T::one(),
            T::from_f64(scale),
            false,
            false,
            false,
            parallelism,
        )
    }
}

/// `lhs·rhs · scale` as a new row-major buffer (written once by the product, never zeroed first).
pub fn matmul<T: CpuFloat>(lhs: Mat<T>, rhs: Mat<T>, scale: f64) -> Vec<T> {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    if k == 0 {
        return vec![T::zero(); m * n];
    }
    let mut out: Vec<std::mem::MaybeUninit<T>> = Vec::with_capacity(m * n);
    // SAFETY: `MaybeUninit` needs no initialization. With `accumulate = false` and `k > 0`, gemm writes every one of
    // the `m × n` elements without reading any, so after the call all are initialized and the buffer can be
    // reinterpreted as `Vec<T>` (same layout, length and capacity).
    unsafe {
        out.set_len(m * n);
        let dst = std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut T, m * n);
        matmul_into(dst, lhs, rhs, scale, false);
        let mut out = std::mem::ManuallyDrop::new(out);
        Vec::from_raw_parts(out.as_mut_ptr() as *mut T, m * n, out.capacity())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn products_of_transposed_views_equal_candle_matmul() {
        let dev = Device::Cpu;
        let a = Tensor::randn(0f64, 1.0, (5, 7), &dev).unwrap();
        let b = Tensor::randn(0f64, 1.0, (7, 3), &dev).unwrap();
        let at = a.t().unwrap().contiguous().unwrap();
        let bt = b.t().unwrap().contiguous().unwrap();
        let expected = (a.matmul(&b).unwrap() * 0.5).unwrap();
        let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let (av, bv, atv, btv) = (v(&a), v(&b), v(&at), v(&bt));
        let cases = [
            matmul(Mat::new(&av, 5, 7), Mat::new(&bv, 7, 3), 0.5),
            matmul(Mat::new(&atv, 7, 5).t(), Mat::new(&bv, 7, 3), 0.5),
            matmul(Mat::new(&av, 5, 7), Mat::new(&btv, 3, 7).t(), 0.5),
            matmul(Mat::new(&atv, 7, 5).t(), Mat::new(&btv, 3, 7).t(), 0.5),
        ];
        for got in cases {
            let diff = v(&expected)
                .iter()
                .zip(&got)
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f64::max);
            assert!(diff < 1e-12, "{diff}");
        }
        // A view copied out row-major: the transpose's values in the transpose's order.
        assert_eq!(Mat::new(&av, 5, 7).to_vec(), av);
        assert_eq!(Mat::new(&atv, 7, 5).t().to_vec(), av);
        // Accumulation adds to what is there.
        let mut acc = vec![1.0f64; 15];
        matmul_into(
            &mut acc,
            Mat::new(&av, 5, 7),
            Mat::new(&bv, 7, 3),
            0.5,
            true,
        );
        for (got, want) in acc.iter().zip(v(&expected)) {
            assert!((got - (want + 1.0)).abs() < 1e-12);
        }
    }
}
