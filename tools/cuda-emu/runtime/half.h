// float16 and bfloat16 conversions of the host-side libraries (cuBLAS, cuRAND): round to nearest even, NaN kept.
#pragma once

#include <cstdint>
#include <cstring>

namespace emu {

inline float bits_to_float(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
inline uint32_t float_to_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float f) {
    const uint32_t b = float_to_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((b >> 16) | 0x40);  // quiet NaN
    return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

inline float half_to_float(uint16_t h) {
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / NaN
    if (exp == 0) {  // zero or subnormal: man · 2^-24
        const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
}

inline uint16_t float_to_half(float f) {
    const uint32_t b = float_to_bits(f);
    const uint16_t sign = static_cast<uint16_t>((b >> 16) & 0x8000);
    const uint32_t abs = b & 0x7fffffffu;
    if (abs > 0x7f800000u) return sign | 0x7e00;                   // NaN
    if (abs >= 0x477ff000u) return sign | 0x7c00;                  // rounds to infinity (≥ 65520)
    if (abs < 0x38800000u) {                                       // below 2^-14: subnormal half
        const float scaled = bits_to_float(abs) * 16777216.0f;     // exact: · 2^24, in units of the half's ulp
        const uint32_t q = static_cast<uint32_t>(scaled);
        const float rest = scaled - static_cast<float>(q);
        const uint32_t r = q + (rest > 0.5f || (rest == 0.5f && (q & 1)));
        return sign | static_cast<uint16_t>(r);
    }
    // Normal: drop 13 mantissa bits with round to nearest even, re-biasing the exponent (127 → 15).
    const uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1);
    return sign | static_cast<uint16_t>((rounded >> 13) - (112u << 10));
}

}  // namespace emu
