// bfloat16 <-> float32 for the native kernels (lora_rows.cpp, decode_attention.cpp, elementwise.cpp): a bfloat16 is
// the top 16 bits of a float32, so widening is a shift; narrowing rounds to nearest, ties to even
// (as torch does), and keeps a NaN a NaN.
#pragma once

#include <cstdint>
#include <cstring>

namespace polyserve_bf16 {

inline float cvt(float v) { return v; }
inline float cvt(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// Without a branch, so that loops over it vectorise.
inline uint16_t to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const uint32_t quiet = (bits >> 16) | 0x40u;  // a NaN stays a NaN
    return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}

}  // namespace polyserve_bf16
