// Rotary embeddings in Hugging Face's half-split layout, applied while moving rows between the token-major layout
// of a projection ([b, t, h·d]) and the head-major layout of attention ([b, h, t, d]) — or within one layout.
// Forward:  o1 = x1·c1 − x2·s1,  o2 = x2·c2 + x1·s2;  backward (the transpose): o1 = x1·c1 + x2·s2,
// o2 = x2·c2 − x1·s1. Tables are float32 [1 or b, 1, t, d] (one row per position, or per sequence and position);
// without tables the rows are only moved (split or merge heads).
#include "common.cuh"

// Offset of row (batch, head, position) in the token-major or head-major layout.
__device__ __forceinline__ u64 row_offset(bool token_major, u64 b, u64 hd, u64 t, u64 H, u64 T, u64 D) {
    return token_major ? ((b * T + t) * H + hd) * D : ((b * H + hd) * T + t) * D;
}

template <typename T>
__device__ void rope_move(const T *x, const float *cos, const float *sin, int rotate, int per_sequence,
                          int in_token_major, int out_token_major, int transposed, u64 B, u64 H, u64 Tn, u64 D,
                          T *out) {
    const u64 half = D / 2;
    FOR_EACH(i, B * H * Tn * half) {
        const u64 k = i % half;
        const u64 row = i / half; // (b, h, t) in head-major order
        const u64 t = row % Tn, hd = (row / Tn) % H, b = row / (Tn * H);
        const T *xr = x + row_offset(in_token_major, b, hd, t, H, Tn, D);
        T *o = out + row_offset(out_token_major, b, hd, t, H, Tn, D);
        const float x1 = to_float(xr[k]), x2 = to_float(xr[k + half]);
        if (!rotate) {
            o[k] = xr[k];
            o[k + half] = xr[k + half];
            continue;
        }
        const u64 table = ((per_sequence ? b * Tn : 0) + t) * D;
        const float c1 = cos[table + k], c2 = cos[table + k + half];
        const float s1 = sin[table + k], s2 = sin[table + k + half];
        if (transposed) {
            o[k] = from_float<T>(x1 * c1 + x2 * s2);
            o[k + half] = from_float<T>(x2 * c2 - x1 * s1);
        } else {
            o[k] = from_float<T>(x1 * c1 - x2 * s1);
            o[k + half] = from_float<T>(x2 * c2 + x1 * s2);
        }
    }
}

#define MOVE(T)                                                                                                \
    (const T *x, const float *cos, const float *sin, int rotate, int per_sequence, int in_token_major,        \
     int out_token_major, int transposed, u64 B, u64 H, u64 Tn, u64 D, T *out)

FOR_FLOAT_TYPES(rope_move, rope_move, MOVE,
                (x, cos, sin, rotate, per_sequence, in_token_major, out_token_major, transposed, B, H, Tn, D, out))
