//! Optimizers exact to PyTorch and bitsandbytes, learning-rate schedules exact to transformers, and clipping.
//!
//! | `optim` | state | semantics |
//! |---|---|---|
//! | `adamw_torch` (`adamw_torch_fused`) | f32 m, v (f64 for float64 parameters) | `torch.optim.AdamW`: decay before the update |
//! | `adamw_8bit` (`adamw_bnb_8bit`), `paged_adamw_8bit` | 8-bit m, v + absmax per 256 | bitsandbytes CUDA kernel: decay after the update, NaN/Inf gradient resets the element; tensors < `min_8bit_size` (4096) keep f32 state (the 32-bit kernel) |
//! | `paged_adamw_32bit` | f32 m, v | bitsandbytes' 32-bit kernel |
//! | `sgd` | f32 momentum | `torch.optim.SGD` |
//!
//! Parameter groups follow the HF Trainer: no weight decay for biases and norm weights.
//!
//! Where the updates run: for float32 parameters on a CUDA device the AdamW state lives in device memory and one
//! kernel per parameter updates it in place (`cuda`); otherwise the state is in host memory and each parameter is
//! brought to the host for its update (one fused pass) and written back. Both run the same float32 operations in the
//! same order, so the numbers do not depend on where the update ran. SGD always updates on the host.
//!
//! "Paged" (`paged_adamw_8bit`, `paged_adamw_32bit`): bitsandbytes allocates the state of large tensors in CUDA
//! managed memory so the driver can evict it to host RAM under memory pressure. Here, on a GPU, a paged state lives
//! in pinned host memory and each parameter's state is copied into a device staging buffer for its update and back
//! (asynchronous copies on the compute stream), so the device holds only the largest parameter's state — never
//! managed memory, which can oversubscribe the card. The numbers are those of the non-paged optimizer; the name is
//! saved with the state.

pub mod adamw;
pub mod adamw8bit;
pub mod clip;
mod config;
#[cfg(feature = "cuda")]
mod cuda;
pub mod schedule;
pub mod sgd;
mod state;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Error, Result};
use crate::files::{write_atomic, write_safetensors, RawTensor};
use crate::quant::dynamic_map::{signed_map, unsigned_map};
use adamw8bit::{Adam8bitState, Adam8bitStep};

pub use clip::clip_grad_norm;
pub use config::{decays, OptimizerConfig, OptimizerName};
pub use schedule::{Schedule, SchedulerType};
pub use state::ParamState;

/// Which state a parameter gets under `config`.
#[derive(Clone, Copy, PartialEq)]
enum StateKind {
    Adam32,
    Adam64,
    Adam8,
    Sgd,
}

impl StateKind {
    /// The state of parameter `name`, `var`: float64 parameters (a float64 model's) train with AdamW torch only.
    fn of(config: &OptimizerConfig, name: &str, var: &Var) -> Result<Self> {
        if var.dtype() == DType::F64 {
            return match config.name {
                OptimizerName::AdamWTorch => Ok(StateKind::Adam64),
                other => Err(Error::InvalidInput(format!(
                    "`{name}` is float64 (a model loaded with compute dtype float64): float64 parameters train \
                     with optim = \"adamw_torch\", not `{other}`"
                ))),
            };
        }
        Ok(match config.name {
            OptimizerName::Sgd => StateKind::Sgd,
            name if name.is_8bit() && var.elem_count() >= config.min_8bit_size => StateKind::Adam8,
            _ => StateKind::Adam32,
        })
    }

    /// The initial (zero) state for `n` elements.
    fn zeros(self, n: usize) -> ParamState {
        match self {
            StateKind::Sgd => ParamState::Sgd(None),
            StateKind::Adam8 => ParamState::Adam8(Adam8bitState::zeros(n)),
            StateKind::Adam32 => ParamState::Adam32 {
                m: vec![0.0; n],
                v: vec![0.0; n],
            },
            StateKind::Adam64 => ParamState::Adam64 {
                m: vec![0.0; n],
                v: vec![0.0; n],
            },
        }
    }
}

/// Runs `update(p, g)` on host copies of parameter `var` and its gradient `g` in float type `T`, and writes the
/// parameter back.
fn on_host<T: candle_core::WithDType>(
    var: &Var,
    g: &Tensor,
    update: impl FnOnce(&mut [T], &[T]),
) -> Result<()> {
    let g: Vec<T> = g.to_dtype(T::DTYPE)?.flatten_all()?.to_vec1()?;
    let mut p: Vec<T> = var
        .as_tensor()
        .to_dtype(T::DTYPE)?
        .flatten_all()?
        .to_vec1()?;
    update(&mut p, &g);
    let t = Tensor::from_vec(p, var.dims(), var.device())?.to_dtype(var.dtype())?;
    var.set(&t)?;
    Ok(())
}

/// Where a parameter's state lives.
enum Placed {
    Host(ParamState),
    #[cfg(feature = "cuda")]
    Cuda(cuda::CudaState),
}

impl Placed {
    /// `state` placed for updates on the device of `var` where they run there (`paged`: in pinned host memory
    /// staged through the device), else on the host.
    fn new(state: ParamState, var: &Var, paged: bool) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Some(on_cuda) = cuda::CudaState::place(&state, var, paged)? {
            return Ok(Placed::Cuda(on_cuda));
        }
        let _ = (var, paged);
        Ok(Placed::Host(state))
    }
}

struct Slot {
    name: String,
    var: Var,
    weight_decay: f64,
    state: Placed,
}

impl Slot {
    /// The state, copied to the host if it is placed for a device.
    fn host_state(&self) -> Result<Cow<'_, ParamState>> {
        match &self.state {
            Placed::Host(s) => Ok(Cow::Borrowed(s)),
            #[cfg(feature = "cuda")]
            Placed::Cuda(s) => Ok(Cow::Owned(s.download(self.var.device().as_cuda_device()?)?)),
        }
    }
}

/// An optimizer over named trainable variables.
pub struct Optimizer {
    config: OptimizerConfig,
    slots: Vec<Slot>,
    step: u64,
    /// The device buffers paged states are updated in.
    #[cfg(feature = "cuda")]
    staging: cuda::Staging,
}

impl Optimizer {
    /// An optimizer for `params` (name, variable); biases and norm weights get no weight decay.
    pub fn new(params: Vec<(String, Var)>, config: OptimizerConfig) -> Result<Self> {
        let paged = config.name.is_paged();
        let slots = params
            .into_iter()
            .map(|(name, var)| {
                let n = var.elem_count();
                let kind = StateKind::of(&config, &name, &var)?;
                let state = Placed::new(kind.zeros(n), &var, paged)?;
                let weight_decay = if decays(&name) {
                    config.weight_decay
                } else {
                    0.0
                };
                Ok(Slot {
                    name,
                    var,
                    weight_decay,
                    state,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Optimizer {
            config,
            slots,
            step: 0,
            #[cfg(feature = "cuda")]
            staging: cuda::Staging::default(),
        })
    }

    /// Updates every parameter that has a gradient in `grads` with learning rate `lr`.
    pub fn step(&mut self, grads: &GradStore, lr: f64) -> Result<()> {
        self.step += 1;
        let (q1, q2) = (signed_map(), unsigned_map());
        let c = &self.config;
        for slot in &mut self.slots {
            let Some(g) = grads.get(&slot.var) else {
                continue;
            };
            let wd = slot.weight_decay;
            #[allow(clippy::infallible_destructuring_match)]
            // a second variant with the `cuda` feature
            let state = match &mut slot.state {
                Placed::Host(state) => state,
                #[cfg(feature = "cuda")]
                Placed::Cuda(state) => {
                    let staging = &mut self.staging;
                    cuda::update(&slot.var, g, state, staging, c, self.step, lr, wd)?;
                    continue;
                }
            };
            let (step, betas, eps) = (self.step, (c.beta1, c.beta2), c.eps);
            match (state, c.name) {
                (ParamState::Adam32 { m, v }, OptimizerName::AdamWTorch) => {
                    on_host(&slot.var, g, |p, g| {
                        adamw::adamw_torch_update::<f32>(p, g, m, v, step, lr, betas, eps, wd)
                    })
                }
                (ParamState::Adam64 { m, v }, _) => on_host(&slot.var, g, |p, g| {
                    adamw::adamw_torch_update::<f64>(p, g, m, v, step, lr, betas, eps, wd)
                }),
                (ParamState::Adam32 { m, v }, _) => on_host(&slot.var, g, |p, g| {
                    adamw::adamw_bnb32_update(
                        p,
                        g,
                        m,
                        v,
                        step,
                        lr as f32,
                        (c.beta1 as f32, c.beta2 as f32),
                        c.eps as f32,
                        wd as f32,
                    )
                }),
                (ParamState::Adam8(state), _) => on_host(&slot.var, g, |p, g| {
                    adamw8bit::adamw8bit_update(
                        p,
                        g,
                        state,
                        &Adam8bitStep {
                            step,
                            lr: lr as f32,
                            betas: (c.beta1 as f32, c.beta2 as f32),
                            eps: c.eps as f32,
                            weight_decay: wd as f32,
                            qmap1: &q1,
                            qmap2: &q2,
                        },
                    )
                }),
                (ParamState::Sgd(buf), _) => on_host(&slot.var, g, |p, g| {
                    sgd::sgd_update(p, g, buf, lr, c.momentum, wd)
                }),
            }?;
        }
        Ok(())
    }

    /// Updates taken so far.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// A copy of the state of parameter `name` (from the device, where it lives there).
    pub fn state(&self, name: &str) -> Result<Option<ParamState>> {
        self.slots
            .iter()
            .find(|s| s.name == name)
            .map(|s| Ok(s.host_state()?.into_owned()))
            .transpose()
    }

    /// Bytes of state in the memory of the parameters' device: all of it for parameters on the CPU; on a GPU the
    /// resident state (a paged state lives in host memory, as does a state updated on the host).
    pub fn resident_bytes(&self) -> usize {
        self.slots
            .iter()
            .map(|s| match &s.state {
                Placed::Host(st) if s.var.device().is_cpu() => st.bytes(),
                Placed::Host(_) => 0,
                #[cfg(feature = "cuda")]
                Placed::Cuda(st @ cuda::CudaState::Resident(_)) => st.bytes(),
                #[cfg(feature = "cuda")]
                Placed::Cuda(cuda::CudaState::Paged(_)) => 0,
            })
            .sum()
    }

    /// The first parameter whose state holds a non-finite number (NaN or infinity), if any.
    pub fn first_non_finite(&self) -> Result<Option<&str>> {
        for s in &self.slots {
            let finite = match &*s.host_state()? {
                ParamState::Adam32 { m, v } => m.iter().chain(v).all(|x| x.is_finite()),
                ParamState::Adam64 { m, v } => m.iter().chain(v).all(|x| x.is_finite()),
                ParamState::Adam8(st) => {
                    st.absmax1.iter().chain(&st.absmax2).all(|x| x.is_finite())
                }
                ParamState::Sgd(b) => b.iter().flatten().all(|x| x.is_finite()),
            };
            if !finite {
                return Ok(Some(&s.name));
            }
        }
        Ok(None)
    }

    /// Bytes of optimizer state (host or device).
    pub fn state_bytes(&self) -> usize {
        self.slots
            .iter()
            .map(|s| match &s.state {
                Placed::Host(st) => st.bytes(),
                #[cfg(feature = "cuda")]
                Placed::Cuda(st) => st.bytes(),
            })
            .sum()
    }

    /// Writes the state to `dir/optimizer.safetensors` and `dir/optimizer.json` (step, hyper-parameters), so a
    /// resumed run continues bit-identically.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let mut tensors = Vec::new();
        for s in &self.slots {
            let f = |v: &[f32]| RawTensor::f32(vec![v.len()], v);
            let u = |v: &[u8]| RawTensor::u8(vec![v.len()], v.to_vec());
            match &*s.host_state()? {
                ParamState::Adam32 { m, v } => {
                    tensors.push((format!("{}.exp_avg", s.name), f(m)));
                    tensors.push((format!("{}.exp_avg_sq", s.name), f(v)));
                }
                ParamState::Adam64 { m, v } => {
                    let d = |v: &[f64]| RawTensor::from_tensor(&Tensor::new(v, &Device::Cpu)?);
                    tensors.push((format!("{}.exp_avg", s.name), d(m)?));
                    tensors.push((format!("{}.exp_avg_sq", s.name), d(v)?));
                }
                ParamState::Adam8(st) => {
                    tensors.push((format!("{}.state1", s.name), u(&st.state1)));
                    tensors.push((format!("{}.state2", s.name), u(&st.state2)));
                    tensors.push((format!("{}.absmax1", s.name), f(&st.absmax1)));
                    tensors.push((format!("{}.absmax2", s.name), f(&st.absmax2)));
                }
                ParamState::Sgd(Some(b)) => {
                    tensors.push((format!("{}.momentum_buffer", s.name), f(b)));
                }
                ParamState::Sgd(None) => {}
            }
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io("cannot create", dir, e))?;
        write_safetensors(&dir.join("optimizer.safetensors"), tensors, None)?;
        let meta = serde_json::json!({
            "optim": self.config.name.as_str(),
            "step": self.step,
            "params": self.slots.iter().map(|s| s.name.clone()).collect::<Vec<_>>(),
            "qmap": "bitsandbytes dynamic maps (FMA build)",
        });
        write_atomic(
            &dir.join("optimizer.json"),
            serde_json::to_string_pretty(&meta).unwrap_or_default(),
        )
    }

    /// Restores state written by [`Optimizer::save`] for the same parameters and optimizer.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        let json_path = dir.join("optimizer.json");
        let text = std::fs::read_to_string(&json_path)
            .map_err(|e| Error::io("cannot read", &json_path, e))?;
        let meta: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::invalid_file(&json_path, e.to_string()))?;
        if meta["optim"].as_str() != Some(self.config.name.as_str()) {
            return Err(Error::invalid_file(
                &json_path,
                format!(
                    "saved for optim `{}`, but this run uses `{}`",
                    meta["optim"],
                    self.config.name.as_str()
                ),
            ));
        }
        let path = dir.join("optimizer.safetensors");
        let tensors: BTreeMap<String, Tensor> = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| Error::invalid_file(&path, format!("{e} (truncated?)")))?
            .into_iter()
            .collect();
        fn get<T: candle_core::WithDType>(
            tensors: &BTreeMap<String, Tensor>,
            path: &Path,
            k: String,
            n: usize,
        ) -> Result<Vec<T>> {
            let t = tensors
                .get(&k)
                .ok_or_else(|| Error::invalid_file(path, format!("`{k}` is missing")))?;
            if t.dtype() != T::DTYPE {
                return Err(Error::invalid_file(
                    path,
                    format!("`{k}` is {:?}, expected {:?}", t.dtype(), T::DTYPE),
                ));
            }
            let v: Vec<T> = t.to_vec1()?;
            if v.len() != n {
                return Err(Error::invalid_file(
                    path,
                    format!("`{k}` has {} values, expected {n}", v.len()),
                ));
            }
            Ok(v)
        }
        let get_f = |k: String, n: usize| get::<f32>(&tensors, &path, k, n);
        let get_d = |k: String, n: usize| get::<f64>(&tensors, &path, k, n);
        let get_u = |k: String, n: usize| get::<u8>(&tensors, &path, k, n);
        let mut restored = Vec::with_capacity(self.slots.len());
        for s in &self.slots {
            let n = s.var.elem_count();
            restored.push(match StateKind::of(&self.config, &s.name, &s.var)? {
                StateKind::Adam32 => ParamState::Adam32 {
                    m: get_f(format!("{}.exp_avg", s.name), n)?,
                    v: get_f(format!("{}.exp_avg_sq", s.name), n)?,
                },
                StateKind::Adam64 => ParamState::Adam64 {
                    m: get_d(format!("{}.exp_avg", s.name), n)?,
                    v: get_d(format!("{}.exp_avg_sq", s.name), n)?,
                },
                StateKind::Adam8 => ParamState::Adam8(Adam8bitState {
                    state1: get_u(format!("{}.state1", s.name), n)?,
                    state2: get_u(format!("{}.state2", s.name), n)?,
                    absmax1: get_f(format!("{}.absmax1", s.name), n.div_ceil(adamw8bit::BLOCK))?,
                    absmax2: get_f(format!("{}.absmax2", s.name), n.div_ceil(adamw8bit::BLOCK))?,
                }),
                StateKind::Sgd => {
                    let k = format!("{}.momentum_buffer", s.name);
                    ParamState::Sgd(if tensors.contains_key(&k) {
                        Some(get_f(k, n)?)
                    } else {
                        None
                    })
                }
            });
        }
        for (s, st) in self.slots.iter_mut().zip(restored) {
            s.state = Placed::new(st, &s.var, self.config.name.is_paged())?;
        }
        self.step = meta["step"].as_u64().unwrap_or(0);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_decay_for_biases_and_norms() {
        assert!(decays(
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        ));
        assert!(!decays("model.layers.0.input_layernorm.weight"));
        assert!(!decays("model.norm.weight"));
        assert!(!decays("model.layers.0.self_attn.q_proj.bias"));
    }

    fn run(name: OptimizerName, steps: u64, resume_at: Option<u64>) -> (Vec<f32>, usize) {
        let dir = tempfile::tempdir().unwrap();
        let init: Vec<f32> = (0..5000).map(|i| ((i as f32) * 0.37).sin()).collect();
        let var = Var::from_vec(init, 5000, &Device::Cpu).unwrap();
        let cfg = OptimizerConfig {
            name,
            weight_decay: 0.01,
            momentum: 0.9,
            ..Default::default()
        };
        let mut opt = Optimizer::new(vec![("w".into(), var.clone())], cfg.clone()).unwrap();
        for k in 1..=steps {
            if Some(k) == resume_at {
                opt.save(dir.path()).unwrap();
                opt = Optimizer::new(vec![("w".into(), var.clone())], cfg.clone()).unwrap();
                opt.load(dir.path()).unwrap();
            }
            let g: Vec<f32> = (0..5000)
                .map(|i| ((i as f32 + k as f32) * 1.3).cos() * 0.1)
                .collect();
            let mut grads = GradStore::default();
            grads.insert(&var, Tensor::from_vec(g, 5000, &Device::Cpu).unwrap());
            opt.step(&grads, 1e-3).unwrap();
        }
        (var.as_tensor().to_vec1().unwrap(), opt.state_bytes())
    }

    #[test]
    fn saved_state_resumes_bit_identically() {
        for name in [
            OptimizerName::AdamWTorch,
            OptimizerName::AdamW8bit,
            OptimizerName::PagedAdamW32bit,
            OptimizerName::Sgd,
        ] {
            let (straight, _) = run(name, 8, None);
            let (resumed, _) = run(name, 8, Some(5));
            assert_eq!(straight, resumed, "{name:?}");
        }
    }

    /// Float64 parameters (a float64 model's adapter) get float64 AdamW state: the update is torch's in float64
    /// (not float32 rounded back), it resumes bit-identically, and other optimizers are refused by name.
    #[test]
    fn float64_parameters_train_with_float64_adamw() {
        let init: Vec<f64> = (0..300).map(|i| ((i as f64) * 0.37).sin()).collect();
        let grad: Vec<f64> = (0..300).map(|i| ((i as f64) * 1.3).cos() * 1e-3).collect();
        let steps = |resume_at: Option<u64>| {
            let dir = tempfile::tempdir().unwrap();
            let var = Var::from_vec(init.clone(), 300, &Device::Cpu).unwrap();
            let new = || {
                Optimizer::new(vec![("w".into(), var.clone())], OptimizerConfig::default()).unwrap()
            };
            let mut opt = new();
            for k in 1..=4 {
                if Some(k) == resume_at {
                    opt.save(dir.path()).unwrap();
                    opt = new();
                    opt.load(dir.path()).unwrap();
                }
                let mut grads = GradStore::default();
                grads.insert(&var, Tensor::new(grad.as_slice(), &Device::Cpu).unwrap());
                opt.step(&grads, 1e-3).unwrap();
            }
            var.as_tensor().to_vec1::<f64>().unwrap()
        };
        let trained = steps(None);
        assert_eq!(trained, steps(Some(3)));
        // The same four steps in float64 by hand: m, v and the update as torch.optim.AdamW computes them.
        let (mut m, mut v, mut p) = (vec![0.0; 300], vec![0.0; 300], init.clone());
        for step in 1..=4 {
            let betas = (0.9, 0.999);
            adamw::adamw_torch_update::<f64>(
                &mut p, &grad, &mut m, &mut v, step, 1e-3, betas, 1e-8, 0.0,
            );
        }
        assert_eq!(trained, p);

        let var = Var::from_vec(init, 300, &Device::Cpu).unwrap();
        let eight_bit = OptimizerConfig {
            name: OptimizerName::AdamW8bit,
            ..Default::default()
        };
        let Err(err) = Optimizer::new(vec![("w".into(), var)], eight_bit) else {
            panic!("an 8-bit optimizer on float64 parameters must be refused");
        };
        assert!(err.to_string().contains("adamw_torch"), "{err}");
    }

    #[test]
    fn eight_bit_state_is_about_two_bytes_per_parameter() {
        let (_, bytes) = run(OptimizerName::AdamW8bit, 1, None);
        let per_param = bytes as f64 / 5000.0;
        assert!((2.0..2.04).contains(&per_param), "{per_param}");
        let (_, bytes) = run(OptimizerName::AdamWTorch, 1, None);
        assert_eq!(bytes, 8 * 5000);
    }
}
