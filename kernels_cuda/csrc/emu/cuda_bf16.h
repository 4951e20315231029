// bfloat16 for the CPU emulation, bit-exact with CUDA's conversions (round to nearest even; NaN -> 0x7fff).
#pragma once
#include <bit>
#include <cstdint>

#include "cuda_runtime.h"

struct __nv_bfloat16 {
    uint16_t bits;
};
struct __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline float __bfloat162float(__nv_bfloat16 value) {
    return std::bit_cast<float>(static_cast<uint32_t>(value.bits) << 16);
}

inline __nv_bfloat16 __float2bfloat16_rn(float value) {
    uint32_t word = std::bit_cast<uint32_t>(value);
    if ((word & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{0x7fff};
    word += 0x7fffu + ((word >> 16) & 1u);
    return __nv_bfloat16{static_cast<uint16_t>(word >> 16)};
}

inline float2 __bfloat1622float2(__nv_bfloat162 value) {
    return float2{__bfloat162float(value.x), __bfloat162float(value.y)};
}

inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
