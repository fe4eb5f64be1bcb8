// The device math of CUDA that plain libm lacks, for kernels compiled as host C++: directed-rounding arithmetic and
// conversions (`__fadd_rz`, `__float2int_rd`, …), the fast intrinsics (`__expf`, …; here the accurate libm functions:
// CUDA's are less accurate, so only tolerances can compare them), the extra functions (`rsqrtf`, `normcdff`,
// `erfinvf`, `sinpif`, …), bit reinterpretations, the integer intrinsics (`__popc`, `__byte_perm`, …) and the
// global `min`/`max` overloads. Also the shared rounding core (namespace `emu_num`) of the fp16/bf16/fp8 headers.
#pragma once
#include "emu_defs.h"
#include "vector_types.h"

// libstdc++'s <math.h> is <cmath> plus `using std::sqrt; …` in the global namespace: unqualified `sqrt(x)`,
// `isnan(x)`, `signbit(x)` on a float then pick the float overloads, as CUDA's global math functions do.
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <limits>

namespace emu_num {

template <class To, class From> inline To bit_cast(From from) {
    static_assert(sizeof(To) == sizeof(From), "bit_cast between types of different sizes");
    To to;
    memcpy(static_cast<void *>(&to), &from, sizeof to);
    return to;
}

// 2^n, exact, usable in constant expressions (std::ldexp is not constexpr).
constexpr double exp2i(int n) { return n < 0 ? 0.5 * exp2i(n + 1) : n > 0 ? 2.0 * exp2i(n - 1) : 1.0; }

enum class Round { nearest, zero, down, up };

// A finite nonzero value (-1)^neg · sig · 2^(e − top), with sig < 2^(top + 1): `e` is the exponent of bit `top`.
struct Parts {
    bool neg;
    int e;
    uint64_t sig;
    int top;
};

// Subnormals have exponent field 0 but the scale of field 1, and no implicit bit.
inline Parts parts(float x) {
    const uint32_t u = bit_cast<uint32_t>(x), field = u >> 23 & 0xff, man = u & 0x7fffff;
    return {bool(u >> 31), int(field ? field : 1) - 127, field ? man | 0x800000u : man, 23};
}
inline Parts parts(double x) {
    const uint64_t u = bit_cast<uint64_t>(x), field = u >> 52 & 0x7ff, man = u & 0xfffffffffffffull;
    return {bool(u >> 63), int(field ? field : 1) - 1023, field ? man | 1ull << 52 : man, 52};
}
// A nonzero integer's magnitude, normalized to bit 62 (the bit shifted out is kept as a sticky bit) so that the
// rounding below never shifts by 64.
inline Parts parts_int(bool neg, uint64_t mag) {
    const int lz = __builtin_clzll(mag);
    const uint64_t norm = mag << lz;
    return {neg, 63 - lz, norm >> 1 | (norm & 1), 62};
}

// The magnitude of `p` rounded to a binary format with E exponent and M mantissa bits (bias 2^(E−1) − 1), as its
// encoding; an encoding beyond the format's largest finite one means overflow, which the caller resolves.
template <int E, int M> inline uint64_t round_bits(const Parts &p, Round mode) {
    constexpr int emin = 2 - (1 << (E - 1)); // exponent of the smallest normal number
    uint64_t sig = p.sig;
    int shift = p.top - M + (p.e < emin ? emin - p.e : 0); // subnormal results keep fewer bits
    if (shift > p.top + 1) { // below half the smallest subnormal: only whether it is nonzero matters
        sig = sig != 0;
        shift = 2;
    }
    const uint64_t q = sig >> shift, rem = sig & ((1ull << shift) - 1), half = 1ull << (shift - 1);
    bool up = false;
    if (mode == Round::nearest) up = rem > half || (rem == half && (q & 1));
    else if (mode != Round::zero) up = rem != 0 && ((mode == Round::up) != p.neg);
    // q's implicit bit adds one to the biased exponent e − emin; a rounding carry ripples into the exponent field.
    return (uint64_t(p.e < emin ? 0 : p.e - emin) << M) + q + up;
}

// IEEE overflow: to infinity when rounding to nearest or away from zero, else to the largest finite value.
template <int E, int M> inline uint64_t ieee_encode(const Parts &p, Round mode) {
    constexpr uint64_t inf = ((1ull << E) - 1) << M;
    uint64_t mag = round_bits<E, M>(p, mode);
    if (mag >= inf) {
        const bool to_inf = mode == Round::nearest || (mode == Round::up && !p.neg) || (mode == Round::down && p.neg);
        mag = to_inf ? inf : inf - 1;
    }
    return (p.neg ? 1ull << (E + M) : 0) | mag;
}

// x (float or double) in the IEEE format (E, M): NaN gives the canonical all-ones NaN that CUDA produces (0x7FFF for
// half and bf16, 0x7FFFFFFF for float).
template <int E, int M, class F> inline uint64_t float_to_ieee(F x, Round mode) {
    constexpr uint64_t sign = 1ull << (E + M), inf = ((1ull << E) - 1) << M;
    if (x != x) return sign - 1;
    const uint64_t s = std::signbit(x) ? sign : 0;
    if (std::isinf(x)) return s | inf;
    if (x == 0) return s;
    return ieee_encode<E, M>(parts(x), mode);
}

// An integer in the IEEE format (E, M), rounded once (converting through double first would round twice).
template <int E, int M, class I> inline uint64_t int_to_ieee(I v, Round mode) {
    if (v == 0) return 0;
    const bool neg = v < 0;
    return ieee_encode<E, M>(parts_int(neg, neg ? 0 - uint64_t(v) : uint64_t(v)), mode);
}

// The float value (exact) of bits `b` of a format with E ≤ 8 exponent and M ≤ 23 mantissa bits. Not `ieee`: the top
// exponent holds finite numbers (e4m3, whose caller handles its NaN). NaNs keep their sign and payload (made quiet,
// as the hardware's conversion does, except bf16's, which is a plain shift).
template <int E, int M, bool ieee = true> inline float widen(uint32_t b) {
    constexpr uint32_t emax = (1u << E) - 1;
    constexpr int bias = (1 << (E - 1)) - 1;
    const uint32_t sign = (b >> (E + M) & 1) << 31, e = b >> M & emax, m = b & ((1u << M) - 1);
    if constexpr (E == 8) {
        return bit_cast<float>(sign | (b & ((1u << (E + M)) - 1)) << (23 - M)); // float's exponent: a shift (bf16)
    } else {
        if (ieee && e == emax) return bit_cast<float>(sign | 0x7f800000u | m << (23 - M) | (m ? 0x400000u : 0));
        if (e == 0) return bit_cast<float>(sign | bit_cast<uint32_t>(float(m) * float(exp2i(1 - bias - M))));
        return bit_cast<float>(sign | (e + 127 - bias) << 23 | m << (23 - M));
    }
}

// x rounded to an integer by `mode` and converted as the device's cvt does: saturated to I's range, NaN → 0 (the
// 64-bit conversions give 0x8000000000000000 for NaN, as CUDA's do).
template <class I> inline I to_int(double x, Round mode) {
    if (x != x) return sizeof(I) == 8 ? I(1ull << 63) : I(0);
    x = mode == Round::nearest ? std::nearbyint(x)
        : mode == Round::zero  ? std::trunc(x)
        : mode == Round::down  ? std::floor(x)
                               : std::ceil(x);
    constexpr double lo = double(std::numeric_limits<I>::min()); // 0 or −2^k: exact
    constexpr double hi = exp2i(std::numeric_limits<I>::digits); // one past the largest value
    if (x <= lo) return std::numeric_limits<I>::min();
    if (x >= hi) return std::numeric_limits<I>::max();
    return I(x);
}

// `s`, the double nearest an exact result, made round-to-odd: when inexact (err ≠ 0 has the sign of exact − s) it
// steps to its odd neighbour on the exact result's side. A round-to-odd double then rounds correctly, in any mode,
// to a format at least two bits narrower (float, half, bf16): single-rounding fma and directed-rounding operations.
inline double to_odd(double s, double err) {
    uint64_t u = bit_cast<uint64_t>(s);
    if ((err < 0 || err > 0) && std::isfinite(s) && !(u & 1)) u += (err > 0) == (s > 0) ? 1 : ~0ull;
    return bit_cast<double>(u);
}

// p + c in round-to-odd (Knuth's TwoSum gives the exact error of the rounded sum).
inline double sum_odd(double p, double c) {
    const double s = p + c, b = s - p;
    return to_odd(s, (p - (s - b)) + (c - b));
}

// a / b in round-to-odd: the remainder a − q·b, exact in an fma, has the sign of the error times b's.
inline double div_odd(double a, double b) {
    const double q = a / b, r = std::fma(-q, b, a);
    return to_odd(q, r == 0 ? 0.0 : (r < 0) != (b < 0) ? -1.0 : 1.0);
}

// √a in round-to-odd: a − s² has the sign of the error.
inline double sqrt_odd(double a) {
    const double s = std::sqrt(a);
    return to_odd(s, std::fma(-s, s, a));
}

inline float to_float(double x, Round mode) { return bit_cast<float>(uint32_t(float_to_ieee<8, 23>(x, mode))); }

// erfinv for y in [0, 1], given c = 1 − y exactly (erfcinv's tiny c would be lost in 1 − c): Giles' single-precision
// approximation (or, deep in the tail where it does not reach, √−log c) refined by Newton steps on erf, or in the tail
// on log erfc, each evaluated where it is accurate.
inline double erfinv_core(double y, double c) {
    if (c == 0) return INFINITY;
    double w = -std::log(c * (2 - c)), x; // −log(1 − y²)
    if (w < 5) {
        w -= 2.5;
        static constexpr double k[] = {2.81022636e-08,  3.43273939e-07, -3.5233877e-06,
                                       -4.39150654e-06, 0.00021858087,  -0.00125372503,
                                       -0.00417768164,  0.246640727,    1.50140941};
        double p = 0;
        for (double ki : k) p = ki + p * w;
        x = p * y;
    } else if (w < 16) {
        w = std::sqrt(w) - 3;
        static constexpr double k[] = {-0.000200214257, 0.000100950558, 0.00134934322,
                                       -0.00367342844,  0.00573950773,  -0.0076224613,
                                       0.00943887047,   1.00167406,     2.83297682};
        double p = 0;
        for (double ki : k) p = ki + p * w;
        x = p * y;
    } else {
        x = std::sqrt(-std::log(c));
    }
    for (int i = 0; i < 4; ++i) {
        const double d = 1.1283791670955126 * std::exp(-x * x); // d/dx erf = 2/√π · e^(−x²)
        if (y < 0.5) {
            x -= (std::erf(x) - y) / d;
        } else {
            const double e = std::erfc(x);
            x += std::log(e / c) * e / d;
        }
    }
    return x;
}

inline double erfinv(double y) {
    if (!(std::fabs(y) <= 1)) return NAN;
    const double x = erfinv_core(std::fabs(y), 1 - std::fabs(y));
    return y < 0 ? -x : x;
}

inline double erfcinv(double c) {
    if (!(c >= 0 && c <= 2)) return NAN;
    return c <= 1 ? erfinv_core(1 - c, c) : -erfinv_core(c - 1, 2 - c); // erfcinv(c) = −erfcinv(2 − c), 2 − c exact
}

// sin(πx) with the argument reduced exactly (fmod is exact) to [−½, ½], so that integers give exact zeros.
inline double sinpi(double x) {
    double r = std::fmod(x, 2.0); // (−2, 2)
    if (r > 1) r -= 2;
    if (r < -1) r += 2;
    if (r > 0.5) r = 1 - r;
    if (r < -0.5) r = -1 - r;
    const double s = std::sin(M_PI * r);
    return s == 0 ? std::copysign(0.0, x) : s;
}

inline double cospi(double x) {
    double r = std::fmod(std::fabs(x), 2.0); // [0, 2)
    if (r > 1) r = 2 - r;                    // cos(πr) is even about 1
    return r <= 0.25 ? std::cos(M_PI * r) : sinpi(0.5 - r);
}

} // namespace emu_num

// ---- Bit reinterpretations ----
inline int __float_as_int(float x) { return emu_num::bit_cast<int>(x); }
inline float __int_as_float(int x) { return emu_num::bit_cast<float>(x); }
inline unsigned int __float_as_uint(float x) { return emu_num::bit_cast<unsigned int>(x); }
inline float __uint_as_float(unsigned int x) { return emu_num::bit_cast<float>(x); }
inline long long __double_as_longlong(double x) { return emu_num::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return emu_num::bit_cast<double>(x); }
inline int __double2hiint(double x) { return int(__double_as_longlong(x) >> 32); }
inline int __double2loint(double x) { return int(__double_as_longlong(x)); }
inline double __hiloint2double(int hi, int lo) {
    return __longlong_as_double(int64_t(uint64_t(uint32_t(hi)) << 32 | uint32_t(lo)));
}

// ---- Conversions and arithmetic in the four rounding modes ----
#define EMU_CONVERSIONS(sfx, mode)                                                                                 \
    inline int __float2int_##sfx(float x) { return emu_num::to_int<int>(x, emu_num::Round::mode); }                \
    inline unsigned int __float2uint_##sfx(float x) { return emu_num::to_int<unsigned int>(x, emu_num::Round::mode); } \
    inline long long __float2ll_##sfx(float x) { return emu_num::to_int<long long>(x, emu_num::Round::mode); }     \
    inline unsigned long long __float2ull_##sfx(float x) {                                                         \
        return emu_num::to_int<unsigned long long>(x, emu_num::Round::mode);                                       \
    }                                                                                                              \
    inline int __double2int_##sfx(double x) { return emu_num::to_int<int>(x, emu_num::Round::mode); }              \
    inline unsigned int __double2uint_##sfx(double x) {                                                            \
        return emu_num::to_int<unsigned int>(x, emu_num::Round::mode);                                             \
    }                                                                                                              \
    inline long long __double2ll_##sfx(double x) { return emu_num::to_int<long long>(x, emu_num::Round::mode); }   \
    inline unsigned long long __double2ull_##sfx(double x) {                                                       \
        return emu_num::to_int<unsigned long long>(x, emu_num::Round::mode);                                       \
    }                                                                                                              \
    inline float __int2float_##sfx(int x) {                                                                        \
        return __uint_as_float(uint32_t(emu_num::int_to_ieee<8, 23>(x, emu_num::Round::mode)));                    \
    }                                                                                                              \
    inline float __uint2float_##sfx(unsigned int x) {                                                              \
        return __uint_as_float(uint32_t(emu_num::int_to_ieee<8, 23>(x, emu_num::Round::mode)));                    \
    }                                                                                                              \
    inline float __ll2float_##sfx(long long x) {                                                                   \
        return __uint_as_float(uint32_t(emu_num::int_to_ieee<8, 23>(x, emu_num::Round::mode)));                    \
    }                                                                                                              \
    inline float __ull2float_##sfx(unsigned long long x) {                                                         \
        return __uint_as_float(uint32_t(emu_num::int_to_ieee<8, 23>(x, emu_num::Round::mode)));                    \
    }                                                                                                              \
    inline double __ll2double_##sfx(long long x) {                                                                 \
        return __longlong_as_double(int64_t(emu_num::int_to_ieee<11, 52>(x, emu_num::Round::mode)));              \
    }                                                                                                              \
    inline double __ull2double_##sfx(unsigned long long x) {                                                       \
        return __longlong_as_double(int64_t(emu_num::int_to_ieee<11, 52>(x, emu_num::Round::mode)));              \
    }                                                                                                              \
    inline float __double2float_##sfx(double x) { return emu_num::to_float(x, emu_num::Round::mode); }
EMU_CONVERSIONS(rn, nearest)
EMU_CONVERSIONS(rz, zero)
EMU_CONVERSIONS(rd, down)
EMU_CONVERSIONS(ru, up)
#undef EMU_CONVERSIONS

inline double __int2double_rn(int x) { return x; }
inline double __uint2double_rn(unsigned int x) { return x; }

// Round-to-nearest is the host's own IEEE arithmetic (no contraction: the emulator compiles with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __frsqrt_rn(float a) { return float(1.0 / std::sqrt(double(a))); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __drcp_rn(double a) { return 1.0 / a; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

// Directed modes: the exact result in round-to-odd double (float products are exact in double), rounded once.
#define EMU_DIRECTED_FLOAT_OPS(sfx, mode)                                                                          \
    inline float __fadd_##sfx(float a, float b) { return emu_num::to_float(emu_num::sum_odd(a, b), mode); }        \
    inline float __fsub_##sfx(float a, float b) { return emu_num::to_float(emu_num::sum_odd(a, -b), mode); }       \
    inline float __fmul_##sfx(float a, float b) { return emu_num::to_float(double(a) * b, mode); }                 \
    inline float __fdiv_##sfx(float a, float b) { return emu_num::to_float(emu_num::div_odd(a, b), mode); }        \
    inline float __frcp_##sfx(float a) { return emu_num::to_float(emu_num::div_odd(1.0, a), mode); }               \
    inline float __fsqrt_##sfx(float a) { return emu_num::to_float(emu_num::sqrt_odd(a), mode); }                  \
    inline float __fmaf_##sfx(float a, float b, float c) {                                                         \
        return emu_num::to_float(emu_num::sum_odd(double(a) * b, c), mode);                                        \
    }
EMU_DIRECTED_FLOAT_OPS(rz, emu_num::Round::zero)
EMU_DIRECTED_FLOAT_OPS(rd, emu_num::Round::down)
EMU_DIRECTED_FLOAT_OPS(ru, emu_num::Round::up)
#undef EMU_DIRECTED_FLOAT_OPS

// ---- Fast intrinsics: the accurate functions ----
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return ::exp10f(x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline void __sincosf(float x, float *s, float *c) { ::sincosf(x, s, c); }
inline float __fdividef(float x, float y) { return x / y; }
inline float fdividef(float x, float y) { return x / y; }
inline double fdivide(double x, double y) { return x / y; }
inline float __saturatef(float x) { return x > 0 ? (x < 1 ? x : 1.0f) : 0.0f; } // NaN → 0

// ---- CUDA's functions beyond C's (the float versions computed in double and rounded once) ----
// Templates: glibc 2.41+ declares C23's rsqrt, sinpi and cospi itself (with CUDA's meaning); its non-template
// functions are then preferred instead of conflicting.
template <class = void> inline float rsqrtf(float x) { return float(1.0 / std::sqrt(double(x))); }
template <class = void> inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
template <class = void> inline double sinpi(double x) { return emu_num::sinpi(x); }
template <class = void> inline float sinpif(float x) { return float(emu_num::sinpi(x)); }
template <class = void> inline double cospi(double x) { return emu_num::cospi(x); }
template <class = void> inline float cospif(float x) { return float(emu_num::cospi(x)); }
inline float rcbrtf(float x) { return float(1.0 / std::cbrt(double(x))); }
inline double rcbrt(double x) { return 1.0 / std::cbrt(x); }
inline float rhypotf(float x, float y) { return float(1.0 / std::hypot(double(x), double(y))); }
inline double rhypot(double x, double y) { return 1.0 / std::hypot(x, y); }
inline double normcdf(double x) { return 0.5 * std::erfc(-x * M_SQRT1_2); }
inline float normcdff(float x) { return float(normcdf(x)); }
inline double erfinv(double y) { return emu_num::erfinv(y); }
inline float erfinvf(float y) { return float(emu_num::erfinv(y)); }
inline double erfcinv(double c) { return emu_num::erfcinv(c); }
inline float erfcinvf(float c) { return float(emu_num::erfcinv(c)); }
inline double normcdfinv(double p) { return -M_SQRT2 * emu_num::erfcinv(2 * p); }
inline float normcdfinvf(float p) { return float(normcdfinv(p)); }
inline void sincospi(double x, double *s, double *c) { *s = sinpi(x), *c = cospi(x); }
inline void sincospif(float x, float *s, float *c) { *s = sinpif(x), *c = cospif(x); }

// ---- Integer intrinsics ----
inline int __popc(unsigned int x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x ? __builtin_clz(unsigned(x)) : 32; }
inline int __clzll(long long x) { return x ? __builtin_clzll(uint64_t(x)) : 64; }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned long long __brevll(unsigned long long x) {
    x = (x >> 1 & 0x5555555555555555ull) | (x & 0x5555555555555555ull) << 1;
    x = (x >> 2 & 0x3333333333333333ull) | (x & 0x3333333333333333ull) << 2;
    x = (x >> 4 & 0x0f0f0f0f0f0f0f0full) | (x & 0x0f0f0f0f0f0f0f0full) << 4;
    return __builtin_bswap64(x);
}
inline unsigned int __brev(unsigned int x) { return unsigned(__brevll(x) >> 32); }
// Result byte i is byte s[4i+2 : 4i] of the 8 bytes y:x (x the low four).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    const uint64_t bytes = uint64_t(y) << 32 | x;
    unsigned int r = 0;
    for (int i = 0; i < 4; ++i) r |= unsigned(bytes >> ((s >> (4 * i) & 7) * 8) & 0xff) << (8 * i);
    return r;
}
// The high (left) or low (right) word of hi:lo shifted by `shift` mod 32, or clamped to 32 (the `c` forms).
inline unsigned int __funnelshift_l(unsigned int lo, unsigned int hi, unsigned int shift) {
    return unsigned((uint64_t(hi) << 32 | lo) << (shift & 31) >> 32);
}
inline unsigned int __funnelshift_lc(unsigned int lo, unsigned int hi, unsigned int shift) {
    return unsigned((uint64_t(hi) << 32 | lo) << (shift < 32 ? shift : 32) >> 32);
}
inline unsigned int __funnelshift_r(unsigned int lo, unsigned int hi, unsigned int shift) {
    return unsigned((uint64_t(hi) << 32 | lo) >> (shift & 31));
}
inline unsigned int __funnelshift_rc(unsigned int lo, unsigned int hi, unsigned int shift) {
    return unsigned((uint64_t(hi) << 32 | lo) >> (shift < 32 ? shift : 32));
}
inline int __mulhi(int a, int b) { return int(int64_t(a) * b >> 32); }
inline unsigned int __umulhi(unsigned int a, unsigned int b) { return unsigned(uint64_t(a) * b >> 32); }
inline long long __mul64hi(long long a, long long b) { return (long long)((__int128)a * b >> 64); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)((unsigned __int128)a * b >> 64);
}
// The low 24 bits of each operand (sign-extended for the signed form), multiplied: the low 32 bits of the product.
inline int __mul24(int a, int b) { return int(uint32_t(int64_t(a << 8 >> 8) * (b << 8 >> 8))); }
inline unsigned int __umul24(unsigned int a, unsigned int b) { return (a & 0xffffff) * (b & 0xffffff); }
inline unsigned int __sad(int x, int y, unsigned int z) {
    return unsigned(x > y ? int64_t(x) - y : int64_t(y) - x) + z;
}
inline unsigned int __usad(unsigned int x, unsigned int y, unsigned int z) { return (x > y ? x - y : y - x) + z; }
// Halving adds without intermediate overflow; the r forms round up. __hadd(__half, __half) is the fp16 add.
inline int __hadd(int a, int b) { return int((int64_t(a) + b) >> 1); }
inline int __rhadd(int a, int b) { return int((int64_t(a) + b + 1) >> 1); }
inline unsigned int __uhadd(unsigned int a, unsigned int b) { return unsigned((uint64_t(a) + b) >> 1); }
inline unsigned int __urhadd(unsigned int a, unsigned int b) { return unsigned((uint64_t(a) + b + 1) >> 1); }
// Four-way byte dot products accumulated into c.
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 32; i += 8) c += int(int8_t(a >> i)) * int(int8_t(b >> i));
    return c;
}
inline unsigned int __dp4a(unsigned int a, unsigned int b, unsigned int c) {
    for (int i = 0; i < 32; i += 8) c += (a >> i & 0xff) * (b >> i & 0xff);
    return c;
}

// ---- CUDA's global min/max overloads (std::min/max are unaffected): mixed signedness compares as unsigned ----
#define EMU_MIN_MAX(R, A, B)                                                                                       \
    inline R min(A a, B b) { return static_cast<R>(a) < static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); } \
    inline R max(A a, B b) { return static_cast<R>(a) > static_cast<R>(b) ? static_cast<R>(a) : static_cast<R>(b); }
EMU_MIN_MAX(int, int, int)
EMU_MIN_MAX(unsigned int, unsigned int, unsigned int)
EMU_MIN_MAX(unsigned int, int, unsigned int)
EMU_MIN_MAX(unsigned int, unsigned int, int)
EMU_MIN_MAX(long, long, long)
EMU_MIN_MAX(unsigned long, unsigned long, unsigned long)
EMU_MIN_MAX(unsigned long, long, unsigned long)
EMU_MIN_MAX(unsigned long, unsigned long, long)
EMU_MIN_MAX(long long, long long, long long)
EMU_MIN_MAX(unsigned long long, unsigned long long, unsigned long long)
EMU_MIN_MAX(unsigned long long, long long, unsigned long long)
EMU_MIN_MAX(unsigned long long, unsigned long long, long long)
#undef EMU_MIN_MAX
inline unsigned int umin(unsigned int a, unsigned int b) { return min(a, b); }
inline unsigned int umax(unsigned int a, unsigned int b) { return max(a, b); }
inline long long llmin(long long a, long long b) { return min(a, b); }
inline long long llmax(long long a, long long b) { return max(a, b); }
inline unsigned long long ullmin(unsigned long long a, unsigned long long b) { return min(a, b); }
inline unsigned long long ullmax(unsigned long long a, unsigned long long b) { return max(a, b); }
// The floating-point forms are fmin/fmax: a NaN operand yields the other one.
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
inline double min(float a, double b) { return std::fmin(a, b); }
inline double max(float a, double b) { return std::fmax(a, b); }
inline double min(double a, float b) { return std::fmin(a, b); }
inline double max(double a, float b) { return std::fmax(a, b); }
