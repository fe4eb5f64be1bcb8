// y = x·Wᵀ for a few rows of x (a decoding step) straight from a 4-bit weight's packed codes: each weight is
// decoded where it is used — `code[nibble] · absmax` in float32, the dequantization kernel's value bit for bit —
// so a token reads half a byte per weight instead of a dequantized copy of the whole matrix.
//
// One warp per output feature (a row of W): its lanes stride over the row, keep one float32 sum per row of x, and
// add the lanes' sums by shuffles. x and y are [rows, in] and [rows, out] in T; rows ≤ MAX_ROWS.
#include "common.cuh"

namespace {
constexpr int MAX_ROWS = 8;
}

template <typename T, bool Nested>
__device__ void nf4_matvec(const T *x, const uint8_t *packed, const float *code, const float *absmax,
                           const uint8_t *nested_codes, const float *nested_map, float offset, u64 blocksize,
                           u64 nested_blocksize, u64 rows, u64 out, u64 in, T *y) {
    const u64 warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (u64 o = (u64)blockIdx.x * warps + threadIdx.x / 32; o < out; o += (u64)gridDim.x * warps) {
        float acc[MAX_ROWS];
#pragma unroll
        for (int r = 0; r < MAX_ROWS; ++r) acc[r] = 0.0f;
        for (u64 j = lane; j < in; j += 32) {
            const u64 e = o * in + j, block = e / blocksize;
            float scale;
            if (Nested) {
                scale = __fadd_rn(__fmul_rn(nested_map[nested_codes[block]], absmax[block / nested_blocksize]), offset);
            } else {
                scale = absmax[block];
            }
            const uint8_t byte = packed[e / 2];
            const float w = __fmul_rn(code[(e & 1) ? (byte & 15) : (byte >> 4)], scale);
            for (u64 r = 0; r < rows; ++r) acc[r] += w * to_float(x[r * in + j]);
        }
        for (u64 r = 0; r < rows; ++r) {
            float v = acc[r];
            for (int offset_lanes = 16; offset_lanes > 0; offset_lanes >>= 1) {
                v += __shfl_xor_sync(0xffffffff, v, offset_lanes);
            }
            if (lane == 0) y[r * out + o] = from_float<T>(v);
        }
    }
}

#define MATVEC_PLAIN(T)                                                                                        \
    (const T *x, const uint8_t *packed, const float *code, const float *absmax, u64 blocksize, u64 rows,       \
     u64 out, u64 in, T *y)
#define MATVEC_NESTED(T)                                                                                       \
    (const T *x, const uint8_t *packed, const float *code, const float *absmax, const uint8_t *nested_codes,   \
     const float *nested_map, float offset, u64 blocksize, u64 nested_blocksize, u64 rows, u64 out, u64 in, T *y)

template <typename T>
__device__ void plain(const T *x, const uint8_t *packed, const float *code, const float *absmax, u64 blocksize,
                      u64 rows, u64 out, u64 in, T *y) {
    nf4_matvec<T, false>(x, packed, code, absmax, nullptr, nullptr, 0.0f, blocksize, 1, rows, out, in, y);
}

template <typename T>
__device__ void nested(const T *x, const uint8_t *packed, const float *code, const float *absmax,
                       const uint8_t *nested_codes, const float *nested_map, float offset, u64 blocksize,
                       u64 nested_blocksize, u64 rows, u64 out, u64 in, T *y) {
    nf4_matvec<T, true>(x, packed, code, absmax, nested_codes, nested_map, offset, blocksize, nested_blocksize, rows,
                        out, in, y);
}

FOR_FLOAT_TYPES(nf4_matvec_plain, plain, MATVEC_PLAIN, (x, packed, code, absmax, blocksize, rows, out, in, y))
FOR_FLOAT_TYPES(nf4_matvec_nested, nested, MATVEC_NESTED,
                (x, packed, code, absmax, nested_codes, nested_map, offset, blocksize, nested_blocksize, rows, out,
                 in, y))
