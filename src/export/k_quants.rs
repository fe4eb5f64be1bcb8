//! ggml's k-quants (`q2_k` … `q6_k`): super-blocks of 256 values in sub-blocks of 16 or 32, each sub-block with a
//! scale (and a minimum, for the asymmetric `q2_k`, `q4_k`, `q5_k`) stored in 4, 6 or 8 bits against the
//! super-block's float16 scales. The codes and scales are chosen as ggml's reference quantizers choose them
//! (`quantize_row_q*_K_ref`, what `llama-quantize` runs without an importance matrix): a search over scales that
//! minimizes a weighted squared (or, for `q2_k`, absolute) error, then the values requantized against the stored
//! scales. The float arithmetic is done in ggml's order, one rounding per operation (no fused multiply-add), so the
//! bytes are ggml's bit for bit; the tests check them against ggml's own quantizers.

use half::f16;

/// Values per super-block.
pub const SUPER_BLOCK: usize = 256;

/// Groups whose largest magnitude is below this are all zeros (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// `round(v)`, halves to even, as ggml's `nearest_int` computes it: `v + 1.5·2²³` puts the integer in the low
/// mantissa bits. Exact for |v| < 2²²; beyond, the same bits as ggml's.
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// `v` as the float16 that a block stores, and that value back as float32 (what the requantization divides by).
fn stored(v: f32) -> (f16, f32) {
    let h = f16::from_f32(v);
    (h, h.to_f32())
}

/// The value of largest magnitude (the first of equals, its sign kept) and that magnitude.
fn extreme(x: &[f32]) -> (f32, f32) {
    x.iter().fold((0f32, 0f32), |(max, amax), &v| {
        if v.abs() > amax {
            (v, v.abs())
        } else {
            (max, amax)
        }
    })
}

/// A symmetric group's codes `l + nmax` (l in `[-nmax, nmax)`) and scale, weighting each value by its square:
/// the scale `−nmax / max` and 18 nearby ones are tried, the one of least weighted error kept (ggml's
/// `make_qx_quants` with `rmse_type` 1).
fn symmetric_codes(x: &[f32], nmax: i32, codes: &mut [u8]) -> f32 {
    let (max, amax) = extreme(x);
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        x.iter().fold((0f32, 0f32), |(sumlx, suml2), &v| {
            let l = level(iscale, v) as f32;
            let w = v * v;
            (sumlx + w * v * l, suml2 + w * l * l)
        })
    };
    let mut set_codes = |iscale: f32| {
        for (c, &v) in codes.iter_mut().zip(x) {
            *c = (nmax + level(iscale, v)) as u8;
        }
    };
    let iscale = -(nmax as f32) / max;
    set_codes(iscale);
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for step in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(nmax as f32 + 0.1f32 * step as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set_codes(iscale);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// A group of 16 for `q3_k`: codes `l + 4` (l in `[-4, 4)`) and the scale, the codes improved one at a time (up
/// to five passes) while the weighted error falls (ggml's `make_q3_quants` with `do_rmse`).
fn q3_codes(x: &[f32], codes: &mut [i8]) -> f32 {
    const NMAX: i32 = 4;
    let (max, amax) = extreme(x);
    if amax < GROUP_MAX_EPS {
        codes.fill(0);
        return 0.0;
    }
    let iscale = -(NMAX as f32) / max;
    let (mut sumlx, mut suml2) = (0f32, 0f32);
    for (c, &v) in codes.iter_mut().zip(x) {
        let l = nearest_int(iscale * v).clamp(-NMAX, NMAX - 1);
        *c = l as i8;
        let (w, l) = (v * v, l as f32);
        sumlx += w * v * l;
        suml2 += w * l * l;
    }
    for _ in 0..5 {
        let mut changed = false;
        for (c, &v) in codes.iter_mut().zip(x) {
            let w = v * v;
            let old = *c as f32;
            let mut slx = sumlx - w * v * old;
            if slx > 0.0 {
                let mut sl2 = suml2 - w * old * old;
                let new = nearest_int(v * sl2 / slx).clamp(-NMAX, NMAX - 1);
                if new != *c as i32 {
                    let l = new as f32;
                    slx += w * v * l;
                    sl2 += w * l * l;
                    if sl2 > 0.0 && slx * slx * suml2 > sumlx * sumlx * sl2 {
                        *c = new as i8;
                        sumlx = slx;
                        suml2 = sl2;
                        changed = true;
                    }
                }
            }
        }
        if !changed {
            break;
        }
    }
    codes.iter_mut().for_each(|c| *c += NMAX as i8);
    if suml2 > 0.0 {
        sumlx / suml2
    } else {
        0.0
    }
}

/// How [`asymmetric_codes`] searches.
struct Search {
    /// Largest code.
    nmax: i32,
    /// The first trial's offset from `nmax` levels over the range.
    rmin: f32,
    /// The offset's step between trials.
    rdelta: f32,
    /// Trials after the first.
    steps: i32,
    /// Absolute rather than squared error.
    absolute: bool,
}

/// An asymmetric group's codes in `[0, nmax]`, scale and minimum (returned as `−min ≥ 0`): the range split
/// evenly, then `steps + 1` other splits tried, each with the least-squares scale and minimum for its codes; the
/// one of least weighted error is kept (ggml's `make_qkx2_quants`).
fn asymmetric_codes(x: &[f32], weights: &[f32], s: &Search, codes: &mut [u8]) -> (f32, f32) {
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for (&v, &w) in x.iter().zip(weights).skip(1) {
        min = if v < min { v } else { min };
        max = if v > max { v } else { max };
        sum_w += w;
        sum_x += w * v;
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        codes.fill(0);
        return (0.0, -min);
    }
    let error = |scale: f32, min: f32, codes: &[u8]| {
        x.iter()
            .zip(weights)
            .zip(codes)
            .fold(0f32, |e, ((&v, &w), &l)| {
                let diff = scale * l as f32 + min - v;
                e + w * if s.absolute { diff.abs() } else { diff * diff }
            })
    };
    let iscale = s.nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    for (c, &v) in codes.iter_mut().zip(x) {
        *c = nearest_int(iscale * (v - min)).clamp(0, s.nmax) as u8;
    }
    let mut best_error = error(scale, min, codes);
    let mut trial = [0u8; 32];
    let trial = &mut trial[..x.len()];
    for step in 0..=s.steps {
        // As ggml: each trial splits the range from the best minimum so far.
        let iscale = (s.rmin + s.rdelta * step as f32 + s.nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0f32, 0f32, 0f32);
        for ((t, &v), &w) in trial.iter_mut().zip(x).zip(weights) {
            *t = nearest_int(iscale * (v - min)).clamp(0, s.nmax) as u8;
            let l = *t as f32;
            sum_l += w * l;
            sum_l2 += w * l * l;
            sum_xl += w * l * v;
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let this_error = error(this_scale, this_min, trial);
            if this_error < best_error {
                codes.copy_from_slice(trial);
                best_error = this_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Packs 2-bit codes as ggml does: of each 128, byte `l` holds codes `l`, `l + 32`, `l + 64`, `l + 96` from the
/// low bits up.
fn put_2bit(out: &mut Vec<u8>, codes: &[u8]) {
    for half in codes.chunks_exact(128) {
        out.extend((0..32).map(|l| {
            (half[l] & 3)
                | (half[l + 32] & 3) << 2
                | (half[l + 64] & 3) << 4
                | (half[l + 96] & 3) << 6
        }));
    }
}

/// Packs 4-bit codes as ggml does: of each 64, byte `l` holds code `l` low and code `l + 32` high.
fn put_4bit(out: &mut Vec<u8>, codes: &[u8]) {
    for quarter in codes.chunks_exact(64) {
        out.extend((0..32).map(|l| (quarter[l] & 0xf) | (quarter[l + 32] & 0xf) << 4));
    }
}

/// The 6-bit scales and minimums of 8 sub-blocks in 12 bytes (ggml's `K_SCALE_SIZE` packing): sub-blocks 0–3
/// whole in bytes 0–7, the low nibbles of 4–7 in bytes 8–11 and their high two bits on top of bytes 0–7.
fn pack_scales_mins(scales: &[u8; 8], mins: &[u8; 8]) -> [u8; 12] {
    let mut out = [0u8; 12];
    for j in 0..8 {
        let (ls, lm) = (scales[j], mins[j]);
        if j < 4 {
            out[j] = ls;
            out[j + 4] = lm;
        } else {
            out[j + 4] = (ls & 0xf) | (lm & 0xf) << 4;
            out[j - 4] |= (ls >> 4) << 6;
            out[j] |= (lm >> 4) << 6;
        }
    }
    out
}

/// Sub-block `j`'s 6-bit scale and minimum from [`pack_scales_mins`]'s bytes.
fn scale_min(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xf) | (q[j - 4] >> 6) << 4,
            (q[j + 4] >> 4) | (q[j] >> 6) << 4,
        )
    }
}

/// `q2_k` (84 bytes): 16 sub-blocks of 16 with 4-bit scales and minimums, 2-bit codes.
pub fn q2_k(x: &[f32], out: &mut Vec<u8>) {
    let search = Search {
        nmax: 3,
        rmin: -0.5,
        rdelta: 0.1,
        steps: 15,
        absolute: true,
    };
    let mut codes = [0u8; SUPER_BLOCK];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for (j, group) in x.chunks_exact(16).enumerate() {
        let weights: [f32; 16] = std::array::from_fn(|l| group[l].abs());
        (scales[j], mins[j]) =
            asymmetric_codes(group, &weights, &search, &mut codes[16 * j..16 * j + 16]);
        max_scale = if scales[j] > max_scale {
            scales[j]
        } else {
            max_scale
        };
        max_min = if mins[j] > max_min { mins[j] } else { max_min };
    }
    let mut packed = [0u8; 16];
    let mut d = f16::ZERO;
    if max_scale > 0.0 {
        let iscale = 15.0 / max_scale;
        for (p, &s) in packed.iter_mut().zip(&scales) {
            *p = nearest_int(iscale * s) as u8;
        }
        d = f16::from_f32(max_scale / 15.0);
    }
    let mut dmin = f16::ZERO;
    if max_min > 0.0 {
        let iscale = 15.0 / max_min;
        for (p, &m) in packed.iter_mut().zip(&mins) {
            *p |= (nearest_int(iscale * m) << 4) as u8;
        }
        dmin = f16::from_f32(max_min / 15.0);
    }
    for (j, group) in x.chunks_exact(16).enumerate() {
        let scale = d.to_f32() * (packed[j] & 0xf) as f32;
        if scale == 0.0 {
            continue;
        }
        let offset = dmin.to_f32() * (packed[j] >> 4) as f32;
        for (c, &v) in codes[16 * j..].iter_mut().zip(group) {
            *c = nearest_int((v + offset) / scale).clamp(0, 3) as u8;
        }
    }
    out.extend_from_slice(&packed);
    put_2bit(out, &codes);
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
}

/// `q3_k` (110 bytes): 16 sub-blocks of 16 with 6-bit signed scales, 3-bit codes (the high bit in a mask).
pub fn q3_k(x: &[f32], out: &mut Vec<u8>) {
    let mut codes = [0i8; SUPER_BLOCK];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut amax) = (0f32, 0f32);
    for (j, group) in x.chunks_exact(16).enumerate() {
        scales[j] = q3_codes(group, &mut codes[16 * j..16 * j + 16]);
        if scales[j].abs() > amax {
            amax = scales[j].abs();
            max_scale = scales[j];
        }
    }
    let mut packed = [0u8; 12];
    let mut d = f16::ZERO;
    if max_scale != 0.0 {
        let iscale = -32.0 / max_scale;
        for (j, &s) in scales.iter().enumerate() {
            let l = ((nearest_int(iscale * s) as i8).clamp(-32, 31) + 32) as u8;
            if j < 8 {
                packed[j] = l & 0xf;
            } else {
                packed[j - 8] |= (l & 0xf) << 4;
            }
            packed[j % 4 + 8] |= (l >> 4) << (2 * (j / 4));
        }
        d = f16::from_f32(1.0 / iscale);
    }
    for (j, group) in x.chunks_exact(16).enumerate() {
        let low = if j < 8 {
            packed[j] & 0xf
        } else {
            packed[j - 8] >> 4
        };
        let high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
        let scale = d.to_f32() * ((low | high << 4) as i32 - 32) as f32;
        if scale == 0.0 {
            continue;
        }
        for (c, &v) in codes[16 * j..].iter_mut().zip(group) {
            *c = (nearest_int(v / scale).clamp(-4, 3) + 4) as i8;
        }
    }
    // The third bits: code j's in bit j / 32 of byte j % 32.
    let mut high_bits = [0u8; 32];
    let mut low = [0u8; SUPER_BLOCK];
    for (j, &c) in codes.iter().enumerate() {
        let c = c as u8;
        if c > 3 {
            high_bits[j % 32] |= 1 << (j / 32);
        }
        low[j] = c & 3;
    }
    out.extend_from_slice(&high_bits);
    put_2bit(out, &low);
    out.extend_from_slice(&packed);
    out.extend_from_slice(&d.to_le_bytes());
}

/// `q4_k` (144 bytes) and `q5_k` (176 bytes): 8 sub-blocks of 32 with 6-bit scales and minimums, 4- or 5-bit codes
/// (the fifth bits in 32 bytes of their own).
fn q4_q5_k(x: &[f32], out: &mut Vec<u8>, five_bits: bool) {
    let search = match five_bits {
        false => Search {
            nmax: 15,
            rmin: -1.0,
            rdelta: 0.1,
            steps: 20,
            absolute: false,
        },
        true => Search {
            nmax: 31,
            rmin: -0.5,
            rdelta: 0.1,
            steps: 15,
            absolute: false,
        },
    };
    let mut codes = [0u8; SUPER_BLOCK];
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let (mut max_scale, mut max_min) = (0f32, 0f32);
    for (j, group) in x.chunks_exact(32).enumerate() {
        let sum_x2 = group.iter().fold(0f32, |s, &v| s + v * v);
        let average = (sum_x2 / 32.0).sqrt();
        let weights: [f32; 32] = std::array::from_fn(|l| average + group[l].abs());
        (scales[j], mins[j]) =
            asymmetric_codes(group, &weights, &search, &mut codes[32 * j..32 * j + 32]);
        max_scale = if scales[j] > max_scale {
            scales[j]
        } else {
            max_scale
        };
        max_min = if mins[j] > max_min { mins[j] } else { max_min };
    }
    let inverse = |m: f32| if m > 0.0 { 63.0 / m } else { 0.0 };
    let (inv_scale, inv_min) = (inverse(max_scale), inverse(max_min));
    let six_bits = |inv: f32, v: f32| (nearest_int(inv * v) as u8).min(63);
    let packed = pack_scales_mins(
        &std::array::from_fn(|j| six_bits(inv_scale, scales[j])),
        &std::array::from_fn(|j| six_bits(inv_min, mins[j])),
    );
    let (d, d_value) = stored(max_scale / 63.0);
    let (dmin, dmin_value) = stored(max_min / 63.0);
    let top = search.nmax;
    for (j, group) in x.chunks_exact(32).enumerate() {
        let (sc, m) = scale_min(j, &packed);
        let scale = d_value * sc as f32;
        if scale == 0.0 {
            continue;
        }
        let offset = dmin_value * m as f32;
        for (c, &v) in codes[32 * j..].iter_mut().zip(group) {
            *c = nearest_int((v + offset) / scale).clamp(0, top) as u8;
        }
    }
    out.extend_from_slice(&d.to_le_bytes());
    out.extend_from_slice(&dmin.to_le_bytes());
    out.extend_from_slice(&packed);
    if five_bits {
        // Of each 64 codes (pair p), the fifth bits of code j and j + 32 go to bits 2p and 2p + 1 of byte j.
        let mut high = [0u8; 32];
        for (p, quarter) in codes.chunks_exact(64).enumerate() {
            for j in 0..32 {
                high[j] |= (quarter[j] >> 4) << (2 * p) | (quarter[j + 32] >> 4) << (2 * p + 1);
            }
        }
        out.extend_from_slice(&high);
    }
    put_4bit(out, &codes);
}

/// `q4_k` (144 bytes).
pub fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    q4_q5_k(x, out, false)
}

/// `q5_k` (176 bytes).
pub fn q5_k(x: &[f32], out: &mut Vec<u8>) {
    q4_q5_k(x, out, true)
}

/// `q6_k` (210 bytes): 16 sub-blocks of 16 with 8-bit signed scales, 6-bit codes (low nibbles, then high pairs).
pub fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut codes = [0u8; SUPER_BLOCK];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs) = (0f32, 0f32);
    for (j, group) in x.chunks_exact(16).enumerate() {
        scales[j] = symmetric_codes(group, 32, &mut codes[16 * j..16 * j + 16]);
        if scales[j].abs() > max_abs {
            max_abs = scales[j].abs();
            max_scale = scales[j];
        }
    }
    if max_abs < GROUP_MAX_EPS {
        out.extend_from_slice(&[0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let (d, d_value) = stored(1.0 / iscale);
    let packed: [i8; 16] = std::array::from_fn(|j| nearest_int(iscale * scales[j]).min(127) as i8);
    for (j, group) in x.chunks_exact(16).enumerate() {
        let scale = d_value * packed[j] as f32;
        if scale == 0.0 {
            continue;
        }
        for (c, &v) in codes[16 * j..].iter_mut().zip(group) {
            *c = (nearest_int(v / scale).clamp(-32, 31) + 32) as u8;
        }
    }
    put_4bit_q6(out, &codes);
    for half in codes.chunks_exact(128) {
        out.extend((0..32).map(|l| {
            (half[l] >> 4)
                | (half[l + 32] >> 4) << 2
                | (half[l + 64] >> 4) << 4
                | (half[l + 96] >> 4) << 6
        }));
    }
    out.extend(packed.iter().map(|&s| s as u8));
    out.extend_from_slice(&d.to_le_bytes());
}

/// `q6_k`'s low nibbles: of each 128 codes, byte `l` holds codes `l` and `l + 64`, byte `l + 32` codes `l + 32`
/// and `l + 96`.
fn put_4bit_q6(out: &mut Vec<u8>, codes: &[u8]) {
    for half in codes.chunks_exact(128) {
        out.extend((0..32).map(|l| (half[l] & 0xf) | (half[l + 64] & 0xf) << 4));
        out.extend((0..32).map(|l| (half[l + 32] & 0xf) | (half[l + 96] & 0xf) << 4));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_halves_to_even() {
        let cases = [
            (0.5, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (3.49, 3),
            (-7.6, -8),
        ];
        for (v, expected) in cases {
            assert_eq!(nearest_int(v), expected, "{v}");
        }
    }

    #[test]
    fn scale_packing_round_trips() {
        let scales: [u8; 8] = std::array::from_fn(|j| (j as u8 * 9 + 5) % 64);
        let mins: [u8; 8] = std::array::from_fn(|j| (j as u8 * 23 + 60) % 64);
        let packed = pack_scales_mins(&scales, &mins);
        for j in 0..8 {
            assert_eq!(scale_min(j, &packed), (scales[j], mins[j]), "sub-block {j}");
        }
    }
}
