// CUDA's bfloat16 type (`__nv_bfloat16`, `__nv_bfloat162`, their raw forms) and intrinsics, for kernels compiled
// as host C++: the same API and rounding as cuda_fp16.h's (EMU_HALF_LIKE_API) with bf16's names and format (8
// exponent bits as float's, 7 mantissa bits). Float has more than twice bf16's precision, so arithmetic computed in
// float and rounded once is correctly rounded, as the sm_80 instructions are.
#pragma once
#include "emu_defs.h"
#include "cuda_fp16.h"

typedef struct __align__(2) { unsigned short x; } __nv_bfloat16_raw;
typedef struct __align__(4) { unsigned short x, y; } __nv_bfloat162_raw;

struct __align__(2) __nv_bfloat16 {
  protected:
    unsigned short __x;

  public:
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(const __nv_bfloat16_raw &r) : __x(r.x) {}
    __nv_bfloat16 &operator=(const __nv_bfloat16_raw &r) { return __x = r.x, *this; }
    volatile __nv_bfloat16 &operator=(const __nv_bfloat16_raw &r) volatile { return __x = r.x, *this; }
    volatile __nv_bfloat16 &operator=(const volatile __nv_bfloat16_raw &r) volatile { return __x = r.x, *this; }
    operator __nv_bfloat16_raw() const { return {__x}; }
    operator __nv_bfloat16_raw() const volatile { return {__x}; }
    explicit __nv_bfloat16(__half v) : __nv_bfloat16(float(v)) {}
    EMU_NUMBER_CONSTRUCTORS(__nv_bfloat16, 8, 7)
};

struct __align__(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
    __nv_bfloat162() = default;
    constexpr __nv_bfloat162(const __nv_bfloat16 &a, const __nv_bfloat16 &b) : x(a), y(b) {}
    __nv_bfloat162(const __nv_bfloat162_raw &r) : x(__nv_bfloat16_raw{r.x}), y(__nv_bfloat16_raw{r.y}) {}
    __nv_bfloat162 &operator=(const __nv_bfloat162_raw &r) { return *this = __nv_bfloat162(r); }
    operator __nv_bfloat162_raw() const { return {__nv_bfloat16_raw(x).x, __nv_bfloat16_raw(y).x}; }
};

// Declared in cuda_fp16.h: a bf16 value rounds to the nearest half.
inline __half::__half(__nv_bfloat16 v) : __half(float(v)) {}

EMU_HALF_LIKE_API(__nv_bfloat16, __nv_bfloat162, bfloat16, 8, 7)

typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;
