// Shared by the kernels: 64-bit element indices (tensors may hold more than 2^32 elements), conversions between
// float and the storage dtypes with round-to-nearest-even (as the CPU path's `half` conversions), and the
// counter-based random numbers of `src/rng.rs`.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef unsigned long long u64;

// Grid-stride loop over [0, n) with a 64-bit index.
#define FOR_EACH(i, n)                                                                                        \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (u64)(n); i += (u64)blockDim.x * gridDim.x)

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// SplitMix64 finalizer (`rng::splitmix`).
__device__ __forceinline__ u64 splitmix(u64 z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// A uniform number in [0, 1) with 24 random bits for element `index` of stream `seed` (`rng::uniform`); exact in
// double, so a comparison gives the CPU's answer.
__device__ __forceinline__ double uniform(u64 seed, u64 index) {
    return (double)(splitmix(seed ^ (index * 0xD6E8FEB86659FD93ULL)) >> 40) / 16777216.0;
}

// Instantiates `name##_f32`, `name##_bf16` and `name##_f16` from a kernel template `impl<T>` taking `ARGS`.
#define FOR_FLOAT_TYPES(name, impl, PARAMS, ARGS)                                                            \
    extern "C" __global__ void name##_f32 PARAMS(float) { impl<float> ARGS; }                                \
    extern "C" __global__ void name##_bf16 PARAMS(__nv_bfloat16) { impl<__nv_bfloat16> ARGS; }               \
    extern "C" __global__ void name##_f16 PARAMS(__half) { impl<__half> ARGS; }

// `v` reduced over the block by `op` (every thread gets the result); `blockDim.x` a multiple of 32, at most 1024.
// `identity` fills the lanes beyond the block's warps in the second round.
template <typename Op> __device__ __forceinline__ float block_reduce(float v, float identity, Op op) {
    __shared__ float partial[32];
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, offset));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads(); // `partial` may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const int warps = blockDim.x >> 5;
    v = lane < warps ? partial[lane] : identity;
    for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(0xffffffff, v, offset));
    return v;
}

struct Add {
    __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};
struct Max {
    __device__ __forceinline__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// The sum of `v` over the block (every thread gets it).
__device__ __forceinline__ float block_sum(float v) { return block_reduce(v, 0.0f, Add()); }

// The maximum of `v` over the block (every thread gets it).
__device__ __forceinline__ float block_max(float v) { return block_reduce(v, -INFINITY, Max()); }

// Grid-stride loop over rows, one block per row.
#define FOR_EACH_ROW(row, rows) for (u64 row = blockIdx.x; row < (u64)(rows); row += gridDim.x)
