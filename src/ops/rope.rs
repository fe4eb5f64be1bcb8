//! Rotary position embeddings in Hugging Face's half-split layout (`rotate_half`), with `rope_theta` and
//! `rope_scaling` (Llama 3, linear, Phi-3's LongRoPE, YaRN). The backward rotates by `-sin`; cos/sin are constants and get no gradient.

use candle_core::{DType, Device, Result, Shape, Tensor, D};

use rayon::prelude::*;

use super::autograd::op::{Apply, Op, Value};
use super::cpu::vector::simd;
use super::cpu::{with_slice, with_slices, CpuFloat};
use super::head_layout::{permute_rows, HeadDims};
use super::heads::split_heads;
use crate::precision::master_dtype;

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

/// Phi-3's LongRoPE (`rope_type = "longrope"`): every frequency divided by its own factor — the short factors
/// while a sequence fits the original context, the long ones beyond it — and cos/sin multiplied by
/// `attention_factor`.
#[derive(Clone, Debug, PartialEq)]
pub struct LongRopeScaling {
    /// Factors for sequences up to `original_max_position_embeddings` positions (one per frequency).
    pub short_factor: Vec<f64>,
    /// Factors for longer sequences.
    pub long_factor: Vec<f64>,
    /// The context length the model was pre-trained with: longer sequences switch to `long_factor`.
    pub original_max_position_embeddings: usize,
    /// cos/sin multiplier (`√(1 + ln(max / original) / ln(original))` unless the config sets it).
    pub attention_factor: f64,
}

impl LongRopeScaling {
    /// The cos/sin multiplier a config leaves unset: `√(1 + ln(factor) / ln(original))` for a context extended by
    /// `factor` (`max_position_embeddings / original`), 1 when it is not extended (transformers' rule).
    pub fn default_attention_factor(factor: f64, original: usize) -> f64 {
        if factor <= 1.0 {
            1.0
        } else {
            (1.0 + factor.ln() / (original as f64).ln()).sqrt()
        }
    }
}

/// YaRN (`rope_type = "yarn"`, gpt-oss): each frequency blended between itself (short wavelengths, extrapolated)
/// and itself divided by `factor` (long wavelengths, interpolated) along a linear ramp between the dimensions that
/// turn `beta_fast` and `beta_slow` times over the original context; cos/sin multiplied by `attention_factor`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnRopeScaling {
    /// Context extension factor.
    pub factor: f64,
    /// Rotations over the original context above which a dimension is extrapolated (32).
    pub beta_fast: f64,
    /// Rotations below which it is interpolated (1).
    pub beta_slow: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Whether the ramp's ends are rounded to whole dimensions (transformers' default; gpt-oss sets `false`).
    pub truncate: bool,
    /// cos/sin multiplier (`0.1·ln(factor) + 1` unless the config sets it).
    pub attention_factor: f64,
}

impl YarnRopeScaling {
    /// transformers' `_compute_yarn_parameters` default for `attention_factor`: `get_mscale(factor, mscale) /
    /// get_mscale(factor, mscale_all_dim)` when both are given, else `get_mscale(factor)`, where
    /// `get_mscale(s, m) = 0.1·m·ln(s) + 1` (1 for `s ≤ 1`).
    pub fn default_attention_factor(
        factor: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
    ) -> f64 {
        let get = |m: f64| {
            if factor <= 1.0 {
                1.0
            } else {
                0.1 * m * factor.ln() + 1.0
            }
        };
        match (mscale, mscale_all_dim) {
            (Some(m), Some(all)) if m != 0.0 && all != 0.0 => get(m) / get(all),
            _ => get(1.0),
        }
    }

    /// The inverse frequencies of `rotary_dim` dimensions with base `theta`: in float32 as transformers computes
    /// them, or (`exact`) in float64 throughout.
    fn frequencies(&self, rotary_dim: usize, theta: f64, exact: bool) -> Vec<f64> {
        let dim = rotary_dim as f64;
        let correction = |rotations: f64| {
            let max = self.original_max_position_embeddings as f64;
            dim * (max / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * theta.ln())
        };
        let (mut low, mut high) = (correction(self.beta_fast), correction(self.beta_slow));
        if self.truncate {
            (low, high) = (low.floor(), high.ceil());
        }
        let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
        if low == high {
            high += 0.001; // transformers' guard against a zero-width ramp
        }
        if exact {
            return (0..rotary_dim / 2)
                .map(|i| {
                    let pos = theta.powf((2 * i) as f64 / dim);
                    let (extrapolated, interpolated) = (1.0 / pos, 1.0 / (self.factor * pos));
                    let keep = 1.0 - ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                    interpolated * (1.0 - keep) + extrapolated * keep
                })
                .collect();
        }
        // The ramp as transformers forms it: a float32 range minus `low`, over `high − low` taken in float64.
        let (low, width) = (low as f32, (high - low) as f32);
        (0..rotary_dim / 2)
            .map(|i| {
                // `base ** (arange(0, dim, 2).float() / dim)` in float32, as transformers computes it.
                let pos = (theta as f32).powf((2 * i) as f32 / rotary_dim as f32);
                let extrapolated = 1.0 / pos;
                let interpolated = 1.0 / (self.factor as f32 * pos);
                let ramp = ((i as f32 - low) / width).clamp(0.0, 1.0);
                let keep = 1.0 - ramp;
                (interpolated * (1.0 - keep) + extrapolated * keep) as f64
            })
            .collect()
    }
}

/// How RoPE frequencies are scaled (`rope_scaling`, or `rope_parameters` in transformers 5).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3's smooth long-wavelength scaling (`rope_type = "llama3"`).
    Llama3(Llama3RopeScaling),
    /// Positions divided by `factor` (`rope_type = "linear"`; Gemma 3's global layers).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Phi-3's LongRoPE.
    LongRope(LongRopeScaling),
    /// YaRN (gpt-oss).
    Yarn(YarnRopeScaling),
}

/// Precomputed cos/sin for every position, `[max_positions, rotary_dim]`: in float32, formed as transformers forms
/// them (float32 frequencies and angles), or — for a model computing in float64 — in float64 from end to end.
#[derive(Clone, Debug)]
pub struct RopeTables {
    cos: Tensor,
    sin: Tensor,
    /// LongRoPE's tables for sequences longer than the given number of positions (the short ones are `cos`/`sin`).
    long: Option<(Tensor, Tensor, usize)>,
}

/// transformers' `inv_freq` for `rotary_dim` rotated dimensions, scaled by `scaling` (LongRoPE: its short
/// factors), rounded to float32 where transformers computes in float32.
pub fn inverse_frequencies(
    rotary_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
) -> Vec<f64> {
    frequencies(rotary_dim, theta, scaling, false, false)
}

/// [`inverse_frequencies`] in float64 throughout (no float32 step), as a float64 model's tables use them.
pub fn inverse_frequencies_f64(
    rotary_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
) -> Vec<f64> {
    frequencies(rotary_dim, theta, scaling, false, true)
}

/// [`inverse_frequencies`], with LongRoPE's long factors when `long`; in float64 throughout when `exact`.
fn frequencies(
    rotary_dim: usize,
    theta: f64,
    scaling: Option<&RopeScaling>,
    long: bool,
    exact: bool,
) -> Vec<f64> {
    if let Some(RopeScaling::Yarn(yarn)) = scaling {
        return yarn.frequencies(rotary_dim, theta, exact);
    }
    // transformers computes inv_freq in float32; a float64 model keeps every digit.
    let round = |x: f64| if exact { x } else { x as f32 as f64 };
    (0..rotary_dim / 2)
        .map(|i| {
            let inv = round(1.0 / theta.powf((2 * i) as f64 / rotary_dim as f64));
            match scaling {
                // YaRN's frequencies are computed apart (above).
                None | Some(RopeScaling::Yarn(_)) => inv,
                Some(RopeScaling::Linear { factor }) => round(inv / factor),
                Some(RopeScaling::LongRope(s)) => {
                    let factors = if long {
                        &s.long_factor
                    } else {
                        &s.short_factor
                    };
                    round(inv / round(factors[i]))
                }
                Some(RopeScaling::Llama3(s)) => llama3_scaled(inv, s),
            }
        })
        .collect()
}

/// Llama 3's scaling as one divisor per frequency, the form llama.cpp stores it in (`rope_freqs`): 1 for short
/// wavelengths, `factor` for long ones, `1 / ((1 − smooth) / factor + smooth)` between, computed in float32 from
/// transformers' float32 frequencies as llama.cpp's converter computes it.
pub fn llama3_frequency_divisors(rotary_dim: usize, theta: f64, s: &Llama3RopeScaling) -> Vec<f32> {
    let old = s.original_max_position_embeddings as f32;
    let (low, high, factor) = (
        s.low_freq_factor as f32,
        s.high_freq_factor as f32,
        s.factor as f32,
    );
    inverse_frequencies(rotary_dim, theta, None)
        .into_iter()
        .map(|inv| {
            let wavelen = 2.0 * std::f32::consts::PI / inv as f32;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor
            } else {
                let smooth = (old / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// One Llama-3-scaled inverse frequency.
fn llama3_scaled(inv: f64, s: &Llama3RopeScaling) -> f64 {
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
        let smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * scaled / s.factor + smooth * scaled
    } else {
        scaled
    }
}

/// cos/sin tables `[max_positions, 2·inv.len()]` of frequencies `inv`, times `multiplier`: float32 tables of
/// float32 angles, or (`exact`) float64 tables of float64 angles.
fn tables(
    inv: &[f64],
    max_positions: usize,
    multiplier: f64,
    device: &Device,
    exact: bool,
) -> Result<(Tensor, Tensor)> {
    if exact {
        let angle = |p: usize, f: f64| p as f64 * f;
        return Ok((
            table_of(inv, max_positions, device, |p, f| {
                angle(p, f).cos() * multiplier
            })?,
            table_of(inv, max_positions, device, |p, f| {
                angle(p, f).sin() * multiplier
            })?,
        ));
    }
    // Angles as transformers forms them: float32 position times float32 frequency.
    let angle = |p: usize, f: f64| ((p as f32) * (f as f32)) as f64;
    let m = multiplier as f32;
    Ok((
        table_of(inv, max_positions, device, |p, f| {
            angle(p, f).cos() as f32 * m
        })?,
        table_of(inv, max_positions, device, |p, f| {
            angle(p, f).sin() as f32 * m
        })?,
    ))
}

/// The `[max_positions, 2·inv.len()]` table of `entry(position, frequency)`, each frequency's column twice (the
/// half-split layout).
fn table_of<T: candle_core::WithDType>(
    inv: &[f64],
    max_positions: usize,
    device: &Device,
    entry: impl Fn(usize, f64) -> T,
) -> Result<Tensor> {
    let dim = 2 * inv.len();
    let mut out = Vec::with_capacity(max_positions * dim);
    for p in 0..max_positions {
        for _ in 0..2 {
            out.extend(inv.iter().map(|f| entry(p, *f)));
        }
    }
    Tensor::from_vec(out, (max_positions, dim), device)
}

impl RopeTables {
    /// Float32 tables for positions `0..max_positions` of `rotary_dim` rotated dimensions.
    pub fn new(
        rotary_dim: usize,
        max_positions: usize,
        theta: f64,
        scaling: Option<&RopeScaling>,
        device: &Device,
    ) -> Result<Self> {
        Self::build(rotary_dim, max_positions, theta, scaling, device, false)
    }

    /// [`RopeTables::new`] in float64 from end to end (frequencies, angles, cos/sin), for a model computing in
    /// float64.
    pub fn new_f64(
        rotary_dim: usize,
        max_positions: usize,
        theta: f64,
        scaling: Option<&RopeScaling>,
        device: &Device,
    ) -> Result<Self> {
        Self::build(rotary_dim, max_positions, theta, scaling, device, true)
    }

    fn build(
        rotary_dim: usize,
        max_positions: usize,
        theta: f64,
        scaling: Option<&RopeScaling>,
        device: &Device,
        exact: bool,
    ) -> Result<Self> {
        let multiplier = match scaling {
            Some(RopeScaling::LongRope(s)) => s.attention_factor,
            Some(RopeScaling::Yarn(s)) => s.attention_factor,
            _ => 1.0,
        };
        let of = |long| {
            let inv = frequencies(rotary_dim, theta, scaling, long, exact);
            tables(&inv, max_positions, multiplier, device, exact)
        };
        let (cos, sin) = of(false)?;
        let long = match scaling {
            Some(RopeScaling::LongRope(s)) => {
                let (c, s_) = of(true)?;
                Some((c, s_, s.original_max_position_embeddings))
            }
            _ => None,
        };
        Ok(RopeTables { cos, sin, long })
    }

    /// The tables for sequences of `len` positions: LongRoPE switches to its long factors once a sequence is longer
    /// than the original context (as transformers does, by the largest position of the call).
    fn for_length(&self, len: usize) -> (&Tensor, &Tensor) {
        match &self.long {
            Some((c, s, original)) if len > *original => (c, s),
            _ => (&self.cos, &self.sin),
        }
    }

    /// Bytes of the tables (cos and sin, and LongRoPE's long pair).
    pub fn bytes(&self) -> usize {
        let t = |x: &Tensor| x.elem_count() * x.dtype().size_in_bytes();
        t(&self.cos) + t(&self.sin) + self.long.as_ref().map_or(0, |(c, s, _)| t(c) + t(s))
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
        let (cos, sin) = self.for_length(offset + len);
        let c = cos.narrow(0, offset, len)?.unsqueeze(0)?.unsqueeze(0)?;
        let s = sin.narrow(0, offset, len)?.unsqueeze(0)?.unsqueeze(0)?;
        Ok((c, s))
    }

    /// cos/sin for explicit positions `[batch, len]` (u32, on any device), shaped `[batch, 1, len, head_dim]`.
    pub fn gather(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        let (b, t) = positions.dims2()?;
        let flat = positions.flatten_all()?.to_device(self.cos.device())?;
        let (cos, sin) = match &self.long {
            Some(_) => {
                let last = flat.to_dtype(DType::U32)?.max(0)?.to_scalar::<u32>()? as usize;
                self.for_length(last + 1)
            }
            None => (&self.cos, &self.sin),
        };
        let d = cos.dim(1)?;
        let c = cos.index_select(&flat, 0)?.reshape((b, 1, t, d))?;
        let s = sin.index_select(&flat, 0)?.reshape((b, 1, t, d))?;
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
    #[cfg(feature = "cuda")]
    if super::rows_cuda::applies(x) {
        use super::rows_cuda::{move_rows, RowLayout};
        let (b, h, t, d) = x.dims4()?;
        let dims = HeadDims { b, t, h, d };
        let head_major = RowLayout::HeadMajor;
        return move_rows(x, dims, Some((cos, sin)), head_major, head_major);
    }
    Rope {
        cos: cos.clone(),
        sin: sin.clone(),
        layout: None,
    }
    .apply([x])
}

/// The RoPE op (input `x`; the tables are constants).
struct Rope {
    /// In the working dtype once the forward ran.
    cos: Tensor,
    sin: Tensor,
    /// Set when the forward ran on CPU slices (the backward follows).
    layout: Option<SliceLayout>,
}

impl Rope {
    /// Every row rotated (`transposed`: the backward's rotation by `-sin`) on CPU slices.
    fn cpu_rotate<T: CpuFloat>(&self, x: &Tensor, transposed: bool) -> Result<Vec<T>> {
        let layout = self
            .layout
            .ok_or_else(|| candle_core::Error::Msg("rope: no slice layout".into()))?;
        with_slices([x, &self.cos, &self.sin], |[xs, c, s]| {
            Ok(rotate(xs, c, s, layout, transposed))
        })
    }

    /// One pass each way instead of a pass per Candle op.
    fn cpu_fwd<T: CpuFloat>(&self, x: &Tensor) -> Result<Value> {
        Ok(Value::cpu(self.cpu_rotate::<T>(x, false)?, x.shape()))
    }

    fn cpu_bwd<T: CpuFloat>(&self, grad: &Tensor) -> Result<Tensor> {
        Tensor::from_vec(
            self.cpu_rotate::<T>(grad, true)?,
            grad.shape(),
            &Device::Cpu,
        )
    }

    fn composed_fwd(&self, x: &Tensor) -> Result<Value> {
        let xw = x.detach().to_dtype(self.cos.dtype())?;
        let y = (xw.broadcast_mul(&self.cos)? + rotate_half(&xw)?.broadcast_mul(&self.sin)?)?;
        Ok(Value::Tensor(y.to_dtype(x.dtype())?))
    }

    fn composed_bwd(&self, x: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let g = grad.to_dtype(self.cos.dtype())?;
        let gx = (g.broadcast_mul(&self.cos)? + rotate_half_t(&g.broadcast_mul(&self.sin)?)?)?;
        gx.to_dtype(x.dtype())
    }
}

impl Op<1> for Rope {
    const NAME: &'static str = "rope";

    fn fwd(&mut self, [x]: [&Tensor; 1]) -> Result<Value> {
        let dtype = x.dtype();
        self.layout = SliceLayout::of(x, &self.cos, &self.sin)
            .filter(|_| matches!(dtype, DType::F32 | DType::F64));
        let tables = if self.layout.is_some() {
            dtype
        } else {
            master_dtype(dtype)
        };
        (self.cos, self.sin) = (self.cos.to_dtype(tables)?, self.sin.to_dtype(tables)?);
        match (self.layout, dtype) {
            (Some(_), DType::F32) => self.cpu_fwd::<f32>(x),
            (Some(_), _) => self.cpu_fwd::<f64>(x),
            (None, _) => self.composed_fwd(x),
        }
    }

    fn bwd(&self, [x]: [&Tensor; 1], grad: &Tensor, _: [bool; 1]) -> Result<[Option<Tensor>; 1]> {
        let gx = match (self.layout, x.dtype()) {
            (Some(_), DType::F32) => self.cpu_bwd::<f32>(grad)?,
            (Some(_), _) => self.cpu_bwd::<f64>(grad)?,
            (None, _) => self.composed_bwd(x, grad)?,
        };
        Ok([Some(gx)])
    }
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
    #[cfg(feature = "cuda")]
    if super::rows_cuda::applies(x) {
        use super::rows_cuda::{move_rows, RowLayout};
        return move_rows(
            x,
            dims,
            Some((cos, sin)),
            RowLayout::TokenMajor,
            RowLayout::HeadMajor,
        );
    }
    let split = (b, heads, t, dims.d);
    match x.dtype() {
        DType::F32 => {
            if let Some(rows) = RotatedRows::<f32>::for_heads(split, x, cos, sin)? {
                return RopeSplitHeads { dims, rows }.apply([x]);
            }
        }
        DType::F64 => {
            if let Some(rows) = RotatedRows::<f64>::for_heads(split, x, cos, sin)? {
                return RopeSplitHeads { dims, rows }.apply([x]);
            }
        }
        _ => {}
    }
    rope(&split_heads(x, heads)?, cos, sin)
}

/// [`rope_split_heads`] on CPU slices (input `x`).
struct RopeSplitHeads<T> {
    dims: HeadDims,
    rows: RotatedRows<T>,
}

impl<T: CpuFloat> Op<1> for RopeSplitHeads<T> {
    const NAME: &'static str = "rope-split-heads";

    fn fwd(&mut self, [x]: [&Tensor; 1]) -> Result<Value> {
        let value = with_slice::<T, _>(x, |xs| self.rows.permute(xs, self.dims, true))?;
        let HeadDims { b, h, t, d } = self.dims;
        Ok(Value::cpu(value, (b, h, t, d)))
    }

    fn bwd(&self, _: [&Tensor; 1], grad: &Tensor, _: [bool; 1]) -> Result<[Option<Tensor>; 1]> {
        let gx = with_slice::<T, _>(grad, |gs| self.rows.permute(gs, self.dims, false))?;
        let HeadDims { b, h, t, d } = self.dims;
        let merged: Shape = (b, t, h * d).into();
        Ok([Some(Tensor::from_vec(gx, merged, &Device::Cpu)?)])
    }
}

/// RoPE tables in `T`, applied row by row while a projection is split into heads or its gradient merged back.
pub(crate) struct RotatedRows<T> {
    cos: Tensor,
    sin: Tensor,
    layout: SliceLayout,
    element: std::marker::PhantomData<T>,
}

impl<T: CpuFloat> RotatedRows<T> {
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
#[inline(always)]
fn rotate_row<T: CpuFloat>(o: &mut [T], x: &[T], c: &[T], s: &[T], transposed: bool) {
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
fn rotate<T: CpuFloat>(
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
            simd(
                #[inline(always)]
                || {
                    for ((o, x), (c, s)) in out.chunks_mut(d).zip(x.chunks(d)).zip(
                        cos[table..table + t * d]
                            .chunks(d)
                            .zip(sin[table..table + t * d].chunks(d)),
                    ) {
                        rotate_row(o, x, c, s, transposed);
                    }
                },
            )
        });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, rand_f64};

    /// YaRN's frequencies and cos/sin factor equal transformers' `_compute_yarn_parameters`: gpt-oss-20b's
    /// (head_dim 64, base 150000, factor 32 over 4096, `truncate = false`) and a truncated ramp (head_dim 16, base
    /// 10⁴, factor 4 over 64, betas 8 and 2).
    #[test]
    fn yarn_matches_transformers() {
        let gpt_oss = YarnRopeScaling {
            factor: 32.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            original_max_position_embeddings: 4096,
            truncate: false,
            attention_factor: YarnRopeScaling::default_attention_factor(32.0, None, None),
        };
        assert!((gpt_oss.attention_factor - 1.3465735902799727).abs() < 1e-12);
        let inv = inverse_frequencies(64, 150_000.0, Some(&RopeScaling::Yarn(gpt_oss)));
        let want = [
            1.0,
            0.05081327259540558,
            0.0004564839182421565,
            4.099978468730114e-06,
        ];
        for (i, w) in want.iter().enumerate() {
            assert!(
                (inv[8 * i] - w).abs() <= 1e-7 * w,
                "{i}: {} vs {w}",
                inv[8 * i]
            );
        }
        let truncated = YarnRopeScaling {
            factor: 4.0,
            beta_fast: 8.0,
            beta_slow: 2.0,
            original_max_position_embeddings: 64,
            truncate: true,
            attention_factor: YarnRopeScaling::default_attention_factor(4.0, None, None),
        };
        assert!((truncated.attention_factor - 1.138629436111989).abs() < 1e-12);
        let inv = inverse_frequencies(16, 10_000.0, Some(&RopeScaling::Yarn(truncated)));
        let want = [
            1.0,
            0.19764235615730286,
            0.02500000037252903,
            0.007905694656074047,
            0.0024999999441206455,
            0.0007905694656074047,
            0.0002500000118743628,
            7.905694656074047e-05,
        ];
        for (g, w) in inv.iter().zip(want) {
            assert!((g - w).abs() <= 1e-7 * w, "{g} vs {w}");
        }
    }

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
        let scaled = inverse_frequencies(128, 500000.0, Some(&RopeScaling::Llama3(s)));
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
