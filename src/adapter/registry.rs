//! Several named adapters on one base model ([`Adapters`]): add (freshly initialized, from given tensors, or as a
//! copy of another), activate, disable, remove, and list their trainable tensors under PEFT's names.

use std::collections::BTreeMap;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};

use crate::error::{Error, Result};
use crate::lora::targets::{is_target, parameter_of, rank_and_alpha};
use crate::lora::{InitLoraWeights, LoraAdapter, LoraConfig};
use crate::models::{LlamaModel, SavedModules};
use crate::precision::master_dtype;

/// One module an adapter config selects, with its shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct AdapterSlot {
    /// Full module name, e.g. `model.layers.0.self_attn.q_proj`.
    pub module: String,
    /// `in_features`.
    pub in_features: usize,
    /// `out_features`.
    pub out_features: usize,
    /// Rank.
    pub r: usize,
    /// Alpha.
    pub alpha: f64,
}

/// Why `config` selects no module of `model`, and what would: the linear modules `target_modules` can name
/// (a mixture's router and experts are parameters to PEFT, named apart with the `target_parameters` that adapt
/// them), or `"all-linear"`.
fn no_target_message(model: &LlamaModel, config: &LoraConfig) -> String {
    let arch = model.config().architecture;
    let layer = "model.layers.0";
    let layer_linears = model.config().layer_linears(0);
    let mut names: Vec<&str> = Vec::new();
    for (n, _) in &layer_linears {
        let short = n.rsplit('.').next().unwrap_or(n);
        if parameter_of(&format!("{layer}.{n}")).is_none() && !names.contains(&short) {
            names.push(short);
        }
    }
    let targets = match &config.target_modules {
        Some(t) => json(t),
        None => match arch.default_lora_targets() {
            Some(d) => format!(
                "not set (so PEFT's default for {}: {})",
                arch.model_type(),
                json(&d.to_vec())
            ),
            None => format!(
                "not set (PEFT has no default for {}: set it)",
                arch.model_type()
            ),
        },
    };
    let excluded = match &config.exclude_modules {
        Some(e) => format!(" (exclude_modules {})", json(e)),
        None => String::new(),
    };
    let experts = if arch.is_moe() {
        // PEFT adapts parameters without dropout, so the advice is whole only with lora_dropout = 0.
        let dropout = match config.lora_dropout {
            d if d != 0.0 => " and lora_dropout = 0",
            _ => "",
        };
        format!(
            " (the router and the experts are parameters to PEFT: target them with target_parameters = \
             [\"{}.weight\", \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"]{dropout})",
            arch.router_name()
        )
    } else {
        String::new()
    };
    let example = layer_linears
        .iter()
        .map(|(n, _)| n)
        .find(|n| parameter_of(&format!("{layer}.{n}")).is_none())
        .map_or(String::new(), |n| format!(" (e.g. {layer}.{n})"));
    format!(
        "target_modules {targets}{excluded} match no module of this model; its linear modules are {}{example}\
         {experts}; or use \"all-linear\"",
        names.join(", ")
    )
}

/// Why an entry of `config`'s `target_parameters` adapts nothing in `model`, if one does: PEFT refuses a
/// `target_parameters` that matches no parameter (when nothing else is targeted; otherwise it only warns), and a
/// setting that changes nothing is an error here either way. The message lists the parameters there are, by the
/// names PEFT matches (transformers' module path + parameter, which a checkpoint's tensor names need not be).
fn unmatched_parameter_message(model: &LlamaModel, config: &LoraConfig) -> Option<String> {
    let entries = config.target_parameters.as_deref().unwrap_or_default();
    let mut parameters: Vec<String> = Vec::new();
    for p in model.linears().iter().filter_map(|(m, _)| parameter_of(m)) {
        if !parameters.contains(&p) {
            parameters.push(p); // each expert's projection stands for the same parameter
        }
    }
    let matches = |t: &str| {
        parameters
            .iter()
            .any(|p| p == t || p.ends_with(&format!(".{t}")))
    };
    let unmatched = entries.iter().find(|t| !matches(t))?;
    let arch = model.config().architecture;
    if parameters.is_empty() {
        return Some(format!(
            "[lora] target_parameters = {}: this {} model has no mixture-of-experts layer, whose router and experts \
             are the parameters target_parameters adapts, so it would adapt nothing; remove target_parameters (the \
             linear layers are named by target_modules)",
            json(&entries),
            arch.model_type()
        ));
    }
    // One layer's parameters, without the layer's prefix: the names an entry usually takes.
    let mut short: Vec<String> = Vec::new();
    for p in &parameters {
        let rest = p.split_once(".layers.").map_or(p.as_str(), |(_, r)| r);
        let name = rest.split_once('.').map_or(rest, |(_, r)| r).to_string();
        if !short.contains(&name) {
            short.push(name);
        }
    }
    Some(format!(
        "[lora] target_parameters: `{unmatched}` matches no parameter of this model; the parameters PEFT can adapt \
         are {} (e.g. {}: transformers' module path and parameter name, which a checkpoint's tensor names need not \
         be); name them so, e.g. target_parameters = {}",
        short.join(", "),
        parameters[0],
        json(&short)
    ))
}

/// `value` as JSON, as `adapter_config.json` writes it (`["q_proj", "v_proj"]`, `"all-linear"`).
fn json<T: serde::Serialize>(value: &T) -> String {
    serde_json::to_string(value).unwrap_or_default()
}

/// PEFT's tensor names for a module's adapter.
pub fn peft_key(module: &str, part: &str) -> String {
    format!("base_model.model.{module}.{part}")
}

/// Uniform in [-bound, bound) or normal(0, std) values from a counter-based stream (deterministic per seed).
fn random(n: usize, seed: u64, gaussian: Option<f64>, bound: f64) -> Vec<f32> {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    (0..n)
        .map(|_| match gaussian {
            Some(std) => {
                let (u1, u2) = (next().max(f64::MIN_POSITIVE), next());
                (std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            }
            None => ((next() * 2.0 - 1.0) * bound) as f32,
        })
        .collect()
}

/// Named adapters on a model, as PEFT's `PeftModel` manages them: add (freshly initialized or from tensors),
/// activate, disable, remove, and list their trainable tensors under PEFT's names.
pub trait Adapters {
    /// The modules `config` adapts, with their shapes, rank and alpha. An error if it selects none.
    fn adapter_slots(&self, config: &LoraConfig) -> Result<Vec<AdapterSlot>>;

    /// Adds adapter `name` with freshly initialized weights (PEFT's init for `init_lora_weights`) and makes it
    /// active. `seed` makes the initialization reproducible.
    fn add_adapter(&mut self, name: &str, config: &LoraConfig, seed: u64) -> Result<()>;

    /// PEFT keys and base tensors of the modules `config` trains in full (`lm_head`, `embed_tokens`).
    fn saved_module_bases(&self, config: &LoraConfig) -> Result<Vec<(String, Tensor)>>;

    /// Adds adapter `name` from PEFT-named tensors (all checked before anything changes: missing or unexpected
    /// keys and wrong shapes are an error naming them). DoRA magnitudes missing from `tensors` are initialized
    /// to the row norms of the merged weight when `init_missing_magnitude`.
    fn insert_adapter(
        &mut self,
        name: &str,
        config: &LoraConfig,
        slots: &[AdapterSlot],
        tensors: BTreeMap<String, Tensor>,
        init_missing_magnitude: bool,
    ) -> Result<()>;

    /// Makes `name` the active adapter on every module (modules without it run the base alone).
    fn set_adapter(&mut self, name: &str) -> Result<()>;

    /// Runs the base model alone until [`Adapters::set_adapter`] is called again.
    fn disable_adapters(&mut self);

    /// Removes adapter `name` (PEFT's `delete_adapter`; `unload` when it is the only one).
    fn delete_adapter(&mut self, name: &str) -> Result<()>;

    /// Adds adapter `copy`: the same settings as adapter `name` and a copy of its current weights (DPO's frozen
    /// reference, as TRL copies an adapter into its `ref` adapter). The active adapter does not change.
    fn copy_adapter(&mut self, name: &str, copy: &str) -> Result<()>;

    /// Names of the loaded adapters.
    fn adapter_names(&self) -> Vec<String>;

    /// The trainable tensors of adapter `name` under PEFT's names, in name order.
    fn adapter_parameters(&self, name: &str) -> Result<Vec<(String, Var)>>;
}

impl Adapters for LlamaModel {
    fn adapter_slots(&self, config: &LoraConfig) -> Result<Vec<AdapterSlot>> {
        config.validate()?;
        let mut slots = Vec::new();
        for (module, lin) in self.linears() {
            if is_target(config, &module)? {
                let (out_features, in_features) = lin.base.weight.dims2()?;
                let (r, alpha) = rank_and_alpha(config, &module)?;
                slots.push(AdapterSlot {
                    module,
                    in_features,
                    out_features,
                    r,
                    alpha,
                });
            }
        }
        if slots.is_empty() {
            return Err(Error::InvalidInput(no_target_message(self, config)));
        }
        if let Some(message) = unmatched_parameter_message(self, config) {
            return Err(Error::InvalidInput(message));
        }
        Ok(slots)
    }

    fn add_adapter(&mut self, name: &str, config: &LoraConfig, seed: u64) -> Result<()> {
        let slots = self.adapter_slots(config)?;
        let mut tensors = BTreeMap::new();
        for (i, s) in slots.iter().enumerate() {
            let seed = seed.wrapping_mul(1_000_003).wrapping_add(i as u64);
            let a_bound = 1.0 / (s.in_features as f64).sqrt();
            let (a, b) = match config.init_lora_weights {
                InitLoraWeights::Default => (
                    random(s.r * s.in_features, seed, None, a_bound),
                    vec![0f32; s.out_features * s.r],
                ),
                InitLoraWeights::Gaussian => (
                    random(s.r * s.in_features, seed, Some(1.0 / s.r as f64), 0.0),
                    vec![0f32; s.out_features * s.r],
                ),
                InitLoraWeights::Random => (
                    random(s.r * s.in_features, seed, None, a_bound),
                    random(
                        s.out_features * s.r,
                        seed ^ 0x5555,
                        None,
                        1.0 / (s.r as f64).sqrt(),
                    ),
                ),
            };
            tensors.insert(
                peft_key(&s.module, "lora_A.weight"),
                Tensor::from_vec(a, (s.r, s.in_features), &Device::Cpu)?,
            );
            tensors.insert(
                peft_key(&s.module, "lora_B.weight"),
                Tensor::from_vec(b, (s.out_features, s.r), &Device::Cpu)?,
            );
        }
        for (key, base) in self.saved_module_bases(config)? {
            tensors.insert(key, base.to_dtype(DType::F32)?);
        }
        self.insert_adapter(name, config, &slots, tensors, true)
    }

    fn saved_module_bases(&self, config: &LoraConfig) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        if self.sharding().is_some() && config.modules_to_save.iter().flatten().next().is_some() {
            return Err(Error::InvalidInput(
                "modules_to_save on a sharded model (FSDP): its embedding table and head are split over the ranks; \
                 remove modules_to_save or fsdp"
                    .into(),
            ));
        }
        for m in config.modules_to_save.iter().flatten() {
            match m.rsplit('.').next().unwrap_or(m) {
                "lm_head" => out.push((peft_key("lm_head", "weight"), self.lm_head.weight.to_dense(DType::F32)?)),
                "embed_tokens" => out.push((peft_key("model.embed_tokens", "weight"), self.embed_tokens.clone())),
                other => {
                    return Err(Error::InvalidInput(format!(
                        "modules_to_save entry `{other}` is not supported: use lm_head and/or embed_tokens"
                    )))
                }
            }
        }
        Ok(out)
    }

    fn insert_adapter(
        &mut self,
        name: &str,
        config: &LoraConfig,
        slots: &[AdapterSlot],
        mut tensors: BTreeMap<String, Tensor>,
        init_missing_magnitude: bool,
    ) -> Result<()> {
        if self.adapter_configs.contains_key(name) {
            return Err(Error::InvalidInput(format!(
                "an adapter named `{name}` is already loaded; remove it first or pick another name"
            )));
        }
        let mut problems = Vec::new();
        let mut built: BTreeMap<String, LoraAdapter> = BTreeMap::new();
        let take = |tensors: &mut BTreeMap<String, Tensor>,
                    key: String,
                    shape: &[usize],
                    problems: &mut Vec<String>|
         -> Option<Tensor> {
            match tensors.remove(&key) {
                None => {
                    problems.push(format!("missing `{key}`"));
                    None
                }
                Some(t) if t.dims() != shape => {
                    problems.push(format!(
                        "`{key}` has shape {:?}, expected {shape:?}",
                        t.dims()
                    ));
                    None
                }
                Some(t) => Some(t),
            }
        };
        for (i, s) in slots.iter().enumerate() {
            let a = take(
                &mut tensors,
                peft_key(&s.module, "lora_A.weight"),
                &[s.r, s.in_features],
                &mut problems,
            );
            let b = take(
                &mut tensors,
                peft_key(&s.module, "lora_B.weight"),
                &[s.out_features, s.r],
                &mut problems,
            );
            let magnitude_key = peft_key(&s.module, "lora_magnitude_vector");
            let magnitude = if !config.use_dora {
                None
            } else if init_missing_magnitude && !tensors.contains_key(&magnitude_key) {
                Some(None)
            } else {
                take(
                    &mut tensors,
                    magnitude_key,
                    &[s.out_features],
                    &mut problems,
                )
                .map(Some)
            };
            let (Some(a), Some(b)) = (a, b) else { continue };
            let (device, master) = (self.device().clone(), master_dtype(self.compute_dtype()));
            let to_var = |t: Tensor| -> Result<Var> {
                Ok(Var::from_tensor(&t.to_device(&device)?.to_dtype(master)?)?)
            };
            let mut adapter = LoraAdapter {
                a: to_var(a)?,
                b: to_var(b)?,
                scaling: config.scaling(s.r, s.alpha),
                dropout: config.lora_dropout,
                magnitude: None,
                module_id: i as u64,
                runtime: self.lora_runtime.clone(),
            };
            adapter.magnitude = match magnitude {
                None => None,
                Some(Some(m)) => Some(to_var(m)?),
                Some(None) => {
                    let linears = self.linears();
                    let (_, layer) =
                        linears
                            .iter()
                            .find(|(n, _)| *n == s.module)
                            .ok_or_else(|| {
                                Error::InvalidInput(format!(
                                    "no module `{}` in this model",
                                    s.module
                                ))
                            })?;
                    Some(Var::from_tensor(&adapter.weight_norm(&layer.base)?)?)
                }
            };
            built.insert(s.module.clone(), adapter);
        }
        let mut saved = SavedModules::default();
        for (key, base) in self.saved_module_bases(config)? {
            if let Some(t) = take(&mut tensors, key.clone(), base.dims(), &mut problems) {
                let master = master_dtype(self.compute_dtype());
                let var = Var::from_tensor(&t.to_device(self.device())?.to_dtype(master)?)?;
                if key.ends_with("lm_head.weight") {
                    saved.lm_head = Some(var);
                } else {
                    saved.embed_tokens = Some(var);
                }
            }
        }
        if !tensors.is_empty() {
            let mut keys: Vec<&String> = tensors.keys().collect();
            keys.truncate(5);
            problems.push(format!(
                "{} unexpected tensors, e.g. {keys:?}",
                tensors.len()
            ));
        }
        if !problems.is_empty() {
            const SHOWN: usize = 3;
            let more = match problems.len().saturating_sub(SHOWN) {
                0 => String::new(),
                n => format!("; and {n} more"),
            };
            problems.truncate(SHOWN);
            return Err(Error::InvalidInput(format!(
                "adapter `{name}` does not fit this model: {}{more} (an adapter for another base model?)",
                problems.join("; ")
            )));
        }
        for (module, lin) in self.linears_mut() {
            if let Some(adapter) = built.remove(&module) {
                lin.adapters.insert(name.to_string(), Arc::new(adapter));
                lin.active = Some(name.to_string());
            }
        }
        self.adapter_configs
            .insert(name.to_string(), config.clone());
        if saved.lm_head.is_some() || saved.embed_tokens.is_some() {
            self.saved_modules.insert(name.to_string(), saved);
        }
        self.set_adapter(name)
    }

    fn set_adapter(&mut self, name: &str) -> Result<()> {
        if !self.adapter_configs.contains_key(name) {
            return Err(Error::InvalidInput(format!(
                "no adapter named `{name}`; loaded: {:?}",
                self.adapter_names()
            )));
        }
        for (_, lin) in self.linears_mut() {
            lin.active = lin.adapters.contains_key(name).then(|| name.to_string());
        }
        self.active_adapter = Some(name.to_string());
        Ok(())
    }

    fn disable_adapters(&mut self) {
        for (_, lin) in self.linears_mut() {
            lin.active = None;
        }
        self.active_adapter = None;
    }

    fn copy_adapter(&mut self, name: &str, copy: &str) -> Result<()> {
        let config = self
            .adapter_configs
            .get(name)
            .cloned()
            .ok_or_else(|| Error::InvalidInput(format!("no adapter named `{name}`")))?;
        let tensors = self
            .adapter_parameters(name)?
            .into_iter()
            .map(|(key, var)| Ok((key, var.as_tensor().copy()?)))
            .collect::<Result<_>>()?;
        let active = self.active_adapter.clone();
        let slots = self.adapter_slots(&config)?;
        self.insert_adapter(copy, &config, &slots, tensors, false)?;
        match active {
            Some(active) => self.set_adapter(&active),
            None => {
                self.disable_adapters();
                Ok(())
            }
        }
    }

    fn delete_adapter(&mut self, name: &str) -> Result<()> {
        if self.adapter_configs.remove(name).is_none() {
            return Err(Error::InvalidInput(format!("no adapter named `{name}`")));
        }
        self.saved_modules.remove(name);
        for (_, lin) in self.linears_mut() {
            lin.adapters.remove(name);
            if lin.active.as_deref() == Some(name) {
                lin.active = None;
            }
        }
        if self.active_adapter.as_deref() == Some(name) {
            self.active_adapter = None;
        }
        Ok(())
    }

    fn adapter_names(&self) -> Vec<String> {
        self.adapter_configs.keys().cloned().collect()
    }

    fn adapter_parameters(&self, name: &str) -> Result<Vec<(String, Var)>> {
        if !self.adapter_configs.contains_key(name) {
            return Err(Error::InvalidInput(format!("no adapter named `{name}`")));
        }
        let mut out = Vec::new();
        for (module, lin) in self.linears() {
            if let Some(a) = lin.adapters.get(name) {
                out.push((peft_key(&module, "lora_A.weight"), a.a.clone()));
                out.push((peft_key(&module, "lora_B.weight"), a.b.clone()));
                if let Some(m) = &a.magnitude {
                    out.push((peft_key(&module, "lora_magnitude_vector"), m.clone()));
                }
            }
        }
        if let Some(saved) = self.saved_modules.get(name) {
            if let Some(v) = &saved.lm_head {
                out.push((peft_key("lm_head", "weight"), v.clone()));
            }
            if let Some(v) = &saved.embed_tokens {
                out.push((peft_key("model.embed_tokens", "weight"), v.clone()));
            }
        }
        out.sort_by(|x, y| x.0.cmp(&y.0));
        Ok(out)
    }
}
