//! Gated activations `act(gate) * up`, the MLP gates of Llama (SwiGLU, `silu`) and Gemma (GeGLU, `gelu_tanh`): one
//! op each that keeps only its two inputs for the backward.
//!
//! The activations share the op (`Gated`); each one (`Activation`) brings its value and derivative on CPU
//! slices and composed of Candle's ops. SwiGLU also has CUDA kernels (`kernels/swiglu.cu`); GeGLU runs the composed
//! path on CUDA.

use std::marker::PhantomData;

use candle_core::{DType, Result, Tensor};

use super::autograd::op::{Apply, Op, Value};
use super::cpu::vector::{map2, map3};
use super::cpu::{gradient, slice_dtype, with_slices, CpuFloat};
use crate::precision::master_dtype;

/// The activation of a gated MLP's gate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GateActivation {
    /// `silu(x) = x·σ(x)`: SwiGLU (Llama, Mistral, Qwen).
    Silu,
    /// `gelu_tanh(x) = 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, PyTorch's `gelu(approximate="tanh")` and
    /// transformers' `gelu_pytorch_tanh`: GeGLU (Gemma).
    GeluTanh,
}

impl GateActivation {
    /// The activation a transformers config names in `hidden_act` / `hidden_activation`, if it is one of these:
    /// `silu` / `swish`, and the tanh approximation of GELU under its names (`gelu_pytorch_tanh`, `gelu_new`,
    /// `gelu_fast`). The exact GELU (`gelu`) is not one of them.
    pub fn from_hidden_act(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Self::GeluTanh),
            _ => None,
        }
    }

    /// transformers' name (`hidden_act`).
    pub fn hidden_act(self) -> &'static str {
        match self {
            Self::Silu => "silu",
            Self::GeluTanh => "gelu_pytorch_tanh",
        }
    }
}

/// `act(gate) * up`, element-wise, computed in float32 (f64 stays f64).
pub fn gated_activation(gate: &Tensor, up: &Tensor, act: GateActivation) -> Result<Tensor> {
    match act {
        GateActivation::Silu => Gated::<Silu>::new().apply([gate, up]),
        GateActivation::GeluTanh => Gated::<GeluTanh>::new().apply([gate, up]),
    }
}

/// SwiGLU: `silu(gate) * up` ([`gated_activation`] with [`GateActivation::Silu`]).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_activation(gate, up, GateActivation::Silu)
}

/// GeGLU with the tanh GELU: `gelu_tanh(gate) * up` ([`gated_activation`] with [`GateActivation::GeluTanh`]).
pub fn geglu_tanh(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    gated_activation(gate, up, GateActivation::GeluTanh)
}

/// A gate activation `f`: its value and derivative on slices and composed of Candle's ops.
trait Activation: Send + Sync + 'static {
    /// The op's name in the graph.
    const NAME: &'static str;
    /// The name prefix of this activation's kernels in `kernels/swiglu.cu` (`{prefix}_fwd`, `{prefix}_bwd`), where
    /// it has them; without them it runs the composed path on CUDA.
    #[cfg(feature = "cuda")]
    const CUDA_KERNELS: Option<&'static str>;

    /// `f(g)`.
    fn value<T: CpuFloat>(g: T) -> T;
    /// `f'(g)`.
    fn derivative<T: CpuFloat>(g: T) -> T;
    /// `f(g)` of a tensor in the working dtype.
    fn composed_value(g: &Tensor) -> Result<Tensor>;
    /// `f'(g)` of a tensor in the working dtype.
    fn composed_derivative(g: &Tensor) -> Result<Tensor>;
}

/// `σ(g)`.
#[inline(always)]
fn sigmoid<T: CpuFloat>(g: T) -> T {
    T::one() / (T::one() + (T::zero() - g).exp())
}

/// `silu(g) = g·σ(g)`.
struct Silu;

impl Activation for Silu {
    const NAME: &'static str = "swiglu";
    #[cfg(feature = "cuda")]
    const CUDA_KERNELS: Option<&'static str> = Some("swiglu");

    #[inline(always)]
    fn value<T: CpuFloat>(g: T) -> T {
        g * sigmoid(g)
    }

    /// `silu'(g) = σ(g)·(1 + g·(1 − σ(g)))`.
    #[inline(always)]
    fn derivative<T: CpuFloat>(g: T) -> T {
        let s = sigmoid(g);
        s * (T::one() + g * (T::one() - s))
    }

    fn composed_value(g: &Tensor) -> Result<Tensor> {
        g.silu()
    }

    fn composed_derivative(g: &Tensor) -> Result<Tensor> {
        let sig = candle_nn::ops::sigmoid(g)?;
        &sig * ((g * (1.0 - &sig)?)? + 1.0)?
    }
}

/// `√(2/π)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
/// The cubic coefficient of the tanh GELU.
const GELU_CUBIC: f64 = 0.044_715;

/// `gelu_tanh(g) = 0.5·g·(1 + tanh(u))` with `u = √(2/π)·(g + 0.044715·g³)`, computed as `g·σ(2u)`
/// (`(1 + tanh(u))/2 = σ(2u)`), which needs one `exp` and loses no precision where `tanh(u)` is near −1.
struct GeluTanh;

/// `2u` of the tanh GELU, `σ(2u)` and `1 − σ(2u)`, the last without cancellation (`e^{−2u}·σ(2u)` where
/// `σ(2u) > 1/2`).
#[inline(always)]
fn gelu_parts<T: CpuFloat>(g: T) -> (T, T) {
    let k = T::from_f64(2.0 * SQRT_2_OVER_PI);
    let z = k * (g + T::from_f64(GELU_CUBIC) * g * g * g);
    let e = (T::zero() - z).exp();
    let s = T::one() / (T::one() + e);
    let rest = if e < T::one() { e * s } else { T::one() - s };
    (s, rest)
}

impl Activation for GeluTanh {
    const NAME: &'static str = "geglu-tanh";
    #[cfg(feature = "cuda")]
    const CUDA_KERNELS: Option<&'static str> = Some("geglu_tanh");

    #[inline(always)]
    fn value<T: CpuFloat>(g: T) -> T {
        g * gelu_parts(g).0
    }

    /// `gelu_tanh'(g) = σ(2u) + g·σ(2u)·(1 − σ(2u))·2√(2/π)·(1 + 3·0.044715·g²)`.
    #[inline(always)]
    fn derivative<T: CpuFloat>(g: T) -> T {
        let (s, rest) = gelu_parts(g);
        let dz =
            T::from_f64(2.0 * SQRT_2_OVER_PI) * (T::one() + T::from_f64(3.0 * GELU_CUBIC) * g * g);
        s + g * s * rest * dz
    }

    fn composed_value(g: &Tensor) -> Result<Tensor> {
        // Candle's `gelu` is the tanh approximation (`gelu_erf` the exact one).
        g.gelu()
    }

    fn composed_derivative(g: &Tensor) -> Result<Tensor> {
        let g2 = g.sqr()?;
        let z = (g * ((&g2 * GELU_CUBIC)? + 1.0)?)?.affine(2.0 * SQRT_2_OVER_PI, 0.0)?;
        let dz = (g2 * (3.0 * GELU_CUBIC))?.affine(2.0 * SQRT_2_OVER_PI, 2.0 * SQRT_2_OVER_PI)?;
        let s = candle_nn::ops::sigmoid(&z)?;
        let rest = (1.0 - &s)?;
        &s + (g * &s)?.mul(&rest)?.mul(&dz)?
    }
}

/// The gated-activation op (inputs `[gate, up]`) of one activation.
struct Gated<A>(PhantomData<A>);

impl<A> Gated<A> {
    fn new() -> Self {
        Gated(PhantomData)
    }
}

/// The element type of the slice path for these inputs, if it applies.
fn slice_path(gate: &Tensor, up: &Tensor) -> Option<DType> {
    slice_dtype(&[gate, up]).filter(|_| gate.dims() == up.dims())
}

impl<A: Activation> Gated<A> {
    /// One parallel, vectorized pass.
    fn cpu_fwd<T: CpuFloat>(gate: &Tensor, up: &Tensor) -> Result<Value> {
        let value = with_slices([gate, up], |[g, u]| {
            Ok(map2(g, u, |g, u: T| A::value(g) * u))
        })?;
        Ok(Value::cpu(value, gate.shape()))
    }

    fn cpu_bwd<T: CpuFloat>(
        [gate, up]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let (dg, du) = with_slices([gate, up, grad], |[g, u, dy]| {
            let dg = needs[0].then(|| map3(g, u, dy, |g, u: T, dy| dy * u * A::derivative(g)));
            let du = needs[1].then(|| map2(g, dy, |g, dy: T| dy * A::value(g)));
            Ok((dg, du))
        })?;
        Ok([gradient(dg, gate.shape())?, gradient(du, up.shape())?])
    }

    /// Any dtype and device: Candle's ops.
    fn composed_fwd(gate: &Tensor, up: &Tensor) -> Result<Value> {
        let work = master_dtype(gate.dtype());
        let value =
            (A::composed_value(&gate.detach().to_dtype(work)?)? * up.detach().to_dtype(work)?)?;
        Ok(Value::Tensor(value.to_dtype(gate.dtype())?))
    }

    fn composed_bwd(
        [gate, up]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        let work = master_dtype(gate.dtype());
        let (g, dy) = (gate.to_dtype(work)?, grad.to_dtype(work)?);
        let d_gate = if needs[0] {
            let u = up.to_dtype(work)?;
            Some(
                (&dy * &u)?
                    .mul(&A::composed_derivative(&g)?)?
                    .to_dtype(gate.dtype())?,
            )
        } else {
            None
        };
        let d_up = if needs[1] {
            Some((&dy * A::composed_value(&g)?)?.to_dtype(up.dtype())?)
        } else {
            None
        };
        Ok([d_gate, d_up])
    }
}

/// The kernels' name prefix when they take these inputs: an activation that has kernels, one float dtype and shape
/// on a CUDA device.
#[cfg(feature = "cuda")]
fn cuda_path<A: Activation>(gate: &Tensor, up: &Tensor) -> Option<&'static str> {
    let fits = gate.device().is_cuda()
        && crate::cuda::fused_kernels()
        && gate.dtype() == up.dtype()
        && gate.dims() == up.dims()
        && matches!(gate.dtype(), DType::F32 | DType::BF16 | DType::F16);
    A::CUDA_KERNELS.filter(|_| fits)
}

#[cfg(feature = "cuda")]
impl<A: Activation> Gated<A> {
    /// `kernels/swiglu.cu`, one pass each way.
    fn cuda_fwd(prefix: &str, gate: &Tensor, up: &Tensor) -> Result<Value> {
        use crate::cuda::{
            alloc, device_of, grid, hold, kernel, run, storage, suffix, with_float_type, SWIGLU,
        };
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        let (gate, up) = (gate.contiguous()?, up.contiguous()?);
        let device = device_of(&gate)?;
        let n = gate.elem_count() as u64;
        let func = kernel(
            &device,
            &SWIGLU,
            &format!("{prefix}_fwd{}", suffix(gate.dtype())?),
        )?;
        with_float_type!(gate.dtype(), T => {
            let mut y = alloc::<T>(&device, gate.elem_count())?;
            let (gh, uh) = (hold(&gate)?, hold(&up)?);
            let (gv, uv) = (gh.view::<T>()?, uh.view::<T>()?);
            let mut args = func.builder();
            args.arg(&gv).arg(&uv).arg(&n).arg(&mut y);
            run(&mut args, grid(n))?;
            Ok(Value::Cuda(storage(y, &device), gate.shape().clone()))
        })
    }

    fn cuda_bwd(
        prefix: &str,
        [gate, up]: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        use crate::cuda::{
            alloc, device_of, grid, hold, kernel, run, suffix, tensor, with_float_type, SWIGLU,
        };
        use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
        let (gate, up, grad) = (gate.contiguous()?, up.contiguous()?, grad.contiguous()?);
        let device = device_of(&gate)?;
        let (len, n) = (gate.elem_count(), gate.elem_count() as u64);
        let which = needs[0] as i32 | (needs[1] as i32) << 1;
        let func = kernel(
            &device,
            &SWIGLU,
            &format!("{prefix}_bwd{}", suffix(gate.dtype())?),
        )?;
        with_float_type!(gate.dtype(), T => {
            // A gradient that is not asked for gets a one-element placeholder the kernel never writes.
            let mut d_gate = alloc::<T>(&device, if needs[0] { len } else { 1 })?;
            let mut d_up = alloc::<T>(&device, if needs[1] { len } else { 1 })?;
            let (gh, uh, dh) = (hold(&gate)?, hold(&up)?, hold(&grad)?);
            let (gv, uv, dv) = (gh.view::<T>()?, uh.view::<T>()?, dh.view::<T>()?);
            let mut args = func.builder();
            args.arg(&gv).arg(&uv).arg(&dv).arg(&n).arg(&which).arg(&mut d_gate).arg(&mut d_up);
            run(&mut args, grid(n))?;
            let keep = |slice, need: bool| need.then(|| tensor(slice, &device, gate.shape().clone()));
            Ok([keep(d_gate, needs[0]), keep(d_up, needs[1])])
        })
    }
}

impl<A: Activation> Op<2> for Gated<A> {
    const NAME: &'static str = A::NAME;

    fn fwd(&mut self, [gate, up]: [&Tensor; 2]) -> Result<Value> {
        #[cfg(feature = "cuda")]
        if let Some(prefix) = cuda_path::<A>(gate, up) {
            return Self::cuda_fwd(prefix, gate, up);
        }
        match slice_path(gate, up) {
            Some(DType::F32) => Self::cpu_fwd::<f32>(gate, up),
            Some(DType::F64) => Self::cpu_fwd::<f64>(gate, up),
            _ => Self::composed_fwd(gate, up),
        }
    }

    fn bwd(
        &self,
        inputs: [&Tensor; 2],
        grad: &Tensor,
        needs: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        #[cfg(feature = "cuda")]
        if let Some(prefix) = cuda_path::<A>(inputs[0], inputs[1]) {
            return Self::cuda_bwd(prefix, inputs, grad, needs);
        }
        match slice_path(inputs[0], inputs[1]) {
            Some(DType::F32) => Self::cpu_bwd::<f32>(inputs, grad, needs),
            Some(DType::F64) => Self::cpu_bwd::<f64>(inputs, grad, needs),
            _ => Self::composed_bwd(inputs, grad, needs),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::autograd::gradcheck::{check, max_abs_diff, rand_f64};
    use candle_core::Device;

    #[test]
    fn gradients_match_finite_differences_and_composite() {
        let f = |xs: &[Tensor]| swiglu(&xs[0], &xs[1]);
        let r = |xs: &[Tensor]| xs[0].silu()? * &xs[1];
        let inputs = [(rand_f64(&[3, 7], 1) * 3.0).unwrap(), rand_f64(&[3, 7], 2)];
        check(&f, &r, &inputs, &[true, true], 21, 1e-6, 1e-12);
        check(&f, &r, &inputs, &[false, true], 21, 1e-6, 1e-12);
    }

    /// PyTorch's `gelu(x, approximate="tanh")` in f64, term by term.
    fn gelu_tanh_f64(x: f64) -> f64 {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
    }

    /// `gelu_tanh(x)` as a composite of Candle primitives with exact backwards (`tanh`, not Candle's `gelu`,
    /// whose backward uses rounded constants).
    fn gelu_tanh_composite(x: &Tensor) -> Result<Tensor> {
        let inner = (x + (x.powf(3.0)? * 0.044715)?)?;
        let t = (inner * (2.0 / std::f64::consts::PI).sqrt())?.tanh()?;
        ((t + 1.0)? * x)? * 0.5
    }

    const VALUES: [f64; 12] = [
        1.0, -0.5, 2.0, 0.0, -3.0, 0.3, -1.7, 5.5, -8.0, 12.0, -40.0, 1e-4,
    ];

    #[test]
    fn geglu_tanh_equals_pytorch_formula() {
        let x = Tensor::new(&VALUES, &Device::Cpu).unwrap();
        let one = x.ones_like().unwrap();
        let got: Vec<f64> = geglu_tanh(&x, &one).unwrap().to_vec1().unwrap();
        for (&v, &g) in VALUES.iter().zip(&got) {
            // The formula loses relative precision where `1 + tanh(u)` cancels (x < 0): compare to within a few
            // ulp of `x`.
            let want = gelu_tanh_f64(v);
            assert!(
                (g - want).abs() <= 1e-15 * v.abs(),
                "gelu_tanh({v}) = {g}, want {want}"
            );
        }
        // Known values of torch.nn.functional.gelu(x, approximate="tanh").
        for (i, want) in [
            (0, 0.8411919906082768),
            (1, -0.15428599017),
            (2, 1.9545976940),
        ] {
            assert!((got[i] - want).abs() < 1e-10, "{} vs {want}", got[i]);
        }
        // Times `up`, and in float32 (fast exp) close to the f64 values.
        let up = rand_f64(&[VALUES.len()], 3);
        let y: Vec<f64> = geglu_tanh(&x, &up).unwrap().to_vec1().unwrap();
        let y32: Vec<f32> = geglu_tanh(
            &x.to_dtype(DType::F32).unwrap(),
            &up.to_dtype(DType::F32).unwrap(),
        )
        .unwrap()
        .to_vec1()
        .unwrap();
        let ups: Vec<f64> = up.to_vec1().unwrap();
        for i in 0..VALUES.len() {
            let want = gelu_tanh_f64(VALUES[i]) * ups[i];
            let scale = (VALUES[i] * ups[i]).abs();
            assert!((y[i] - want).abs() <= 1e-15 * scale, "{i}");
            assert!((y32[i] as f64 - want).abs() <= 1e-6 * scale, "{i}");
        }
    }

    #[test]
    fn geglu_tanh_gradients_match_finite_differences_and_composite() {
        let f = |xs: &[Tensor]| geglu_tanh(&xs[0], &xs[1]);
        let r = |xs: &[Tensor]| gelu_tanh_composite(&xs[0])? * &xs[1];
        let inputs = [(rand_f64(&[3, 7], 4) * 4.0).unwrap(), rand_f64(&[3, 7], 5)];
        check(&f, &r, &inputs, &[true, true], 21, 1e-6, 1e-12);
        check(&f, &r, &inputs, &[true, false], 21, 1e-6, 1e-12);
        check(&f, &r, &inputs, &[false, true], 21, 1e-6, 1e-12);
        // Large magnitudes, where σ(2u) saturates.
        let x = Tensor::new(&VALUES, &Device::Cpu)
            .unwrap()
            .reshape((3, 4))
            .unwrap();
        let inputs = [x, rand_f64(&[3, 4], 6)];
        check(&f, &r, &inputs, &[true, true], 12, 1e-6, 1e-12);
    }

    /// The slice path and the composed path of one activation: values and both gradients, in f64 and f32.
    fn paths_agree<A: Activation>() {
        let gate = (rand_f64(&[5, 33], 7) * 5.0).unwrap();
        let (up, dy) = (rand_f64(&[5, 33], 8), rand_f64(&[5, 33], 9));
        for (dtype, tol) in [(DType::F64, 1e-14), (DType::F32, 2e-6)] {
            let [g, u, d] = [&gate, &up, &dy].map(|t| t.to_dtype(dtype).unwrap());
            let fwd = |v: Result<Value>| {
                v.unwrap()
                    .into_tensor()
                    .unwrap()
                    .to_dtype(DType::F64)
                    .unwrap()
            };
            let slice = match dtype {
                DType::F64 => fwd(Gated::<A>::cpu_fwd::<f64>(&g, &u)),
                _ => fwd(Gated::<A>::cpu_fwd::<f32>(&g, &u)),
            };
            let composed = fwd(Gated::<A>::composed_fwd(&g, &u));
            assert!(
                max_abs_diff(&slice, &composed) <= tol,
                "{} {dtype:?} forward",
                A::NAME
            );
            let slice = match dtype {
                DType::F64 => Gated::<A>::cpu_bwd::<f64>([&g, &u], &d, [true, true]),
                _ => Gated::<A>::cpu_bwd::<f32>([&g, &u], &d, [true, true]),
            }
            .unwrap();
            let composed = Gated::<A>::composed_bwd([&g, &u], &d, [true, true]).unwrap();
            for (i, (a, b)) in slice.iter().zip(&composed).enumerate() {
                let [a, b] = [a, b].map(|t| t.as_ref().unwrap().to_dtype(DType::F64).unwrap());
                let diff = max_abs_diff(&a, &b);
                assert!(
                    diff <= tol * 10.0,
                    "{} {dtype:?} gradient {i}: {diff}",
                    A::NAME
                );
            }
        }
    }

    #[test]
    fn slice_and_composed_paths_agree() {
        paths_agree::<Silu>();
        paths_agree::<GeluTanh>();
    }

    #[test]
    fn other_dtypes_take_the_composed_path() {
        let gate = (rand_f64(&[4, 9], 10) * 3.0).unwrap();
        let up = rand_f64(&[4, 9], 11);
        for act in [GateActivation::Silu, GateActivation::GeluTanh] {
            let want = gated_activation(&gate, &up, act).unwrap();
            let [g, u] = [&gate, &up].map(|t| t.to_dtype(DType::BF16).unwrap());
            let got = gated_activation(&g, &u, act).unwrap();
            assert_eq!(got.dtype(), DType::BF16);
            let diff = max_abs_diff(&got.to_dtype(DType::F64).unwrap(), &want);
            assert!(diff < 0.05, "{act:?}: {diff}");
        }
    }

    #[test]
    fn activations_from_config_names() {
        use GateActivation::*;
        assert_eq!(GateActivation::from_hidden_act("silu"), Some(Silu));
        assert_eq!(
            GateActivation::from_hidden_act("gelu_pytorch_tanh"),
            Some(GeluTanh)
        );
        assert_eq!(GateActivation::from_hidden_act("gelu"), None);
    }
}
