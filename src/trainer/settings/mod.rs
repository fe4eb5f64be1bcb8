//! What a run asks for, read and checked before anything loads: [`args::TrainingArguments`] (`[training]`), the
//! TOML run config ([`config::RunConfig`]: its sections, `--set` overrides, each section read by `sections`, which
//! names an unknown key's closest valid one), the training methods' own sections ([`dpo::DpoConfig`], [`grpo::GrpoConfig`]), FSDP's options
//! ([`fsdp::FsdpConfig`]), and
//! `preflight`: the settings against the tokenized data (`best_model`: the metric that picks the best checkpoint) and the file system before the weights load. The bottom
//! layer of the trainer: it imports nothing else of it.

pub mod args;
mod best_model;
pub mod config;
pub mod dpo;
pub mod fsdp;
pub mod grpo;
mod overrides;
pub(crate) mod preflight;
pub(crate) mod sections;
