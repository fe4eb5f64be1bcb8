//! Rotary position embeddings in Hugging Face's half-split layout (`rotate_half`), with `rope_theta` and Llama-3
//! `rope_scaling`. The backward rotates by `-sin`; cos/sin are constants and get no gradient.

use candle_core::{DType, Device, Result, Tensor, D};

use rayon::prelude::*;

use super::autograd::{attach1, attach1_cpu};
use super::gemm::{with_slice, GemmFloat};
use super::heads::{permute_rows, split_heads, HeadDims};

/// Llama-3 frequency scaling (`rope_scaling` with `rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct Llama3RopeScaling {
    /// Context extension factor.
    pub factor: f64,
    /// Wavelengths longer than `original_max_position_embeddings / low_freq_factor` are divided by `factor`.
    pub low_freq_factor: f64,
    /// Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are kept.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// Precomputed cos/sin for every position, `[max_positions, head_dim]` in float32.
#[derive(Clone, Debug)]
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
}

/// transformers' `inv_freq`, optionally Llama-3 scaled.
pub fn inverse_frequencies(
    head_dim: usize,
    theta: f64,
    scaling: Option<&Llama3RopeScaling>,
) -> Vec<f64> {
    (0..head_dim / 2)
        .map(|i| {
            let inv = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
            // transformers computes inv_freq in float32.
            let inv = inv as f32 as f64;
            match scaling {
                None => inv,
                Some(s) => {
                    let old = s.original_max_position_embeddings as f64;
                    let low_wavelen = old / s.low_freq_factor;
                    let high_wavelen = old / s.high_freq_factor;
                    let wavelen = 2.0 * std::f64::consts::PI / inv;
                    let scaled = if wavelen > low_wavelen {
                        inv / s.factor
                    } else {
                        inv
                    };
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    if medium {
                        let smooth = (old / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1.0 - smooth) * scaled / s.factor + smooth * scaled
                    } else {
                        scaled
                    }
                }
            }
        })
        .collect()
}

impl RopeTables {
    /// Tables for positions `0..max_positions`.
    pub fn new(
        head_dim: usize,
        max_positions: usize,
        theta: f64,
        scaling: Option<&Llama3RopeScaling>,
        device: &Device,
    ) -> Result<Self> {
        let inv = inverse_frequencies(head_dim, theta, scaling);
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(max_positions * head_dim);
        let mut sin = Vec::with_capacity(max_positions * head_dim);
        for p in 0..max_positions {
            // Angles as transformers forms them: float32 position times float32 frequency.
            let angles: Vec<f64> = inv
                .iter()
                .map(|f| ((p as f32) * (*f as f32)) as f64)
                .collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|a| a.cos() as f32));
                sin.extend(angles.iter().map(|a| a.sin() as f32));
            }
            debug_assert_eq!(cos.len(), (p + 1) * 2 * half);
        }
        Ok(RopeTables {
            cos: Tensor::from_vec(cos, (max_positions, head_dim), device)?,
            sin: Tensor::from_vec(sin, (max_positions, head_dim), device)?,
        })
    }

    /// Number of positions covered.
    pub fn max_positions(&self) -> usize {
        self.cos.dims()[0]
    }

    /// cos/sin for positions `offset..offset+len`, shaped `[1, 1, len, head_dim]`.
    pub fn range(&self, offset: usize, len: usize) -> Result<(Tensor, Tensor)> {
        if offset + len > self.max_positions() {
            candle_core::bail!(
                "position {} is beyond the {} positions RoPE tables were built for (max_position_embeddings)",
                offset + len - 1,
                self.max_positions()
            );
        }
        let c = self
            .cos
            .narrow(0, offset, len)?
            .unsqueeze(0)?
            .unsqueeze(0)?;
        let s = self
            .sin
            .narrow(0, offset, len)?
            .unsqueeze(0)?
            .unsqueeze(0)?;
        Ok((c, s))
    }

    /// cos/sin for explicit positions `[batch, len]` (u32), shaped `[batch, 1, len, head_dim]`.
    pub fn gather(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t) = positions.dims2()?;
        let flat = positions.flatten_all()?;
        let d = self.cos.dim(1)?;
        let c = self.cos.index_select(&flat, 0)?.reshape((b, 1, t, d))?;
        let s = self.sin.index_select(&flat, 0)?.reshape((b, 1, t, d))?;
        Ok((c, s))
    }
}

/// `cat(-x2, x1)` over the last dimension.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// The transpose of [`rotate_half`]: `cat(g2, -g1)`.
fn rotate_half_t(g: &Tensor) -> Result<Tensor> {
    let half = g.dim(D::Minus1)? / 2;
    let g1 = g.narrow(D::Minus1, 0, half)?;
    let g2 = g.narrow(D::Minus1, half, half)?;
    Tensor::cat(&[&g2, &g1.neg()?], D::Minus1)
}

/// Applies RoPE to `x` (`[batch, heads, seq, head_dim]`) with `cos`/`sin` broadcastable to it (from
/// [`RopeTables::range`] or [`RopeTables::gather`]), computing in float32 (f64 stays f64).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    if let Some(layout) = SliceLayout::of(x, cos, sin) {
        match dtype {
            DType::F32 => return rope_cpu::<f32>(x, cos, sin, layout),
            DType::F64 => return rope_cpu::<f64>(x, cos, sin, layout),
            _ => {}
        }
    }
    let work = if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let (cos, sin) = (cos.to_dtype(work)?, sin.to_dtype(work)?);
    let value = {
        let x = x.detach().to_dtype(work)?;
        (x.broadcast_mul(&cos)? + rotate_half(&x)?.broadcast_mul(&sin)?)?.to_dtype(dtype)?
    };
    attach1(
        "rope",
        x,
        value,
        Box::new(move |x, grad| {
            let g = grad.to_dtype(work)?;
            let gx = (g.broadcast_mul(&cos)? + rotate_half_t(&g.broadcast_mul(&sin)?)?)?;
            Ok(Some(gx.to_dtype(x.dtype())?))
        }),
    )
}

/// RoPE on a projection's output split into heads: `x` (`[b, t, heads·d]`) → rotated `[b, heads, t, d]`, equal to
/// `rope(split_heads(x, heads), cos, sin)`. On the CPU one pass each way (the backward rotates back and merges the
/// heads in the same pass) instead of a copy, three view nodes and the rotation.
pub fn rope_split_heads(x: &Tensor, heads: usize, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, t, width) = x.dims3()?;
    let dims = HeadDims {
        b,
        t,
        h: heads,
        d: width / heads,
    };
    let split = (b, heads, t, dims.d);
    match x.dtype() {
        DType::F32 => {
            if let Some(rows) = RotatedRows::<f32>::for_heads(split, x, cos, sin)? {
                return rope_split_cpu(x, dims, rows);
            }
        }
        DType::F64 => {
            if let Some(rows) = RotatedRows::<f64>::for_heads(split, x, cos, sin)? {
                return rope_split_cpu(x, dims, rows);
            }
        }
        _ => {}
    }
    rope(&split_heads(x, heads)?, cos, sin)
}

fn rope_split_cpu<T: GemmFloat + Default>(
    x: &Tensor,
    dims: HeadDims,
    rows: RotatedRows<T>,
) -> Result<Tensor> {
    let value = with_slice::<T, _>(x, |xs| rows.permute(xs, dims, true))?;
    let HeadDims { b, h, t, d } = dims;
    attach1_cpu(
        "rope-split-heads",
        x,
        value,
        (b, h, t, d).into(),
        Box::new(move |_, grad| {
            let grad = grad.contiguous()?;
            let gx = with_slice::<T, _>(&grad, |gs| rows.permute(gs, dims, false))?;
            Ok(Some(Tensor::from_vec(gx, (b, t, h * d), &Device::Cpu)?))
        }),
    )
}

/// RoPE tables in `T`, applied row by row while a projection is split into heads or its gradient merged back.
pub(crate) struct RotatedRows<T> {
    cos: Tensor,
    sin: Tensor,
    layout: SliceLayout,
    element: std::marker::PhantomData<T>,
}

impl<T: GemmFloat + Default> RotatedRows<T> {
    /// The tables for heads `[b, heads, t, d]` of `x`'s projection, when the slice path takes them (`x` contiguous on
    /// the CPU, even `d`, cos/sin of `[1 or b, 1, t, d]`).
    pub(crate) fn for_heads(
        split: (usize, usize, usize, usize),
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Option<Self>> {
        match SliceLayout::of_dims(split, x, cos, sin).filter(|_| x.is_contiguous()) {
            Some(layout) => Ok(Some(Self::new(cos, sin, layout)?)),
            None => Ok(None),
        }
    }

    fn new(cos: &Tensor, sin: &Tensor, layout: SliceLayout) -> Result<Self> {
        Ok(RotatedRows {
            cos: cos.to_dtype(T::DTYPE)?,
            sin: sin.to_dtype(T::DTYPE)?,
            layout,
            element: std::marker::PhantomData,
        })
    }

    /// `x: [b, t, h·d]` rotated into heads `[b, h, t, d]` (`to_heads`), or the transpose: heads rotated back by
    /// `-sin` and merged (the gradient of the former).
    pub(crate) fn permute(&self, x: &[T], dims: HeadDims, to_heads: bool) -> Result<Vec<T>> {
        let (t, d) = (dims.t, dims.d);
        let per_sequence = self.layout.per_sequence;
        with_slice::<T, _>(&self.cos, |c| {
            with_slice::<T, _>(&self.sin, |s| {
                Ok(permute_rows(x, dims, to_heads, |o, x, batch, position| {
                    // Row `(batch, position)` of the tables (one set for all sequences, or one per sequence).
                    let row = if per_sequence { batch * t } else { 0 } + position;
                    let r = row * d..(row + 1) * d;
                    rotate_row(o, x, &c[r.clone()], &s[r], !to_heads)
                }))
            })
        })
    }
}

/// Shapes the slice path handles: `x: [b, h, t, d]` on the CPU with even `d`, and cos/sin of `[1 or b, 1, t, d]`.
#[derive(Clone, Copy)]
struct SliceLayout {
    heads: usize,
    t: usize,
    d: usize,
    /// Whether cos/sin have one row of tables per sequence (explicit positions) or one for all.
    per_sequence: bool,
}

impl SliceLayout {
    fn of(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Option<Self> {
        Self::of_dims(x.dims4().ok()?, x, cos, sin)
    }

    /// The layout for a `[b, heads, t, d]` input of `x`'s device and tables `cos`/`sin`.
    fn of_dims(
        (b, heads, t, d): (usize, usize, usize, usize),
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Option<Self> {
        let (cb, one, ct, cd) = cos.dims4().ok()?;
        let fits = x.device().is_cpu()
            && d % 2 == 0
            && sin.dims() == cos.dims()
            && (cb == 1 || cb == b)
            && (one, ct, cd) == (1, t, d);
        fits.then_some(SliceLayout {
            heads,
            t,
            d,
            per_sequence: cb > 1,
        })
    }
}

/// One `d`-row: `x⊙cos + rotate_half(x)⊙sin`, or with `transposed` the backward's `x⊙cos + rotate_halfᵀ(x⊙sin)`.
fn rotate_row<T: GemmFloat>(o: &mut [T], x: &[T], c: &[T], s: &[T], transposed: bool) {
    let half = x.len() / 2;
    let (o1, o2) = o.split_at_mut(half);
    let (x1, x2) = x.split_at(half);
    let (c1, c2) = c.split_at(half);
    let (s1, s2) = s.split_at(half);
    for i in 0..half {
        if transposed {
            o1[i] = x1[i] * c1[i] + x2[i] * s2[i];
            o2[i] = x2[i] * c2[i] - x1[i] * s1[i];
        } else {
            o1[i] = x1[i] * c1[i] - x2[i] * s1[i];
            o2[i] = x2[i] * c2[i] + x1[i] * s2[i];
        }
    }
}

/// [`rotate_row`] for every row of every `[t, d]` head of `x` (one parallel task per head).
fn rotate<T: GemmFloat>(
    x: &[T],
    cos: &[T],
    sin: &[T],
    layout: SliceLayout,
    transposed: bool,
) -> Vec<T> {
    let SliceLayout {
        heads,
        t,
        d,
        per_sequence,
    } = layout;
    let mut out = vec![T::zero(); x.len()];
    out.par_chunks_mut(t * d)
        .zip(x.par_chunks(t * d))
        .enumerate()
        .for_each(|(bh, (out, x))| {
            let table = if per_sequence { bh / heads * t * d } else { 0 };
            for ((o, x), (c, s)) in out.chunks_mut(d).zip(x.chunks(d)).zip(
                cos[table..table + t * d]
                    .chunks(d)
                    .zip(sin[table..table + t * d].chunks(d)),
            ) {
                rotate_row(o, x, c, s, transposed);
            }
        });
    out
}

/// [`rope`] on CPU slices: one pass each way instead of a pass per Candle op.
fn rope_cpu<T: GemmFloat>(
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    layout: SliceLayout,
) -> Result<Tensor> {
    let (cos, sin) = (cos.to_dtype(T::DTYPE)?, sin.to_dtype(T::DTYPE)?);
    let with_tables = move |x: &Tensor, transposed: bool| -> Result<Vec<T>> {
        with_slice::<T, _>(x, |xs| {
            with_slice::<T, _>(&cos, |c| {
                with_slice::<T, _>(&sin, |s| Ok(rotate(xs, c, s, layout, transposed)))
            })
        })
    };
    let value = with_tables(x, false)?;
    let shape = x.shape().clone();
    attach1_cpu(
        "rope",
        x,
        value,
        shape.clone(),
        Box::new(move |_, grad| {
            let gx = with_tables(grad, true)?;
            Ok(Some(Tensor::from_vec(gx, &shape, &Device::Cpu)?))
        }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::gradcheck::{check, rand_f64};

    #[test]
    fn gradient_matches_finite_differences_and_rope_slow() {
        let tables = RopeTables::new(8, 16, 10000.0, None, &Device::Cpu).unwrap();
        let (c, s) = tables.range(3, 5).unwrap();
        let (c2, s2) = (
            c.squeeze(0).unwrap().squeeze(0).unwrap(),
            s.squeeze(0).unwrap().squeeze(0).unwrap(),
        );
        let f = |xs: &[Tensor]| rope(&xs[0], &c, &s);
        let r = |xs: &[Tensor]| {
            candle_nn::rotary_emb::rope_slow(
                &xs[0],
                &c2.narrow(1, 0, 4)?.to_dtype(DType::F64)?,
                &s2.narrow(1, 0, 4)?.to_dtype(DType::F64)?,
            )
        };
        check(
            &f,
            &r,
            &[rand_f64(&[2, 3, 5, 8], 1)],
            &[true],
            40,
            1e-6,
            1e-6,
        );
    }

    /// The fused split + rotation equals splitting with Candle's views then `rope_slow`, for shared tables and for
    /// one table per sequence (explicit positions), and its gradient checks.
    #[test]
    fn rope_split_heads_matches_split_then_rope() {
        let tables = RopeTables::new(8, 16, 10000.0, None, &Device::Cpu).unwrap();
        let positions = Tensor::new(&[[4u32, 5, 6, 7, 8], [0, 1, 2, 0, 1]], &Device::Cpu).unwrap();
        let shared = tables.range(3, 5).unwrap();
        let per_sequence = tables.gather(&positions).unwrap();
        for (c, s) in [shared, per_sequence] {
            let (c64, s64) = (
                c.to_dtype(DType::F64).unwrap(),
                s.to_dtype(DType::F64).unwrap(),
            );
            let f = |xs: &[Tensor]| rope_split_heads(&xs[0], 3, &c, &s);
            let r = |xs: &[Tensor]| {
                let split = xs[0].reshape((2, 5, 3, 8))?.transpose(1, 2)?.contiguous()?;
                let rotated_half = Tensor::cat(
                    &[
                        &split.narrow(D::Minus1, 4, 4)?.neg()?,
                        &split.narrow(D::Minus1, 0, 4)?,
                    ],
                    D::Minus1,
                )?;
                split.broadcast_mul(&c64)? + rotated_half.broadcast_mul(&s64)?
            };
            check(&f, &r, &[rand_f64(&[2, 5, 24], 2)], &[true], 40, 1e-6, 1e-6);
        }
    }

    #[test]
    fn llama3_scaling_matches_transformers_formula() {
        let s = Llama3RopeScaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        };
        let plain = inverse_frequencies(128, 500000.0, None);
        let scaled = inverse_frequencies(128, 500000.0, Some(&s));
        // High frequencies unchanged, the lowest divided by the factor.
        assert_eq!(plain[0], scaled[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
        assert!(scaled.iter().zip(&plain).all(|(a, b)| a <= b));
    }

    #[test]
    fn gathered_positions_equal_the_range() {
        let tables = RopeTables::new(4, 10, 10000.0, None, &Device::Cpu).unwrap();
        let pos = Tensor::new(&[[2u32, 3, 4]], &Device::Cpu).unwrap();
        let (c1, _) = tables.gather(&pos).unwrap();
        let (c2, _) = tables.range(2, 3).unwrap();
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(c1), flat(c2));
    }
}
