// AVX-512 kernels: this file is compiled with -mavx512f -mavx512bw -mavx512vl and only
// called after a runtime CPU check.
#include <immintrin.h>
// The shared headers' helpers are this file's own (an inline namespace per instruction set): the linker must
// never keep an AVX-512 build of one for the AVX2 or scalar kernels to call.
#define ZINF_ISA isa_avx512
#include "kernel_scalar_body.h"

namespace zinf::adam {
namespace {

constexpr size_t kW = 16;

template <DType G>
inline __m512 load_grad(const void* g, size_t i) {
  if constexpr (G == DType::kFloat32) {
    return _mm512_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == DType::kBFloat16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

template <DType O>
inline void store_out(void* out, size_t i, __m512 p) {
  if constexpr (O == DType::kBFloat16) {
    const __m512i u = _mm512_castps_si512(p);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i), _mm512_cvtepi32_epi16(r));
  } else if constexpr (O == DType::kFloat16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(out) + i),
                        _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType S>
inline __m512 load_state(const void* s, size_t i) {
  if constexpr (S == DType::kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(s) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(static_cast<const float*>(s) + i);
  }
}

// sr_bits of 16 consecutive indices (kernel_scalar_body.h)
inline __m512i sr_bits(uint32_t seed, uint32_t index) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i x = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index)), lanes);
  x = _mm512_xor_si512(_mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x9E3779B1u))),
                       _mm512_set1_epi32(static_cast<int>(seed)));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// f32_to_bf16_stochastic on 16 lanes, r16 the random bits in each lane's low half
template <DType S>
inline void store_state(void* s, size_t i, __m512 x, __m512i r16) {
  if constexpr (S == DType::kBFloat16) {
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r16), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(s) + i), _mm512_cvtepi32_epi16(r));
  } else {
    (void)r16;
    _mm512_storeu_ps(static_cast<float*>(s) + i, x);
  }
}

template <DType G, DType O, DType S>
struct Avx512Range {
  static void run(const AdamArgs& a, size_t b, size_t e) {
    const __m512 grad_mul = _mm512_set1_ps(a.grad_mul);
    const __m512 w1 = _mm512_set1_ps(a.one_minus_beta1);
    const __m512 b2 = _mm512_set1_ps(a.beta2);
    const __m512 w2 = _mm512_set1_ps(a.one_minus_beta2);
    const __m512 eps = _mm512_set1_ps(a.eps);
    const __m512 l2 = _mm512_set1_ps(a.l2_decay);
    const __m512 decay = _mm512_set1_ps(a.decay_mul);
    const __m512 neg_step = _mm512_set1_ps(-a.step_size);
    const __m512 bc2 = _mm512_set1_ps(a.bc2_sqrt);
    const bool decoupled = a.decoupled;
    float* const zero = a.grad_zero;
    size_t i = b;
    for (; i + kW <= e; i += kW) {
      __m512 p = _mm512_loadu_ps(a.param + i);
      __m512 g = _mm512_mul_ps(load_grad<G>(a.grad, i), grad_mul);
      if (decoupled) p = _mm512_mul_ps(p, decay);
      else g = _mm512_fmadd_ps(l2, p, g);
      __m512 m = load_state<S>(a.exp_avg, i);
      m = _mm512_fmadd_ps(w1, _mm512_sub_ps(g, m), m);
      __m512 v = _mm512_mul_ps(load_state<S>(a.exp_avg_sq, i), b2);
      v = _mm512_fmadd_ps(_mm512_mul_ps(w2, g), g, v);  // torch's addcmul_: fma(value * t1, t2, self)
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2), eps);
      p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(neg_step, m), denom));
      _mm512_storeu_ps(a.param + i, p);
      __m512i r = _mm512_setzero_si512();
      if constexpr (S == DType::kBFloat16) r = sr_bits(a.seed, a.index_base + static_cast<uint32_t>(i));
      store_state<S>(a.exp_avg, i, m, _mm512_and_si512(r, _mm512_set1_epi32(0xffff)));
      store_state<S>(a.exp_avg_sq, i, v, _mm512_srli_epi32(r, 16));
      store_out<O>(a.param_out, i, p);
      if (zero) _mm512_storeu_ps(zero + i, _mm512_setzero_ps());  // the line is already in cache: no extra read
    }
    adam_scalar_range<G, O, S>(a, i, e);
  }
};

void adam(const AdamArgs& a, size_t b, size_t e) { dispatch_adam<Avx512Range>(a, b, e); }

template <DType G>
double sumsq_t(const void* d, size_t b, size_t e) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  __m512d acc2 = _mm512_setzero_pd(), acc3 = _mm512_setzero_pd();
  size_t i = b;
  for (; i + 2 * kW <= e; i += 2 * kW) {
    const __m512 x = load_grad<G>(d, i);
    const __m512 y = load_grad<G>(d, i + kW);
    const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d x1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    const __m512d y0 = _mm512_cvtps_pd(_mm512_castps512_ps256(y));
    const __m512d y1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
    acc0 = _mm512_fmadd_pd(x0, x0, acc0);
    acc1 = _mm512_fmadd_pd(x1, x1, acc1);
    acc2 = _mm512_fmadd_pd(y0, y0, acc2);
    acc3 = _mm512_fmadd_pd(y1, y1, acc3);
  }
  const __m512d acc = _mm512_add_pd(_mm512_add_pd(acc0, acc1), _mm512_add_pd(acc2, acc3));
  return _mm512_reduce_add_pd(acc) + sumsq_scalar_range<G>(d, i, e);
}

double sumsq(const void* d, DType t, size_t b, size_t e) {
  switch (t) {
    case DType::kBFloat16: return sumsq_t<DType::kBFloat16>(d, b, e);
    case DType::kFloat16: return sumsq_t<DType::kFloat16>(d, b, e);
    default: return sumsq_t<DType::kFloat32>(d, b, e);
  }
}

void stream(float* p, const float* g, float* m, float* v, size_t b, size_t e) {
  size_t i = b;
  for (; i + kW <= e; i += kW) {
    // all loads first, then all stores (same order as the Adam kernel: avoids 4K-aliasing stalls)
    const __m512 gi = _mm512_loadu_ps(g + i);
    const __m512 pi = _mm512_loadu_ps(p + i);
    const __m512 mi = _mm512_loadu_ps(m + i);
    const __m512 vi = _mm512_loadu_ps(v + i);
    _mm512_storeu_ps(p + i, _mm512_add_ps(pi, gi));
    _mm512_storeu_ps(m + i, _mm512_add_ps(mi, gi));
    _mm512_storeu_ps(v + i, _mm512_add_ps(vi, gi));
  }
  stream_scalar_range(p, g, m, v, i, e);
}

}  // namespace

Kernels kernels_avx512() { return {adam, sumsq, stream}; }

}  // namespace zinf::adam
