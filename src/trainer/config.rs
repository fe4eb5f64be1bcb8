//! A training config: a TOML file with `[model]` (name_or_path, revision, `[model.quantization]` =
//! `BitsAndBytesConfig`), `[lora]` (`LoraConfig`), `[data]` and `[training]` (`TrainingArguments`), section and
//! field names as in Python. `--set section.key=value` overrides any field. Unknown keys are errors that suggest
//! the closest valid name.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::lora::LoraConfig;
use crate::quant::{QuantConfig, QuantType};

use super::args::{unknown_key, TrainingArguments};

/// `[model]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSection {
    /// Hub id, local folder or `.gguf` file.
    pub name_or_path: String,
    /// Hub revision.
    pub revision: Option<String>,
    /// `[model.quantization]` (`BitsAndBytesConfig`): `None` when `load_in_4bit` is false or absent.
    pub quantization: Option<QuantConfig>,
    /// `bnb_4bit_compute_dtype` (`bfloat16`, `float16`, `float32`).
    pub compute_dtype: String,
}

/// `[data]`.
#[derive(Clone, Debug, PartialEq)]
pub struct DataSection {
    /// Training JSONL file.
    pub train_file: PathBuf,
    /// Evaluation JSONL file.
    pub eval_file: Option<PathBuf>,
    /// Fraction of the training file held out for evaluation when there is no `eval_file`.
    pub eval_split: Option<f64>,
    /// `auto`, `text`, `alpaca`, `messages` or `sharegpt`.
    pub format: String,
    /// Longest sequence in tokens.
    pub max_length: usize,
    /// Pack several examples per sequence.
    pub packing: bool,
    /// Loss on completions only (prompt labelled −100).
    pub completion_only_loss: bool,
    /// Loss on assistant turns only.
    pub assistant_only_loss: bool,
    /// Count bad lines instead of stopping.
    pub skip_bad_lines: bool,
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
    /// `[data]`.
    pub data: DataSection,
    /// `[training]`.
    pub training: TrainingArguments,
    /// `[callbacks]`.
    pub callbacks: CallbackSection,
    /// The config after `--set` overrides, as TOML (copied into checkpoints).
    pub resolved: String,
}

/// `[callbacks]`: the built-in callbacks a run uses.
#[derive(Clone, Debug, PartialEq)]
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

const SECTIONS: &[&str] = &["model", "lora", "data", "training", "callbacks"];
const CALLBACK_KEYS: &[&str] = &[
    "early_stopping_patience",
    "early_stopping_threshold",
    "memory_monitor",
    "memory_warn_fraction",
];
const MODEL_KEYS: &[&str] = &["name_or_path", "revision", "quantization"];
const QUANT_KEYS: &[&str] = &[
    "load_in_4bit",
    "bnb_4bit_quant_type",
    "bnb_4bit_use_double_quant",
    "bnb_4bit_compute_dtype",
    "bnb_4bit_quant_storage",
    "bnb_4bit_blocksize",
];
const LORA_KEYS: &[&str] = &[
    "r",
    "lora_alpha",
    "lora_dropout",
    "target_modules",
    "exclude_modules",
    "bias",
    "use_rslora",
    "rank_pattern",
    "alpha_pattern",
    "init_lora_weights",
    "use_dora",
    "modules_to_save",
    "task_type",
];
const DATA_KEYS: &[&str] = &[
    "train_file",
    "eval_file",
    "eval_split",
    "format",
    "max_length",
    "packing",
    "completion_only_loss",
    "assistant_only_loss",
    "skip_bad_lines",
];

fn check_keys(table: &toml::Table, path: &str, section: &str, keys: &[&str]) -> Result<()> {
    match table.keys().find(|k| !keys.contains(&k.as_str())) {
        Some(k) => Err(unknown_key(path, section, k, keys)),
        None => Ok(()),
    }
}

fn section<'a>(root: &'a toml::Table, name: &str, path: &str) -> Result<&'a toml::Table> {
    match root.get(name) {
        Some(toml::Value::Table(t)) => Ok(t),
        Some(_) => Err(Error::InvalidInput(format!(
            "{path}: [{name}] must be a table"
        ))),
        None => Err(Error::InvalidInput(format!(
            "{path}: the [{name}] section is missing"
        ))),
    }
}

/// The value of `key` in `[section]` converted by `convert`; an error naming both when it has another type.
fn typed<'a, T>(
    table: &'a toml::Table,
    key: &str,
    (path, section): (&str, &str),
    want: &str,
    convert: impl Fn(&'a toml::Value) -> Option<T>,
) -> Result<Option<T>> {
    match table.get(key) {
        None => Ok(None),
        Some(v) => convert(v).map(Some).ok_or_else(|| {
            Error::InvalidInput(format!("{path}: [{section}] {key} = {v}: expected {want}"))
        }),
    }
}

fn as_bool(v: &toml::Value) -> Option<bool> {
    v.as_bool()
}

fn as_str(v: &toml::Value) -> Option<&str> {
    v.as_str()
}

fn as_count(v: &toml::Value) -> Option<usize> {
    v.as_integer().and_then(|i| usize::try_from(i).ok())
}

fn as_number(v: &toml::Value) -> Option<f64> {
    v.as_float().or_else(|| v.as_integer().map(|i| i as f64))
}

/// Parses `value` of a `--set` as TOML (numbers, booleans, arrays), falling back to a string.
fn parse_value(text: &str) -> toml::Value {
    format!("v = {text}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(text.into()))
}

impl RunConfig {
    /// Reads `path` and applies `overrides` (`section.key=value`).
    pub fn load(path: &Path, overrides: &[String]) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io("cannot read config", path, e))?;
        let mut root: toml::Table = text.parse().map_err(|e: toml::de::Error| {
            Error::InvalidInput(format!("{}: {e}", path.display()))
        })?;
        for o in overrides {
            let (key, value) = o.split_once('=').ok_or_else(|| {
                Error::InvalidInput(format!("--set `{o}`: expected section.key=value"))
            })?;
            let mut parts: Vec<&str> = key.trim().split('.').collect();
            let last = parts.pop().filter(|_| !parts.is_empty()).ok_or_else(|| {
                Error::InvalidInput(format!(
                    "--set `{o}`: the key needs a section, e.g. training.learning_rate"
                ))
            })?;
            let mut table = &mut root;
            for p in parts {
                table = table
                    .entry(p.to_string())
                    .or_insert_with(|| toml::Value::Table(Default::default()))
                    .as_table_mut()
                    .ok_or_else(|| {
                        Error::InvalidInput(format!("--set `{o}`: `{p}` is not a table"))
                    })?;
            }
            table.insert(last.to_string(), parse_value(value.trim()));
        }
        Self::from_table(&root, path)
    }

    /// Builds a config from a parsed TOML document.
    pub fn from_table(root: &toml::Table, path: &Path) -> Result<Self> {
        let p = path.display().to_string();
        check_keys(root, &p, "top level", SECTIONS)?;
        let base = path.parent().unwrap_or(Path::new("."));

        let m = section(root, "model", &p)?;
        check_keys(m, &p, "model", MODEL_KEYS)?;
        let name_or_path = m
            .get("name_or_path")
            .and_then(|v| v.as_str())
            .ok_or_else(|| {
                Error::InvalidInput(format!(
                    "{p}: [model] needs name_or_path (a Hub id, folder or .gguf)"
                ))
            })?
            .to_string();
        let (quantization, compute_dtype) = match m.get("quantization") {
            None => (None, "float32".to_string()),
            Some(toml::Value::Table(q)) => {
                check_keys(q, &p, "model.quantization", QUANT_KEYS)?;
                let at = (p.as_str(), "model.quantization");
                let get_bool = |k: &str, d: bool| -> Result<bool> {
                    Ok(typed(q, k, at, "true or false", as_bool)?.unwrap_or(d))
                };
                let quant_type: QuantType =
                    typed(q, "bnb_4bit_quant_type", at, "a string", as_str)?
                        .unwrap_or("fp4")
                        .parse()?;
                let compute = typed(q, "bnb_4bit_compute_dtype", at, "a string", as_str)?
                    .unwrap_or("float32")
                    .to_string();
                if !["bfloat16", "float16", "float32"].contains(&compute.as_str()) {
                    return Err(Error::InvalidInput(format!(
                        "{p}: bnb_4bit_compute_dtype `{compute}`: use bfloat16, float16 or float32"
                    )));
                }
                let cfg = QuantConfig {
                    quant_type,
                    blocksize: typed(q, "bnb_4bit_blocksize", at, "an integer", as_count)?
                        .unwrap_or(64),
                    double_quant: get_bool("bnb_4bit_use_double_quant", false)?,
                    ..QuantConfig::nf4()
                };
                cfg.validate()?;
                (get_bool("load_in_4bit", false)?.then_some(cfg), compute)
            }
            Some(_) => {
                return Err(Error::InvalidInput(format!(
                    "{p}: [model.quantization] must be a table"
                )))
            }
        };
        let model = ModelSection {
            name_or_path,
            revision: typed(m, "revision", (&p, "model"), "a string", as_str)?.map(str::to_string),
            quantization,
            compute_dtype,
        };

        let l = section(root, "lora", &p)?;
        check_keys(l, &p, "lora", LORA_KEYS)?;
        let json = serde_json::to_value(l)
            .map_err(|e| Error::InvalidInput(format!("{p}: [lora]: {e}")))?;
        let lora = LoraConfig::from_json(&json, path)?;

        let d = section(root, "data", &p)?;
        check_keys(d, &p, "data", DATA_KEYS)?;
        let at = (p.as_str(), "data");
        let file = |k: &str| -> Result<Option<PathBuf>> {
            Ok(typed(d, k, at, "a file path", as_str)?.map(|f| base.join(f)))
        };
        let flag = |k: &str, default: bool| -> Result<bool> {
            Ok(typed(d, k, at, "true or false", as_bool)?.unwrap_or(default))
        };
        let data = DataSection {
            train_file: file("train_file")?
                .ok_or_else(|| Error::InvalidInput(format!("{p}: [data] needs train_file")))?,
            eval_file: file("eval_file")?,
            eval_split: typed(d, "eval_split", at, "a number", as_number)?,
            format: typed(d, "format", at, "a string", as_str)?
                .unwrap_or("auto")
                .to_string(),
            max_length: typed(d, "max_length", at, "a positive integer", as_count)?.unwrap_or(1024),
            packing: flag("packing", false)?,
            completion_only_loss: flag("completion_only_loss", true)?,
            assistant_only_loss: flag("assistant_only_loss", false)?,
            skip_bad_lines: flag("skip_bad_lines", false)?,
        };
        if data.max_length == 0 {
            return Err(Error::InvalidInput(format!(
                "{p}: [data] max_length must be at least 1"
            )));
        }
        data.format.parse::<crate::data::DataFormat>()?;

        let training = match root.get("training") {
            Some(toml::Value::Table(t)) => TrainingArguments::from_toml(t, &p)?,
            Some(_) => {
                return Err(Error::InvalidInput(format!(
                    "{p}: [training] must be a table"
                )))
            }
            None => TrainingArguments::default(),
        };
        let callbacks = match root.get("callbacks") {
            None => CallbackSection::default(),
            Some(toml::Value::Table(c)) => {
                check_keys(c, &p, "callbacks", CALLBACK_KEYS)?;
                let at = (p.as_str(), "callbacks");
                let defaults = CallbackSection::default();
                CallbackSection {
                    early_stopping_patience: typed(
                        c,
                        "early_stopping_patience",
                        at,
                        "a positive integer",
                        as_count,
                    )?,
                    early_stopping_threshold: typed(
                        c,
                        "early_stopping_threshold",
                        at,
                        "a number",
                        as_number,
                    )?
                    .unwrap_or(defaults.early_stopping_threshold),
                    memory_monitor: typed(c, "memory_monitor", at, "true or false", as_bool)?
                        .unwrap_or(defaults.memory_monitor),
                    memory_warn_fraction: typed(
                        c,
                        "memory_warn_fraction",
                        at,
                        "a number",
                        as_number,
                    )?
                    .unwrap_or(defaults.memory_warn_fraction),
                }
            }
            Some(_) => {
                return Err(Error::InvalidInput(format!(
                    "{p}: [callbacks] must be a table"
                )))
            }
        };
        Ok(RunConfig {
            path: path.to_path_buf(),
            model,
            lora,
            data,
            training,
            callbacks,
            resolved: root.to_string(),
        })
    }
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

    #[test]
    fn reads_the_design_recipe_and_applies_overrides() {
        let (_d, p) = write(RECIPE);
        let c = RunConfig::load(
            &p,
            &[
                "training.learning_rate=1e-4".into(),
                "lora.r=8".into(),
                "data.packing=true".into(),
            ],
        )
        .unwrap();
        assert_eq!(c.model.quantization, Some(QuantConfig::nf4()));
        assert_eq!(c.model.compute_dtype, "bfloat16");
        assert_eq!((c.lora.r, c.lora.lora_alpha), (8, 32.0));
        assert_eq!(c.training.learning_rate, 1e-4);
        assert!(c.data.packing);
        assert_eq!(
            c.data.train_file,
            p.parent().unwrap().join("data/train.jsonl")
        );
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
        assert!(err.contains("int4"), "{err}");
        let (_d, p) =
            write(&RECIPE.replace("[data]\ntrain_file = \"data/train.jsonl\"\n", "[data]\n"));
        assert!(RunConfig::load(&p, &[])
            .unwrap_err()
            .to_string()
            .contains("train_file"));
    }
}
