// Included first into every kernel source the emulated device compiles for the CPU (`g++ -include emu_kernel.h`).
// A kernel runs as one fiber per CUDA thread (runtime/launch.cpp); everything a thread asks of "the hardware" —
// its indices, barriers, warp shuffles and votes, shared memory, atomics — is a call into the runtime
// (libcuda.so.1), which knows the running thread.
//
// `kernelize.py` preprocesses a source with CUEMU_SCAN defined, so that `__global__`, `__shared__` and
// `__launch_bounds__` survive as words it can find: it lists the kernels and turns each `__shared__` declaration
// into a reference to the block's shared memory (cuemu_static_shared / cuemu_dynamic_shared below).
#pragma once

#include "emu_defs.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>

#include "vector_types.h"

// ---- the runtime's entry points for kernel code (C linkage, exported by libcuda.so.1) ----
extern "C" {
struct cuemu_thread_info {
    uint3 thread_idx, block_idx;
    dim3 block_dim, grid_dim;
};
// The running CUDA thread's indices.
const cuemu_thread_info *cuemu_thread(void);
void cuemu_syncthreads(void);
// `__syncthreads_count` (op 0), `_and` (1), `_or` (2).
int cuemu_syncthreads_op(int predicate, int op);
void cuemu_syncwarp(unsigned mask);
// A warp shuffle of an 8-byte value: kind 0 = idx, 1 = up, 2 = down, 3 = xor.
unsigned long long cuemu_shfl(unsigned mask, unsigned long long value, int arg, int width, int kind);
// A warp vote: kind 0 = ballot, 1 = any, 2 = all.
unsigned cuemu_vote(unsigned mask, int predicate, int kind);
unsigned cuemu_activemask(void);
// Static `__shared__` storage of one declaration (`site` tells declarations apart) in the running block.
void *cuemu_static_shared(const void *site, size_t size, size_t align);
// The block's dynamic (`extern __shared__`) shared memory.
void *cuemu_dynamic_shared(void);
// The running warp's scratch area (8 KiB) for a warp-collective step (WMMA): lanes write their parts, meet at
// `__syncwarp`, and read. Two areas alternate with the warp's barriers, so a lane that runs ahead into the next step
// cannot overwrite what a slower lane still reads.
void *cuemu_warp_scratch(void);
// Stops the kernel with an error naming it (`__trap`, a failed `assert`).
void cuemu_trap(const char *why) __attribute__((noreturn));
long long cuemu_clock64(void);
}

// ---- CUDA's built-in variables ----
#define threadIdx (cuemu_thread()->thread_idx)
#define blockIdx (cuemu_thread()->block_idx)
#define blockDim (cuemu_thread()->block_dim)
#define gridDim (cuemu_thread()->grid_dim)
#define warpSize 32

#ifndef CUEMU_SCAN
#define __global__
#define __launch_bounds__(...)
#endif

#include "emu_math.h"

// ---- barriers, warps ----
__device__ inline void __syncthreads() { cuemu_syncthreads(); }
__device__ inline int __syncthreads_count(int p) { return cuemu_syncthreads_op(p, 0); }
__device__ inline int __syncthreads_and(int p) { return cuemu_syncthreads_op(p, 1); }
__device__ inline int __syncthreads_or(int p) { return cuemu_syncthreads_op(p, 2); }
__device__ inline void __syncwarp(unsigned mask = 0xffffffffu) { cuemu_syncwarp(mask); }
__device__ inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__device__ inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__device__ inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__device__ inline unsigned __activemask() { return cuemu_activemask(); }
__device__ inline unsigned __ballot_sync(unsigned mask, int p) { return cuemu_vote(mask, p, 0); }
__device__ inline int __any_sync(unsigned mask, int p) { return (int)cuemu_vote(mask, p, 1); }
__device__ inline int __all_sync(unsigned mask, int p) { return (int)cuemu_vote(mask, p, 2); }
__device__ inline unsigned __lanemask_lt() { return (1u << (threadIdx.x & 31)) - 1; }
__device__ inline long long clock64() { return cuemu_clock64(); }
__device__ inline long long clock() { return cuemu_clock64(); }
__device__ inline void __nanosleep(unsigned) {}
__device__ inline void __trap() { cuemu_trap("__trap()"); }
__device__ inline void __brkpt() { cuemu_trap("__brkpt()"); }

namespace cuemu_detail {
// Any trivially copyable value of at most 8 bytes through the 8-byte shuffle.
template <typename T> __device__ inline T shfl(unsigned mask, T v, int arg, int width, int kind) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a type of more than 8 bytes");
    unsigned long long bits = 0;
    memcpy(&bits, &v, sizeof(T));
    bits = cuemu_shfl(mask, bits, arg, width, kind);
    T out;
    memcpy(&out, &bits, sizeof(T));
    return out;
}
} // namespace cuemu_detail

template <typename T> __device__ inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return cuemu_detail::shfl(mask, v, src, width, 0);
}
template <typename T> __device__ inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cuemu_detail::shfl(mask, v, (int)delta, width, 1);
}
template <typename T> __device__ inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cuemu_detail::shfl(mask, v, (int)delta, width, 2);
}
template <typename T> __device__ inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return cuemu_detail::shfl(mask, v, lane_mask, width, 3);
}

// ---- atomics: GCC's atomic builtins, which the instrumentation turns into the runtime's checked atomics ----
namespace cuemu_detail {
template <typename T, typename F> __device__ inline T cas_loop(T *p, F f) {
    // Floating-point read-modify-write through the integer of the same size.
    using Bits = typename std::conditional<sizeof(T) == 8, unsigned long long,
                                           typename std::conditional<sizeof(T) == 4, unsigned, unsigned short>::type>::type;
    Bits *q = reinterpret_cast<Bits *>(p);
    Bits old = __atomic_load_n(q, __ATOMIC_RELAXED), desired;
    T prev;
    do {
        memcpy(&prev, &old, sizeof(T));
        const T next = f(prev);
        memcpy(&desired, &next, sizeof(T));
    } while (!__atomic_compare_exchange_n(q, &old, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
    return prev;
}
} // namespace cuemu_detail

#define CUEMU_INT_ATOMICS(T)                                                                                   \
    __device__ inline T atomicAdd(T *p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); } \
    __device__ inline T atomicSub(T *p, T v) { return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST); } \
    __device__ inline T atomicAnd(T *p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); } \
    __device__ inline T atomicOr(T *p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }   \
    __device__ inline T atomicXor(T *p, T v) { return __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST); } \
    __device__ inline T atomicExch(T *p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); } \
    __device__ inline T atomicMax(T *p, T v) {                                                                 \
        return cuemu_detail::cas_loop(p, [v](T x) { return x > v ? x : v; });                                  \
    }                                                                                                          \
    __device__ inline T atomicMin(T *p, T v) {                                                                 \
        return cuemu_detail::cas_loop(p, [v](T x) { return x < v ? x : v; });                                  \
    }                                                                                                          \
    __device__ inline T atomicCAS(T *p, T compare, T v) {                                                      \
        __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
        return compare;                                                                                        \
    }
CUEMU_INT_ATOMICS(int)
CUEMU_INT_ATOMICS(unsigned int)
CUEMU_INT_ATOMICS(unsigned long long int)
CUEMU_INT_ATOMICS(long long int)
#undef CUEMU_INT_ATOMICS

__device__ inline unsigned short atomicCAS(unsigned short *p, unsigned short compare, unsigned short v) {
    __atomic_compare_exchange_n(p, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return compare;
}
__device__ inline unsigned atomicInc(unsigned *p, unsigned limit) {
    return cuemu_detail::cas_loop(p, [limit](unsigned x) { return x >= limit ? 0u : x + 1; });
}
__device__ inline unsigned atomicDec(unsigned *p, unsigned limit) {
    return cuemu_detail::cas_loop(p, [limit](unsigned x) { return (x == 0 || x > limit) ? limit : x - 1; });
}
__device__ inline float atomicAdd(float *p, float v) {
    return cuemu_detail::cas_loop(p, [v](float x) { return x + v; });
}
__device__ inline double atomicAdd(double *p, double v) {
    return cuemu_detail::cas_loop(p, [v](double x) { return x + v; });
}
__device__ inline float atomicExch(float *p, float v) {
    return cuemu_detail::cas_loop(p, [v](float) { return v; });
}
#define atomicAdd_block atomicAdd
#define atomicAdd_system atomicAdd

// ---- the module's kernel table (kernelize.py appends one entry per kernel) ----
extern "C" struct cuemu_kernel {
    const char *name;
    void (*launch)(void **params);
    unsigned param_count;
    const unsigned *param_sizes;
    const unsigned char *param_is_pointer;
};

namespace cuemu_registry {
template <typename F> struct signature;
template <typename... A> struct signature<void (*)(A...)> {
    static constexpr unsigned count = sizeof...(A);
    static constexpr unsigned sizes[sizeof...(A) + 1] = {static_cast<unsigned>(sizeof(A))..., 0u};
    static constexpr unsigned char pointers[sizeof...(A) + 1] = {
        static_cast<unsigned char>(std::is_pointer<A>::value)..., 0};
    template <void (*F)(A...), size_t... I> static void call(void **params, std::index_sequence<I...>) {
        F(*static_cast<A *>(params[I])...);
    }
    // Calls the kernel with the values cuLaunchKernel's `kernelParams` point to.
    template <void (*F)(A...)> static void launch(void **params) { call<F>(params, std::index_sequence_for<A...>{}); }
};
template <auto F> cuemu_kernel entry(const char *name) {
    using S = signature<decltype(F)>;
    return cuemu_kernel{name, &S::template launch<F>, S::count, S::sizes, S::pointers};
}
} // namespace cuemu_registry

// `assert` in device code stops the kernel with the condition, like the hardware's assertion trap.
#undef assert
#define assert(c) ((c) ? (void)0 : cuemu_trap("assertion failed: " #c))

#include "cuda_fp16.h"
#include "cuda_bf16.h"
