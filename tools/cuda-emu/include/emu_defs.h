// The CUDA C++ qualifiers and attributes, for kernel sources compiled as host C++ by the emulated device.
// Included first by every header of this folder; the emulator compiles each translation unit with one set of
// flags, so a `__forceinline__` function is inlined like the rest of the kernel.
#pragma once

#include <stddef.h>
#include <stdint.h>

#ifndef __device__
#define __device__
#endif
#ifndef __host__
#define __host__
#endif
#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif
#ifndef __noinline__
#define __noinline__ __attribute__((noinline))
#endif
#ifndef __inline__
#define __inline__ inline
#endif
#ifndef __align__
#define __align__(n) __attribute__((aligned(n)))
#endif
#ifndef __restrict__
#define __restrict__ __restrict
#endif
#ifndef __constant__
#define __constant__
#endif
#ifndef __managed__
#define __managed__
#endif
#ifndef __CUDACC__
#define __CUDACC__ 1
#endif
