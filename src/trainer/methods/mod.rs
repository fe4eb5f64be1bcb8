//! The training methods, each behind the one interface the loop calls ([`method::Method`]): its items and
//! batches, one accumulation window's forward, loss and backward, its metrics and evaluation, what it keeps in a
//! checkpoint and its setup. Each method is a folder — `supervised` (TRL's `SFTTrainer`), [`dpo`] (TRL's
//! `DPOTrainer`) and [`grpo`] (TRL's `GRPOTrainer`) — and [`from_run_config`] is the one place a run config's method is chosen: a new method is a
//! folder here and a line there (and its section in `settings`, when it has settings of its own).

pub mod dpo;
pub mod grpo;
pub(crate) mod method;
pub(crate) mod supervised;

use method::Method;

use crate::error::Result;
use crate::models::TextTokenizer;
use crate::trainer::settings::config::RunConfig;

/// The method `config` asks for, with its data read and tokenized (and the notes to print about the data): DPO
/// with `[dpo]`, GRPO with `[grpo]`, supervised fine-tuning otherwise.
pub(crate) fn from_run_config(
    config: &RunConfig,
    tokenizer: &TextTokenizer,
) -> Result<(Box<dyn Method>, Vec<String>)> {
    fn boxed<M: Method + 'static>((m, notes): (M, Vec<String>)) -> (Box<dyn Method>, Vec<String>) {
        (Box::new(m), notes)
    }
    Ok(match (&config.dpo, &config.grpo) {
        (Some(dpo), _) => boxed(dpo::Dpo::from_run_config(config, dpo, tokenizer)?),
        (None, Some(grpo)) => boxed(grpo::Grpo::from_run_config(config, grpo, tokenizer)?),
        (None, None) => boxed(supervised::Supervised::from_run_config(config, tokenizer)?),
    })
}
