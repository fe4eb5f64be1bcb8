//! Test helpers: gradients of an op against central finite differences (f64) and against a composite reference.

use candle_core::{DType, Device, Result, Tensor, Var};

/// A deterministic pseudo-random f64 tensor in [-1, 1) (no RNG state shared between tests).
pub fn rand_f64(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// `sum(f(inputs) * r)` for a fixed random `r`, so every output element contributes a distinct weight.
fn weighted_sum(y: &Tensor, r: &Tensor) -> Result<Tensor> {
    (y.to_dtype(DType::F64)? * r)?.sum_all()
}

/// float32's unit roundoff, 2⁻²⁴: the largest relative error of one rounded operation.
pub const F32_UNIT_ROUNDOFF: f64 = 1.0 / 16_777_216.0;

/// The worst-case distance of a float32 chain of products `x · m₁ᵀ · m₂ᵀ ⋯` (`x: [.., k₀]`, `mᵢ: [kᵢ, kᵢ₋₁]`)
/// from the exact one, for any order of its sums: the classical first-order bound (Σᵢ (kᵢ₋₁ + 1))·u·(|x|·|m₁|ᵀ·
/// |m₂|ᵀ ⋯) of recursive summation — each product of inner width k adds k rounded additions and one rounding of
/// its terms — at its largest entry. CPUs differ only in the order and blocking of these sums (AVX2 or AVX-512
/// kernels, a matrix-vector kernel or a GEMM), which the bound covers; two float32 results of the same chain are
/// within twice it of each other.
pub fn f32_chain_bound(x: &Tensor, chain: &[&Tensor]) -> f64 {
    let abs = |t: &Tensor| t.to_dtype(DType::F64).unwrap().abs().unwrap();
    let mut magnitude = abs(x);
    let mut terms = 0;
    for m in chain {
        terms += m.dim(1).unwrap() + 1;
        magnitude = magnitude.broadcast_matmul(&abs(m).t().unwrap()).unwrap();
    }
    let largest = magnitude
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    terms as f64 * F32_UNIT_ROUNDOFF * largest
}

/// Largest absolute difference (as f64).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

/// Checks the gradients of `f` with respect to every input (those listed in `differentiable`):
/// - against central finite differences on up to `samples` elements per input (0 skips), relative tolerance `fd_tol`;
/// - against `reference` (a composite of Candle primitives) on every element, absolute tolerance `ref_tol`,
///   and the forward values too.
pub fn check(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    differentiable: &[bool],
    samples: usize,
    fd_tol: f64,
    ref_tol: f64,
) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let as_tensors = |vs: &[Var]| -> Vec<Tensor> {
        vs.iter()
            .zip(differentiable)
            .map(|(v, d)| {
                if *d {
                    v.as_tensor().clone()
                } else {
                    v.as_detached_tensor()
                }
            })
            .collect()
    };
    let y = f(&as_tensors(&vars)).unwrap();
    let r = rand_f64(y.dims(), 99);
    let grads = weighted_sum(&y, &r).unwrap().backward().unwrap();

    let ref_vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let y_ref = reference(&as_tensors(&ref_vars)).unwrap();
    let forward_diff = max_abs_diff(
        &y.to_dtype(DType::F64).unwrap(),
        &y_ref.to_dtype(DType::F64).unwrap(),
    );
    assert!(
        forward_diff <= ref_tol,
        "forward differs from the reference by {forward_diff}"
    );
    let ref_grads = weighted_sum(&y_ref, &r).unwrap().backward().unwrap();

    for (i, (var, d)) in vars.iter().zip(differentiable).enumerate() {
        let g = grads.get(var);
        if !*d {
            assert!(g.is_none(), "input {i} is frozen but got a gradient");
            continue;
        }
        let g = g
            .unwrap_or_else(|| panic!("no gradient for input {i}"))
            .to_dtype(DType::F64)
            .unwrap();
        let g_ref = ref_grads
            .get(&ref_vars[i])
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let diff = max_abs_diff(&g, &g_ref);
        assert!(
            diff <= ref_tol,
            "input {i}: gradient differs from the composite reference by {diff}"
        );

        let flat: Vec<f64> = inputs[i].flatten_all().unwrap().to_vec1().unwrap();
        let g_flat: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
        let n = flat.len();
        let step = (n / samples.max(1)).max(1);
        for j in (0..n).step_by(step).take(samples) {
            let eps = 1e-6 * flat[j].abs().max(1.0);
            let eval = |delta: f64| -> f64 {
                let mut v = flat.clone();
                v[j] += delta;
                let mut xs: Vec<Tensor> = inputs.to_vec();
                xs[i] = Tensor::from_vec(v, inputs[i].dims(), &Device::Cpu).unwrap();
                weighted_sum(&f(&xs).unwrap(), &r)
                    .unwrap()
                    .to_scalar::<f64>()
                    .unwrap()
            };
            let numeric = (eval(eps) - eval(-eps)) / (2.0 * eps);
            let err = (g_flat[j] - numeric).abs();
            assert!(
                err <= fd_tol * (1.0 + numeric.abs()),
                "input {i} element {j}: analytic {} vs numeric {numeric}",
                g_flat[j]
            );
        }
    }
}
