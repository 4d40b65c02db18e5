// Scalar fp32 <-> bf16/fp16 conversions, round-to-nearest-even (as torch does).
#pragma once
#include <cstdint>
#include <cstring>

#ifndef ZINF_ISA  // each kernel file names its instruction set: helpers built for one never serve another
#error "define ZINF_ISA (isa_avx512, isa_avx2 or isa_scalar) before including this header"
#endif
namespace zinf::adam {
inline namespace ZINF_ISA {

inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;  // mant * 2^-24, exact
    return bits_f32(f32_bits(mag) | sign);
  }
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (mant << 13));
  return bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline uint16_t f32_to_f16(float f) {
  const uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7e00 : 0x7c00);
  const int e = static_cast<int>(a >> 23) - 127;
  const uint32_t mant = a & 0x7fffffu;
  if (e > 15) return sign | 0x7c00;
  if (e >= -14) {  // normal half (rounding may carry into the exponent, up to inf)
    uint32_t h = (static_cast<uint32_t>(e + 15) << 10) | (mant >> 13);
    const uint32_t rem = mant & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  const int shift = -e - 1;  // >= 14
  if (shift >= 25) return sign;
  const uint32_t m = mant | 0x800000u;
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}

}  // namespace ZINF_ISA
}  // namespace zinf::adam
