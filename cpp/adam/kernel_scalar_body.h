// Per-element scalar Adam math, shared by every ISA for loop tails. Mirrors, operation for
// operation, the single-tensor path of torch.optim.Adam(W) on CPU as torch 2.13 computes it
// (checked element-wise against torch): add(alpha) = fma(alpha, p, g); lerp = fma(w, g - m, m);
// mul + addcmul = fma(w2 * g, g, v * beta2); denom = sqrt(v) / sqrt(bc2) + eps;
// addcdiv = p + (-step_size * m) / denom (no FMA). Bit-identical results, not just close ones.
//
// [Note: bf16 moments] With state_dtype kBFloat16 the moments are read as bf16 (exact widening), the step
// computed in fp32 as above, and the new moments rounded to bf16 stochastically: the fp32 bits plus 16 random
// bits, truncated. Round-to-nearest would freeze exp_avg_sq, whose per-step change (1 - beta2 = 0.1%) is below
// half a bf16 unit (0.2%); rounding up with probability equal to the dropped fraction keeps every moment's
// expected value. The bits are a hash of (seed, element index), the same in every ISA and in
// zinf.native.adam_step_torch, so a run is reproducible and resumes exactly; exp_avg takes the hash's low
// half, exp_avg_sq its high half.
#pragma once
#include <cmath>
#include <type_traits>
#include "adam.h"
#include "convert.h"

#ifndef ZINF_ISA  // each kernel file names its instruction set: helpers built for one never serve another
#error "define ZINF_ISA (isa_avx512, isa_avx2 or isa_scalar) before including this header"
#endif

namespace zinf::adam {
inline namespace ZINF_ISA {

template <DType G>
inline float load_grad_scalar(const void* g, size_t i) {
  if constexpr (G == DType::kFloat32) return static_cast<const float*>(g)[i];
  else if constexpr (G == DType::kBFloat16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

// lowbias32, Chris Wellons' integer hash
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The rounding bits of an element: the hash of its index mixed with the seed.
inline uint32_t sr_bits(uint32_t seed, uint32_t index) { return lowbias32((index * 0x9E3779B1u) ^ seed); }

inline uint16_t f32_to_bf16_stochastic(float f, uint32_t r16) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  return static_cast<uint16_t>((u + r16) >> 16);
}

template <DType S>
inline float load_state_scalar(const void* s, size_t i) {
  if constexpr (S == DType::kBFloat16) return bf16_to_f32(static_cast<const uint16_t*>(s)[i]);
  else return static_cast<const float*>(s)[i];
}

template <DType S>
inline void store_state_scalar(void* s, size_t i, float x, uint32_t r16) {
  if constexpr (S == DType::kBFloat16) static_cast<uint16_t*>(s)[i] = f32_to_bf16_stochastic(x, r16);
  else static_cast<float*>(s)[i] = x;
}

template <DType O>
inline void store_out_scalar(void* out, size_t i, float p) {
  if constexpr (O == DType::kBFloat16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
  else if constexpr (O == DType::kFloat16) static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
}

}  // namespace ZINF_ISA
}  // namespace zinf::adam

#include "int8_moments.h"

namespace zinf::adam {
inline namespace ZINF_ISA {

template <DType G, DType O, DType S>
inline void adam_scalar_range(const AdamArgs& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float p = a.param[i];
    float g = load_grad_scalar<G>(a.grad, i) * a.grad_mul;
    if (a.decoupled) p = p * a.decay_mul;
    else g = std::fma(a.l2_decay, p, g);  // torch's add(alpha=) is an FMA
    float m = load_state_scalar<S>(a.exp_avg, i);
    m = std::fma(a.one_minus_beta1, g - m, m);  // torch's lerp (weight < 0.5)
    float v = load_state_scalar<S>(a.exp_avg_sq, i) * a.beta2;
    v = std::fma(a.one_minus_beta2 * g, g, v);  // torch's addcmul_ on CPU: fma(value * t1, t2, self)
    const float denom = std::sqrt(v) / a.bc2_sqrt + a.eps;
    p = p + ((-a.step_size) * m) / denom;  // torch's addcdiv: self + value * t1 / t2
    a.param[i] = p;
    uint32_t r = 0;
    if constexpr (S == DType::kBFloat16) r = sr_bits(a.seed, a.index_base + static_cast<uint32_t>(i));
    store_state_scalar<S>(a.exp_avg, i, m, r & 0xffffu);
    store_state_scalar<S>(a.exp_avg_sq, i, v, r >> 16);
    store_out_scalar<O>(a.param_out, i, p);
    if (a.grad_zero) a.grad_zero[i] = 0.0f;
  }
}

template <DType G>
inline double sumsq_scalar_range(const void* data, size_t begin, size_t end) {
  double s = 0.0;
  for (size_t i = begin; i < end; ++i) {
    const double x = load_grad_scalar<G>(data, i);
    s += x * x;
  }
  return s;
}

inline void stream_scalar_range(float* p, const float* g, float* m, float* v, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    const float gi = g[i];
    p[i] = p[i] + gi;
    m[i] = m[i] + gi;
    v[i] = v[i] + gi;
  }
}

// Instantiates the (grad dtype x out dtype x state dtype) kernel table from a template Range<G, O, S>.
template <template <DType, DType, DType> class Range>
inline void dispatch_adam(const AdamArgs& a, size_t begin, size_t end) {
  auto by_state = [&](auto gtag, auto otag) {
    constexpr DType G = decltype(gtag)::value;
    constexpr DType O = decltype(otag)::value;
    if (a.state_dtype == DType::kBFloat16) Range<G, O, DType::kBFloat16>::run(a, begin, end);
    else if (a.state_dtype == DType::kInt8) adam_int8_range<Range, G, O>(a, begin, end);
    else Range<G, O, DType::kFloat32>::run(a, begin, end);
  };
  auto by_out = [&](auto gtag) {
    switch (a.out_dtype) {
      case DType::kBFloat16: by_state(gtag, std::integral_constant<DType, DType::kBFloat16>{}); break;
      case DType::kFloat16: by_state(gtag, std::integral_constant<DType, DType::kFloat16>{}); break;
      default: by_state(gtag, std::integral_constant<DType, DType::kNone>{}); break;
    }
  };
  switch (a.grad_dtype) {
    case DType::kBFloat16: by_out(std::integral_constant<DType, DType::kBFloat16>{}); break;
    case DType::kFloat16: by_out(std::integral_constant<DType, DType::kFloat16>{}); break;
    default: by_out(std::integral_constant<DType, DType::kFloat32>{}); break;
  }
}

}  // namespace ZINF_ISA
}  // namespace zinf::adam
