// 4-bit (NF4/FP4) dequantization in one kernel: `code[nibble] · absmax` in float32, rounded to the output dtype —
// the CPU kernel's arithmetic operation for operation (`quant::cpu::dequantize_4bit`), so the result is
// bit-identical. With double quantization the block's absmax is first rebuilt as `map[c8] · absmax2 + offset`.
// Each thread writes the two elements of one packed byte (high nibble first); an odd count ends in a half byte.
//
// And the other way, 4-bit quantization (`quant_4bit`): the CPU kernel's (`quant::cpu::quantize_4bit`) arithmetic
// too, one thread a block, so the codes and absmax are its bytes.
#include "common.cuh"

template <typename T, bool Nested>
__device__ void dequant_4bit(const uint8_t *packed, const float *code, const float *absmax,
                             const uint8_t *nested_codes, const float *nested_map, float offset, u64 blocksize,
                             u64 nested_blocksize, u64 n, T *out) {
    FOR_EACH(i, (n + 1) / 2) {
        const u64 e = 2 * i;
        const u64 block = e / blocksize; // blocksizes are even: both elements share the block
        float scale;
        if (Nested) {
            scale = __fadd_rn(__fmul_rn(nested_map[nested_codes[block]], absmax[block / nested_blocksize]), offset);
        } else {
            scale = absmax[block];
        }
        const uint8_t byte = packed[i];
        out[e] = from_float<T>(__fmul_rn(code[byte >> 4], scale));
        if (e + 1 < n) {
            out[e + 1] = from_float<T>(__fmul_rn(code[byte & 15], scale));
        }
    }
}

#define DEQUANT_PLAIN(T) (const uint8_t *packed, const float *code, const float *absmax, u64 blocksize, u64 n, T *out)
#define DEQUANT_NESTED(T)                                                                                      \
    (const uint8_t *packed, const float *code, const float *absmax, const uint8_t *nested_codes,               \
     const float *nested_map, float offset, u64 blocksize, u64 nested_blocksize, u64 n, T *out)

template <typename T>
__device__ void plain(const uint8_t *packed, const float *code, const float *absmax, u64 blocksize, u64 n, T *out) {
    dequant_4bit<T, false>(packed, code, absmax, nullptr, nullptr, 0.0f, blocksize, 1, n, out);
}

template <typename T>
__device__ void nested(const uint8_t *packed, const float *code, const float *absmax, const uint8_t *nested_codes,
                       const float *nested_map, float offset, u64 blocksize, u64 nested_blocksize, u64 n, T *out) {
    dequant_4bit<T, true>(packed, code, absmax, nested_codes, nested_map, offset, blocksize, nested_blocksize, n,
                          out);
}

FOR_FLOAT_TYPES(dequant_4bit_plain, plain, DEQUANT_PLAIN, (packed, code, absmax, blocksize, n, out))
FOR_FLOAT_TYPES(dequant_4bit_nested, nested, DEQUANT_NESTED,
                (packed, code, absmax, nested_codes, nested_map, offset, blocksize, nested_blocksize, n, out))

// Blocks of `n` values to packed 4-bit codes and float32 absmax, one thread a block, as `quant::cpu::quantize_4bit`:
// - absmax = max |x| (exact in any order);
// - bitsandbytes' CUDA arithmetic (`cpu_scaling` 0): every value, and the zero padding of an odd count, times
//   1 / absmax (an all-zero block: 0 · inf = NaN, which takes bucket 0); its CPU backend's (`cpu_scaling` 1):
//   absmax clamped to 1e-38, a partial last block divided by it (its padding left 0), a whole one times 1 / it;
// - code = remap[the number of `thresholds` below the scaled value] (strict `>`), or with `sign_magnitude` the
//   number below |value|, its sign in bit 3.
// A non-finite value leaves the block unwritten and the least such index in `bad`.
template <typename T>
__device__ void quant_4bit(const T *x, const float *thresholds, const uint8_t *remap, int n_thresholds,
                           int sign_magnitude, int cpu_scaling, u64 blocksize, u64 n, uint8_t *packed, float *absmax,
                           long long *bad) {
    FOR_EACH(b, (n + blocksize - 1) / blocksize) {
        const u64 start = b * blocksize;
        const u64 len = n - start < blocksize ? n - start : blocksize;
        float amax = 0.0f;
        bool finite = true;
        for (u64 i = 0; i < len && finite; i++) {
            const float v = to_float(x[start + i]);
            if (!isfinite(v)) {
                atomicMin(bad, (long long)(start + i));
                finite = false;
            }
            amax = fmaxf(amax, fabsf(v));
        }
        if (!finite) continue;
        absmax[b] = amax;
        const float denom = cpu_scaling ? fmaxf(amax, 1e-38f) : amax;
        const bool divide = cpu_scaling && len < blocksize;
        const float inv = __fdiv_rn(1.0f, denom);
        for (u64 i = 0; i < len; i += 2) {
            uint8_t pair[2];
            for (int k = 0; k < 2; k++) {
                const u64 e = i + k;
                const float v = e < len ? to_float(x[start + e]) : 0.0f;
                const float s = divide ? (e < len ? __fdiv_rn(v, denom) : 0.0f) : __fmul_rn(v, inv);
                const float m = sign_magnitude ? fabsf(s) : s;
                int count = 0;
                for (int t = 0; t < n_thresholds; t++) count += m > thresholds[t];
                pair[k] = remap[count] | (sign_magnitude && s < 0.0f ? 8 : 0);
            }
            packed[(start + i) / 2] = (uint8_t)((pair[0] << 4) | pair[1]);
        }
    }
}

#define QUANT_PARAMS(T)                                                                                        \
    (const T *x, const float *thresholds, const uint8_t *remap, int n_thresholds, int sign_magnitude,           \
     int cpu_scaling, u64 blocksize, u64 n, uint8_t *packed, float *absmax, long long *bad)
FOR_FLOAT_TYPES(quant_4bit, quant_4bit, QUANT_PARAMS,
                (x, thresholds, remap, n_thresholds, sign_magnitude, cpu_scaling, blocksize, n, packed, absmax, bad))
