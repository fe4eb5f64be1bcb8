// 4-bit (NF4/FP4) dequantization in one kernel: `code[nibble] · absmax` in float32, rounded to the output dtype —
// the CPU kernel's arithmetic operation for operation (`quant::cpu::dequantize_4bit`), so the result is
// bit-identical. With double quantization the block's absmax is first rebuilt as `map[c8] · absmax2 + offset`.
// Each thread writes the two elements of one packed byte (high nibble first); an odd count ends in a half byte.
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
