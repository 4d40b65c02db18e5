// AVX2 kernels: this file is compiled with -mavx2 -mfma -mf16c and only called after a
// runtime CPU check.
#include <immintrin.h>
// The shared headers' helpers are this file's own (an inline namespace per instruction set): the linker must
// never keep an AVX-512 build of one for the AVX2 or scalar kernels to call.
#define ZINF_ISA isa_avx2
#include "kernel_scalar_body.h"

namespace zinf::adam {
namespace {

constexpr size_t kW = 8;

template <DType G>
inline __m256 load_grad(const void* g, size_t i) {
  if constexpr (G == DType::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(g) + i);
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(g) + i));
    if constexpr (G == DType::kBFloat16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

template <DType O>
inline void store_out(void* out, size_t i, __m256 p) {
  __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (O == DType::kBFloat16) {
    const __m256i u = _mm256_castps_si256(p);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(dst, _mm256_castsi256_si128(packed));
  } else if constexpr (O == DType::kFloat16) {
    _mm_storeu_si128(dst, _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

template <DType S>
inline __m256 load_state(const void* s, size_t i) {
  if constexpr (S == DType::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(s) + i);
  }
}

// sr_bits of 8 consecutive indices (kernel_scalar_body.h)
inline __m256i sr_bits(uint32_t seed, uint32_t index) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index)), lanes);
  x = _mm256_xor_si256(_mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x9E3779B1u))),
                       _mm256_set1_epi32(static_cast<int>(seed)));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// f32_to_bf16_stochastic on 8 lanes, r16 the random bits in each lane's low half
template <DType S>
inline void store_state(void* s, size_t i, __m256 x, __m256i r16) {
  if constexpr (S == DType::kBFloat16) {
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r16), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(s) + i), _mm256_castsi256_si128(packed));
  } else {
    (void)r16;
    _mm256_storeu_ps(static_cast<float*>(s) + i, x);
  }
}

template <DType G, DType O, DType S>
struct Avx2Range {
  static void run(const AdamArgs& a, size_t b, size_t e) {
    const __m256 grad_mul = _mm256_set1_ps(a.grad_mul);
    const __m256 w1 = _mm256_set1_ps(a.one_minus_beta1);
    const __m256 b2 = _mm256_set1_ps(a.beta2);
    const __m256 w2 = _mm256_set1_ps(a.one_minus_beta2);
    const __m256 eps = _mm256_set1_ps(a.eps);
    const __m256 l2 = _mm256_set1_ps(a.l2_decay);
    const __m256 decay = _mm256_set1_ps(a.decay_mul);
    const __m256 neg_step = _mm256_set1_ps(-a.step_size);
    const __m256 bc2 = _mm256_set1_ps(a.bc2_sqrt);
    const bool decoupled = a.decoupled;
    size_t i = b;
    float* const zero = a.grad_zero;
    for (; i + kW <= e; i += kW) {
      __m256 p = _mm256_loadu_ps(a.param + i);
      __m256 g = _mm256_mul_ps(load_grad<G>(a.grad, i), grad_mul);
      if (decoupled) p = _mm256_mul_ps(p, decay);
      else g = _mm256_fmadd_ps(l2, p, g);
      __m256 m = load_state<S>(a.exp_avg, i);
      m = _mm256_fmadd_ps(w1, _mm256_sub_ps(g, m), m);
      __m256 v = _mm256_mul_ps(load_state<S>(a.exp_avg_sq, i), b2);
      v = _mm256_fmadd_ps(_mm256_mul_ps(w2, g), g, v);  // torch's addcmul_: fma(value * t1, t2, self)
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2), eps);
      p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(neg_step, m), denom));
      _mm256_storeu_ps(a.param + i, p);
      __m256i r = _mm256_setzero_si256();
      if constexpr (S == DType::kBFloat16) r = sr_bits(a.seed, a.index_base + static_cast<uint32_t>(i));
      store_state<S>(a.exp_avg, i, m, _mm256_and_si256(r, _mm256_set1_epi32(0xffff)));
      store_state<S>(a.exp_avg_sq, i, v, _mm256_srli_epi32(r, 16));
      store_out<O>(a.param_out, i, p);
      if (zero) _mm256_storeu_ps(zero + i, _mm256_setzero_ps());
    }
    adam_scalar_range<G, O, S>(a, i, e);
  }
};

void adam(const AdamArgs& a, size_t b, size_t e) { dispatch_adam<Avx2Range>(a, b, e); }

inline double hsum(__m256d x) {
  const __m128d s = _mm_add_pd(_mm256_castpd256_pd128(x), _mm256_extractf128_pd(x, 1));
  return _mm_cvtsd_f64(_mm_add_sd(s, _mm_unpackhi_pd(s, s)));
}

template <DType G>
double sumsq_t(const void* d, size_t b, size_t e) {
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  __m256d acc2 = _mm256_setzero_pd(), acc3 = _mm256_setzero_pd();
  size_t i = b;
  for (; i + 2 * kW <= e; i += 2 * kW) {
    const __m256 x = load_grad<G>(d, i);
    const __m256 y = load_grad<G>(d, i + kW);
    const __m256d x0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    const __m256d x1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    const __m256d y0 = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
    const __m256d y1 = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
    acc0 = _mm256_fmadd_pd(x0, x0, acc0);
    acc1 = _mm256_fmadd_pd(x1, x1, acc1);
    acc2 = _mm256_fmadd_pd(y0, y0, acc2);
    acc3 = _mm256_fmadd_pd(y1, y1, acc3);
  }
  const __m256d acc = _mm256_add_pd(_mm256_add_pd(acc0, acc1), _mm256_add_pd(acc2, acc3));
  return hsum(acc) + sumsq_scalar_range<G>(d, i, e);
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
    const __m256 gi = _mm256_loadu_ps(g + i);
    const __m256 pi = _mm256_loadu_ps(p + i);
    const __m256 mi = _mm256_loadu_ps(m + i);
    const __m256 vi = _mm256_loadu_ps(v + i);
    _mm256_storeu_ps(p + i, _mm256_add_ps(pi, gi));
    _mm256_storeu_ps(m + i, _mm256_add_ps(mi, gi));
    _mm256_storeu_ps(v + i, _mm256_add_ps(vi, gi));
  }
  stream_scalar_range(p, g, m, v, i, e);
}

}  // namespace

Kernels kernels_avx2() { return {adam, sumsq, stream}; }

}  // namespace zinf::adam
