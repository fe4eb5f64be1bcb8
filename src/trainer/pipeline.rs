//! From a run config to a ready `Trainer`: the device and compute dtype, the model (quantized on load), the
//! tokenized data, and the callbacks the config asks for — what `qlora train` does before training.

use super::callbacks::{EarlyStoppingCallback, MemoryMonitorCallback};
use super::checkpoint::verify_checkpoint_files;
use super::config::RunConfig;
use super::dpo::DpoConfig;
use super::preflight::{check_before_loading, DataFacts};
use super::run::ADAPTER;
use super::run::{prepare_output_dir, start_memory_snapshot, Prepared, Trainer};
use crate::adapter::load_adapter;
use crate::data::{Dataset, PreferenceDataset};
use crate::error::Result;
use crate::loading::model::no_tokenizer;
use crate::loading::{load_model, load_tokenizer, LoadOptions};
use crate::memory::{human_bytes, process_memory};
use crate::models::TextTokenizer;
use crate::precision::Precision;
use std::path::Path;

/// A run's tokenized data, with the notes to print about it.
enum Data {
    Supervised(Dataset, Dataset, Vec<String>),
    Preference(
        Box<DpoConfig>,
        PreferenceDataset,
        PreferenceDataset,
        Vec<String>,
    ),
}

impl Data {
    /// Reads and tokenizes the data `config` names: preference pairs with `[dpo]`, supervised examples otherwise.
    fn read(config: &RunConfig, tokenizer: &TextTokenizer) -> Result<Self> {
        let data = &config.data;
        let name =
            |f: Option<&std::path::PathBuf>| f.map(|f| f.display().to_string()).unwrap_or_default();
        let (train_name, eval_name) = (
            name(data.train_file.as_ref()),
            name(data.eval_file.as_ref()),
        );
        let task = match &config.dpo {
            None => {
                let (train, eval) = Dataset::train_and_eval(tokenizer, data)?;
                train.check_learnable(
                    "the training set",
                    data.learn_all_keys("[data] ").as_deref(),
                )?;
                let mut notes = match &data.eval_file {
                    Some(_) => {
                        let mut notes =
                            train.file_notes(&train_name, train.truncated, data.max_length);
                        notes.extend(eval.file_notes(&eval_name, eval.truncated, data.max_length));
                        notes
                    }
                    None => {
                        let truncated = train.truncated + eval.truncated;
                        train.file_notes(&train_name, truncated, data.max_length)
                    }
                };
                notes.push(format!(
                    "{} training examples, {} evaluation examples",
                    train.examples,
                    eval.len()
                ));
                if data.packing {
                    notes.push(train.packing_note(data.max_length));
                }
                Data::Supervised(train, eval, notes)
            }
            Some(dpo) => {
                let (train, eval) =
                    PreferenceDataset::train_and_eval(tokenizer, data, dpo.truncation_mode)?;
                let max = Some(data.max_length);
                let mut notes = train.file_notes(&train_name, max);
                if data.eval_file.is_some() {
                    notes.extend(eval.file_notes(&eval_name, max));
                }
                notes.push(format!(
                    "{} training pairs, {} evaluation pairs",
                    train.len(),
                    eval.len()
                ));
                Data::Preference(Box::new(dpo.clone()), train, eval, notes)
            }
        };
        Ok(task)
    }

    /// What to print about the data (skipped, truncated, packed, counts).
    fn notes(&self) -> &[String] {
        match self {
            Data::Supervised(_, _, notes) | Data::Preference(_, _, _, notes) => notes,
        }
    }
}

impl Trainer {
    /// A trainer for `config`: loads its model on the device `[training]` selects (computing in the dtype its
    /// `bf16`/`fp16` flags and `bnb_4bit_compute_dtype` select) with the adapter `[model] adapter` names, tokenizes
    /// its data (printing what was skipped, truncated or packed; preference pairs with `[dpo]`), and adds the
    /// callbacks of `[callbacks]`. Resume with
    /// `train(config.training.resume_checkpoint()?.as_deref())`.
    pub fn from_run_config(config: &RunConfig) -> Result<Self> {
        // Everything cheap first (tokenizer, chat template, data, the run against its data and the model's config,
        // output folder, resume checkpoint), so a mistake is reported in seconds, not after loading the weights.
        let args = &config.training;
        let model_name = &config.model.name_or_path;
        let revision = config.model.revision.as_deref();
        // Training needs one to read the data.
        let tokenizer =
            load_tokenizer(model_name, revision)?.ok_or_else(|| no_tokenizer(model_name))?;
        let task = Data::read(config, &tokenizer)?;
        let facts = match &task {
            Data::Supervised(train, eval, _) => DataFacts::supervised(train, eval),
            Data::Preference(_, train, eval, _) => DataFacts::preference(train, eval),
        };
        check_before_loading(config, &facts)?;
        let resume = args.resume_checkpoint()?;
        let checkpoint = match resume {
            Some(ckpt) => {
                let manifest = verify_checkpoint_files(&ckpt)?;
                Some((ckpt, manifest))
            }
            None => None,
        };
        let lock = prepare_output_dir(args, Path::new(&args.output_dir), checkpoint.is_some())?;
        for note in task.notes() {
            eprintln!("{note}");
        }
        let device = args.device()?;
        let quant_compute = config.quant_compute_dtype().map(|d| d.dtype());
        let precision = Precision::from_flags(args.bf16, args.fp16, quant_compute, &device)?;
        let options = LoadOptions {
            quantization: config.quant_config()?,
            compute_dtype: precision.compute_dtype,
        };
        // A memory snapshot records from before the load, so the weights are in it.
        let recording = args
            .memory_snapshot
            .then(|| start_memory_snapshot(&device, args))
            .transpose()?;
        let started = std::time::Instant::now();
        let loaded = load_model(model_name, revision, &options)?;
        // Nothing before the load holds much, so the process' peak so far is the load's.
        let peak = process_memory()
            .peak_rss
            .map(|b| format!("; peak resident while loading {}", human_bytes(b)))
            .unwrap_or_default();
        eprintln!(
            "loaded {} ({} of weights) in {:.1} s{peak}",
            loaded.source,
            human_bytes(loaded.model.weight_bytes() as u64),
            started.elapsed().as_secs_f64()
        );
        let mut model = loaded.model.to_device(&device)?;
        if let Some(dir) = &config.model.adapter {
            load_adapter(&mut model, dir, ADAPTER)?;
            eprintln!("continuing adapter {}", dir.display());
        }
        let mut trainer = match task {
            Data::Supervised(train, eval, _) => {
                Trainer::new(model, args.clone(), &config.lora, train, eval)?
            }
            Data::Preference(dpo, train, eval, _) => {
                Trainer::new_dpo(model, args.clone(), &config.lora, *dpo, train, eval)?
            }
        };
        trainer.set_prepared(Prepared {
            lock,
            checkpoint,
            recording,
        });
        trainer.set_base_model_name(model_name);
        trainer.set_run_config(config.resolved.clone());
        let callbacks = &config.callbacks;
        if let Some(patience) = callbacks.early_stopping_patience {
            trainer.add_callback(Box::new(EarlyStoppingCallback::new(
                patience,
                callbacks.early_stopping_threshold,
            )));
        }
        if callbacks.memory_monitor {
            trainer.add_callback(Box::new(
                MemoryMonitorCallback::new(callbacks.memory_warn_fraction)
                    .on_device(trainer.model.device()),
            ));
        }
        Ok(trainer)
    }
}
