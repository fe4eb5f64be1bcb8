// CUDA's built-in vector types (`float2`, `int4`, `uchar4`, …) with the alignment CUDA gives them, their `make_*`
// constructor functions, and `uint3`/`dim3`. Kernels reinterpret memory through these types (8 bf16 values as one
// float4), so size and alignment must match CUDA's exactly.
#pragma once
#include "emu_defs.h"

// CUDA's rule for every element type: 1- and 3-vectors are naturally aligned, 2-vectors to their size, 4-vectors to
// their size capped at 16 bytes (the widest device load).
#define EMU_VECTOR_TYPES(T, name)                                                                                  \
    struct name##1 { T x; };                                                                                       \
    struct __align__(2 * sizeof(T)) name##2 { T x, y; };                                                           \
    struct name##3 { T x, y, z; };                                                                                 \
    struct __align__(4 * sizeof(T) < 16 ? 4 * sizeof(T) : 16) name##4 { T x, y, z, w; };                           \
    inline name##1 make_##name##1(T x) { return name##1{x}; }                                                      \
    inline name##2 make_##name##2(T x, T y) { return name##2{x, y}; }                                              \
    inline name##3 make_##name##3(T x, T y, T z) { return name##3{x, y, z}; }                                      \
    inline name##4 make_##name##4(T x, T y, T z, T w) { return name##4{x, y, z, w}; }

// CUDA 13 deprecates the 4-vectors of 8-byte elements in favour of explicitly 16- and 32-byte aligned ones.
#define EMU_WIDE_VECTOR_TYPES(T, name)                                                                             \
    EMU_VECTOR_TYPES(T, name)                                                                                      \
    struct __align__(16) name##4_16a { T x, y, z, w; };                                                            \
    struct __align__(32) name##4_32a { T x, y, z, w; };

EMU_VECTOR_TYPES(signed char, char)
EMU_VECTOR_TYPES(unsigned char, uchar)
EMU_VECTOR_TYPES(short, short)
EMU_VECTOR_TYPES(unsigned short, ushort)
EMU_VECTOR_TYPES(int, int)
EMU_VECTOR_TYPES(unsigned int, uint)
EMU_VECTOR_TYPES(float, float)
EMU_WIDE_VECTOR_TYPES(long, long)
EMU_WIDE_VECTOR_TYPES(unsigned long, ulong)
EMU_WIDE_VECTOR_TYPES(long long, longlong)
EMU_WIDE_VECTOR_TYPES(unsigned long long, ulonglong)
EMU_WIDE_VECTOR_TYPES(double, double)

#undef EMU_VECTOR_TYPES
#undef EMU_WIDE_VECTOR_TYPES

// Launch dimensions: unspecified components default to 1.
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};
