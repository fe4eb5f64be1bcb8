//! Integration tests, in one binary so the Candle stack is linked once.

mod bnb_layout;
mod cli;
mod common;
mod quant_golden;
