// Random numbers on the device from `src/rng.rs`'s generator. LoRA dropout, bit-identical to
// `ops::low_rank_linear::dropout_mask` on the CPU: element i is kept when `uniform(seed, i) < keep`, and a kept
// element is scaled by `(float)(1 / keep)` (then rounded to the dtype).
#include "common.cuh"

// The scale of a kept element, `(float)(1 / keep)` rounded to T, as a float.
template <typename T> __device__ __forceinline__ float kept_scale(double keep) {
    return to_float(from_float<T>((float)(1.0 / keep)));
}

// The mask values themselves.
template <typename T> __device__ void mask(u64 seed, double keep, u64 n, T *out) {
    const T kept = from_float<T>((float)(1.0 / keep));
    const T dropped = from_float<T>(0.0f);
    FOR_EACH(i, n) { out[i] = uniform(seed, i) < keep ? kept : dropped; }
}

// `x ⊙ mask` without materializing the mask (the product rounds as `x * mask` does in T).
template <typename T> __device__ void apply(u64 seed, double keep, u64 n, const T *x, T *out) {
    const float kept = kept_scale<T>(keep);
    FOR_EACH(i, n) { out[i] = uniform(seed, i) < keep ? from_float<T>(to_float(x[i]) * kept) : from_float<T>(0.0f); }
}

#define MASK(T) (u64 seed, double keep, u64 n, T *out)
// `apply` and `accumulate`: an input and an output.
#define MASKED(T) (u64 seed, double keep, u64 n, const T *x, T *out)

FOR_FLOAT_TYPES(dropout_mask, mask, MASK, (seed, keep, n, out))
FOR_FLOAT_TYPES(dropout_apply, apply, MASKED, (seed, keep, n, x, out))

// `out += x ⊙ mask`: a dropped-out gradient added into another (the LoRA branch's input gradient into the base's).
template <typename T> __device__ void accumulate(u64 seed, double keep, u64 n, const T *x, T *out) {
    const float kept = kept_scale<T>(keep);
    FOR_EACH(i, n) {
        if (uniform(seed, i) < keep) {
            out[i] = from_float<T>(to_float(out[i]) + to_float(from_float<T>(to_float(x[i]) * kept)));
        }
    }
}

FOR_FLOAT_TYPES(dropout_accumulate, accumulate, MASKED, (seed, keep, n, x, out))

// NEFTune's noise (`trainer::neftune`): `(float)((2 · uniform(seed, i) − 1) · magnitude)`, in double as the host
// computes it, so the noise is the same on either device.
extern "C" __global__ void uniform_noise(u64 seed, double magnitude, u64 n, float *out) {
    FOR_EACH(i, n) { out[i] = (float)((2.0 * uniform(seed, i) - 1.0) * magnitude); }
}
