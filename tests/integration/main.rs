//! Integration tests, in one binary so the Candle stack is linked once.

mod bnb_layout;
mod cli;
mod common;
mod model_cli;
mod model_parity;
mod optim_golden;
mod packing;
mod peft_parity;
mod quant_golden;
mod smollm2_training;
mod trainer;
