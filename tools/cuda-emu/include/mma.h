// Warp matrix multiply-accumulate (`nvcuda::wmma`) for the emulated device: the m16n16k16 shape with __half or
// __nv_bfloat16 inputs and float accumulators, the shapes and types tensor-core kernels use for training.
//
// Which lane holds which element of a fragment is unspecified in CUDA, and code may only treat a fragment's
// elements uniformly (fill, scale, convert). Here each fragment kind spreads its 256 elements over the 32 lanes in
// its own scrambled order, so code that assumes a layout gets wrong numbers instead of working by accident. The
// pointers must be 256-bit aligned and `ldm` a multiple of 16 bytes, as the CUDA documentation requires; a kernel
// that breaks either stops with its name.
//
// The fast mode's build (CUEMU_FAST, for CUDA_EMU_FAST=1) has its own variant, below.
#pragma once

#include "emu_defs.h"

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

namespace detail {
constexpr int TILE = 16;
constexpr int PER_LANE = TILE * TILE / 32;

// The kind of a fragment: 0 = matrix_a, 1 = matrix_b, 2 = accumulator (each gets its own element order).
template <typename Use> struct kind;
template <> struct kind<matrix_a> { static constexpr unsigned value = 0; };
template <> struct kind<matrix_b> { static constexpr unsigned value = 1; };
template <> struct kind<accumulator> { static constexpr unsigned value = 2; };

// The position (row · 16 + column) of element `i` of `lane` in a fragment of kind `k`: an affine bijection of
// [0, 256) with an odd multiplier, different per kind.
__attribute__((no_sanitize("thread"), always_inline)) __device__ inline unsigned position(unsigned k, unsigned lane, unsigned i) {
    const unsigned multiplier = k == 0 ? 97u : k == 1 ? 181u : 59u;
    const unsigned shift = k == 0 ? 13u : k == 1 ? 202u : 111u;
    return (multiplier * (lane * PER_LANE + i) + shift) & 255u;
}

__device__ inline unsigned lane() { return threadIdx.x & 31u; }

// The alignment and leading dimension CUDA requires of a WMMA load or store.
__device__ inline void check(const void *p, unsigned ldm, unsigned element_bytes, bool load) {
    if ((uintptr_t)p % 32 != 0)
        cuemu_trap(load ? "wmma::load_matrix_sync: pointer not 256-bit aligned"
                        : "wmma::store_matrix_sync: pointer not 256-bit aligned");
    if ((ldm * element_bytes) % 16 != 0)
        cuemu_trap(load ? "wmma::load_matrix_sync: ldm is not a multiple of 16 bytes"
                        : "wmma::store_matrix_sync: ldm is not a multiple of 16 bytes");
}

// Offset of element (row, col) of a 16x16 tile stored with leading dimension `ldm`.
__device__ inline size_t offset(unsigned row, unsigned col, unsigned ldm, bool row_major_storage) {
    return row_major_storage ? (size_t)row * ldm + col : (size_t)col * ldm + row;
}

template <typename T> __attribute__((no_sanitize("thread"), always_inline)) __device__ inline float widen(T v) {
    return (float)v;
}
template <> __attribute__((no_sanitize("thread"), always_inline)) __device__ inline float widen<__half>(__half v) {
    return __half2float(v);
}
template <>
__attribute__((no_sanitize("thread"), always_inline)) __device__ inline float widen<__nv_bfloat16>(__nv_bfloat16 v) {
    const unsigned bits = (unsigned)__nv_bfloat16_raw(v).x << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}
} // namespace detail

#ifdef CUEMU_FAST
// The fast variant: a fragment holds its whole 16 × 16 tile (`num_elements` = 256, the logical matrix in row-major
// order: A[m][k], B[k][n], C[m][n]) and lane 0 does the warp's WMMA work alone — fills, loads, products, stores —
// at its place in the program, while the other lanes pass and their fragments stay unused. No lane waits for
// another, so a tensor-core step costs no meeting of the warp's fibers. Exact for kernels the race-check mode
// passes (a WMMA step's arguments are the same in every lane; nothing a WMMA load reads is written, and nothing a
// WMMA store writes is read, by another lane without a barrier between), with the products summed as in the other
// builds. Element-wise code that treats a fragment's elements uniformly works as on a GPU; code that assumes a
// layout gets wrong numbers here too.
template <typename Use, int M, int N, int K, typename T, typename Layout = void> class fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulated device has WMMA m16n16k16 only");

  public:
    using element_type = T;
    enum { num_elements = detail::TILE * detail::TILE };
    T x[num_elements];
};

namespace detail {
// Whether the running lane does the warp's WMMA work.
__device__ inline bool leads() { return lane() == 0; }

// Element (row, col) of a tile at `p`, for every row and column, into `tile` (row-major).
template <typename T>
__device__ inline void load_tile(T *tile, const T *p, unsigned ldm, bool row_major_storage) {
    for (unsigned row = 0; row < TILE; ++row)
        for (unsigned col = 0; col < TILE; ++col) tile[row * TILE + col] = p[offset(row, col, ldm, row_major_storage)];
}
} // namespace detail

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
__device__ inline void fill_fragment(fragment<Use, M, N, K, T, Layout> &f, const V &v) {
    if (!detail::leads()) return;
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

template <typename Use, typename T, typename Layout>
__device__ inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout> &f, const T *p, unsigned ldm) {
    static_assert(sizeof(T) == 2, "WMMA inputs are __half or __nv_bfloat16 on the emulated device");
    detail::check(p, ldm, sizeof(T), true);
    if (detail::leads()) detail::load_tile(f.x, p, ldm, std::is_same<Layout, row_major>::value);
}

template <typename T>
__device__ inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T> &f, const T *p, unsigned ldm,
                                        layout_t layout) {
    detail::check(p, ldm, sizeof(T), true);
    if (detail::leads()) detail::load_tile(f.x, p, ldm, layout == mem_row_major);
}

template <typename T>
__device__ inline void store_matrix_sync(T *p, const fragment<accumulator, 16, 16, 16, T> &f, unsigned ldm,
                                         layout_t layout) {
    detail::check(p, ldm, sizeof(T), false);
    if (!detail::leads()) return;
    for (unsigned row = 0; row < 16; ++row)
        for (unsigned col = 0; col < 16; ++col)
            p[detail::offset(row, col, ldm, layout == mem_row_major)] = f.x[row * 16 + col];
}

// D = A · B + C in float32, each element summed in k order (as the other builds' `mma_product`); `d` may be `c`:
// a row of C is read whole before the row of D is written.
template <typename TA, typename LA, typename TB, typename LB>
__device__ inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                                const fragment<matrix_a, 16, 16, 16, TA, LA> &a,
                                const fragment<matrix_b, 16, 16, 16, TB, LB> &b,
                                const fragment<accumulator, 16, 16, 16, float> &c) {
    if (!detail::leads()) return;
    float wide_b[256];
    for (unsigned i = 0; i < 256; ++i) wide_b[i] = detail::widen(b.x[i]);
    for (unsigned r = 0; r < 16; ++r) {
        float acc[16];  // unrolled, so that the row stays in registers
#pragma GCC unroll 16
        for (unsigned col = 0; col < 16; ++col) acc[col] = c.x[r * 16 + col];
#pragma GCC unroll 16
        for (unsigned kk = 0; kk < 16; ++kk) {
            const float x = detail::widen(a.x[r * 16 + kk]);
#pragma GCC unroll 16
            for (unsigned col = 0; col < 16; ++col) acc[col] += x * wide_b[kk * 16 + col];
        }
        for (unsigned col = 0; col < 16; ++col) d.x[r * 16 + col] = acc[col];
    }
}
#else
template <typename Use, int M, int N, int K, typename T, typename Layout = void> class fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulated device has WMMA m16n16k16 only");

  public:
    using element_type = T;
    enum { num_elements = detail::PER_LANE };
    T x[num_elements];
};

template <typename Use, int M, int N, int K, typename T, typename Layout, typename V>
__device__ inline void fill_fragment(fragment<Use, M, N, K, T, Layout> &f, const V &v) {
    for (int i = 0; i < f.num_elements; ++i) f.x[i] = v;
}

// matrix_a / matrix_b: the layout is the fragment's. A's element (row m, column k); B's element (row k, column n).
template <typename Use, typename T, typename Layout>
__device__ inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, Layout> &f, const T *p, unsigned ldm) {
    static_assert(sizeof(T) == 2, "WMMA inputs are __half or __nv_bfloat16 on the emulated device");
    detail::check(p, ldm, sizeof(T), true);
    const unsigned k = detail::kind<Use>::value, lane = detail::lane();
    for (unsigned i = 0; i < detail::PER_LANE; ++i) {
        const unsigned pos = detail::position(k, lane, i);
        f.x[i] = p[detail::offset(pos / 16, pos % 16, ldm, std::is_same<Layout, row_major>::value)];
    }
}

template <typename T>
__device__ inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, T> &f, const T *p, unsigned ldm,
                                        layout_t layout) {
    detail::check(p, ldm, sizeof(T), true);
    const unsigned lane = detail::lane();
    for (unsigned i = 0; i < detail::PER_LANE; ++i) {
        const unsigned pos = detail::position(2, lane, i);
        f.x[i] = p[detail::offset(pos / 16, pos % 16, ldm, layout == mem_row_major)];
    }
}

template <typename T>
__device__ inline void store_matrix_sync(T *p, const fragment<accumulator, 16, 16, 16, T> &f, unsigned ldm,
                                         layout_t layout) {
    detail::check(p, ldm, sizeof(T), false);
    const unsigned lane = detail::lane();
    for (unsigned i = 0; i < detail::PER_LANE; ++i) {
        const unsigned pos = detail::position(2, lane, i);
        p[detail::offset(pos / 16, pos % 16, ldm, layout == mem_row_major)] = f.x[i];
    }
}

namespace detail {
// The two halves of `mma_sync` around the warp's meeting. They touch only the warp's scratch and the fragments,
// the emulator's bookkeeping rather than device memory, so they are left out of the kernels' access
// instrumentation (whose calls would otherwise be most of a tensor-core kernel's time).
//
// The scratch holds A, B and C (row-major 16x16 floats each), then D, then a flag: whether D is computed yet.

// Lays this lane's elements of A, B and C out in the warp's scratch and marks D as not yet computed (every lane
// does, before the meeting; the first lane after it computes D).
template <typename TA, typename TB>
__attribute__((no_sanitize("thread"))) __device__ inline void mma_scatter(float *scratch, const TA *a, const TB *b,
                                                                          const float *c, unsigned lane) {
    for (unsigned i = 0; i < PER_LANE; ++i) {
        scratch[position(0, lane, i)] = widen(a[i]);
        scratch[256 + position(1, lane, i)] = widen(b[i]);
        scratch[512 + position(2, lane, i)] = c[i];
    }
    scratch[1024] = 0.0f;
}

// D = A · B + C for the whole tile, once per warp (the first lane to need it), each element summed in k order:
// the rows' columns side by side, so the compiler multiplies a row's 16 columns as vectors.
__attribute__((no_sanitize("thread"))) __device__ inline void mma_product(float *scratch) {
    const float *sa = scratch, *sb = scratch + 256, *sc = scratch + 512;
    float *sd = scratch + 768;
    for (unsigned r = 0; r < 16; ++r) {
        float acc[16];  // unrolled, so that the row stays in registers
#pragma GCC unroll 16
        for (unsigned col = 0; col < 16; ++col) acc[col] = sc[r * 16 + col];
#pragma GCC unroll 16
        for (unsigned kk = 0; kk < 16; ++kk) {
            const float x = sa[r * 16 + kk];
#pragma GCC unroll 16
            for (unsigned col = 0; col < 16; ++col) acc[col] += x * sb[kk * 16 + col];
        }
        for (unsigned col = 0; col < 16; ++col) sd[r * 16 + col] = acc[col];
    }
    scratch[1024] = 1.0f;
}

// This lane's elements of D = A · B + C, computed by the first lane of the warp to get here.
__attribute__((no_sanitize("thread"))) __device__ inline void mma_gather(float *d, float *scratch, unsigned lane) {
    if (scratch[1024] == 0.0f) mma_product(scratch);
    for (unsigned i = 0; i < PER_LANE; ++i) d[i] = scratch[768 + position(2, lane, i)];
}
} // namespace detail

// D = A · B + C in float32, the products summed in k order. A warp-collective step: every lane lays its elements
// of A, B and C out in the warp's scratch, the warp meets, the first lane to run on computes the tile's D, and each
// lane takes its own elements of it.
template <typename TA, typename LA, typename TB, typename LB>
__device__ inline void mma_sync(fragment<accumulator, 16, 16, 16, float> &d,
                                const fragment<matrix_a, 16, 16, 16, TA, LA> &a,
                                const fragment<matrix_b, 16, 16, 16, TB, LB> &b,
                                const fragment<accumulator, 16, 16, 16, float> &c) {
    float *scratch = static_cast<float *>(cuemu_warp_scratch());
    const unsigned lane = detail::lane();
    detail::mma_scatter(scratch, a.x, b.x, c.x, lane);
    cuemu_syncwarp(0xffffffffu);
    detail::mma_gather(d.x, scratch, lane);
}

#endif

} // namespace wmma
} // namespace nvcuda
