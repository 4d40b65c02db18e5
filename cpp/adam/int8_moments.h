// int8 Adam moments: one byte per moment per element, a power-of-two scale per block of kMomentBlock elements.
//
// [Note: int8 moments]
// Each block of 256 elements (counted from the start of the stepped range) keeps a signed exponent e per moment;
// an element's moment is its code's value times 2^e, where e is the smallest with the block's largest magnitude
// <= 2^e, within [-127, 127]. exp_avg's code is a sign bit and a float of 4 exponent and 3 mantissa bits (largest
// 1.0, smallest normal 2^-14, subnormals down to 2^-17); exp_avg_sq's (never negative) a float of 5 exponent and 3
// mantissa bits (1.0 down to 2^-30, subnormals to 2^-33), and a positive value never becomes 0, which would turn the
// update into m / eps. fp32 reaches 2^128: a block whose largest magnitude is past 2^127 takes e = 127 and codes up
// to the format's largest, 1.875 (past 1.875 * 2^127 a value saturates there; inf too). A block whose codes are all
// 0 is a zero block, e = kZeroBlock, whatever e its values asked for: one encoding per value. Scales that are powers
// of two make decoding and scaling exact, so a decoded block encodes back to the same bytes (exponents included): a
// checkpoint holding the decoded fp32 values resumes exactly. A block is decoded, stepped
// in fp32 exactly as the fp32 path does (kernel_scalar_body.h), and encoded again with stochastic rounding (20
// random bits per moment from two hashes of the element's index), so each moment keeps its expected value. The
// same scalar code serves every ISA and zinf.native.adam's torch twin mirrors it operation for operation.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam.h"
#include "convert.h"

#ifndef ZINF_ISA  // each kernel file names its instruction set: helpers built for one never serve another
#error "define ZINF_ISA (isa_avx512, isa_avx2 or isa_scalar) before including this header"
#endif
namespace zinf::adam {
inline namespace ZINF_ISA {

constexpr int8_t kZeroBlock = -128;  // every code of the block is 0

// A second hash of the same index for exp_avg_sq's rounding bits.
inline uint32_t sr_bits2(uint32_t h) { return lowbias32(h ^ 0x68E31DA4u); }

// Needs lowbias32, sr_bits, load_grad_scalar and store_out_scalar: included by kernel_scalar_body.h after them.

// Smallest e with a <= 2^e (a > 0), clamped to the int8 range; kZeroBlock for a == 0.
inline int8_t block_exponent(float a) {
  if (!(a > 0.0f)) return kZeroBlock;
  if (!std::isfinite(a)) return 127;
  int k = 0;
  const float f = std::frexp(a, &k);  // a = f * 2^k, f in [0.5, 1)
  int e = f == 0.5f ? k - 1 : k;
  if (e < -127) e = -127;
  if (e > 127) e = 127;
  return static_cast<int8_t>(e);
}

inline float pow2(int e) { return bits_f32(static_cast<uint32_t>(e + 127) << 23); }  // e in [-126, 127]

inline float exp2_scale(int8_t e) { return e <= -127 ? std::ldexp(1.0f, e) : pow2(e); }

// A block's scale 2^e, and its reciprocal: both 0 for a zero block (every code decodes and encodes to 0).
inline float block_scale(int8_t e) { return e == kZeroBlock ? 0.0f : exp2_scale(e); }
inline float block_inverse(int8_t e) { return e == kZeroBlock ? 0.0f : 1.0f / exp2_scale(e); }

constexpr float kLargestCode = 1.875f;  // both formats' largest code: used only in blocks of the largest scale

// a in [0, kLargestCode]: the code of a float with 3 mantissa bits and exponent bias ``bias`` (smallest normal
// 2^(1 - bias)), rounded stochastically with the 20 random bits r20. Branch-free, so that the block loops vectorize.
inline uint32_t encode_magnitude(float a, uint32_t r20, int bias) {
  a = a >= 0.0f ? a : 0.0f;                 // NaN: not representable (a step that made one is a failed step)
  a = a > kLargestCode ? kLargestCode : a;  // saturates: past 1.875 * 2^127, and inf
  const uint32_t u = (f32_bits(a) + r20) & ~0xFFFFFu;
  const uint32_t normal = (((u >> 23) - 127u + static_cast<uint32_t>(bias)) << 3) | ((u >> 20) & 7u);
  float t = a * pow2(bias + 2);  // a over the subnormal step 2^(1 - bias - 3): exact
  t = t < 16.0f ? t : 16.0f;     // only below the smallest normal (t < 8) is it used
  const float r = static_cast<float>(r20) * 9.5367431640625e-07f;  // r20 * 2^-20, in [0, 1)
  const uint32_t sub = static_cast<uint32_t>(static_cast<int32_t>(std::floor(t + r)));  // 8: the smallest normal
  return a >= pow2(1 - bias) ? normal : sub;
}

inline float decode_magnitude(uint32_t code, int bias) {
  const uint32_t exp = code >> 3, mant = code & 7u;
  const float sub = static_cast<float>(mant) * pow2(-bias - 2);
  const float normal = bits_f32(((exp + 127u - static_cast<uint32_t>(bias)) << 23) | (mant << 20));
  return exp == 0 ? sub : normal;
}

inline float decode_m(uint8_t code, float scale) {
  const float v = decode_magnitude(code & 0x7fu, 15) * scale;
  return (code & 0x80u) ? -v : v;
}

inline uint8_t encode_m(float x, float inv_scale, uint32_t r20) {
  const float y = x * inv_scale;
  const uint32_t mag = encode_magnitude(std::fabs(y), r20, 15);
  return static_cast<uint8_t>(mag == 0 ? 0u : mag | (y < 0.0f ? 0x80u : 0u));
}

inline float decode_v(uint8_t code, float scale) { return decode_magnitude(code, 31) * scale; }

inline uint8_t encode_v(float x, float inv_scale, uint32_t r20) {
  const uint32_t mag = encode_magnitude(x * inv_scale, r20, 31);
  return static_cast<uint8_t>(x > 0.0f ? (mag == 0 ? 1u : mag) : 0u);
}

constexpr uint32_t kHalfCodeM = 14u << 3;  // exp_avg's code of 0.5
constexpr uint32_t kHalfCodeV = 30u << 3;  // exp_avg_sq's code of 0.5

// A block whose largest code is 0.5 (its largest value rounded down to half the scale) takes the scale halved and
// every code doubled, exactly: one value, one encoding, so a decoded block encodes back to the same bytes.
inline void halve_scale(uint8_t* codes, size_t n, int8_t* exp, bool is_m) {
  const int bias = is_m ? 15 : 31;
  *exp = static_cast<int8_t>(*exp - 1);
  for (size_t j = 0; j < n; ++j) {
    const uint32_t sign = is_m ? codes[j] & 0x80u : 0u;
    const uint32_t mag = is_m ? codes[j] & 0x7fu : codes[j];
    if (mag == 0) continue;
    codes[j] = static_cast<uint8_t>(sign | encode_magnitude(decode_magnitude(mag, bias) * 2.0f, 0, bias));
  }
}

// Adam over [begin, end) with int8 moments; begin is a multiple of kMomentBlock (adam_step's slices). Each block is
// decoded into fp32 buffers (in L1), stepped by the ISA's fp32 kernel ``Range`` (the same numbers as fp32 moments
// of those values) and encoded back: one pass over memory.
template <template <DType, DType, DType> class Range, DType G, DType O>
inline void adam_int8_range(const AdamArgs& a, size_t begin, size_t end) {
  uint8_t* const mc = static_cast<uint8_t*>(a.exp_avg);
  uint8_t* const vc = static_cast<uint8_t*>(a.exp_avg_sq);
  alignas(64) float mbuf[kMomentBlock];
  alignas(64) float vbuf[kMomentBlock];
  const size_t gsize = G == DType::kFloat32 ? 4 : 2;
  for (size_t b0 = begin; b0 < end; b0 += kMomentBlock) {
    const size_t n = (b0 + kMomentBlock < end ? b0 + kMomentBlock : end) - b0;
    const size_t block = b0 / kMomentBlock;
    const float ms = block_scale(a.exp_avg_scale[block]), vs = block_scale(a.exp_avg_sq_scale[block]);
    for (size_t j = 0; j < n; ++j) {
      mbuf[j] = decode_m(mc[b0 + j], ms);
      vbuf[j] = decode_v(vc[b0 + j], vs);
    }
    AdamArgs blk = a;
    blk.param = a.param + b0;
    blk.grad = static_cast<const char*>(a.grad) + b0 * gsize;
    blk.param_out = a.param_out ? static_cast<char*>(a.param_out) + b0 * 2 : nullptr;
    blk.grad_zero = a.grad_zero ? a.grad_zero + b0 : nullptr;
    blk.exp_avg = mbuf;
    blk.exp_avg_sq = vbuf;
    blk.state_dtype = DType::kFloat32;
    Range<G, O, DType::kFloat32>::run(blk, 0, n);
    uint32_t mtop = 0, vtop = 0;  // the largest magnitudes' bits (monotone in the value; NaN above all)
    for (size_t j = 0; j < n; ++j) {
      const uint32_t mb = f32_bits(mbuf[j]) & 0x7fffffffu, vb = f32_bits(vbuf[j]) & 0x7fffffffu;
      mtop = mb > mtop ? mb : mtop;
      vtop = vb > vtop ? vb : vtop;
    }
    int8_t me = block_exponent(bits_f32(mtop)), ve = block_exponent(bits_f32(vtop));
    const float m_inv = block_inverse(me), v_inv = block_inverse(ve);
    const uint32_t base = a.index_base + static_cast<uint32_t>(b0);
    for (size_t j = 0; j < n; ++j) {
      const uint32_t h = sr_bits(a.seed, base + static_cast<uint32_t>(j));
      mc[b0 + j] = encode_m(mbuf[j], m_inv, h & 0xFFFFFu);
      vc[b0 + j] = encode_v(vbuf[j], v_inv, sr_bits2(h) & 0xFFFFFu);
    }
    uint32_t mcode_top = 0, vcode_top = 0;
    for (size_t j = 0; j < n; ++j) {
      const uint32_t cm = mc[b0 + j] & 0x7fu, cv = vc[b0 + j];
      mcode_top = cm > mcode_top ? cm : mcode_top;
      vcode_top = cv > vcode_top ? cv : vcode_top;
    }
    if (mcode_top == 0) me = kZeroBlock;  // values too small for the smallest scale's codes: a zero block
    if (vcode_top == 0) ve = kZeroBlock;
    if (me > -127 && mcode_top == kHalfCodeM) halve_scale(mc + b0, n, &me, true);
    if (ve > -127 && vcode_top == kHalfCodeV) halve_scale(vc + b0, n, &ve, false);
    a.exp_avg_scale[block] = me;
    a.exp_avg_sq_scale[block] = ve;
  }
}

}  // namespace ZINF_ISA
}  // namespace zinf::adam
