//! Counter-based randomness: values are pure functions of (seed, index), so dropout masks and NEFTune noise are
//! reproduced exactly when a step is recomputed (checkpointing) or replayed (resume).

/// SplitMix64 finalizer of `z`.
pub(crate) fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in `[0, 1)` (24 random bits) for element `index` of the stream `seed`.
pub(crate) fn uniform(seed: u64, index: u64) -> f64 {
    (splitmix(seed ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93)) >> 40) as f64 / (1u64 << 24) as f64
}
