// Causal grouped-query attention on tensor cores (WMMA, bf16/f16 in, float32 accumulation), FlashAttention-2 style:
// the forward keeps a running maximum and sum per query row over tiles of keys and saves only the row's
// log-sum-exp; the backward recomputes each tile's probabilities from it. Memory is linear in the sequence length.
// The causal mask and the packed-row (segment) mask are computed in the kernels: query row i of a sequence of TQ
// queries sits at position (S − TQ) + i of the S keys and sees keys first..position, where first is 0 or the start
// of its example (`starts`, per batch and position), and with a sliding window W (`window` > 0) at least
// position + 1 − W. With `cap` > 0 the scaled scores are soft-capped, s → cap·tanh(s / cap), before the mask (the
// backward multiplies their gradient by 1 − tanh²). With `has_sinks`, query head h's softmax has one more column
// holding `sinks[h]` (gpt-oss) that has no value: the forward's running maximum and sum start from it, so the saved
// log-sum-exp includes it and the backward, P = exp(s − lse) and Δ = rowsum(dO ⊙ O), needs no change.
//
// Layouts: q, out [B, HQ, TQ, D]; k, v [B, HKV, S, D]; lse, delta [B, HQ, TQ]; HQ a multiple of HKV. Head dims 64
// and 128. Dynamic shared memory: the sizes `fwd_shared_bytes` / `bwd_shared_bytes` in src/ops/attention/cuda.rs.
#include <mma.h>

#include "common.cuh"

using namespace nvcuda;

namespace {

constexpr int WARPS = 4;
constexpr int THREADS = 32 * WARPS;
// Forward: 16 query rows per warp, keys in tiles of 64 (fewer passes of the output through shared memory).
constexpr int FWD_ROWS = 16 * WARPS;
constexpr int FWD_KEYS = 64;
// Backward: 16 keys per warp, queries in tiles of 32.
constexpr int BWD_KEYS = 16 * WARPS;
constexpr int BWD_QUERIES = 32;
// Row strides of the shared tiles that lanes read by row (a lane pair owns a row and reads every other column):
// four floats or eight halves past the tile's width put the rows of a warp's 16 in different banks (two lanes a
// bank at most, where the tile's width would put all 16 in one), and keep WMMA's 16-byte multiple.
constexpr int FWD_S_STRIDE = FWD_KEYS + 4;  // scores, float
constexpr int FWD_P_STRIDE = FWD_KEYS + 8;  // probabilities, T
constexpr int SLAB_STRIDE = 16 + 4;         // a 16 × 16 float product read back by row pairs
constexpr int BWD_S_STRIDE = BWD_QUERIES + 4; // scores and dP, float
constexpr int BWD_P_STRIDE = BWD_QUERIES + 8; // Pᵀ and dSᵀ, T

// The first key position query position `pos` of sequence `b` sees.
__device__ __forceinline__ u64 first_key(const unsigned int *starts, int has_starts, u64 len, u64 b, u64 pos,
                                         u64 window) {
    const u64 start = has_starts ? (u64)starts[b * len + pos] : 0;
    return window > 0 && pos + 1 > window ? max(start, pos + 1 - window) : start;
}

// A scaled score, soft-capped when `cap` > 0.
__device__ __forceinline__ float capped(float x, float cap) { return cap > 0.0f ? cap * tanhf(x / cap) : x; }

template <typename T> using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
template <typename T> using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major>;
template <typename T> using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major>;
template <typename T> using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
using Acc = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Copies ROWS rows of D elements from `src` (row `first` on, of `available` rows) into shared `dst`, zeros past
// the end. Sixteen bytes at a time, every load of a thread issued before its first store (a tile costs one trip to
// memory, not one per element), when `src` is 16-byte aligned, as a tensor of its own is; element by element else.
template <typename T, int D, int ROWS>
__device__ __forceinline__ void load_rows(T *dst, const T *src, u64 first, u64 available) {
    constexpr int PER = 16 / sizeof(T);          // elements in 16 bytes
    constexpr int CHUNKS = ROWS * D / PER;       // 16-byte chunks of the tile
    constexpr int EACH = (CHUNKS + THREADS - 1) / THREADS;
    static_assert(D % PER == 0, "rows of whole 16-byte chunks");
    if (((uintptr_t)src & 15) == 0) {
        uint4 chunk[EACH];
#pragma unroll
        for (int i = 0; i < EACH; ++i) {
            const int c = threadIdx.x + i * THREADS;
            const u64 r = (u64)(c / (D / PER));
            chunk[i] = make_uint4(0u, 0u, 0u, 0u); // all-zero bits: 0.0 in bf16 and f16
            if (c < CHUNKS && first + r < available) {
                chunk[i] = *reinterpret_cast<const uint4 *>(src + (first + r) * D + (c % (D / PER)) * PER);
            }
        }
#pragma unroll
        for (int i = 0; i < EACH; ++i) {
            const int c = threadIdx.x + i * THREADS;
            if (c < CHUNKS) *reinterpret_cast<uint4 *>(dst + c * PER) = chunk[i];
        }
        return;
    }
    for (u64 e = threadIdx.x; e < (u64)ROWS * D; e += THREADS) {
        const u64 r = e / D;
        dst[e] = first + r < available ? src[(first + r) * D + e % D] : from_float<T>(0.0f);
    }
}

} // namespace

template <typename T, int D>
__device__ void attn_fwd(const T *q, const T *k, const T *v, const unsigned int *starts, int has_starts,
                         const float *sinks, int has_sinks, u64 HQ, u64 HKV, u64 TQ, u64 S, float scale, u64 window,
                         float cap, T *out, float *lse) {
    extern __shared__ __align__(128) unsigned char smem[];
    T *sQ = (T *)smem;                  // [FWD_ROWS][D]
    T *sK = sQ + FWD_ROWS * D;          // [FWD_KEYS][D]
    T *sV = sK + FWD_KEYS * D;          // [FWD_KEYS][D]
    float *sS = (float *)(sV + FWD_KEYS * D); // [FWD_ROWS][FWD_S_STRIDE]; a warp's rows also hold its P·V slab
    T *sP = (T *)(sS + FWD_ROWS * FWD_S_STRIDE); // [FWD_ROWS][FWD_P_STRIDE]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u64 b = blockIdx.z, h = blockIdx.y, i0 = (u64)blockIdx.x * FWD_ROWS;
    const u64 hk = h / (HQ / HKV);
    const u64 offset = S - TQ;
    const T *qh = q + (b * HQ + h) * TQ * D;
    const T *kh = k + (b * HKV + hk) * S * D;
    const T *vh = v + (b * HKV + hk) * S * D;
    load_rows<T, D, FWD_ROWS>(sQ, qh, i0, TQ);

    // A lane owns one row (two lanes a row) and the row's columns of its parity.
    const int r = lane / 2, half = lane % 2;
    const u64 row = i0 + warp * 16 + r;
    const bool valid = row < TQ;
    const u64 pos = offset + row;
    const u64 first = valid ? first_key(starts, has_starts, S, b, pos, window) : 0;
    // The sink is a column already seen: probability exp(sink − m) of the sum, nothing of the output.
    float m = has_sinks ? sinks[h] : -INFINITY, l = has_sinks ? 1.0f : 0.0f;
    float acc[D / 2];
#pragma unroll
    for (int c = 0; c < D / 2; ++c) acc[c] = 0.0f;

    const u64 last = min(i0 + FWD_ROWS, TQ) - 1;
    const u64 key_end = offset + last + 1;
    const u64 key_begin = first_key(starts, has_starts, S, b, offset + i0, window) / FWD_KEYS * FWD_KEYS;
    float *sSw = sS + warp * 16 * FWD_S_STRIDE;
    T *sPw = sP + warp * 16 * FWD_P_STRIDE;
    for (u64 j0 = key_begin; j0 < key_end; j0 += FWD_KEYS) {
        __syncthreads(); // every warp is done with the previous tile
        load_rows<T, D, FWD_KEYS>(sK, kh, j0, S);
        load_rows<T, D, FWD_KEYS>(sV, vh, j0, S);
        __syncthreads();
        // Scores of the warp's 16 rows against the tile's keys.
#pragma unroll
        for (int n = 0; n < FWD_KEYS / 16; ++n) {
            Acc c;
            wmma::fill_fragment(c, 0.0f);
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                FragA<T> a;
                FragBT<T> kt;
                wmma::load_matrix_sync(a, sQ + warp * 16 * D + kk * 16, D);
                wmma::load_matrix_sync(kt, sK + n * 16 * D + kk * 16, D);
                wmma::mma_sync(c, a, kt, c);
            }
            wmma::store_matrix_sync(sSw + n * 16, c, FWD_S_STRIDE, wmma::mem_row_major);
        }
        __syncwarp();
        // Online softmax over the lane's half of the row's keys in the tile (the columns of its parity).
        float s[FWD_KEYS / 2];
        float tile_max = -INFINITY;
#pragma unroll
        for (int c = 0; c < FWD_KEYS / 2; ++c) {
            const u64 j = j0 + 2 * c + half;
            const bool visible = valid && j >= first && j <= pos && j < S;
            s[c] = visible ? capped(sSw[r * FWD_S_STRIDE + 2 * c + half] * scale, cap) : -INFINITY;
            tile_max = fmaxf(tile_max, s[c]);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
        const float m_new = fmaxf(m, tile_max);
        const float alpha = m_new == -INFINITY ? 1.0f : expf(m - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int c = 0; c < FWD_KEYS / 2; ++c) {
            const float p = s[c] == -INFINITY ? 0.0f : expf(s[c] - m_new);
            sum += p;
            sPw[r * FWD_P_STRIDE + 2 * c + half] = from_float<T>(p);
        }
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        l = l * alpha + sum;
        m = m_new;
#pragma unroll
        for (int c = 0; c < D / 2; ++c) acc[c] *= alpha;
        __syncwarp();
        // O += P·V, one 16-column slab at a time through the warp's scratch (its score rows, read above).
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
            Acc c;
            wmma::fill_fragment(c, 0.0f);
#pragma unroll
            for (int kk = 0; kk < FWD_KEYS / 16; ++kk) {
                FragA<T> p;
                FragB<T> vb;
                wmma::load_matrix_sync(p, sPw + kk * 16, FWD_P_STRIDE);
                wmma::load_matrix_sync(vb, sV + kk * 16 * D + n * 16, D);
                wmma::mma_sync(c, p, vb, c);
            }
            wmma::store_matrix_sync(sSw, c, SLAB_STRIDE, wmma::mem_row_major);
            __syncwarp();
#pragma unroll
            for (int t = 0; t < 8; ++t) acc[n * 8 + t] += sSw[r * SLAB_STRIDE + half + 2 * t];
            __syncwarp();
        }
    }
    if (valid) {
        T *o = out + ((b * HQ + h) * TQ + row) * D;
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
#pragma unroll
            for (int t = 0; t < 8; ++t) o[n * 16 + half + 2 * t] = from_float<T>(acc[n * 8 + t] * inv);
        }
        if (half == 0) lse[(b * HQ + h) * TQ + row] = m + logf(l);
    }
}

// Δ = rowsum(dO ⊙ O) per query row (float32), for the backward.
template <typename T>
__device__ void attn_delta(const T *dout, const T *out, u64 rows, u64 D, float *delta) {
    FOR_EACH(row, rows) {
        float sum = 0.0f;
        for (u64 c = 0; c < D; ++c) sum += to_float(dout[row * D + c]) * to_float(out[row * D + c]);
        delta[row] = sum;
    }
}

// One block per tile of BWD_KEYS keys of a kv head: for every query head of its group and every tile of queries,
// P = exp(scale·q·kᵀ − lse) again, dV += Pᵀ·dO, dS = P ⊙ (dO·Vᵀ − Δ), dK += scale·dSᵀ·Q (both kept in registers
// for the block's keys), and dQ += scale·dS·K added atomically into float32 `dq` (zeroed by the caller). A launch
// covers the kv heads hk0 … hk0 + gridDim.y − 1, and `dq` holds their query heads only ([B, gridDim.y·G, TQ, D]): a
// long sequence's float32 dQ is then made a few heads at a time.
template <typename T, int D>
__device__ void attn_bwd(const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta,
                         const unsigned int *starts, int has_starts, u64 HQ, u64 HKV, u64 TQ, u64 S, float scale,
                         u64 window, float cap, u64 hk0, float *dq, T *dk, T *dv) {
    extern __shared__ __align__(128) unsigned char smem[];
    T *sK = (T *)smem;                      // [BWD_KEYS][D]
    T *sV = sK + BWD_KEYS * D;              // [BWD_KEYS][D]
    T *sQ = sV + BWD_KEYS * D;              // [BWD_QUERIES][D]
    T *sdO = sQ + BWD_QUERIES * D;          // [BWD_QUERIES][D]
    T *sPt = sdO + BWD_QUERIES * D;          // [BWD_KEYS][BWD_P_STRIDE]
    T *sdSt = sPt + BWD_KEYS * BWD_P_STRIDE; // [BWD_KEYS][BWD_P_STRIDE]
    float *scratch = (float *)(sdSt + BWD_KEYS * BWD_P_STRIDE); // per warp [16][BWD_S_STRIDE]
    float *sL = scratch + WARPS * 16 * BWD_S_STRIDE;            // [BWD_QUERIES]
    float *sDelta = sL + BWD_QUERIES;                           // [BWD_QUERIES]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const u64 b = blockIdx.z, hk = hk0 + blockIdx.y, j0 = (u64)blockIdx.x * BWD_KEYS;
    const u64 G = HQ / HKV, offset = S - TQ, dq_heads = (u64)gridDim.y * G;
    const T *kh = k + (b * HKV + hk) * S * D;
    const T *vh = v + (b * HKV + hk) * S * D;
    load_rows<T, D, BWD_KEYS>(sK, kh, j0, S);
    load_rows<T, D, BWD_KEYS>(sV, vh, j0, S);

    Acc dKf[D / 16], dVf[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
        wmma::fill_fragment(dKf[n], 0.0f);
        wmma::fill_fragment(dVf[n], 0.0f);
    }
    // A lane owns one key row of its warp (two lanes a row) and the tile's queries of its parity.
    const int r = lane / 2, half = lane % 2;
    const u64 j = j0 + warp * 16 + r;
    float *scr = scratch + warp * 16 * BWD_S_STRIDE;
    // Queries before position j0 see none of these keys; with a window, neither do those W or more past the last.
    const u64 query_begin = j0 > offset ? (j0 - offset) / BWD_QUERIES * BWD_QUERIES : 0;
    const u64 last_key = min(j0 + BWD_KEYS, S) - 1;
    const u64 query_end = window == 0                      ? TQ
                          : last_key + window > offset ? min(TQ, last_key + window - offset)
                                                       : 0;

    for (u64 g = 0; g < G; ++g) {
        const u64 h = hk * G + g;
        const T *qh = q + (b * HQ + h) * TQ * D;
        const T *dh = dout + (b * HQ + h) * TQ * D;
        float *dqh = dq + (b * dq_heads + h - hk0 * G) * TQ * D;
        for (u64 i0 = query_begin; i0 < query_end; i0 += BWD_QUERIES) {
            __syncthreads();
            load_rows<T, D, BWD_QUERIES>(sQ, qh, i0, TQ);
            load_rows<T, D, BWD_QUERIES>(sdO, dh, i0, TQ);
            for (int e = threadIdx.x; e < BWD_QUERIES; e += blockDim.x) {
                const bool in = i0 + e < TQ;
                sL[e] = in ? lse[(b * HQ + h) * TQ + i0 + e] : 0.0f;
                sDelta[e] = in ? delta[(b * HQ + h) * TQ + i0 + e] : 0.0f;
            }
            __syncthreads();

            // Sᵀ = K_w·Qᵀ for the warp's 16 keys.
#pragma unroll
            for (int n = 0; n < BWD_QUERIES / 16; ++n) {
                Acc c;
                wmma::fill_fragment(c, 0.0f);
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    FragA<T> a;
                    FragBT<T> qt;
                    wmma::load_matrix_sync(a, sK + warp * 16 * D + kk * 16, D);
                    wmma::load_matrix_sync(qt, sQ + n * 16 * D + kk * 16, D);
                    wmma::mma_sync(c, a, qt, c);
                }
                wmma::store_matrix_sync(scr + n * 16, c, BWD_S_STRIDE, wmma::mem_row_major);
            }
            __syncwarp();
            // Pᵀ, masked, for the lane's half of the queries; with a cap, the cap's derivative 1 − tanh² too.
            float p[BWD_QUERIES / 2], dcap[BWD_QUERIES / 2];
#pragma unroll
            for (int c = 0; c < BWD_QUERIES / 2; ++c) {
                const int qi = 2 * c + half;
                const u64 i = i0 + qi, pos = offset + i;
                const bool visible =
                    i < TQ && j < S && j <= pos && j >= first_key(starts, has_starts, S, b, pos, window);
                const float score = capped(scr[r * BWD_S_STRIDE + qi] * scale, cap);
                const float t = cap > 0.0f ? score / cap : 0.0f;
                dcap[c] = 1.0f - t * t;
                p[c] = visible ? expf(score - sL[qi]) : 0.0f;
                sPt[(warp * 16 + r) * BWD_P_STRIDE + qi] = from_float<T>(p[c]);
            }
            __syncwarp();
            // dV += Pᵀ·dO.
#pragma unroll
            for (int n = 0; n < D / 16; ++n) {
#pragma unroll
                for (int kk = 0; kk < BWD_QUERIES / 16; ++kk) {
                    FragA<T> a;
                    FragB<T> d;
                    wmma::load_matrix_sync(a, sPt + warp * 16 * BWD_P_STRIDE + kk * 16, BWD_P_STRIDE);
                    wmma::load_matrix_sync(d, sdO + kk * 16 * D + n * 16, D);
                    wmma::mma_sync(dVf[n], a, d, dVf[n]);
                }
            }
            // dPᵀ = V_w·dOᵀ.
#pragma unroll
            for (int n = 0; n < BWD_QUERIES / 16; ++n) {
                Acc c;
                wmma::fill_fragment(c, 0.0f);
#pragma unroll
                for (int kk = 0; kk < D / 16; ++kk) {
                    FragA<T> a;
                    FragBT<T> dt;
                    wmma::load_matrix_sync(a, sV + warp * 16 * D + kk * 16, D);
                    wmma::load_matrix_sync(dt, sdO + n * 16 * D + kk * 16, D);
                    wmma::mma_sync(c, a, dt, c);
                }
                wmma::store_matrix_sync(scr + n * 16, c, BWD_S_STRIDE, wmma::mem_row_major);
            }
            __syncwarp();
            // dSᵀ = Pᵀ ⊙ (dPᵀ − Δ) (⊙ (1 − tanh²) through a cap).
#pragma unroll
            for (int c = 0; c < BWD_QUERIES / 2; ++c) {
                const int qi = 2 * c + half;
                const float ds = p[c] * (scr[r * BWD_S_STRIDE + qi] - sDelta[qi]) * dcap[c];
                sdSt[(warp * 16 + r) * BWD_P_STRIDE + qi] = from_float<T>(ds);
            }
            __syncwarp();
            // dK += dSᵀ·Q (scaled at the end).
#pragma unroll
            for (int n = 0; n < D / 16; ++n) {
#pragma unroll
                for (int kk = 0; kk < BWD_QUERIES / 16; ++kk) {
                    FragA<T> a;
                    FragB<T> qb;
                    wmma::load_matrix_sync(a, sdSt + warp * 16 * BWD_P_STRIDE + kk * 16, BWD_P_STRIDE);
                    wmma::load_matrix_sync(qb, sQ + kk * 16 * D + n * 16, D);
                    wmma::mma_sync(dKf[n], a, qb, dKf[n]);
                }
            }
            // dQ += dS·K over the block's keys, each warp for its D / WARPS columns (every warp's dSᵀ rows are in
            // place after the barrier), added into float32 `dq`.
            __syncthreads();
            constexpr int SLABS = D / 16 / WARPS; // 16-column slabs of dQ per warp
#pragma unroll
            for (int mq = 0; mq < BWD_QUERIES / 16; ++mq) {
#pragma unroll
                for (int sl = 0; sl < SLABS; ++sl) {
                    const int n = warp * SLABS + sl;
                    Acc c;
                    wmma::fill_fragment(c, 0.0f);
#pragma unroll
                    for (int kk = 0; kk < BWD_KEYS / 16; ++kk) {
                        FragAT<T> a;
                        FragB<T> kb;
                        wmma::load_matrix_sync(a, sdSt + kk * 16 * BWD_P_STRIDE + mq * 16, BWD_P_STRIDE);
                        wmma::load_matrix_sync(kb, sK + kk * 16 * D + n * 16, D);
                        wmma::mma_sync(c, a, kb, c);
                    }
                    wmma::store_matrix_sync(scr, c, 16, wmma::mem_row_major);
                    __syncwarp();
                    for (int e = lane; e < 256; e += 32) {
                        const u64 i = i0 + mq * 16 + e / 16;
                        if (i < TQ) atomicAdd(&dqh[i * D + n * 16 + e % 16], scr[e] * scale);
                    }
                    __syncwarp();
                }
            }
        }
    }
    // The block's dK and dV rows.
    __syncthreads();
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
        for (int which = 0; which < 2; ++which) {
            wmma::store_matrix_sync(scr, which == 0 ? dKf[n] : dVf[n], 16, wmma::mem_row_major);
            __syncwarp();
            T *dst = which == 0 ? dk : dv;
            const float factor = which == 0 ? scale : 1.0f;
            for (int e = lane; e < 256; e += 32) {
                const u64 key = j0 + warp * 16 + e / 16;
                if (key < S) dst[((b * HKV + hk) * S + key) * D + n * 16 + e % 16] = from_float<T>(scr[e] * factor);
            }
            __syncwarp();
        }
    }
}

#define FWD(T)                                                                                                 \
    (const T *q, const T *k, const T *v, const unsigned int *starts, int has_starts, const float *sinks,       \
     int has_sinks, u64 HQ, u64 HKV, u64 TQ, u64 S, float scale, u64 window, float cap, T *out, float *lse)
#define BWD(T)                                                                                                 \
    (const T *q, const T *k, const T *v, const T *dout, const float *lse, const float *delta,                  \
     const unsigned int *starts, int has_starts, u64 HQ, u64 HKV, u64 TQ, u64 S, float scale, u64 window,      \
     float cap, u64 hk0, float *dq, T *dk, T *dv)
#define DELTA(T) (const T *dout, const T *out, u64 rows, u64 D, float *delta)

#define FOR_HEAD_DIM(T, suffix, D)                                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) attn_fwd_##suffix##_d##D FWD(T) {                   \
        attn_fwd<T, D>(q, k, v, starts, has_starts, sinks, has_sinks, HQ, HKV, TQ, S, scale, window, cap, out, \
                       lse);                                                                                   \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) attn_bwd_##suffix##_d##D BWD(T) {                   \
        attn_bwd<T, D>(q, k, v, dout, lse, delta, starts, has_starts, HQ, HKV, TQ, S, scale, window, cap, hk0, dq, \
                       dk, dv);                                                                                  \
    }

// bfloat16 tensor cores start at compute 8.0: a build for a T4 (CUDA_COMPUTE_CAP=75) has the float16 kernels only.
#if __CUDA_ARCH__ >= 800
FOR_HEAD_DIM(__nv_bfloat16, bf16, 64)
FOR_HEAD_DIM(__nv_bfloat16, bf16, 128)
#endif
FOR_HEAD_DIM(__half, f16, 64)
FOR_HEAD_DIM(__half, f16, 128)

extern "C" __global__ void attn_delta_bf16 DELTA(__nv_bfloat16) { attn_delta(dout, out, rows, D, delta); }
extern "C" __global__ void attn_delta_f16 DELTA(__half) { attn_delta(dout, out, rows, D, delta); }
