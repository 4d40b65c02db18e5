// Per-element scalar Adam math, shared by every ISA for loop tails. Mirrors, operation for
// operation, the single-tensor path of torch.optim.Adam(W) on CPU as torch 2.13 computes it
// (checked element-wise against torch): add(alpha) = fma(alpha, p, g); lerp = fma(w, g - m, m);
// mul + addcmul = fma(w2 * g, g, v * beta2); denom = sqrt(v) / sqrt(bc2) + eps;
// addcdiv = p + (-step_size * m) / denom (no FMA). Bit-identical results, not just close ones.
#pragma once
#include <cmath>
#include <type_traits>
#include "adam.h"
#include "convert.h"

namespace zinf::adam {

template <DType G>
inline float load_grad_scalar(const void* g, size_t i) {
  if constexpr (G == DType::kFloat32) return static_cast<const float*>(g)[i];
  else if constexpr (G == DType::kBFloat16) return bf16_to_f32(static_cast<const uint16_t*>(g)[i]);
  else return f16_to_f32(static_cast<const uint16_t*>(g)[i]);
}

template <DType O>
inline void store_out_scalar(void* out, size_t i, float p) {
  if constexpr (O == DType::kBFloat16) static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
  else if constexpr (O == DType::kFloat16) static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
}

template <DType G, DType O>
inline void adam_scalar_range(const AdamArgs& a, size_t begin, size_t end) {
  for (size_t i = begin; i < end; ++i) {
    float p = a.param[i];
    float g = load_grad_scalar<G>(a.grad, i) * a.grad_mul;
    if (a.decoupled) p = p * a.decay_mul;
    else g = std::fma(a.l2_decay, p, g);  // torch's add(alpha=) is an FMA
    float m = a.exp_avg[i];
    m = std::fma(a.one_minus_beta1, g - m, m);  // torch's lerp (weight < 0.5)
    float v = a.exp_avg_sq[i] * a.beta2;
    v = std::fma(a.one_minus_beta2 * g, g, v);  // torch's addcmul_ on CPU: fma(value * t1, t2, self)
    const float denom = std::sqrt(v) / a.bc2_sqrt + a.eps;
    p = p + ((-a.step_size) * m) / denom;  // torch's addcdiv: self + value * t1 / t2
    a.param[i] = p;
    a.exp_avg[i] = m;
    a.exp_avg_sq[i] = v;
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

// Instantiates the (grad dtype x out dtype) kernel table from a template Range<G, O>.
template <template <DType, DType> class Range>
inline void dispatch_adam(const AdamArgs& a, size_t begin, size_t end) {
  auto by_out = [&](auto gtag) {
    constexpr DType G = decltype(gtag)::value;
    switch (a.out_dtype) {
      case DType::kBFloat16: Range<G, DType::kBFloat16>::run(a, begin, end); break;
      case DType::kFloat16: Range<G, DType::kFloat16>::run(a, begin, end); break;
      default: Range<G, DType::kNone>::run(a, begin, end); break;
    }
  };
  switch (a.grad_dtype) {
    case DType::kBFloat16: by_out(std::integral_constant<DType, DType::kBFloat16>{}); break;
    case DType::kFloat16: by_out(std::integral_constant<DType, DType::kFloat16>{}); break;
    default: by_out(std::integral_constant<DType, DType::kFloat32>{}); break;
  }
}

}  // namespace zinf::adam
