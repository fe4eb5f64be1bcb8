// Kernels for the emulator's own tests (selftest.cpp): correct ones whose results the test checks, and ones with
// the bugs the emulator must catch, each of which must fail naming the kernel.
#include <mma.h>
#include <stdint.h>

using namespace nvcuda;

// y = a·x + y.
extern "C" __global__ void saxpy(const float *x, float *y, float a, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}

// Reads one element past the end of `x` (the last thread's `i + 1`).
extern "C" __global__ void off_by_one_read(const float *x, float *y, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i + 1];
}

// Writes one element past the end of `y`.
extern "C" __global__ void off_by_one_write(const float *x, float *y, unsigned n) {
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i <= n) y[i] = 2.0f * x[i < n ? i : 0];
}

// The sum of each block's 256 values, by halving in shared memory.
template <bool Synchronized> __device__ void block_sum(const float *x, float *sums) {
    __shared__ float s[256];
    const unsigned t = threadIdx.x;
    s[t] = x[blockIdx.x * 256 + t];
    __syncthreads();
    for (unsigned half = 128; half > 0; half /= 2) {
        if (t < half) s[t] += s[t + half];
        if (Synchronized) __syncthreads();  // without it, a thread reads a neighbour's partial sum of this round
    }
    if (t == 0) sums[blockIdx.x] = s[0];
}
extern "C" __global__ void reduce_synchronized(const float *x, float *sums) { block_sum<true>(x, sums); }
extern "C" __global__ void reduce_missing_syncthreads(const float *x, float *sums) { block_sum<false>(x, sums); }

// The sum of each warp's values by shuffles, and the warp's ballot of positive values.
extern "C" __global__ void warp_sums(const float *x, float *sums, unsigned *ballots) {
    float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    const unsigned positive = __ballot_sync(0xffffffffu, v > 0.0f);
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (threadIdx.x % 32 == 0) {
        sums[(blockIdx.x * blockDim.x + threadIdx.x) / 32] = v;
        ballots[(blockIdx.x * blockDim.x + threadIdx.x) / 32] = positive;
    }
}

// A `__syncthreads` only half of a warp reaches: the other half waits for it in a shuffle, forever.
extern "C" __global__ void divergent_barrier(float *y) {
    float v = (float)threadIdx.x;
    if (threadIdx.x < 16) __syncthreads();
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    y[threadIdx.x] = v;
}

// Uses 100 KiB of dynamic shared memory (needs the opt-in attribute).
extern "C" __global__ void big_shared(float *y) {
    extern __shared__ float buffer[];
    buffer[threadIdx.x] = (float)threadIdx.x;
    __syncthreads();
    y[threadIdx.x] = buffer[blockDim.x - 1 - threadIdx.x];
}

// Writes past its dynamic shared memory.
extern "C" __global__ void shared_overflow(float *y, unsigned n) {
    extern __shared__ float buffer[];
    buffer[threadIdx.x + n] = 1.0f;
    y[threadIdx.x] = 0.0f;
}

// C = A · B for one 16×16×16 tile, bf16 inputs, float result; one warp.
extern "C" __global__ void wmma_tile(const __nv_bfloat16 *a, const __nv_bfloat16 *b, float *c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= 2.0f;  // layout-agnostic: allowed
    wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

// Assumes which lane holds which accumulator element (a layout CUDA does not promise): writes element i of lane L
// to row L / 2, column (L % 2) · 8 + i.
extern "C" __global__ void wmma_layout_assumed(const __nv_bfloat16 *a, const __nv_bfloat16 *b, float *c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    const unsigned lane = threadIdx.x % 32;
    for (int i = 0; i < acc.num_elements; ++i) c[(lane / 2) * 16 + (lane % 2) * 8 + i] = 2.0f * acc.x[i];
}

// A WMMA load from a pointer that is not 256-bit aligned.
extern "C" __global__ void wmma_misaligned(const __nv_bfloat16 *a, float *c) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
    wmma::load_matrix_sync(fa, a + 1, 16);
    c[threadIdx.x] = 0.0f;
}

// Reads through a pointer stored in device memory (so the launch cannot check it): `table[0]` may be freed.
extern "C" __global__ void indirect_read(const float *const *table, float *y) { y[threadIdx.x] = table[0][threadIdx.x]; }
