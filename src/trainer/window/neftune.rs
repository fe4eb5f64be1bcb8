//! NEFTune (Jain et al., 2023): uniform noise added to the input embeddings during training, with transformers'
//! magnitude `alpha / sqrt(seq_len · hidden)`. The noise is a pure function of the micro-batch seed, so a resumed or
//! recomputed step sees the same noise.

use candle_core::{Result, Tensor};

use crate::rng::uniform;

/// `embeds + U(−m, m)` with `m = alpha / sqrt(seq · hidden)` for `embeds: [batch, seq, hidden]`.
pub fn neftune_noise(embeds: &Tensor, alpha: f64, seed: u64) -> Result<Tensor> {
    let (_, seq, hidden) = embeds.dims3()?;
    let magnitude = alpha / ((seq * hidden) as f64).sqrt();
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(device) = embeds.device() {
        return embeds
            + cuda_noise(device, seed, magnitude, embeds.dims())?.to_dtype(embeds.dtype())?;
    }
    let noise: Vec<f32> = (0..embeds.elem_count() as u64)
        .map(|i| ((2.0 * uniform(seed, i) - 1.0) * magnitude) as f32)
        .collect();
    let noise =
        Tensor::from_vec(noise, embeds.dims(), embeds.device())?.to_dtype(embeds.dtype())?;
    embeds + noise
}

/// The float32 noise made on the GPU (`kernels/dropout.cu`), the same values as the host's.
#[cfg(feature = "cuda")]
fn cuda_noise(
    device: &candle_core::CudaDevice,
    seed: u64,
    magnitude: f64,
    dims: &[usize],
) -> Result<Tensor> {
    use crate::cuda::{alloc, grid, kernel, run, tensor, DROPOUT};
    use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
    let n = dims.iter().product::<usize>() as u64;
    let mut out = alloc::<f32>(device, n as usize)?;
    let func = kernel(device, &DROPOUT, "uniform_noise")?;
    let mut args = func.builder();
    args.arg(&seed).arg(&magnitude).arg(&n).arg(&mut out);
    run(&mut args, grid(n))?;
    Ok(tensor(out, device, dims))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn noise_has_transformers_magnitude_and_is_reproducible() {
        let x = Tensor::zeros((2, 8, 16), DType::F32, &Device::Cpu).unwrap();
        let a = neftune_noise(&x, 5.0, 7).unwrap();
        let b = neftune_noise(&x, 5.0, 7).unwrap();
        let c = neftune_noise(&x, 5.0, 8).unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(flat(&a), flat(&b));
        assert_ne!(flat(&a), flat(&c));
        let m = 5.0 / (8.0f64 * 16.0).sqrt();
        let v = flat(&a);
        let max = v.iter().fold(0f32, |acc, x| acc.max(x.abs())) as f64;
        let mean = v.iter().map(|x| *x as f64).sum::<f64>() / v.len() as f64;
        assert!(max <= m && max > 0.9 * m, "{max} vs {m}");
        assert!(mean.abs() < 0.1 * m, "{mean}");
    }
}
