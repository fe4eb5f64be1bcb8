//! A training config: a TOML file with `[model]` (name_or_path, revision, `[model.quantization]` =
//! `BitsAndBytesConfig`, `adapter` to continue), `[lora]` (`LoraConfig`; optional when continuing an adapter, whose
//! settings it must then agree with), `[data]` ([`DataConfig`]), `[training]` (`TrainingArguments`), `[callbacks]`
//! and `[dpo]` (`DPOConfig`'s own fields; its presence makes the run DPO), section and field names as in Python.
//! `--set section.key=value` overrides any field.
//!
//! Every section is a serde type; `read_section` (`sections`) reads one, so an unknown key is an error that suggests
//! the closest valid name, and a value of the wrong type names its key; a key of another section is sent there.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::args::{IntervalStrategy, TrainingArguments};
use super::dpo::DpoConfig;
use super::grpo::{GrpoConfig, REFUSED_TRL_FIELDS};
use super::overrides::{apply_override, explain_raw};
use super::sections::{check_keys, closest, either, field_names, read_section, unknown_key};
use crate::data::DataConfig;
use crate::distributed::{check_ranks, RanksFrom};
use crate::error::{Error, Result};
use crate::lora::config::LoraConfig;
use crate::lora::targets::is_target;
use crate::precision::TorchDtype;
use crate::quant::{QuantConfig, QuantType};

/// `[model]`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// Hub id, local folder or `.gguf` file.
    pub name_or_path: String,
    /// Hub revision.
    #[serde(default)]
    pub revision: Option<String>,
    /// `[model.quantization]` (`BitsAndBytesConfig`).
    #[serde(default)]
    pub quantization: Option<QuantizationSection>,
    /// A PEFT adapter folder to continue training (its LoRA settings are the run's; relative to the config's
    /// folder). For DPO a frozen copy of it is the reference.
    #[serde(default)]
    pub adapter: Option<PathBuf>,
}

/// `[model.quantization]`: transformers' `BitsAndBytesConfig` (4-bit fields).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuantizationSection {
    /// Quantize the linear weights to 4 bits on load.
    pub load_in_4bit: bool,
    /// `nf4` or `fp4` (bitsandbytes' default).
    pub bnb_4bit_quant_type: QuantType,
    /// Quantize the block absmax values too.
    pub bnb_4bit_use_double_quant: bool,
    /// The dtype 4-bit layers compute in: on a GPU the compute dtype when `[training]` sets neither `bf16` nor
    /// `fp16` (which win, as autocast does in transformers); the CPU computes in float32 unless they are set.
    pub bnb_4bit_compute_dtype: TorchDtype,
    /// How the packed codes are stored (bitsandbytes' `uint8`; accepted for compatibility).
    pub bnb_4bit_quant_storage: Option<String>,
    /// Elements per absmax block (bitsandbytes' `blocksize`; 64 for 4-bit).
    pub bnb_4bit_blocksize: usize,
}

impl Default for QuantizationSection {
    fn default() -> Self {
        QuantizationSection {
            load_in_4bit: false,
            bnb_4bit_quant_type: QuantType::Fp4,
            bnb_4bit_use_double_quant: false,
            bnb_4bit_compute_dtype: TorchDtype::Float32,
            bnb_4bit_quant_storage: None,
            bnb_4bit_blocksize: 64,
        }
    }
}

impl QuantizationSection {
    /// What to quantize to (checked), or `None` when `load_in_4bit` is off.
    pub fn quant_config(&self) -> Result<Option<QuantConfig>> {
        let config = QuantConfig {
            quant_type: self.bnb_4bit_quant_type,
            blocksize: self.bnb_4bit_blocksize,
            double_quant: self.bnb_4bit_use_double_quant,
            ..QuantConfig::nf4()
        };
        config.validate()?;
        Ok(self.load_in_4bit.then_some(config))
    }
}

/// `[callbacks]`: the built-in callbacks a run uses.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CallbackSection {
    /// Stop after this many evaluations without improvement (transformers' `early_stopping_patience`); off if
    /// absent.
    pub early_stopping_patience: Option<usize>,
    /// Minimum improvement of eval_loss (`early_stopping_threshold`).
    pub early_stopping_threshold: f64,
    /// Record memory per step in `output_dir/memory.jsonl` and warn near the machine's limit.
    pub memory_monitor: bool,
    /// Fraction of physical memory that triggers the warning.
    pub memory_warn_fraction: f64,
}

impl Default for CallbackSection {
    fn default() -> Self {
        CallbackSection {
            early_stopping_patience: None,
            early_stopping_threshold: 0.0,
            memory_monitor: true,
            memory_warn_fraction: 0.9,
        }
    }
}

/// A whole training config.
#[derive(Clone, Debug, PartialEq)]
pub struct RunConfig {
    /// The file it was read from.
    pub path: PathBuf,
    /// `[model]`.
    pub model: ModelSection,
    /// `[lora]`.
    pub lora: LoraConfig,
    /// `[data]`, with file names resolved against the config's folder.
    pub data: DataConfig,
    /// `[training]`.
    pub training: TrainingArguments,
    /// `[callbacks]`.
    pub callbacks: CallbackSection,
    /// `[dpo]`: its presence makes the run DPO on preference pairs.
    pub dpo: Option<DpoConfig>,
    /// `[grpo]`: its presence makes the run GRPO on prompts (or rollouts), with the rollouts file resolved against
    /// the config's folder.
    pub grpo: Option<GrpoConfig>,
    /// The config after `--set` overrides, as TOML (copied into checkpoints).
    pub resolved: String,
}

/// The sections of a run config.
const SECTIONS: &[&str] = &[
    "model",
    "lora",
    "data",
    "training",
    "callbacks",
    "dpo",
    "grpo",
];

/// PEFT keys `[lora]` accepts besides [`LoraConfig`]'s fields (its task is always causal LM).
const LORA_EXTRA_KEYS: &[&str] = &["task_type"];
/// The keys of each section of a run config, `model.quantization` (a table inside `[model]`) apart.
fn section_keys() -> [(&'static str, Vec<&'static str>); 8] {
    let lora = [field_names::<LoraConfig>(), LORA_EXTRA_KEYS].concat();
    [
        ("model", field_names::<ModelSection>().to_vec()),
        (
            "model.quantization",
            field_names::<QuantizationSection>().to_vec(),
        ),
        ("lora", lora),
        ("data", field_names::<DataConfig>().to_vec()),
        ("training", field_names::<TrainingArguments>().to_vec()),
        ("callbacks", field_names::<CallbackSection>().to_vec()),
        ("dpo", field_names::<DpoConfig>().to_vec()),
        ("grpo", field_names::<GrpoConfig>().to_vec()),
    ]
}

/// An error for the first key of `root` that its section does not have (a key before the first header is in no
/// section). A key another section has is named with that section — where it belongs; otherwise the closest key
/// of its own section is suggested, else a close one of another section, else the valid keys are listed.
fn check_section_keys(root: &toml::Table, path: &str) -> Result<()> {
    let sections = section_keys();
    let in_other = |section: &str, key: &str| -> Vec<String> {
        sections
            .iter()
            .filter(|(name, keys)| *name != section && keys.contains(&key))
            .map(|(name, _)| format!("[{name}]"))
            .collect()
    };
    let error = |section: &str, key: &str, own: &[&str]| -> Error {
        let shown = if section.is_empty() {
            "top level"
        } else {
            section
        };
        let homes = in_other(section, key);
        if let Some(home) = homes.first() {
            let dotted = home.trim_matches(['[', ']']);
            return Error::InvalidInput(format!(
                "{path}: unknown key `{key}` in [{shown}]; it belongs in {} (`{dotted}.{key}`)",
                either(&homes)
            ));
        }
        if !closest(key, own).is_empty() || section.is_empty() {
            return unknown_key(path, shown, key, own);
        }
        let elsewhere: Vec<String> = sections
            .iter()
            .filter(|(name, _)| *name != section)
            .flat_map(|(name, keys)| {
                closest(key, keys)
                    .into_iter()
                    .map(move |k| format!("[{name}] `{k}`"))
            })
            .collect();
        match elsewhere.is_empty() {
            true => unknown_key(path, shown, key, own),
            false => Error::InvalidInput(format!(
                "{path}: unknown key `{key}` in [{shown}]; did you mean {}?",
                either(&elsewhere)
            )),
        }
    };
    if let Some(key) = root.keys().find(|k| !SECTIONS.contains(&k.as_str())) {
        return Err(error("", key, SECTIONS));
    }
    for (name, keys) in &sections {
        let table = match name.split_once('.') {
            Some((outer, inner)) => root.get(outer).and_then(|t| t.get(inner)),
            None => root.get(*name),
        };
        if let Some(toml::Value::Table(table)) = table {
            if let Some(key) = table.keys().find(|k| !keys.contains(&k.as_str())) {
                return Err(error(name, key, keys));
            }
        }
    }
    Ok(())
}
/// The LoRA settings of a run continuing the adapter in `dir`: the adapter's own, which a `[lora]` section (when
/// given) must agree with, setting by setting.
fn continued_lora(dir: &Path, section: Option<&toml::Value>, path: &str) -> Result<LoraConfig> {
    let adapter = LoraConfig::from_file(&dir.join(crate::adapter::ADAPTER_CONFIG))?;
    let Some(section) = section else {
        return Ok(adapter);
    };
    let asked: LoraConfig = read_section(section, path, "lora", LORA_EXTRA_KEYS)?;
    match adapter.first_difference(&asked) {
        None => Ok(adapter),
        Some((key, theirs, ours)) => Err(Error::InvalidInput(format!(
            "{path}: [lora] {key} = {ours}, but the adapter the run continues ({}) has {key} = {theirs}: a \
             continued adapter keeps its LoRA settings; remove [lora] (or the key), or set it to the adapter's",
            dir.display()
        ))),
    }
}

impl RunConfig {
    /// Reads `path` and applies `overrides` (`section.key=value`).
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io("cannot read config", path, e))?;
        let mut root: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            Error::InvalidInput(format!("{}: {e}", path.display()))
        })?;
        let mut raw = Vec::new();
        for o in overrides {
            raw.extend(apply_override(&mut root, o)?);
        }
        Self::from_table(&root, path).map_err(|e| explain_raw(e, &raw))
    }

    /// Builds a config from a parsed TOML document; `path` names it in errors and relative data files are resolved
    /// against its folder.
    pub fn from_table(root: &toml::Table, path: &Path) -> Result<Self> {
        let p = path.display().to_string();
        refuse_trl_only_grpo_fields(root, &p)?;
        check_section_keys(root, &p)?;
        let required = |name: &str| {
            root.get(name)
                .ok_or_else(|| Error::InvalidInput(format!("{p}: the [{name}] section is missing")))
        };
        let optional = |name: &str| {
            root.get(name)
                .cloned()
                .unwrap_or(toml::Value::Table(Default::default()))
        };

        let model_table = required("model")?;
        if let Some(toml::Value::Table(q)) = model_table.get("quantization") {
            check_keys::<QuantizationSection>(q, &p, "model.quantization", &[])?;
        }
        let mut model: ModelSection = read_section(model_table, &p, "model", &[])?;
        if let Some(q) = &model.quantization {
            q.quant_config()
                .map_err(|e| Error::InvalidInput(format!("{p}: [model.quantization]: {e}")))?;
        }
        let base = path.parent().unwrap_or(Path::new("."));
        // An empty path joined to the config's folder would name that folder: refused by key instead.
        if model
            .adapter
            .as_ref()
            .is_some_and(|a| a.as_os_str().is_empty())
        {
            return Err(Error::InvalidInput(format!(
                "{p}: [model] adapter = \"\" names no folder: set it to the adapter folder to continue, or remove \
                 adapter to train a new adapter"
            )));
        }
        model.adapter = model.adapter.map(|a| base.join(a));
        let lora = match &model.adapter {
            Some(dir) => continued_lora(dir, root.get("lora"), &p)?,
            None => read_section(required("lora")?, &p, "lora", LORA_EXTRA_KEYS)?,
        };
        lora.validate()
            .map_err(|e| Error::InvalidInput(format!("{p}: [lora]: {e}")))?;
        let mut data: DataConfig = read_section(required("data")?, &p, "data", &[])?;
        for (key, file) in [
            ("train_file", &data.train_file),
            ("eval_file", &data.eval_file),
        ] {
            if file.as_ref().is_some_and(|f| f.as_os_str().is_empty()) {
                return Err(Error::InvalidInput(format!(
                    "{p}: [data] {key} = \"\" names no file: set it to a JSONL file"
                )));
            }
        }
        // A GRPO run on rollouts reads its prompts from the rollouts file.
        let rollouts = root.get("grpo").and_then(|g| g.get("rollouts")).is_some();
        data.train_file = match (&data.train_file, rollouts) {
            (Some(f), _) => Some(base.join(f)),
            (None, true) => None,
            (None, false) => {
                return Err(Error::InvalidInput(format!("{p}: [data] needs train_file")))
            }
        };
        data.eval_file = data.eval_file.map(|f| base.join(f));
        data.validate()
            .map_err(|e| Error::InvalidInput(format!("{p}: [data]: {e}")))?;
        let training = TrainingArguments::from_toml_value(&optional("training"), &p)?;
        let callbacks: CallbackSection =
            read_section(&optional("callbacks"), &p, "callbacks", &[])?;
        // transformers' EarlyStoppingCallback asserts as much when training begins: here before anything loads.
        if let Some(patience) = callbacks.early_stopping_patience {
            if training.eval_strategy == IntervalStrategy::No {
                return Err(Error::InvalidInput(format!(
                    "{p}: [callbacks] early_stopping_patience = {patience} needs evaluations, and [training] \
                     eval_strategy is \"no\": set eval_strategy = \"steps\" or \"epoch\" (with [data] eval_file \
                     or eval_split), or remove early_stopping_patience"
                )));
            }
        }
        check_tiled_mlp(&training, &lora, &p)?;
        if training.fsdp.is_some() && lora.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(Error::InvalidInput(format!(
                "{p}: [lora] modules_to_save with [training] fsdp: the trained copies of the embedding table and \
                 head would be whole on every rank while the base's are sharded; remove modules_to_save or fsdp"
            )));
        }
        if training.fsdp.is_some() && lora.use_dora {
            return Err(Error::InvalidInput(format!(
                "{p}: [lora] use_dora = true with [training] fsdp: DoRA reads each whole base weight for its norm, \
                 which a sharded base holds only while its layer runs; remove use_dora or fsdp"
            )));
        }
        let dpo: Option<DpoConfig> = root
            .get("dpo")
            .map(|v| read_section(v, &p, "dpo", &[]))
            .transpose()?;
        if let Some(dpo) = &dpo {
            dpo.validate(&p)?;
            dpo.check_training(&training, &p)?;
            if data.packing {
                return Err(Error::InvalidInput(format!(
                    "{p}: [data] packing = true: DPO runs each pair's sequences whole (TRL has no packing for \
                     DPO); remove packing"
                )));
            }
        }
        let grpo: Option<GrpoConfig> = match root.get("grpo") {
            Some(v) => Some(read_grpo(v, &p, base, &training, &data)?),
            None => None,
        };
        if dpo.is_some() && grpo.is_some() {
            return Err(Error::InvalidInput(format!(
                "{p}: both [dpo] and [grpo]: a run trains with one method; remove one of the sections"
            )));
        }
        Ok(RunConfig {
            path: path.to_path_buf(),
            model,
            lora,
            data,
            training,
            callbacks,
            dpo,
            grpo,
            resolved: root.to_string(),
        })
    }

    /// The 4-bit quantization `[model.quantization]` asks for, if any.
    pub fn quant_config(&self) -> Result<Option<QuantConfig>> {
        match &self.model.quantization {
            Some(q) => q.quant_config(),
            None => Ok(None),
        }
    }

    /// `bnb_4bit_compute_dtype` when 4-bit loading is on.
    pub fn quant_compute_dtype(&self) -> Option<TorchDtype> {
        self.model
            .quantization
            .as_ref()
            .filter(|q| q.load_in_4bit)
            .map(|q| q.bnb_4bit_compute_dtype)
    }

    /// Checks that the run can train as `world_size` processes, `local` of them on this machine, before any rank
    /// starts (the launcher) or loads the model (each rank): the build and the GPUs ([`check_ranks`]), then what
    /// the config allows — several processes train on GPUs, and DPO in one process for now.
    pub fn check_ranks(&self, world_size: usize, local: usize, from: RanksFrom) -> Result<()> {
        check_ranks(world_size, local, from)?;
        if world_size == 1 {
            return Ok(());
        }
        let p = self.path.display();
        let alone = match from {
            RanksFrom::Launcher => "drop --nproc-per-node",
            RanksFrom::Environment => "start the command without a launcher",
        };
        if self.training.use_cpu {
            return Err(Error::InvalidInput(format!(
                "{p}: [training] use_cpu = true with {world_size} processes: the ranks of a distributed run train                  on GPUs, one each; remove use_cpu, or {alone} to train on the CPU in one process"
            )));
        }
        if self.dpo.is_some() {
            return Err(Error::InvalidInput(format!(
                "{p}: [dpo] with {world_size} processes: DPO runs in one process for now; {alone}"
            )));
        }
        if self.training.fsdp.is_some() && self.training.predict_with_generate {
            return Err(Error::InvalidInput(format!(
                "{p}: [training] predict_with_generate = true with fsdp over {world_size} processes: each rank would \
                 generate its own answers, token by token, while its layers gather from the others; remove \
                 predict_with_generate (the evaluation loss is computed sharded) or fsdp"
            )));
        }
        if let (Some(_), Some(why)) = (&self.grpo, GrpoConfig::world_size_problem(world_size)) {
            return Err(Error::InvalidInput(format!(
                "{p}: [grpo] with {world_size} processes: {why}; {alone}"
            )));
        }
        Ok(())
    }
}

/// A field of TRL's `GRPOConfig` in `[grpo]` that this trainer lacks, refused with why (rather than as an unknown key).
fn refuse_trl_only_grpo_fields(root: &toml::Table, p: &str) -> Result<()> {
    let Some(table) = root.get("grpo").and_then(toml::Value::as_table) else {
        return Ok(());
    };
    match REFUSED_TRL_FIELDS.iter().find(|(k, _)| table.contains_key(*k)) {
        Some((key, why)) => Err(Error::InvalidInput(format!(
            "{p}: [grpo] {key}: TRL's GRPOConfig has it, and this trainer does not: {why}; remove it"
        ))),
        None => Ok(()),
    }
}

/// `[grpo]` read and checked against `[training]` and `[data]`, the rollouts file resolved against the config's
/// folder `base`.
fn read_grpo(
    value: &toml::Value,
    p: &str,
    base: &Path,
    training: &TrainingArguments,
    data: &DataConfig,
) -> Result<GrpoConfig> {
    let mut grpo: GrpoConfig = read_section(value, p, "grpo", &[])?;
    grpo.validate(p)?;
    grpo.check_training(training, p)?;
    if data.packing {
        return Err(Error::InvalidInput(format!(
            "{p}: [data] packing = true: GRPO generates whole completions after each prompt; remove packing"
        )));
    }
    if grpo
        .rollouts
        .as_ref()
        .is_some_and(|r| r.as_os_str().is_empty())
    {
        return Err(Error::InvalidInput(format!(
            "{p}: [grpo] rollouts = \"\" names no file: set it to a JSONL file of rollouts, or remove it"
        )));
    }
    grpo.rollouts = grpo.rollouts.map(|r| base.join(r));
    Ok(grpo)
}

/// `tiled_mlp` runs each MLP over slices of its rows, and LoRA dropout's mask is drawn over a projection's whole
/// input: the two together on an MLP projection are refused before anything loads (the model would refuse them at
/// the first step).
fn check_tiled_mlp(training: &TrainingArguments, lora: &LoraConfig, p: &str) -> Result<()> {
    if !training.tiled_mlp || lora.lora_dropout <= 0.0 {
        return Ok(());
    }
    for projection in ["gate_proj", "up_proj", "down_proj", "gate_up_proj"] {
        if is_target(lora, &format!("model.layers.0.mlp.{projection}"))? {
            return Err(Error::InvalidInput(format!(
                "{p}: [training] tiled_mlp = true with [lora] lora_dropout = {} on the MLP's {projection}: a \
                 tiled MLP cannot replay dropout's mask (drawn over the whole input); set lora_dropout = 0, \
                 leave the MLP projections out of target_modules, or set tiled_mlp = false",
                lora.lora_dropout
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const RECIPE: &str = r#"
[model]
name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
[model.quantization]
load_in_4bit = true
bnb_4bit_quant_type = "nf4"
bnb_4bit_use_double_quant = true
bnb_4bit_compute_dtype = "bfloat16"
[lora]
r = 16
lora_alpha = 32
lora_dropout = 0.05
target_modules = "all-linear"
task_type = "CAUSAL_LM"
[data]
train_file = "data/train.jsonl"
max_length = 512
[training]
output_dir = "runs/smollm2"
learning_rate = 2e-4
optim = "paged_adamw_8bit"
"#;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("run.toml");
        std::fs::write(&p, text).unwrap();
        (dir, p)
    }

    /// `[grpo]`: a TRL field we lack is refused with the reason, `[dpo]` with it is refused, a rollouts file
    /// replaces `train_file` and is resolved against the config's folder, the batch shape follows TRL's rules.
    #[test]
    fn grpo_sections_are_read_and_checked() {
        let grpo = |section: &str| RECIPE.to_string() + "[grpo]\nnum_generations = 4\n" + section;
        let (dir, p) = write(&grpo("rollouts = \"r.jsonl\"\n"));
        let c = RunConfig::load(&p, &[]).unwrap();
        assert_eq!(
            c.grpo.unwrap().rollouts.unwrap(),
            dir.path().join("r.jsonl")
        );
        let (_d, p) = write(
            &grpo("rollouts = \"r.jsonl\"\n").replace("train_file = \"data/train.jsonl\"\n", ""),
        );
        assert!(RunConfig::load(&p, &[]).unwrap().data.train_file.is_none());
        for (section, says) in [
            (
                "use_vllm = true\n",
                "[grpo] use_vllm: TRL's GRPOConfig has it",
            ),
            ("num_generations_typo = 2\n", "num_generations"),
            ("[dpo]\nbeta = 0.1\n", "both [dpo] and [grpo]"),
            (
                "generation_batch_size = 6\n",
                "multiple of [training] per_device_train_batch_size",
            ),
            ("rollouts = \"\"\n", "[grpo] rollouts = \"\" names no file"),
        ] {
            let (_d, p) = write(&grpo(section));
            let err = RunConfig::load(&p, &[]).unwrap_err().to_string();
            assert!(err.contains(says), "{section}: {err}");
        }
    }

    #[test]
    fn reads_the_design_recipe_and_applies_overrides() {
        let (_d, p) = write(RECIPE);
        let c = RunConfig::load(
            &p,
            &[
                "training.learning_rate=1e-4".into(),
                "lora.r=8".into(),
                "data.packing=true".into(),
                "training.tiled_mlp=true".into(),
                "lora.lora_dropout=0".into(),
            ],
        )
        .unwrap();
        assert!(c.training.tiled_mlp);
        assert!(!RunConfig::load(&p, &[]).unwrap().training.tiled_mlp);
        assert_eq!(c.quant_config().unwrap(), Some(QuantConfig::nf4()));
        assert_eq!(c.quant_compute_dtype(), Some(TorchDtype::BFloat16));
        assert_eq!((c.lora.r, c.lora.lora_alpha), (8, 32.0));
        assert_eq!(c.training.learning_rate, 1e-4);
        assert!(c.data.packing);
        assert_eq!(
            c.data.train_file.unwrap(),
            p.parent().unwrap().join("data/train.jsonl")
        );
    }

    /// `tiled_mlp` with dropout on an MLP projection is refused naming both keys; dropout on attention alone is not.
    #[test]
    fn tiled_mlp_refuses_dropout_on_the_mlp() {
        let (_d, p) = write(RECIPE);
        let load = |sets: &[&str]| {
            RunConfig::load(&p, &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        };
        let err = load(&["training.tiled_mlp=true"]).unwrap_err().to_string();
        assert!(
            err.contains("tiled_mlp")
                && err.contains("lora_dropout = 0.05")
                && err.contains("gate_proj"),
            "{err}"
        );
        let attention = load(&[
            "training.tiled_mlp=true",
            r#"lora.target_modules=["q_proj", "v_proj"]"#,
        ]);
        assert!(attention.unwrap().training.tiled_mlp);
        assert!(load(&["training.tiled_mlp=true", "lora.lora_dropout=0.0"]).is_ok());
    }

    #[test]
    fn unknown_keys_and_wrong_types_name_the_place() {
        let (_d, p) = write(&RECIPE.replace("lora_dropout", "lora_droput"));
        let err = RunConfig::load(&p, &[]).unwrap_err().to_string();
        assert!(
            err.contains("run.toml")
                && err.contains("[lora]")
                && err.contains("did you mean `lora_dropout`"),
            "{err}"
        );
        let (_d, p) = write(RECIPE);
        let err = RunConfig::load(&p, &["training.num_train_epoch=2".into()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("did you mean `num_train_epochs`"), "{err}");
        let err = RunConfig::load(
            &p,
            &["model.quantization.bnb_4bit_quant_type=\"int4\"".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("int4") && err.contains("bnb_4bit_quant_type"),
            "{err}"
        );
        let err = RunConfig::load(
            &p,
            &["model.quantization.bnb_4bit_quant_typ=\"nf4\"".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("[model.quantization]")
                && err.contains("did you mean `bnb_4bit_quant_type`"),
            "{err}"
        );
        let err = RunConfig::load(&p, &["data.max_length=\"long\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("[data] max_length") && err.contains("invalid type"),
            "{err}"
        );
        let (_d, p) =
            write(&RECIPE.replace("[data]\ntrain_file = \"data/train.jsonl\"\n", "[data]\n"));
        assert!(RunConfig::load(&p, &[])
            .unwrap_err()
            .to_string()
            .contains("train_file"));
    }

    #[test]
    fn a_key_of_another_section_is_sent_there_and_only_plausible_slips_are_suggested() {
        let (_d, p) = write(RECIPE);
        let err = |set: &str| {
            RunConfig::load(&p, &[set.to_string()])
                .unwrap_err()
                .to_string()
        };
        // A key in the wrong section: where it belongs, never a look-alike of this section (`max_steps`).
        for (set, says) in [
            (
                "training.max_length=64",
                "in [training]; it belongs in [data] (`data.max_length`)",
            ),
            (
                "training.eval_split=0.1",
                "it belongs in [data] (`data.eval_split`)",
            ),
            ("training.memory_monitor=false", "it belongs in [callbacks]"),
            ("training.beta=0.1", "it belongs in [dpo]"),
            (
                "model.load_in_4bit=true",
                "in [model]; it belongs in [model.quantization]",
            ),
            ("lora.learning_rate=1e-4", "it belongs in [training]"),
            (
                "training.max_seq_len=64",
                "did you mean [data] `max_length`?",
            ),
        ] {
            let e = err(set);
            assert!(e.contains(says), "{set}: {e}");
        }
        let (_d, top) = write(&format!("learning_rate = 1e-4\n{RECIPE}"));
        let e = RunConfig::load(&top, &[]).unwrap_err().to_string();
        assert!(
            e.contains("`learning_rate` in [top level]; it belongs in [training]"),
            "{e}"
        );

        // Typos and near names are suggested; other settings of transformers, PEFT or TRL that share a word with
        // one of ours are not passed off as it.
        let training = field_names::<TrainingArguments>();
        for (key, meant) in [
            ("learning_rat", &["learning_rate"][..]),
            ("learningrate", &["learning_rate"]),
            ("evaluation_strategy", &["eval_strategy"]),
            ("lr_scheduler", &["lr_scheduler_type"]),
            ("num_epochs", &["num_train_epochs"]),
            ("grad_accum_steps", &["gradient_accumulation_steps"]),
            ("gradient_checkpointing_enable", &["gradient_checkpointing"]),
            ("bf_16", &["bf16"]),
            (
                "per_device_batch_size",
                &["per_device_train_batch_size", "per_device_eval_batch_size"],
            ),
            ("max_length", &[]),
            ("eval_split", &[]),
            ("eval_accumulation_steps", &[]),
            ("save_safetensors", &[]),
            ("save_only_model", &[]),
            ("logging_dir", &[]),
            ("dataloader_num_workers", &[]),
            ("optim_args", &[]),
            ("fp16_full_eval", &[]),
            ("lr", &[]),
        ] {
            assert_eq!(closest(key, training), meant, "{key}");
        }
        let lora = field_names::<LoraConfig>();
        assert_eq!(closest("rank", lora), Vec::<&str>::new());
        assert_eq!(closest("lora_droput", lora), ["lora_dropout"]);
        let quantization = field_names::<QuantizationSection>();
        assert_eq!(closest("load_in_8bit", quantization), Vec::<&str>::new());
        assert_eq!(
            closest("bnb_4bit_quant", quantization),
            ["bnb_4bit_quant_type"]
        );
    }

    #[test]
    fn set_values_that_are_no_toml_are_refused_naming_the_argument() {
        let (_d, p) = write(RECIPE);
        let load = |set: &str| RunConfig::load(&p, &[set.to_string()]);
        let err = |set: &str| load(set).unwrap_err().to_string();
        // A broken number for a key of another type: named by the argument (it was "invalid type: string").
        let e = err("training.learning_rate=1e-3x");
        assert!(
            e.contains("--set `training.learning_rate=1e-3x`") && e.contains("takes no string"),
            "{e}"
        );
        // A broken array or string for a string key was taken as the string itself.
        let e = err("training.output_dir=[runs");
        assert!(
            e.contains("--set `training.output_dir=[runs`") && e.contains("not a valid TOML value"),
            "{e}"
        );
        assert!(err("training.output_dir=\"runs").contains("not a valid TOML value"));
        // An integer beyond 64 bits: the range, not "invalid type: string".
        let e = err("training.seed=99999999999999999999");
        assert!(
            e.contains("99999999999999999999 is out of range")
                && e.contains("9223372036854775807")
                && !e.contains("invalid type"),
            "{e}"
        );
        // A negative count: the range of the key.
        let e = err("training.per_device_train_batch_size=-1");
        assert!(e.contains("must be an integer from 0 to"), "{e}");
        // A bare word for a string key, and a quoted one, still work.
        assert_eq!(
            load("training.output_dir=runs/x")
                .unwrap()
                .training
                .output_dir,
            "runs/x"
        );
        assert_eq!(
            load("training.output_dir=\"[runs\"")
                .unwrap()
                .training
                .output_dir,
            "[runs"
        );
    }

    #[test]
    fn set_takes_activation_checkpointing_and_refuses_it_against_gradient_checkpointing() {
        let (_d, p) = write(RECIPE);
        let c = RunConfig::load(&p, &["training.activation_checkpointing=true".into()]).unwrap();
        assert!(c.training.checkpointing() && !c.training.gradient_checkpointing);
        let (_d, p) = write(&format!("{RECIPE}gradient_checkpointing = true\n"));
        let c = RunConfig::load(&p, &["training.activation_checkpointing=true".into()]).unwrap();
        assert!(c.training.checkpointing());
        let err = RunConfig::load(&p, &["training.activation_checkpointing=false".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("run.toml: [training]")
                && err.contains(
                    "`gradient_checkpointing` = true and `activation_checkpointing` = false disagree"
                ),
            "{err}"
        );
    }

    #[test]
    fn field_names_come_from_serde() {
        let fields = field_names::<CallbackSection>();
        assert_eq!(
            fields,
            [
                "early_stopping_patience",
                "early_stopping_threshold",
                "memory_monitor",
                "memory_warn_fraction"
            ]
        );
        assert!(field_names::<TrainingArguments>().contains(&"learning_rate"));
    }
}
