//! MXFP4 (the OCP microscaling format: 4-bit E2M1 values in blocks of 32 sharing one power-of-two E8M0 scale), as
//! gpt-oss checkpoints store their experts (`*_blocks` `[..., groups, 16]` bytes, two values each, the low nibble
//! first; `*_scales` `[..., groups]` biased exponents). Dequantized exactly, as transformers'
//! `convert_moe_packed_tensors` does before it transposes, to be quantized again (to NF4) for training.

use candle_core::{DType, Result, Tensor};

/// The 16 E2M1 values by code (bit 3 the sign).
pub const E2M1_VALUES: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// Values per scale (each byte of a block holds two).
pub const MXFP4_BLOCK: usize = 32;

/// `2^(exponent − 127)` exactly (`exponent` 0 gives the subnormal `2^−127`); `None` for 255, E8M0's NaN.
fn scale_of(exponent: u8) -> Option<f32> {
    match exponent {
        255 => None,
        0 => Some(f32::from_bits(1 << 22)),
        e => Some(f32::from_bits((e as u32) << 23)),
    }
}

/// The float32 values of MXFP4 `blocks` (`[..., groups, 16]`, u8) under `scales` (`[..., groups]`, u8):
/// `[..., groups · 32]`. An error names the shapes when they do not fit, and a NaN scale (255).
pub fn dequantize_mxfp4(blocks: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let dims = blocks.dims();
    let fits = blocks.dtype() == DType::U8
        && scales.dtype() == DType::U8
        && dims.len() >= 2
        && dims[dims.len() - 1] == MXFP4_BLOCK / 2
        && scales.dims() == &dims[..dims.len() - 1];
    if !fits {
        candle_core::bail!(
            "MXFP4 blocks {:?} ({:?}) and scales {:?} ({:?}) do not fit: blocks are [..., groups, 16] bytes and \
             scales [..., groups] bytes",
            dims,
            blocks.dtype(),
            scales.dims(),
            scales.dtype()
        );
    }
    let codes: Vec<u8> = blocks.flatten_all()?.to_vec1()?;
    let exponents: Vec<u8> = scales.flatten_all()?.to_vec1()?;
    let mut out = Vec::with_capacity(codes.len() * 2);
    for (group, &exponent) in codes.chunks(MXFP4_BLOCK / 2).zip(&exponents) {
        let Some(scale) = scale_of(exponent) else {
            candle_core::bail!("an MXFP4 scale is 255 (NaN): the checkpoint is damaged");
        };
        for byte in group {
            out.push(E2M1_VALUES[(byte & 0x0f) as usize] * scale);
            out.push(E2M1_VALUES[(byte >> 4) as usize] * scale);
        }
    }
    let mut shape = scales.dims().to_vec();
    let groups = shape.pop().expect("checked: at least one dimension");
    shape.push(groups * MXFP4_BLOCK);
    Tensor::from_vec(out, shape, blocks.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Nibbles decode low first, scaled by `2^(e − 127)`; shapes and a NaN scale are refused.
    #[test]
    fn decodes_nibbles_low_first_with_the_group_scale() {
        let mut bytes = vec![0u8; 32];
        bytes[0] = 0x71; // 0.5, then 6.0
        bytes[1] = 0xf9; // -0.5, then -6.0
        bytes[16] = 0x2a; // -1.0, then 1.0 (second group, scale 2^-2)
        let blocks = Tensor::from_vec(bytes, (1, 2, 16), &Device::Cpu).unwrap();
        let scales = Tensor::from_vec(vec![128u8, 125], (1, 2), &Device::Cpu).unwrap();
        let v: Vec<f32> = dequantize_mxfp4(&blocks, &scales)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(v.len(), 64);
        assert_eq!(&v[..4], &[1.0, 12.0, -1.0, -12.0]);
        assert_eq!(&v[32..34], &[-0.25, 0.25]);
        assert!(v[4..32].iter().all(|x| *x == 0.0));
        assert_eq!(scale_of(0), Some(2f32.powi(-127)));
        assert_eq!(scale_of(254), Some(2f32.powi(127)));

        let nan = Tensor::from_vec(vec![255u8, 127], (1, 2), &Device::Cpu).unwrap();
        assert!(dequantize_mxfp4(&blocks, &nan).is_err());
        let wrong = Tensor::from_vec(vec![127u8], (1, 1), &Device::Cpu).unwrap();
        assert!(dequantize_mxfp4(&blocks, &wrong).is_err());
    }
}
