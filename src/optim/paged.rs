//! "Paged" optimizers (`paged_adamw_8bit`, `paged_adamw_32bit`).
//!
//! bitsandbytes allocates the state of large tensors (≥ 1e5 elements) in CUDA managed memory so the driver can
//! evict it to host RAM under memory pressure, and prefetches each parameter's pages before its update. Here every
//! optimizer keeps its state in host memory and brings one parameter's values and gradient in for its update (one
//! fused pass), then writes the parameter back — explicit host staging, the fallback bitsandbytes uses where
//! managed memory is missing. The numbers are therefore identical to the non-paged optimizers, on CPU as on any
//! device; `is_paged` only records what the user asked for (and is saved with the state).

/// Tensors smaller than this are never paged by bitsandbytes (their state is allocated normally).
pub const PAGED_MIN_ELEMENTS: usize = 100_000;
