// Checks of the emulated device's numeric headers (cuda_fp16.h, cuda_bf16.h, cuda_fp8.h, emu_math.h, …) against
// independent references: the F16C instructions and GCC's _Float16 (correctly rounded, honouring the rounding mode)
// for fp16, an integer algorithm for bf16, a scale-and-round one for fp8, the host's IEEE arithmetic under
// fesetround for the directed-rounding float operations, and exact __float128 arithmetic for fused multiply-adds.
// Standalone; prints what failed and exits with status 1 on any failure.
//
//   g++ -std=c++17 -O2 -ffp-contract=off -I tools/cuda-emu/include tools/cuda-emu/tests/numeric_test.cpp
//       -o /tmp/numeric_test && /tmp/numeric_test [full]
//
// The float → 16/8-bit sweeps cover every 7th float bit pattern plus every rounding edge (each representable
// value, each halfway point and its two float neighbours, the overflow thresholds); `full` sweeps all 2^32.

#include <cfenv>
#include <cfloat>
#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <immintrin.h>
#include <random>
#include <vector>

// emu_kernel.h declares atomicCAS for the kernels; the fp16/bf16 atomics need these two.
unsigned short atomicCAS(unsigned short *p, unsigned short expected, unsigned short desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
unsigned int atomicCAS(unsigned int *p, unsigned int expected, unsigned int desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}

#include "cuda/std/limits"
#include "cuda_bf16.h"
#include "cuda_fp16.h"
#include "cuda_fp8.h"
#include "emu_math.h"
#include "math_constants.h"

// ---- Reporting ----
static long g_failures = 0;

// Counts a failure; the first 30 are printed.
__attribute__((format(printf, 1, 2))) static void fail(const char *fmt, ...) {
    if (++g_failures > 30) return;
    va_list args;
    va_start(args, fmt);
    printf("  FAIL: ");
    vprintf(fmt, args);
    printf("\n");
    va_end(args);
}
#define EXPECT(cond, ...)                                                                                              \
    do {                                                                                                               \
        if (!(cond)) fail(__VA_ARGS__);                                                                                \
    } while (0)

// Runs one group of checks, reporting its time and new failures.
template <class F> static void section(const char *name, F body) {
    const long before = g_failures;
    const auto t0 = std::chrono::steady_clock::now();
    body();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    printf("%-44s %s (%.1f s)\n", name, g_failures == before ? "ok" : "FAILED", s);
}

static uint32_t fbits(float f) { return __float_as_uint(f); }
static float bitsf(uint32_t u) { return __uint_as_float(u); }
static double pow2(int n) { return __longlong_as_double((long long)(1023 + n) << 52); }
static unsigned short f16bits(_Float16 h) { return emu_num::bit_cast<unsigned short>(h); }

// ---- References ----
// Value of encoding t (positive: finite, or the one past the largest, read as the next binade) of a format with E
// exponent and M mantissa bits: exact in double.
static double decode(unsigned t, int E, int M) {
    const int bias = (1 << (E - 1)) - 1, e = t >> M, m = t & ((1 << M) - 1);
    return e ? std::ldexp(m + (1 << M), e - bias - M) : std::ldexp(m, 1 - bias - M);
}

static bool has_f16c() { return __builtin_cpu_supports("f16c"); }
// fp16 conversion in hardware: imm selects the rounding (_MM_FROUND_TO_NEAREST_INT, _TO_ZERO, …).
__attribute__((target("f16c"))) static unsigned short f16c_half(float x, int imm) {
    switch (imm) {
    case _MM_FROUND_TO_ZERO:
        return _cvtss_sh(x, _MM_FROUND_TO_ZERO);
    case _MM_FROUND_TO_NEG_INF:
        return _cvtss_sh(x, _MM_FROUND_TO_NEG_INF);
    case _MM_FROUND_TO_POS_INF:
        return _cvtss_sh(x, _MM_FROUND_TO_POS_INF);
    default:
        return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
    }
}

// f() in fesetround mode `mode`: the host's SSE arithmetic and libgcc's soft-float _Float16 both honour it. The
// callers' volatile operands and results keep the compiler from moving the operation out of the mode's scope.
template <class F> static auto in_mode(int mode, F f) {
    fesetround(mode);
    const auto r = f();
    fesetround(FE_TONEAREST);
    return r;
}
static unsigned short soft_half(float x, int mode) {
    return in_mode(mode, [&] {
        volatile float vx = x;
        volatile _Float16 h = (_Float16)vx;
        return f16bits(h);
    });
}

// bf16 by integer rounding of the float bits (NaN: CUDA's canonical 0x7FFF).
static unsigned short ref_bf16(uint32_t u, emu_num::Round mode) {
    if ((u & 0x7fffffff) > 0x7f800000) return 0x7FFF;
    const bool neg = u >> 31, inexact = u & 0xffff;
    switch (mode) {
    case emu_num::Round::nearest:
        return (u + 0x7fff + (u >> 16 & 1)) >> 16;
    case emu_num::Round::zero:
        return u >> 16;
    case emu_num::Round::up:
        return (u >> 16) + (inexact && !neg);
    default:
        return (u >> 16) + (inexact && neg);
    }
}

// fp8 by scaling the magnitude so that the last kept bit is 1 and rounding to an integer with the 2^52 trick (round
// to nearest even in double); CUDA's saturation and NaN rules.
static unsigned ref_fp8(float x, bool e4m3, bool sat) {
    const int M = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15, emax = e4m3 ? 8 : 15;
    const unsigned top_q = e4m3 ? 14 : 7; // significand of the largest value, 1.11(0)b · 2^emax
    const uint32_t u = fbits(x);
    const unsigned sign = u >> 24 & 0x80;
    if (std::isnan(x)) return sign | (e4m3 ? 0x7F : 0x7E | (u >> 21 & 3));
    const unsigned overflow = sign | (sat ? (e4m3 ? 0x7E : 0x7B) : (e4m3 ? 0x7F : 0x7C));
    if (std::isinf(x)) return overflow;
    int e = std::max(int(u >> 23 & 0xff) - 127, 1 - bias); // x's exponent, or the subnormals' fixed one
    const double q = (std::fabs(double(x)) * pow2(M - e) + 0x1p52) - 0x1p52;
    unsigned qi = unsigned(q);
    if (qi == 2u << M) qi >>= 1, ++e; // rounded up into the next binade
    if (e > emax || (e == emax && qi > top_q)) return overflow;
    return sign | (qi < (1u << M) ? qi : unsigned(e + bias) << M | (qi - (1u << M)));
}

// Whether bits r of format (E, M) are `exact` rounded to nearest even (overflow: to infinity, read as the value of
// the next binade). Zero's sign is not checked.
static bool is_rne(unsigned r, __float128 exact, int E, int M) {
    const unsigned sign = 1u << (E + M), inf = ((1u << E) - 1) << M, mag = r & (sign - 1);
    if (mag > inf || (exact != 0 && (exact < 0) != bool(r & sign))) return false;
    const __float128 x = exact < 0 ? -exact : exact;
    auto dist = [&](unsigned t) {
        const __float128 d = x - (__float128)decode(t, E, M);
        return d < 0 ? -d : d;
    };
    const __float128 d = dist(mag);
    const bool below_ok = mag == 0 || d < dist(mag - 1) || (d == dist(mag - 1) && !(mag & 1));
    const bool above_ok = mag == inf || d < dist(mag + 1) || (d == dist(mag + 1) && !(mag & 1));
    return below_ok && above_ok;
}

// ---- Inputs ----
// Every representable positive value of format (E, M) up to `largest`, each halfway point to the next (also past
// the largest) and the halfway points' float neighbours, with both signs; plus the special floats.
static std::vector<float> edges(int E, int M, unsigned largest) {
    std::vector<float> v = {0.0f, INFINITY, NAN, bitsf(0x7f800001), bitsf(0x7fffffff), 0x1p-149f, 0x1p-126f, FLT_MAX};
    for (unsigned t = 0; t <= largest; ++t) {
        const float value = float(decode(t, E, M)), mid = float((decode(t, E, M) + decode(t + 1, E, M)) / 2);
        v.insert(v.end(), {value, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, INFINITY)});
    }
    const size_t n = v.size();
    for (size_t i = 0; i < n; ++i) v.push_back(-v[i]);
    return v;
}

// Calls check(x) on every stride-th float bit pattern, then on the edges.
template <class F> static void sweep(uint64_t stride, const std::vector<float> &edge_inputs, F check) {
    for (uint64_t u = 0; u < (1ull << 32); u += stride) check(bitsf(uint32_t(u)));
    for (float x : edge_inputs) check(x);
}

static std::mt19937_64 rng(20240601);
static float random_float() { return bitsf(uint32_t(rng())); }
// A float in ±[2^-lo, 2^hi): random sign, exponent and mantissa.
static float random_float_in(int lo, int hi) {
    const int e = int(rng() % unsigned(hi + lo)) - lo;
    const float f = float(std::ldexp(1.0 + double(rng() % (1u << 23)) / (1u << 23), e));
    return rng() & 1 ? -f : f;
}

static const emu_num::Round kModes[] = {emu_num::Round::zero, emu_num::Round::down, emu_num::Round::up};
static const int kFeModes[] = {FE_TOWARDZERO, FE_DOWNWARD, FE_UPWARD};
static const int kImmModes[] = {_MM_FROUND_TO_ZERO, _MM_FROUND_TO_NEG_INF, _MM_FROUND_TO_POS_INF};
static const char *const kModeNames[] = {"rz", "rd", "ru"};

// The library functions under test for a mode index (0 rz, 1 rd, 2 ru).
static __half half_directed(float x, int m) {
    return m == 0 ? __float2half_rz(x) : m == 1 ? __float2half_rd(x) : __float2half_ru(x);
}
static __nv_bfloat16 bf16_directed(float x, int m) {
    return m == 0 ? __float2bfloat16_rz(x) : m == 1 ? __float2bfloat16_rd(x) : __float2bfloat16_ru(x);
}

int main(int argc, char **argv) {
    const bool full = argc > 1 && !strcmp(argv[1], "full");
    const bool f16c = has_f16c();
    if (!f16c) printf("(no F16C: the fp16 sweep uses _Float16, on every 61st of its patterns)\n");
    const uint64_t stride = full ? 1 : 7;

    section("float -> half, round to nearest even", [&] {
        const std::vector<float> e = edges(5, 10, 0x7BFF);
        sweep(f16c ? stride : stride * 61, e, [&](float x) {
            const unsigned got = __half_as_ushort(__float2half(x));
            const unsigned want = std::isnan(x) ? 0x7FFF
                                  : f16c        ? f16c_half(x, _MM_FROUND_TO_NEAREST_INT)
                                                : soft_half(x, FE_TONEAREST);
            EXPECT(got == want, "__float2half(%a [%08x]) = %04x, want %04x", x, fbits(x), got, want);
        });
        for (float x : e) { // _Float16 itself, on the edges
            if (std::isnan(x)) continue;
            const unsigned got = __half_as_ushort(__float2half_rn(x)), want = soft_half(x, FE_TONEAREST);
            EXPECT(got == want, "__float2half_rn(%a) = %04x, _Float16 %04x", x, got, want);
        }
    });

    section("float -> bf16, round to nearest even", [&] {
        sweep(stride, edges(8, 7, 0x7F7F), [&](float x) {
            const unsigned got = __bfloat16_as_ushort(__float2bfloat16(x));
            const unsigned want = ref_bf16(fbits(x), emu_num::Round::nearest);
            EXPECT(got == want, "__float2bfloat16(%a [%08x]) = %04x, want %04x", x, fbits(x), got, want);
        });
    });

    for (bool e4m3 : {true, false}) {
        section(e4m3 ? "float -> fp8 e4m3 (satfinite, nosat)" : "float -> fp8 e5m2 (satfinite, nosat)", [&] {
            const __nv_fp8_interpretation_t kind = e4m3 ? __NV_E4M3 : __NV_E5M2;
            const std::vector<float> e = edges(e4m3 ? 4 : 5, e4m3 ? 3 : 2, e4m3 ? 0x7E : 0x7B);
            // The modes differ only beyond the largest value, which the edges cover: nosat sweeps more sparsely.
            for (bool sat : {true, false}) {
                sweep(sat ? stride : stride * 16, e, [&](float x) {
                    const unsigned got = __nv_cvt_float_to_fp8(x, sat ? __NV_SATFINITE : __NV_NOSAT, kind);
                    const unsigned want = ref_fp8(x, e4m3, sat);
                    EXPECT(got == want, "%s %s (%a [%08x]) = %02x, want %02x", e4m3 ? "e4m3" : "e5m2",
                           sat ? "sat" : "nosat", x, fbits(x), got, want);
                });
            }
        });
    }

    section("half/bf16/fp8 -> float, every pattern", [] {
        for (unsigned b = 0; b < 0x10000; ++b) {
            const float h = __half2float(__ushort_as_half(b)),
                        want_h = float(emu_num::bit_cast<_Float16>((unsigned short)b));
            EXPECT(std::isnan(want_h) ? std::isnan(h) : fbits(h) == fbits(want_h), "__half2float(%04x) = %a", b, h);
            const float f = __bfloat162float(__ushort_as_bfloat16(b));
            EXPECT(fbits(f) == b << 16, "__bfloat162float(%04x) = %08x", b, fbits(f));
        }
        for (unsigned b = 0; b < 0x100; ++b) {
            for (bool e4m3 : {true, false}) {
                const __nv_fp8_interpretation_t kind = e4m3 ? __NV_E4M3 : __NV_E5M2;
                const unsigned got = __nv_cvt_fp8_to_halfraw(b, kind).x, mag = b & 0x7F;
                const bool nan = e4m3 ? mag == 0x7F : mag > 0x7C;
                const double value =
                    (e4m3 || mag < 0x7C ? decode(mag, e4m3 ? 4 : 5, e4m3 ? 3 : 2) : INFINITY) * (b & 0x80 ? -1 : 1);
                EXPECT(nan ? got == 0x7FFF
                           : double(__half2float(__ushort_as_half(got))) == value && got >> 15 == b >> 7,
                       "fp8 %s %02x -> half %04x", e4m3 ? "e4m3" : "e5m2", b, got);
                // Back: every finite fp8 value is exact in float, half and bf16.
                if (!nan) {
                    EXPECT(__nv_cvt_float_to_fp8(float(value), __NV_NOSAT, kind) == b, "fp8 %02x round trip", b);
                    EXPECT(__nv_cvt_halfraw_to_fp8(__half_raw{(unsigned short)got}, __NV_NOSAT, kind) == b,
                           "fp8 %02x via half", b);
                    EXPECT(__nv_cvt_bfloat16raw_to_fp8(__nv_bfloat16(float(value)), __NV_NOSAT, kind) == b,
                           "fp8 %02x via bf16", b);
                }
            }
        }
    });

    section("float -> half/bf16, _rz/_rd/_ru", [&] {
        std::vector<float> xs = edges(5, 10, 0x7BFF), bf = edges(8, 7, 0x7F7F);
        xs.insert(xs.end(), bf.begin(), bf.end());
        for (int i = 0; i < 300000; ++i) xs.push_back(random_float());
        for (int m = 0; m < 3; ++m) {
            for (float x : xs) {
                const unsigned h = __half_as_ushort(half_directed(x, m)), b = __bfloat16_as_ushort(bf16_directed(x, m));
                if (std::isnan(x)) {
                    EXPECT(h == 0x7FFF && b == 0x7FFF, "%s(NaN) = %04x / %04x", kModeNames[m], h, b);
                    continue;
                }
                const unsigned want_h = f16c ? f16c_half(x, kImmModes[m]) : soft_half(x, kFeModes[m]);
                EXPECT(h == want_h, "__float2half_%s(%a) = %04x, want %04x", kModeNames[m], x, h, want_h);
                EXPECT(b == ref_bf16(fbits(x), kModes[m]), "__float2bfloat16_%s(%a) = %04x", kModeNames[m], x, b);
            }
            for (size_t i = 0; i < xs.size(); i += 37) { // _Float16 under fesetround agrees too
                if (std::isnan(xs[i])) continue;
                const unsigned h = __half_as_ushort(half_directed(xs[i], m)), want = soft_half(xs[i], kFeModes[m]);
                EXPECT(h == want, "__float2half_%s(%a) = %04x, _Float16 %04x", kModeNames[m], xs[i], h, want);
            }
        }
    });

    section("double -> half/bf16/float", [] {
        for (int i = 0; i < 200000; ++i) {
            const double d = __longlong_as_double((long long)rng()),
                         near = std::ldexp(double(rng() >> 11), int(rng() % 80) - 100);
            for (double x : {d, near, -near}) {
                const unsigned h = __half_as_ushort(__double2half(x)), b = __bfloat16_as_ushort(__double2bfloat16(x));
                if (std::isnan(x)) {
                    EXPECT(h == 0x7FFF && b == 0x7FFF, "__double2half/bfloat16(NaN)");
                    continue;
                }
                EXPECT(h == f16bits((_Float16)x), "__double2half(%a) = %04x", x, h);
                EXPECT(is_rne(b, x, 8, 7), "__double2bfloat16(%a) = %04x", x, b);
                for (int m = 0; m < 3; ++m) {
                    const float got = m == 0   ? __double2float_rz(x)
                                      : m == 1 ? __double2float_rd(x)
                                               : __double2float_ru(x);
                    const float want = in_mode(kFeModes[m], [&] {
                        volatile double vx = x;
                        volatile float r = float(vx);
                        return float(r);
                    });
                    EXPECT(fbits(got) == fbits(want), "__double2float_%s(%a) = %a, want %a", kModeNames[m], x, got,
                           want);
                }
            }
        }
    });

    section("integer <-> half/bf16/float conversions", [] {
        // A value between two bf16 numbers just above the halfway point: rounding through float first would tie.
        EXPECT(__bfloat162float(__int2bfloat16_rn((1 << 30) + (1 << 22) + 1)) == 0x1p30f + 0x1p23f,
               "int -> bf16 rounds once");
        EXPECT(__bfloat162float(__ll2bfloat16_rn((1ll << 62) + (1ll << 54) + 1)) == 0x1p62f + 0x1p55f,
               "ll -> bf16 rounds once");
        // 64-bit magnitudes: the lowest bit still breaks a tie.
        EXPECT(__ull2float_rn((1ull << 63) + (1ull << 39) + 1) == 0x1p63f + 0x1p40f, "__ull2float_rn sticky bit");
        EXPECT(__ull2double_rn((1ull << 63) + (1ull << 10) + 1) == 0x1p63 + 0x1p11, "__ull2double_rn sticky bit");
        EXPECT(__bfloat162float(__ull2bfloat16_rn((1ull << 63) + (1ull << 55) + 1)) == 0x1p63f + 0x1p56f,
               "__ull2bfloat16_rn sticky bit");
        for (int i = 0; i < 100000; ++i) {
            const long long v = (long long)rng() >> (rng() % 64);
            const int iv = int(v);
            EXPECT(__half_as_ushort(__int2half_rn(iv)) == f16bits((_Float16)float(iv)) || std::abs(iv) >= (1 << 24),
                   "__int2half_rn(%d)", iv);
            for (int m = 0; m < 3; ++m) {
                const float got = m == 0 ? __ll2float_rz(v) : m == 1 ? __ll2float_rd(v) : __ll2float_ru(v);
                const float want = in_mode(kFeModes[m], [&] {
                    volatile long long vv = v;
                    volatile float r = float(vv);
                    return float(r);
                });
                EXPECT(got == want, "__ll2float_%s(%lld) = %a, want %a", kModeNames[m], v, got, want);
                const float gotu = m == 0 ? __ull2float_rz(v) : m == 1 ? __ull2float_rd(v) : __ull2float_ru(v);
                const float wantu = in_mode(kFeModes[m], [&] {
                    volatile unsigned long long vv = v;
                    volatile float r = float(vv);
                    return float(r);
                });
                EXPECT(gotu == wantu, "__ull2float_%s(%llu) = %a, want %a", kModeNames[m], (unsigned long long)v, gotu,
                       wantu);
                const double gotd = m == 0 ? __ll2double_rz(v) : m == 1 ? __ll2double_rd(v) : __ll2double_ru(v);
                const double wantd = in_mode(kFeModes[m], [&] {
                    volatile long long vv = v;
                    volatile double r = double(vv);
                    return double(r);
                });
                EXPECT(gotd == wantd, "__ll2double_%s(%lld) = %a, want %a", kModeNames[m], v, gotd, wantd);
            }
        }
        EXPECT(__half2int_rn(__float2half(2.5f)) == 2 && __half2int_rn(__float2half(3.5f)) == 4,
               "__half2int_rn ties to even");
        EXPECT(__half2int_rd(__float2half(-1.5f)) == -2 && __half2int_ru(__float2half(-1.5f)) == -1,
               "__half2int_rd/_ru");
        EXPECT(__half2int_rz(__float2half(-1.5f)) == -1, "__half2int_rz");
        EXPECT(__half2uint_rn(__float2half(-3.0f)) == 0 && __half2ushort_rz(__float2half(65504.0f)) == 65504,
               "__half2uint saturation");
        EXPECT(__half2short_rz(__float2half(INFINITY)) == 32767 && __half2char_rz(__float2half(-300.0f)) == -128,
               "__half2short/char saturation");
        EXPECT(__half2int_rz(__ushort_as_half(0x7E00)) == 0 && __half2ll_rz(__ushort_as_half(0x7E00)) == LLONG_MIN,
               "NaN -> integer");
        EXPECT(__half_as_ushort(__uint2half_rn(65520)) == 0x7C00 && __half_as_ushort(__uint2half_rz(70000)) == 0x7BFF,
               "uint -> half overflow");
        EXPECT(__half_as_ushort(__int2half_rd(-65520)) == 0xFC00 && __half_as_ushort(__int2half_ru(-70000)) == 0xFBFF,
               "int -> half directed overflow");
        EXPECT(__bfloat162int_rn(__float2bfloat16(-2.5f)) == -2 &&
                   __bfloat162ull_rz(__float2bfloat16(1e30f)) == ULLONG_MAX,
               "bf16 -> integer");
        EXPECT(__float2int_rn(2.5f) == 2 && __float2int_rn(-2.5f) == -2 && __float2int_rd(-0.5f) == -1 &&
                   __float2int_ru(0.25f) == 1,
               "__float2int");
        EXPECT(__float2int_rz(3e9f) == INT_MAX && __float2int_rz(-3e9f) == INT_MIN && __float2int_rn(NAN) == 0,
               "__float2int saturation");
        EXPECT(__float2uint_rn(-1.0f) == 0 && __float2uint_ru(4294967296.0f) == UINT_MAX, "__float2uint saturation");
        EXPECT(__float2ll_rn(NAN) == LLONG_MIN && __float2ull_rn(NAN) == 0x8000000000000000ull &&
                   __float2ll_rd(1e30f) == LLONG_MAX,
               "__float2ll");
        EXPECT(__double2int_rn(1e10) == INT_MAX && __double2ull_rz(1.9) == 1, "__double2int");
        EXPECT(__int2float_rz(16777217) == 16777216.0f && __int2float_ru(16777217) == 16777218.0f,
               "__int2float_rz/_ru");
        EXPECT(__uint2float_rd(0xffffffffu) == 4294967040.0f && __uint2float_rn(0xffffffffu) == 4294967296.0f,
               "__uint2float");
        // The class's own conversions: integers construct rounding to nearest, convert back truncating.
        const __half h = 70000; // overflows to inf
        EXPECT(__hisinf(h) == 1 && int(__half(-2.75f)) == -2 && (unsigned char)__half(300.0f) == 255,
               "__half integer conversions");
        const __nv_bfloat16 b = 257u; // 257 is not a bf16: rounds to 256
        EXPECT(float(b) == 256.0f && (long long)__nv_bfloat16(-1e20f) == LLONG_MIN, "bf16 integer conversions");
        EXPECT(float(__half(__nv_bfloat16(1.0078125f))) == 1.0078125f &&
                   float(__nv_bfloat16(__half(1.0009765625f))) == 1.0f,
               "half <-> bf16");
    });

    section("half arithmetic vs _Float16 and exact fma", [] {
        auto random_half = [] { return __ushort_as_half((unsigned short)rng()); };
        for (int i = 0; i < 300000; ++i) {
            const __half a = random_half(), b = random_half(), c = random_half();
            const _Float16 fa = emu_num::bit_cast<_Float16>(a), fb = emu_num::bit_cast<_Float16>(b);
            const std::pair<__half, _Float16> ops[] = {{__hadd(a, b), fa + fb}, {__hsub(a, b), fa - fb},
                                                       {__hmul(a, b), fa * fb}, {__hdiv(a, b), fa / fb},
                                                       {a + b, fa + fb},        {a * b, fa * fb}};
            for (const auto &op : ops) {
                const bool nan = std::isnan(float(op.second));
                EXPECT(nan ? __hisnan(op.first) : __half_as_ushort(op.first) == f16bits(op.second),
                       "half op #%d (%04x, %04x) = %04x, want %04x", int(&op - ops), __half_as_ushort(a),
                       __half_as_ushort(b), __half_as_ushort(op.first), f16bits(op.second));
            }
            if (__hisnan(a) || __hisnan(b) || __hisnan(c) || __hisinf(a) || __hisinf(b) || __hisinf(c)) continue;
            const __half r = __hfma(a, b, c);
            const __float128 exact = (__float128)float(a) * float(b) + float(c);
            EXPECT(is_rne(__half_as_ushort(r), exact, 5, 10), "__hfma(%04x, %04x, %04x) = %04x", __half_as_ushort(a),
                   __half_as_ushort(b), __half_as_ushort(c), __half_as_ushort(r));
        }
        // A product exactly halfway between halves, nudged by a tiny addend: double rounding would lose the nudge.
        const __half one_plus = __float2half(1.0f + 0x1p-10f), tiny = __float2half(0x1p-24f);
        EXPECT(float(__hfma(one_plus, __float2half(1.0f + 0x1p-1f), tiny)) ==
                   float(__float2half_ru(1.5f + 0x1p-10f + 0x1p-11f)),
               "__hfma single rounding");
    });

    section("bf16 arithmetic (exact references)", [] {
        for (int i = 0; i < 300000; ++i) {
            const __nv_bfloat16 a = __float2bfloat16(random_float_in(30, 30)),
                                b = __float2bfloat16(random_float_in(30, 30)),
                                c = __float2bfloat16(random_float_in(30, 30));
            const __float128 fa = float(a), fb = float(b), fc = float(c);
            EXPECT(is_rne(__bfloat16_as_ushort(a + b), fa + fb, 8, 7), "bf16 add");
            EXPECT(is_rne(__bfloat16_as_ushort(__hsub(a, b)), fa - fb, 8, 7), "bf16 sub");
            EXPECT(is_rne(__bfloat16_as_ushort(a * b), fa * fb, 8, 7), "bf16 mul");
            EXPECT(is_rne(__bfloat16_as_ushort(__hfma(a, b, c)), fa * fb + fc, 8, 7), "bf16 fma(%a, %a, %a) = %a",
                   float(a), float(b), float(c), float(__hfma(a, b, c)));
            const __nv_bfloat162 p = __hadd2(__halves2bfloat162(a, b), __halves2bfloat162(c, a));
            EXPECT(__bfloat16_as_ushort(p.x) == __bfloat16_as_ushort(a + c) &&
                       __bfloat16_as_ushort(p.y) == __bfloat16_as_ushort(b + a),
                   "__hadd2 on bf16 pairs");
        }
        // The largest bf16 times 2 overflows to infinity; 2^-133 is the smallest subnormal.
        const __nv_bfloat16 big = std::numeric_limits<__nv_bfloat16>::max(), two = 2.0f;
        EXPECT(__hisinf(big * two) == 1 && __hisinf(-big * two) == -1, "bf16 overflow");
        EXPECT(float(__float2bfloat16(0x1p-133f)) == 0x1p-133f && float(__float2bfloat16(0x1p-134f)) == 0.0f,
               "bf16 subnormals");
    });

    section("min/max, comparisons, NaN handling", [] {
        const __half nan = __ushort_as_half(0x7E01), one = 1.0f, two = 2.0f, pz = 0.0f, nz = -0.0f;
        EXPECT(__half_as_ushort(__hmax(nan, one)) == 0x3C00 && __half_as_ushort(__hmin(one, nan)) == 0x3C00,
               "__hmax/__hmin ignore NaN");
        EXPECT(__half_as_ushort(__hmax(nan, nan)) == 0x7FFF && __half_as_ushort(__hmax_nan(one, nan)) == 0x7FFF,
               "NaN results are canonical");
        EXPECT(__half_as_ushort(__hmax(nz, pz)) == 0 && __half_as_ushort(__hmin(pz, nz)) == 0x8000, "+0 > -0");
        EXPECT(__half_as_ushort(__hmax(one, two)) == 0x4000 && __half_as_ushort(__hmin_nan(one, two)) == 0x3C00,
               "__hmax/__hmin");
        EXPECT(!__heq(nan, nan) && __hneu(nan, nan) && !__hne(nan, one) && __hltu(nan, one) && !__hlt(nan, one),
               "NaN comparisons");
        EXPECT(nan != nan && !(nan == nan) && one < two && two >= one && pz == nz, "__half operators");
        EXPECT(__half_as_ushort(__habs(__float2half(-3.0f))) == 0x4200 &&
                   __half_as_ushort(__habs(__ushort_as_half(0xFE01))) == 0x7FFF,
               "__habs");
        EXPECT(__half_as_ushort(-one) == 0xBC00 && __hisnan(nan) && !__hisnan(one) &&
                   __hisinf(__ushort_as_half(0xFC00)) == -1,
               "__hneg, classification");
        EXPECT(__half_as_ushort(__hadd_sat(two, one)) == 0x3C00 && __half_as_ushort(__hfma_relu(one, -two, one)) == 0,
               "_sat/_relu");
        const __nv_bfloat16 bn = __ushort_as_bfloat16(0x7FC1), b1 = 1.0f;
        EXPECT(__bfloat16_as_ushort(__hmax(bn, b1)) == 0x3F80 && __bfloat16_as_ushort(__hmax_nan(bn, b1)) == 0x7FFF,
               "bf16 max");
        EXPECT(__bfloat16_as_ushort(__float2bfloat16(NAN)) == 0x7FFF && __half_as_ushort(__float2half(-NAN)) == 0x7FFF,
               "canonical NaN");
        // CUDA's global min/max: unsigned when mixed, NaN-ignoring for floats; std::min untouched.
        EXPECT(min(-1, 1u) == 1u && max(-1, 2) == 2 && min(3ll, 2ll) == 2 && max(5ul, 7l) == 7ul, "integer min/max");
        EXPECT(min(NAN, 1.0f) == 1.0f && max(2.0, NAN) == 2.0 && std::min(1, 2) == 1 && fmaxf(NAN, -1.0f) == -1.0f,
               "float min/max");
        EXPECT(isnan(NAN) && isinf(-INFINITY) && isfinite(1.0f) && signbit(-0.0f) && !signbit(0.0) &&
                   isnan(double(NAN)),
               "classification");
    });

    section("float ops in directed modes vs fesetround", [] {
        for (int i = 0; i < 200000; ++i) {
            const float a = i % 2 ? random_float() : random_float_in(60, 60),
                        b = i % 2 ? random_float() : random_float_in(60, 60), c = random_float_in(60, 60);
            for (int m = 0; m < 3; ++m) {
                const float got[] = {m == 0   ? __fadd_rz(a, b)
                                     : m == 1 ? __fadd_rd(a, b)
                                              : __fadd_ru(a, b),
                                     m == 0   ? __fsub_rz(a, b)
                                     : m == 1 ? __fsub_rd(a, b)
                                              : __fsub_ru(a, b),
                                     m == 0   ? __fmul_rz(a, b)
                                     : m == 1 ? __fmul_rd(a, b)
                                              : __fmul_ru(a, b),
                                     m == 0   ? __fdiv_rz(a, b)
                                     : m == 1 ? __fdiv_rd(a, b)
                                              : __fdiv_ru(a, b),
                                     m == 0   ? __fsqrt_rz(a)
                                     : m == 1 ? __fsqrt_rd(a)
                                              : __fsqrt_ru(a),
                                     m == 0   ? __frcp_rz(a)
                                     : m == 1 ? __frcp_rd(a)
                                              : __frcp_ru(a),
                                     m == 0   ? __fmaf_rz(a, b, c)
                                     : m == 1 ? __fmaf_rd(a, b, c)
                                              : __fmaf_ru(a, b, c)};
                float want[7];
                in_mode(kFeModes[m], [&] {
                    volatile float va = a, vb = b, vc = c;
                    volatile float r[] = {va + vb,
                                          va - vb,
                                          va * vb,
                                          va / vb,
                                          std::sqrt(float(va)),
                                          1.0f / va,
                                          std::fma(float(va), float(vb), float(vc))};
                    for (int k = 0; k < 7; ++k) want[k] = r[k];
                    return 0;
                });
                for (int k = 0; k < 7; ++k)
                    EXPECT(std::isnan(want[k]) ? std::isnan(got[k]) : fbits(got[k]) == fbits(want[k]),
                           "directed op #%d _%s(%a, %a, %a) = %a, want %a", k, kModeNames[m], a, b, c, got[k], want[k]);
            }
            EXPECT(__fmul_rn(a, b) == a * b || std::isnan(a * b), "__fmul_rn");
            EXPECT(fbits(__fmaf_rn(a, b, c)) == fbits(std::fma(a, b, c)) || std::isnan(std::fma(a, b, c)), "__fmaf_rn");
        }
    });

    section("math functions", [] {
        for (float y = -0.999f; y < 1.0f; y += 0.0137f) {
            EXPECT(std::fabs(std::erf(double(erfinvf(y))) - y) < 1e-6, "erfinvf(%g) = %g", y, erfinvf(y));
            const float c = y + 1.0f; // (0, 2)
            EXPECT(std::fabs(std::erfc(double(erfcinvf(c))) - c) < 1e-6 * c + 1e-7, "erfcinvf(%g)", c);
        }
        for (double c : {1e-10, 1e-30, 1e-100, 1e-300}) {
            const double x = erfcinv(c);
            EXPECT(std::fabs(std::erfc(x) / c - 1) < 1e-12, "erfcinv(%g) = %.17g", c, x);
        }
        EXPECT(erfinv(0.0) == 0 && std::isinf(erfinv(1.0)) && std::isnan(erfinv(1.5)) && erfcinvf(2.0f) == -INFINITY,
               "erfinv edges");
        EXPECT(std::fabs(normcdfinvf(0.975f) - 1.959964f) < 1e-5f && normcdff(0.0f) == 0.5f &&
                   std::fabs(normcdf(-1.0) - 0.15865525393145707) < 1e-15,
               "normcdf/normcdfinv");
        EXPECT(sinpif(1.0f) == 0 && sinpif(-3.0f) == 0 && sinpif(0.5f) == 1 && cospif(0.5f) == 0 &&
                   cospif(1.0f) == -1 && cospi(2.0) == 1,
               "sinpi/cospi exact");
        EXPECT(std::fabs(sinpif(0.25f) - float(M_SQRT1_2)) < 1e-7f && std::fabs(cospi(1.0 / 3) - 0.5) < 1e-15,
               "sinpi/cospi");
        float s, c;
        sincospif(1.5f, &s, &c);
        EXPECT(s == -1 && c == 0, "sincospif");
        EXPECT(rsqrtf(4.0f) == 0.5f && rcbrtf(8.0f) == 0.5f && rsqrt(0.25) == 2 && __frsqrt_rn(16.0f) == 0.25f,
               "rsqrt/rcbrt");
        EXPECT(__saturatef(NAN) == 0 && __saturatef(1.5f) == 1 && __saturatef(-2.0f) == 0 &&
                   __saturatef(0.25f) == 0.25f,
               "__saturatef");
        EXPECT(std::fabs(__expf(1.0f) - float(M_E)) < 1e-6f && __exp10f(2.0f) == 100.0f &&
                   __fdividef(1.0f, 4.0f) == 0.25f,
               "fast intrinsics");
        EXPECT(float(hexp(__float2half(0.0f))) == 1 && float(hsqrt(__nv_bfloat16(4.0f))) == 2 &&
                   float(hrcp(__half(4.0f))) == 0.25f,
               "h math");
        EXPECT(float(hrint(__half(2.5f))) == 2 && float(hfloor(__nv_bfloat16(-1.5f))) == -2 &&
                   float(h2ceil(__floats2half2_rn(0.5f, 1.5f)).y) == 2,
               "h rounding");
        EXPECT(CUDART_PI_F == 3.141592654f && CUDART_SQRT_HALF_F == 0.707106781f && CUDART_LNPI_F == 1.144729886f &&
                   CUDART_L2T_F == 3.321928094f && std::isinf(CUDART_INF_F) && CUDART_NAN != CUDART_NAN,
               "math constants");
        EXPECT(__double2hiint(1.0) == 0x3ff00000 && __double2loint(1.0) == 0 && __hiloint2double(0x40000000, 0) == 2.0,
               "double words");
    });

    section("integer intrinsics", [] {
        EXPECT(__popc(0xF0F0u) == 8 && __popcll(~0ull) == 64 && __clz(0) == 32 && __clz(1) == 31 && __clzll(-1) == 0,
               "popc/clz");
        EXPECT(__ffs(0) == 0 && __ffs(8) == 4 && __ffsll(1ll << 40) == 41, "ffs");
        EXPECT(__brev(1u) == 0x80000000u && __brev(0x12345678u) == 0x1E6A2C48u && __brevll(1ull) == 1ull << 63, "brev");
        EXPECT(__byte_perm(0x33221100u, 0x77665544u, 0x5410u) == 0x55441100u &&
                   __byte_perm(0x33221100u, 0, 0x0123u) == 0x00112233u,
               "byte_perm");
        EXPECT(__funnelshift_l(0x80000000u, 1u, 1u) == 3u && __funnelshift_l(1u, 2u, 33u) == 4u &&
                   __funnelshift_lc(1u, 2u, 40u) == 1u,
               "funnelshift_l");
        EXPECT(__funnelshift_r(0x2u, 0x1u, 1u) == 0x80000001u && __funnelshift_rc(1u, 2u, 40u) == 2u, "funnelshift_r");
        EXPECT(__mulhi(-2, 0x40000000) == -1 && __umulhi(0x80000000u, 4u) == 2u && __mul64hi(-1, 1) == -1 &&
                   __umul64hi(1ull << 63, 4) == 2,
               "mulhi");
        EXPECT(__mul24(-3, 0x01000005) == -15 && __umul24(0x01000003u, 5u) == 15u, "mul24");
        EXPECT(__sad(-3, 4, 1u) == 8u && __usad(2u, 9u, 1u) == 8u, "sad");
        EXPECT(__hadd(INT_MAX, INT_MAX) == INT_MAX && __rhadd(1, 2) == 2 && __hadd(-3, 0) == -2 &&
                   __uhadd(~0u, ~0u) == ~0u && __urhadd(1u, 2u) == 2u,
               "halving adds");
        EXPECT(float(__hadd(__half(1.0f), __half(2.0f))) == 3.0f, "__hadd(__half) is the fp16 add");
        EXPECT(__dp4a(0x01FF0203, 0x02020202, 10) == 10 + 2 * (1 - 1 + 2 + 3) &&
                   __dp4a(0xFF000000u, 0x02000000u, 1u) == 511u,
               "dp4a");
        EXPECT(__float_as_int(1.0f) == 0x3f800000 && __int_as_float(0x40000000) == 2.0f &&
                   __double_as_longlong(1.0) == 0x3ff0000000000000ll,
               "reinterpretations");
    });

    section("types, limits, atomics", [] {
        static_assert(sizeof(__half) == 2 && alignof(__half) == 2 && sizeof(__half2) == 4 && alignof(__half2) == 4, "");
        static_assert(sizeof(__nv_bfloat16) == 2 && alignof(__nv_bfloat162) == 4 && sizeof(__nv_fp8_e4m3) == 1, "");
        static_assert(alignof(__nv_fp8x2_e5m2) == 2 && sizeof(__nv_fp8x2_e4m3) == 2, "");
        static_assert(alignof(float2) == 8 && alignof(float4) == 16 && alignof(float3) == 4 && sizeof(float3) == 12,
                      "");
        static_assert(alignof(double2) == 16 && alignof(int4) == 16 && alignof(int2) == 8 && alignof(uchar4) == 4, "");
        static_assert(alignof(char2) == 2 && alignof(short4) == 8 && alignof(longlong2) == 16 && alignof(double4) == 16,
                      "");
        static_assert(alignof(ushort2) == 4 && alignof(ulonglong2) == 16 && alignof(double4_32a) == 32, "");
        static_assert(std::is_trivially_copyable<__half>::value &&
                          std::is_trivially_default_constructible<__nv_bfloat162>::value,
                      "");
        constexpr dim3 d(4);
        static_assert(d.x == 4 && d.y == 1 && d.z == 1, "dim3 defaults");
        const float4 f = make_float4(1, 2, 3, 4);
        EXPECT(f.w == 4 && make_int2(1, 2).y == 2 && uint3(dim3(1, 2, 3)).z == 3, "vector constructors");
        using HL = cuda::std::numeric_limits<__half>;
        using BL = cuda::std::numeric_limits<__nv_bfloat16>;
        EXPECT(__half_as_ushort(HL::max()) == 0x7BFF && __half_as_ushort(HL::lowest()) == 0xFBFF &&
                   float(HL::min()) == 0x1p-14f && float(HL::epsilon()) == 0x1p-10f && __hisinf(HL::infinity()) &&
                   __hisnan(HL::quiet_NaN()) && HL::is_specialized,
               "numeric_limits<__half>");
        EXPECT(float(BL::max()) == 0x1.FEp127f && float(BL::lowest()) == -0x1.FEp127f &&
                   float(BL::min()) == 0x1p-126f && float(BL::epsilon()) == 0x1p-7f &&
                   float(BL::denorm_min()) == 0x1p-133f && BL::digits == 8,
               "numeric_limits<__nv_bfloat16>");
        EXPECT(cuda::std::numeric_limits<int64_t>::lowest() == INT64_MIN &&
                   cuda::std::numeric_limits<uint8_t>::max() == 255 && (cuda::std::is_same<int, int>::value),
               "numeric_limits forwarding");
        __half h = 1.0f;
        const __half old = atomicAdd(&h, __half(0.5f));
        __nv_bfloat162 b2 = __floats2bfloat162_rn(1.0f, 2.0f);
        atomicAdd(&b2, __floats2bfloat162_rn(0.5f, 0.25f));
        __nv_bfloat16 b = 3.0f;
        atomicAdd(&b, __nv_bfloat16(-1.0f));
        EXPECT(float(old) == 1 && float(h) == 1.5f && __low2float(b2) == 1.5f && __high2float(b2) == 2.25f &&
                   float(b) == 2,
               "atomicAdd");
        const __nv_fp8_e4m3 e(1000.0f), n(-0.3f);
        const __nv_fp8_e5m2 g(__half(3.0f));
        EXPECT(e.__x == 0x7E && float(e) == 448 && float(n) == -0.3125f && int(n) == 0 && float(g) == 3 && bool(g) &&
                   !bool(__nv_fp8_e4m3(0.0f)),
               "fp8 classes");
        EXPECT(float(__nv_fp8_e4m3(INFINITY)) == 448 && float(__nv_fp8_e5m2(1e6)) == 57344 &&
                   float(__nv_fp8_e4m3(300)) == 288,
               "fp8 saturation");
        const float2 pair = float2(__nv_fp8x2_e4m3(make_float2(0.5f, -2.0f)));
        EXPECT(pair.x == 0.5f && pair.y == -2.0f, "fp8x2");
    });

    printf("%s: %ld failure(s)\n", g_failures ? "FAILED" : "PASSED", g_failures);
    return g_failures ? 1 : 0;
}
