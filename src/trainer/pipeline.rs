//! From a run config to a ready `Trainer`: the device and compute dtype, the model (quantized on load), the
//! tokenized data, and the callbacks the config asks for — what `qlora train` does before training.

use super::callbacks::{EarlyStoppingCallback, MemoryMonitorCallback};
use super::config::RunConfig;
use super::run::Trainer;
use crate::data::Dataset;
use crate::error::Result;
use crate::loading::{load_model, LoadOptions};
use crate::precision::Precision;

impl Trainer {
    /// A trainer for `config`: loads its model on the device `[training]` selects (computing in the dtype its
    /// `bf16`/`fp16` flags and `bnb_4bit_compute_dtype` select), tokenizes its data (printing what was skipped,
    /// truncated or packed), and adds the callbacks of `[callbacks]`. Resume with
    /// `train(config.training.resume_checkpoint()?.as_deref())`.
    pub fn from_run_config(config: &RunConfig) -> Result<Self> {
        let args = &config.training;
        let device = args.device();
        let quant_compute = config.quant_compute_dtype().map(|d| d.dtype());
        let precision = Precision::from_flags(args.bf16, args.fp16, quant_compute, &device)?;
        let options = LoadOptions {
            quantization: config.quant_config()?,
            compute_dtype: precision.compute_dtype,
        };
        let model_name = &config.model.name_or_path;
        let loaded = load_model(model_name, config.model.revision.as_deref(), &options)?;
        let tokenizer = loaded.tokenizer()?;
        let data = &config.data;
        let (train, eval) = Dataset::train_and_eval(tokenizer, data)?;
        // Each file's skipped lines and truncation (a held-out split counts with its file), then the sizes.
        let name =
            |f: Option<&std::path::PathBuf>| f.map(|f| f.display().to_string()).unwrap_or_default();
        let mut notes = match &data.eval_file {
            Some(file) => {
                let mut notes = train.file_notes(
                    &name(data.train_file.as_ref()),
                    train.truncated,
                    data.max_length,
                );
                notes.extend(eval.file_notes(&name(Some(file)), eval.truncated, data.max_length));
                notes
            }
            None => {
                let truncated = train.truncated + eval.truncated;
                train.file_notes(&name(data.train_file.as_ref()), truncated, data.max_length)
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
        for note in notes {
            eprintln!("{note}");
        }
        let model = loaded.model.to_device(&device)?;
        let mut trainer = Trainer::new(model, args.clone(), &config.lora, train, eval)?;
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
                MemoryMonitorCallback::new(callbacks.memory_warn_fraction).on_device(&device),
            ));
        }
        Ok(trainer)
    }
}
