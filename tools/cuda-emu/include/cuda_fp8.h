// CUDA's 8-bit float types (`__nv_fp8_e4m3`, `__nv_fp8_e5m2`, their x2 pairs) and conversion functions, for
// kernels compiled as host C++. e4m3: bias 7, no infinities, 0x7F/0xFF NaN, largest 448; e5m2: IEEE-like, bias 15,
// largest 57344. Conversions to fp8 round to nearest even; the constructors saturate to the largest finite value
// (__NV_SATFINITE), as CUDA's do.
#pragma once
#include "emu_defs.h"
#include "cuda_bf16.h"
#include "cuda_fp16.h"

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short int __nv_fp8x2_storage_t;
typedef unsigned int __nv_fp8x4_storage_t;

typedef enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE } __nv_saturation_t;
typedef enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 } __nv_fp8_interpretation_t;

namespace emu_num {

// x in fp8, CUDA's conversion exactly: beyond the largest finite value (infinities included) it saturates with
// __NV_SATFINITE, else gives NaN (e4m3) or infinity (e5m2); a NaN keeps its sign (and in e5m2 the top two payload
// bits, quiet).
template <class F> inline __nv_fp8_storage_t to_fp8(F x, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    const bool e4m3 = kind == __NV_E4M3;
    const unsigned sign = std::signbit(x) ? 0x80 : 0;
    if (x != x) return sign | (e4m3 ? 0x7F : 0x7E | unsigned(bit_cast<uint64_t>(double(x)) >> 50 & 3));
    if (x == 0) return sign;
    const uint64_t mag = e4m3 ? round_bits<4, 3>(parts(x), Round::nearest) : round_bits<5, 2>(parts(x), Round::nearest);
    const unsigned largest = e4m3 ? 0x7E : 0x7B;
    if (mag > largest) return sign | (sat == __NV_SATFINITE ? largest : e4m3 ? 0x7F : 0x7C);
    return sign | unsigned(mag);
}

// fp8 bits as a half (exact); NaN gives the canonical 0x7FFF without its sign, as CUDA's conversion does.
inline __half_raw fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t kind) {
    if (kind == __NV_E5M2) return {(unsigned short)((x & 0x7F) > 0x7C ? 0x7FFF : x << 8)}; // a half's top byte
    if ((x & 0x7F) == 0x7F) return {0x7FFF};
    return {(unsigned short)float_to_ieee<5, 10>(widen<4, 3, false>(x), Round::nearest)};
}

} // namespace emu_num

inline __nv_fp8_storage_t __nv_cvt_double_to_fp8(double x, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    return emu_num::to_fp8(x, sat, kind);
}
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    return emu_num::to_fp8(x, sat, kind);
}
inline __nv_fp8_storage_t __nv_cvt_halfraw_to_fp8(__half_raw x, __nv_saturation_t sat,
                                                  __nv_fp8_interpretation_t kind) {
    return emu_num::to_fp8(float(__half(x)), sat, kind);
}
inline __nv_fp8_storage_t __nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16_raw x, __nv_saturation_t sat,
                                                      __nv_fp8_interpretation_t kind) {
    return emu_num::to_fp8(float(__nv_bfloat16(x)), sat, kind);
}
inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t kind) {
    return emu_num::fp8_to_halfraw(x, kind);
}

// Pairs: the x (low) component in the low byte.
inline __nv_fp8x2_storage_t __nv_cvt_double2_to_fp8x2(double2 x, __nv_saturation_t sat,
                                                      __nv_fp8_interpretation_t kind) {
    return __nv_fp8x2_storage_t(emu_num::to_fp8(x.y, sat, kind) << 8 | emu_num::to_fp8(x.x, sat, kind));
}
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t sat,
                                                     __nv_fp8_interpretation_t kind) {
    return __nv_fp8x2_storage_t(emu_num::to_fp8(x.y, sat, kind) << 8 | emu_num::to_fp8(x.x, sat, kind));
}
inline __nv_fp8x2_storage_t __nv_cvt_halfraw2_to_fp8x2(__half2_raw x, __nv_saturation_t sat,
                                                       __nv_fp8_interpretation_t kind) {
    return __nv_fp8x2_storage_t(__nv_cvt_halfraw_to_fp8({x.y}, sat, kind) << 8 |
                                __nv_cvt_halfraw_to_fp8({x.x}, sat, kind));
}
inline __nv_fp8x2_storage_t __nv_cvt_bfloat16raw2_to_fp8x2(__nv_bfloat162_raw x, __nv_saturation_t sat,
                                                           __nv_fp8_interpretation_t kind) {
    return __nv_fp8x2_storage_t(__nv_cvt_bfloat16raw_to_fp8({x.y}, sat, kind) << 8 |
                                __nv_cvt_bfloat16raw_to_fp8({x.x}, sat, kind));
}
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t kind) {
    return {__nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(x), kind).x,
            __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t(x >> 8), kind).x};
}

namespace emu_num {

// The members CUDA gives both fp8 types: explicit, saturating conversions from the wider types and the integers
// (through float), explicit conversions back (integers truncate, saturated; NaN → 0).
template <__nv_fp8_interpretation_t K> struct fp8 {
    __nv_fp8_storage_t __x;
    fp8() = default;
    explicit fp8(__half v) : __x(__nv_cvt_halfraw_to_fp8(v, __NV_SATFINITE, K)) {}
    explicit fp8(__nv_bfloat16 v) : __x(__nv_cvt_bfloat16raw_to_fp8(v, __NV_SATFINITE, K)) {}
    explicit fp8(float v) : __x(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, K)) {}
    explicit fp8(double v) : __x(__nv_cvt_double_to_fp8(v, __NV_SATFINITE, K)) {}
    explicit fp8(short v) : fp8(float(v)) {}
    explicit fp8(unsigned short v) : fp8(float(v)) {}
    explicit fp8(int v) : fp8(float(v)) {}
    explicit fp8(unsigned int v) : fp8(float(v)) {}
    explicit fp8(long v) : fp8(float(v)) {}
    explicit fp8(unsigned long v) : fp8(float(v)) {}
    explicit fp8(long long v) : fp8(float(v)) {}
    explicit fp8(unsigned long long v) : fp8(float(v)) {}
    explicit operator __half() const { return __nv_cvt_fp8_to_halfraw(__x, K); }
    explicit operator float() const { return float(__half(*this)); }
    explicit operator double() const { return float(*this); }
    explicit operator __nv_bfloat16() const { return __float2bfloat16_rz(float(*this)); }
#define EMU_EXPLICIT_INT_OPERATOR(I)                                                                               \
    explicit operator I() const { return to_int<I>(float(*this), Round::zero); }
    EMU_INT_CONVERSION_OPERATORS(EMU_EXPLICIT_INT_OPERATOR)
#undef EMU_EXPLICIT_INT_OPERATOR
    explicit operator bool() const { return (__x & 0x7F) != 0; }
};

template <__nv_fp8_interpretation_t K> struct fp8x2 {
    __nv_fp8x2_storage_t __x;
    fp8x2() = default;
    explicit fp8x2(__half2 v) : __x(__nv_cvt_halfraw2_to_fp8x2(v, __NV_SATFINITE, K)) {}
    explicit fp8x2(__nv_bfloat162 v) : __x(__nv_cvt_bfloat16raw2_to_fp8x2(v, __NV_SATFINITE, K)) {}
    explicit fp8x2(float2 v) : __x(__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, K)) {}
    explicit fp8x2(double2 v) : __x(__nv_cvt_double2_to_fp8x2(v, __NV_SATFINITE, K)) {}
    explicit operator __half2() const { return __nv_cvt_fp8x2_to_halfraw2(__x, K); }
    explicit operator float2() const { return __half22float2(__half2(*this)); }
};

} // namespace emu_num

struct __align__(1) __nv_fp8_e4m3 : emu_num::fp8<__NV_E4M3> {
    using emu_num::fp8<__NV_E4M3>::fp8;
};
struct __align__(1) __nv_fp8_e5m2 : emu_num::fp8<__NV_E5M2> {
    using emu_num::fp8<__NV_E5M2>::fp8;
};
struct __align__(2) __nv_fp8x2_e4m3 : emu_num::fp8x2<__NV_E4M3> {
    using emu_num::fp8x2<__NV_E4M3>::fp8x2;
};
struct __align__(2) __nv_fp8x2_e5m2 : emu_num::fp8x2<__NV_E5M2> {
    using emu_num::fp8x2<__NV_E5M2>::fp8x2;
};
