// CUDA's fp16 type (`__half`, `__half2`, their raw forms) and intrinsics, for kernels compiled as host C++, with
// the members, conversions and operators CUDA 13 declares. Conversions round as the device's cvt does (to nearest
// even, or the _rz/_rd/_ru mode asked for; subnormals kept; NaN → the canonical 0x7FFF). Arithmetic computes in
// float and rounds once: float has more than twice fp16's precision, so + − × ÷ √ are the correctly rounded fp16
// operations; fma rounds the exact result once. EMU_HALF_LIKE_API generates the functions bf16 shares.
#pragma once
#include "emu_defs.h"
#include "emu_math.h"

#include <type_traits>

typedef struct __align__(2) { unsigned short x; } __half_raw;
typedef struct __align__(4) { unsigned short x, y; } __half2_raw;

struct __nv_bfloat16;

// Applies X to the integer types the 16- and 8-bit float types convert to (truncating and saturating, as CUDA's
// _rz conversions do).
#define EMU_INT_CONVERSION_OPERATORS(X)                                                                            \
    X(signed char) X(unsigned char) X(char) X(short) X(unsigned short) X(int) X(unsigned int) X(long)              \
    X(unsigned long) X(long long) X(unsigned long long)
#define EMU_INT_OPERATOR(I)                                                                                        \
    operator I() const { return emu_num::to_int<I>(float(*this), emu_num::Round::zero); }

// The constructors and assignments from numbers of a 16-bit float type T with format (E, M), CUDA's set: floating
// point and integers (not the char types) construct it rounding to nearest; no assignment from long. Ends the
// struct's public part (a private helper follows).
#define EMU_NUMBER_CONSTRUCTORS(T, E, M)                                                                           \
    T(float v) : __x(bits(v)) {}                                                                                   \
    T(double v) : __x(bits(v)) {}                                                                                  \
    T(short v) : __x(bits(v)) {}                                                                                   \
    T(unsigned short v) : __x(bits(v)) {}                                                                          \
    T(int v) : __x(bits(v)) {}                                                                                     \
    T(unsigned int v) : __x(bits(v)) {}                                                                            \
    T(long v) : __x(bits(v)) {}                                                                                    \
    T(unsigned long v) : __x(bits(v)) {}                                                                           \
    T(long long v) : __x(bits(v)) {}                                                                               \
    T(unsigned long long v) : __x(bits(v)) {}                                                                      \
    T &operator=(float v) { return *this = T(v); }                                                                 \
    T &operator=(double v) { return *this = T(v); }                                                                \
    T &operator=(short v) { return *this = T(v); }                                                                 \
    T &operator=(unsigned short v) { return *this = T(v); }                                                        \
    T &operator=(int v) { return *this = T(v); }                                                                   \
    T &operator=(unsigned int v) { return *this = T(v); }                                                          \
    T &operator=(long long v) { return *this = T(v); }                                                             \
    T &operator=(unsigned long long v) { return *this = T(v); }                                                    \
    operator float() const { return emu_num::widen<E, M>(__x); }                                                   \
    EMU_INT_CONVERSION_OPERATORS(EMU_INT_OPERATOR)                                                                 \
    constexpr operator bool() const { return (__x & 0x7FFF) != 0; }                                                \
                                                                                                                   \
  private:                                                                                                         \
    template <class V> static unsigned short bits(V v) {                                                           \
        if constexpr (std::is_floating_point<V>::value)                                                            \
            return (unsigned short)emu_num::float_to_ieee<E, M>(v, emu_num::Round::nearest);                       \
        else                                                                                                       \
            return (unsigned short)emu_num::int_to_ieee<E, M>(v, emu_num::Round::nearest);                         \
    }

struct __align__(2) __half {
  protected:
    unsigned short __x;

  public:
    __half() = default;
    constexpr __half(const __half_raw &r) : __x(r.x) {}
    __half &operator=(const __half_raw &r) { return __x = r.x, *this; }
    volatile __half &operator=(const __half_raw &r) volatile { return __x = r.x, *this; }
    volatile __half &operator=(const volatile __half_raw &r) volatile { return __x = r.x, *this; }
    operator __half_raw() const { return {__x}; }
    operator __half_raw() const volatile { return {__x}; }
    explicit __half(__nv_bfloat16 v); // in cuda_bf16.h
    EMU_NUMBER_CONSTRUCTORS(__half, 5, 10)
};

struct __align__(4) __half2 {
    __half x, y;
    __half2() = default;
    constexpr __half2(const __half &a, const __half &b) : x(a), y(b) {}
    __half2(const __half2_raw &r) : x(__half_raw{r.x}), y(__half_raw{r.y}) {}
    __half2 &operator=(const __half2_raw &r) { return *this = __half2(r); }
    operator __half2_raw() const { return {__half_raw(x).x, __half_raw(y).x}; }
};

// A unary math function of T and T2 (componentwise), computed in float from `x` and rounded once.
#define EMU_HALF_MATH(T, T2, name, expr)                                                                           \
    inline T h##name(T a) {                                                                                        \
        const float x = float(a);                                                                                  \
        return T(expr);                                                                                            \
    }                                                                                                              \
    inline T2 h2##name(T2 a) { return T2(h##name(a.x), h##name(a.y)); }

// The conversions between T (stem N: __half2int_rn / __bfloat162int_rn) and integer type I in the four modes.
#define EMU_HALF_INT_CONVERSION(T, N, E, M, I, iname, sfx, mode)                                                   \
    inline T __##iname##2##N##_##sfx(I i) {                                                                        \
        return __ushort_as_##N((unsigned short)emu_num::int_to_ieee<E, M>(i, emu_num::Round::mode));               \
    }                                                                                                              \
    inline I __##N##2##iname##_##sfx(T h) { return emu_num::to_int<I>(float(h), emu_num::Round::mode); }
#define EMU_HALF_INT_CONVERSIONS(T, N, E, M, I, iname)                                                             \
    EMU_HALF_INT_CONVERSION(T, N, E, M, I, iname, rn, nearest)                                                     \
    EMU_HALF_INT_CONVERSION(T, N, E, M, I, iname, rz, zero)                                                        \
    EMU_HALF_INT_CONVERSION(T, N, E, M, I, iname, rd, down)                                                        \
    EMU_HALF_INT_CONVERSION(T, N, E, M, I, iname, ru, up)

// Everything __half and __nv_bfloat16 share: T the type, T2 its pair, N the stem of CUDA's names (half, bfloat16),
// (E, M) the format. The bit patterns 0x7FFF (canonical NaN) and 0x8000 (sign) are the same in both formats.
#define EMU_HALF_LIKE_API(T, T2, N, E, M)                                                                          \
    /* Bit reinterpretations */                                                                                    \
    inline unsigned short __##N##_as_ushort(T h) { return emu_num::bit_cast<unsigned short>(h); }                 \
    inline short __##N##_as_short(T h) { return (short)__##N##_as_ushort(h); }                                     \
    inline T __ushort_as_##N(unsigned short u) { return emu_num::bit_cast<T>(u); }                                 \
    inline T __short_as_##N(short s) { return __ushort_as_##N((unsigned short)s); }                                \
                                                                                                                   \
    /* Conversions with float and double */                                                                        \
    inline float __##N##2float(T h) { return float(h); }                                                           \
    inline T __float2##N(float a) { return T(a); }                                                                 \
    inline T __double2##N(double a) { return T(a); }                                                               \
    inline T __float2##N##_rn(float a) { return T(a); }                                                            \
    inline T __float2##N##_rz(float a) {                                                                           \
        return __ushort_as_##N((unsigned short)emu_num::float_to_ieee<E, M>(a, emu_num::Round::zero));             \
    }                                                                                                              \
    inline T __float2##N##_rd(float a) {                                                                           \
        return __ushort_as_##N((unsigned short)emu_num::float_to_ieee<E, M>(a, emu_num::Round::down));             \
    }                                                                                                              \
    inline T __float2##N##_ru(float a) {                                                                           \
        return __ushort_as_##N((unsigned short)emu_num::float_to_ieee<E, M>(a, emu_num::Round::up));               \
    }                                                                                                              \
    EMU_HALF_INT_CONVERSIONS(T, N, E, M, int, int)                                                                 \
    EMU_HALF_INT_CONVERSIONS(T, N, E, M, unsigned int, uint)                                                       \
    EMU_HALF_INT_CONVERSIONS(T, N, E, M, short, short)                                                             \
    EMU_HALF_INT_CONVERSIONS(T, N, E, M, unsigned short, ushort)                                                   \
    EMU_HALF_INT_CONVERSIONS(T, N, E, M, long long, ll)                                                            \
    EMU_HALF_INT_CONVERSIONS(T, N, E, M, unsigned long long, ull)                                                  \
    inline signed char __##N##2char_rz(T h) { return emu_num::to_int<signed char>(float(h), emu_num::Round::zero); } \
    inline unsigned char __##N##2uchar_rz(T h) {                                                                   \
        return emu_num::to_int<unsigned char>(float(h), emu_num::Round::zero);                                     \
    }                                                                                                              \
                                                                                                                   \
    /* Pairs: x is the low half, y the high one */                                                                 \
    inline T2 make_##N##2(T a, T b) { return T2(a, b); }                                                           \
    inline T2 __halves2##N##2(T a, T b) { return T2(a, b); }                                                       \
    inline T2 __##N##2##N##2(T a) { return T2(a, a); }                                                             \
    inline T __low2##N(T2 a) { return a.x; }                                                                       \
    inline T __high2##N(T2 a) { return a.y; }                                                                      \
    inline T2 __low2##N##2(T2 a) { return T2(a.x, a.x); }                                                          \
    inline T2 __high2##N##2(T2 a) { return T2(a.y, a.y); }                                                         \
    inline T2 __lows2##N##2(T2 a, T2 b) { return T2(a.x, b.x); }                                                   \
    inline T2 __highs2##N##2(T2 a, T2 b) { return T2(a.y, b.y); }                                                  \
    inline T2 __lowhigh2highlow(T2 a) { return T2(a.y, a.x); }                                                     \
    inline float __low2float(T2 a) { return float(a.x); }                                                          \
    inline float __high2float(T2 a) { return float(a.y); }                                                         \
    inline T2 __float2##N##2_rn(float a) { return T2(T(a), T(a)); }                                                \
    inline T2 __floats2##N##2_rn(float a, float b) { return T2(T(a), T(b)); }                                      \
    inline T2 __float22##N##2_rn(float2 a) { return T2(T(a.x), T(a.y)); }                                          \
    inline float2 __##N##22float2(T2 a) { return make_float2(float(a.x), float(a.y)); }                            \
                                                                                                                   \
    /* Classification and comparisons: the u forms are true when either operand is NaN */                          \
    inline bool __hisnan(T a) { return (__##N##_as_ushort(a) & 0x7FFF) > (((1u << E) - 1) << M); }                 \
    inline int __hisinf(T a) {                                                                                     \
        const unsigned short u = __##N##_as_ushort(a);                                                             \
        return (u & 0x7FFF) == (((1u << E) - 1) << M) ? (u >> 15 ? -1 : 1) : 0;                                    \
    }                                                                                                              \
    inline bool __heq(T a, T b) { return float(a) == float(b); }                                                   \
    inline bool __hne(T a, T b) { return float(a) < float(b) || float(a) > float(b); }                             \
    inline bool __hlt(T a, T b) { return float(a) < float(b); }                                                    \
    inline bool __hle(T a, T b) { return float(a) <= float(b); }                                                   \
    inline bool __hgt(T a, T b) { return float(a) > float(b); }                                                    \
    inline bool __hge(T a, T b) { return float(a) >= float(b); }                                                   \
    inline bool __hequ(T a, T b) { return !__hne(a, b); }                                                          \
    inline bool __hneu(T a, T b) { return !__heq(a, b); }                                                          \
    inline bool __hltu(T a, T b) { return !__hge(a, b); }                                                          \
    inline bool __hleu(T a, T b) { return !__hgt(a, b); }                                                          \
    inline bool __hgtu(T a, T b) { return !__hle(a, b); }                                                          \
    inline bool __hgeu(T a, T b) { return !__hlt(a, b); }                                                          \
    inline bool __hbeq2(T2 a, T2 b) { return __heq(a.x, b.x) && __heq(a.y, b.y); }                                 \
    inline bool __hbne2(T2 a, T2 b) { return __hne(a.x, b.x) && __hne(a.y, b.y); }                                 \
    inline bool __hbneu2(T2 a, T2 b) { return __hneu(a.x, b.x) && __hneu(a.y, b.y); }                              \
    inline bool __hblt2(T2 a, T2 b) { return __hlt(a.x, b.x) && __hlt(a.y, b.y); }                                 \
    inline bool __hble2(T2 a, T2 b) { return __hle(a.x, b.x) && __hle(a.y, b.y); }                                 \
    inline bool __hbgt2(T2 a, T2 b) { return __hgt(a.x, b.x) && __hgt(a.y, b.y); }                                 \
    inline bool __hbge2(T2 a, T2 b) { return __hge(a.x, b.x) && __hge(a.y, b.y); }                                 \
                                                                                                                   \
    /* Arithmetic, rounded once; _sat clamps to [0, 1] (NaN → 0), _relu clamps below at 0 */                       \
    inline T __hadd(T a, T b) { return T(float(a) + float(b)); }                                                   \
    inline T __hsub(T a, T b) { return T(float(a) - float(b)); }                                                   \
    inline T __hmul(T a, T b) { return T(float(a) * float(b)); }                                                   \
    inline T __hdiv(T a, T b) { return T(float(a) / float(b)); }                                                   \
    inline T __hadd_rn(T a, T b) { return __hadd(a, b); }                                                          \
    inline T __hsub_rn(T a, T b) { return __hsub(a, b); }                                                          \
    inline T __hmul_rn(T a, T b) { return __hmul(a, b); }                                                          \
    inline T __hfma(T a, T b, T c) { /* the product is exact in double */                                          \
        return T(emu_num::sum_odd(double(float(a)) * float(b), float(c)));                                         \
    }                                                                                                              \
    inline T __hadd_sat(T a, T b) { return T(__saturatef(float(__hadd(a, b)))); }                                  \
    inline T __hsub_sat(T a, T b) { return T(__saturatef(float(__hsub(a, b)))); }                                  \
    inline T __hmul_sat(T a, T b) { return T(__saturatef(float(__hmul(a, b)))); }                                  \
    inline T __hfma_sat(T a, T b, T c) { return T(__saturatef(float(__hfma(a, b, c)))); }                          \
    inline T __hfma_relu(T a, T b, T c) {                                                                          \
        const T r = __hfma(a, b, c);                                                                               \
        return __hisnan(r) ? __ushort_as_##N(0x7FFF) : float(r) < 0 ? T(0.0f) : r;                                 \
    }                                                                                                              \
    inline T __hneg(T a) { return __ushort_as_##N(__##N##_as_ushort(a) ^ 0x8000); }                                \
    inline T __habs(T a) {                                                                                         \
        return __hisnan(a) ? __ushort_as_##N(0x7FFF) : __ushort_as_##N(__##N##_as_ushort(a) & 0x7FFF);            \
    }                                                                                                              \
    /* One NaN operand yields the other (both NaN: canonical NaN); +0 is above −0. _nan: any NaN gives NaN */      \
    inline T __hmax(T a, T b) {                                                                                    \
        if (__hisnan(a)) return __hisnan(b) ? __ushort_as_##N(0x7FFF) : b;                                         \
        if (__hisnan(b)) return a;                                                                                 \
        if (float(a) != float(b)) return float(a) > float(b) ? a : b;                                              \
        return __ushort_as_##N(__##N##_as_ushort(a) & __##N##_as_ushort(b));                                       \
    }                                                                                                              \
    inline T __hmin(T a, T b) {                                                                                    \
        if (__hisnan(a)) return __hisnan(b) ? __ushort_as_##N(0x7FFF) : b;                                         \
        if (__hisnan(b)) return a;                                                                                 \
        if (float(a) != float(b)) return float(a) < float(b) ? a : b;                                              \
        return __ushort_as_##N(__##N##_as_ushort(a) | __##N##_as_ushort(b));                                       \
    }                                                                                                              \
    inline T __hmax_nan(T a, T b) { return __hisnan(a) || __hisnan(b) ? __ushort_as_##N(0x7FFF) : __hmax(a, b); }  \
    inline T __hmin_nan(T a, T b) { return __hisnan(a) || __hisnan(b) ? __ushort_as_##N(0x7FFF) : __hmin(a, b); }  \
                                                                                                                   \
    /* Pair arithmetic, componentwise */                                                                           \
    inline T2 __hadd2(T2 a, T2 b) { return T2(__hadd(a.x, b.x), __hadd(a.y, b.y)); }                               \
    inline T2 __hsub2(T2 a, T2 b) { return T2(__hsub(a.x, b.x), __hsub(a.y, b.y)); }                               \
    inline T2 __hmul2(T2 a, T2 b) { return T2(__hmul(a.x, b.x), __hmul(a.y, b.y)); }                               \
    inline T2 __h2div(T2 a, T2 b) { return T2(__hdiv(a.x, b.x), __hdiv(a.y, b.y)); }                               \
    inline T2 __hadd2_sat(T2 a, T2 b) { return T2(__hadd_sat(a.x, b.x), __hadd_sat(a.y, b.y)); }                   \
    inline T2 __hsub2_sat(T2 a, T2 b) { return T2(__hsub_sat(a.x, b.x), __hsub_sat(a.y, b.y)); }                   \
    inline T2 __hmul2_sat(T2 a, T2 b) { return T2(__hmul_sat(a.x, b.x), __hmul_sat(a.y, b.y)); }                   \
    inline T2 __hfma2(T2 a, T2 b, T2 c) { return T2(__hfma(a.x, b.x, c.x), __hfma(a.y, b.y, c.y)); }               \
    inline T2 __hfma2_sat(T2 a, T2 b, T2 c) { return T2(__hfma_sat(a.x, b.x, c.x), __hfma_sat(a.y, b.y, c.y)); }   \
    inline T2 __hneg2(T2 a) { return T2(__hneg(a.x), __hneg(a.y)); }                                               \
    inline T2 __habs2(T2 a) { return T2(__habs(a.x), __habs(a.y)); }                                               \
    inline T2 __hmax2(T2 a, T2 b) { return T2(__hmax(a.x, b.x), __hmax(a.y, b.y)); }                               \
    inline T2 __hmin2(T2 a, T2 b) { return T2(__hmin(a.x, b.x), __hmin(a.y, b.y)); }                               \
    inline T2 __hmax2_nan(T2 a, T2 b) { return T2(__hmax_nan(a.x, b.x), __hmax_nan(a.y, b.y)); }                   \
    inline T2 __hmin2_nan(T2 a, T2 b) { return T2(__hmin_nan(a.x, b.x), __hmin_nan(a.y, b.y)); }                   \
                                                                                                                   \
    /* Operators, as CUDA defines them (!= is unordered, the pair comparisons need both components) */             \
    inline T operator+(const T &a, const T &b) { return __hadd(a, b); }                                            \
    inline T operator-(const T &a, const T &b) { return __hsub(a, b); }                                            \
    inline T operator*(const T &a, const T &b) { return __hmul(a, b); }                                            \
    inline T operator/(const T &a, const T &b) { return __hdiv(a, b); }                                            \
    inline T &operator+=(T &a, const T &b) { return a = __hadd(a, b); }                                            \
    inline T &operator-=(T &a, const T &b) { return a = __hsub(a, b); }                                            \
    inline T &operator*=(T &a, const T &b) { return a = __hmul(a, b); }                                            \
    inline T &operator/=(T &a, const T &b) { return a = __hdiv(a, b); }                                            \
    inline T &operator++(T &a) { return a += T(1.0f); }                                                            \
    inline T &operator--(T &a) { return a -= T(1.0f); }                                                            \
    inline T operator++(T &a, int) { const T old = a; a += T(1.0f); return old; }                                  \
    inline T operator--(T &a, int) { const T old = a; a -= T(1.0f); return old; }                                  \
    inline T operator+(const T &a) { return a; }                                                                   \
    inline T operator-(const T &a) { return __hneg(a); }                                                           \
    inline bool operator==(const T &a, const T &b) { return __heq(a, b); }                                         \
    inline bool operator!=(const T &a, const T &b) { return __hneu(a, b); }                                        \
    inline bool operator<(const T &a, const T &b) { return __hlt(a, b); }                                          \
    inline bool operator<=(const T &a, const T &b) { return __hle(a, b); }                                         \
    inline bool operator>(const T &a, const T &b) { return __hgt(a, b); }                                          \
    inline bool operator>=(const T &a, const T &b) { return __hge(a, b); }                                         \
    inline T2 operator+(const T2 &a, const T2 &b) { return __hadd2(a, b); }                                        \
    inline T2 operator-(const T2 &a, const T2 &b) { return __hsub2(a, b); }                                        \
    inline T2 operator*(const T2 &a, const T2 &b) { return __hmul2(a, b); }                                        \
    inline T2 operator/(const T2 &a, const T2 &b) { return __h2div(a, b); }                                        \
    inline T2 &operator+=(T2 &a, const T2 &b) { return a = __hadd2(a, b); }                                        \
    inline T2 &operator-=(T2 &a, const T2 &b) { return a = __hsub2(a, b); }                                        \
    inline T2 &operator*=(T2 &a, const T2 &b) { return a = __hmul2(a, b); }                                        \
    inline T2 &operator/=(T2 &a, const T2 &b) { return a = __h2div(a, b); }                                        \
    inline T2 operator+(const T2 &a) { return a; }                                                                 \
    inline T2 operator-(const T2 &a) { return __hneg2(a); }                                                        \
    inline bool operator==(const T2 &a, const T2 &b) { return __hbeq2(a, b); }                                     \
    inline bool operator!=(const T2 &a, const T2 &b) { return __hbneu2(a, b); }                                    \
    inline bool operator<(const T2 &a, const T2 &b) { return __hblt2(a, b); }                                      \
    inline bool operator<=(const T2 &a, const T2 &b) { return __hble2(a, b); }                                     \
    inline bool operator>(const T2 &a, const T2 &b) { return __hbgt2(a, b); }                                      \
    inline bool operator>=(const T2 &a, const T2 &b) { return __hbge2(a, b); }                                     \
                                                                                                                   \
    /* Math functions (CUDA's are approximations; these are the float functions rounded once) */                  \
    EMU_HALF_MATH(T, T2, exp, std::exp(x))                                                                         \
    EMU_HALF_MATH(T, T2, exp2, std::exp2(x))                                                                       \
    EMU_HALF_MATH(T, T2, exp10, ::exp10f(x))                                                                       \
    EMU_HALF_MATH(T, T2, log, std::log(x))                                                                         \
    EMU_HALF_MATH(T, T2, log2, std::log2(x))                                                                       \
    EMU_HALF_MATH(T, T2, log10, std::log10(x))                                                                     \
    EMU_HALF_MATH(T, T2, sqrt, std::sqrt(x))                                                                       \
    EMU_HALF_MATH(T, T2, rsqrt, 1.0f / std::sqrt(x))                                                               \
    EMU_HALF_MATH(T, T2, rcp, 1.0f / x)                                                                            \
    EMU_HALF_MATH(T, T2, sin, std::sin(x))                                                                         \
    EMU_HALF_MATH(T, T2, cos, std::cos(x))                                                                         \
    EMU_HALF_MATH(T, T2, tanh, std::tanh(x))                                                                       \
    EMU_HALF_MATH(T, T2, ceil, std::ceil(x))                                                                       \
    EMU_HALF_MATH(T, T2, floor, std::floor(x))                                                                     \
    EMU_HALF_MATH(T, T2, trunc, std::trunc(x))                                                                     \
    EMU_HALF_MATH(T, T2, rint, std::nearbyint(x))                                                                  \
                                                                                                                   \
    /* Atomic adds by compare-and-swap on the bits (atomicCAS comes from emu_kernel.h) */                          \
    inline T atomicAdd(T *address, T val) {                                                                        \
        unsigned short *p = reinterpret_cast<unsigned short *>(address), old = *p, assumed;                        \
        do {                                                                                                       \
            assumed = old;                                                                                         \
            old = atomicCAS(p, assumed, __##N##_as_ushort(__hadd(__ushort_as_##N(assumed), val)));                 \
        } while (old != assumed);                                                                                  \
        return __ushort_as_##N(old);                                                                               \
    }                                                                                                              \
    inline T2 atomicAdd(T2 *address, T2 val) {                                                                     \
        unsigned int *p = reinterpret_cast<unsigned int *>(address), old = *p, assumed;                            \
        do {                                                                                                       \
            assumed = old;                                                                                         \
            const T2 sum = __hadd2(emu_num::bit_cast<T2>(assumed), val);                                           \
            old = atomicCAS(p, assumed, emu_num::bit_cast<unsigned int>(sum));                                     \
        } while (old != assumed);                                                                                  \
        return emu_num::bit_cast<T2>(old);                                                                         \
    }

EMU_HALF_LIKE_API(__half, __half2, half, 5, 10)

typedef __half half;
typedef __half2 half2;
typedef __half __nv_half;
typedef __half2 __nv_half2;
typedef __half_raw __nv_half_raw;
typedef __half2_raw __nv_half2_raw;
typedef __half nv_half;
typedef __half2 nv_half2;
