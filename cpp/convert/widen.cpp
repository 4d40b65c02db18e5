// See widen.h. One translation unit, each ISA's loop in a function of its own target (internal linkage, so no
// symbol is shared between instruction sets: tests/unit/native/test_isa_isolation.py), chosen by the same SIMD
// level as the CPU-Adam (ZINF_SIMD).
#include "widen.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>

#include "../adam/adam.h"
#define ZINF_ISA isa_widen  // convert.h's scalar conversions, built for this file alone
#include "../adam/convert.h"

namespace zinf::convert {
namespace {

using zinf::adam::bf16_to_f32;
using zinf::adam::bits_f32;
using zinf::adam::f16_to_f32;
using zinf::adam::f32_bits;

// As vcvtph2ps and torch's vector loop: an fp16 signalling NaN comes out quiet (its payload kept), which the Adam
// kernels' f16_to_f32 does not do; bf16 NaNs keep their bits, as torch keeps them.
float narrow_to_f32(uint16_t h, Narrow kind) {
  if (kind == Narrow::kBf16) return bf16_to_f32(h);
  const uint32_t u = f32_bits(f16_to_f32(h));
  return bits_f32((u & 0x7fffffffu) > 0x7f800000u ? u | 0x400000u : u);
}

void widen_scalar(const uint16_t* src, float* dst, size_t n, Narrow kind) {
  for (size_t i = 0; i < n; ++i) dst[i] = narrow_to_f32(src[i], kind);
}

__attribute__((target("avx512f,avx512bw"))) void widen_avx512(const uint16_t* src, float* dst, size_t n,
                                                              Narrow kind, bool stream) {
  size_t i = 0;
  if (stream) {  // scalar up to a 64-byte boundary of dst: streaming stores are aligned
    for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 63) != 0; ++i) dst[i] = narrow_to_f32(src[i], kind);
  }
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i));
    const __m512 w = kind == Narrow::kBf16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16))
                                           : _mm512_cvtph_ps(h);
    if (stream)
      _mm512_stream_ps(dst + i, w);
    else
      _mm512_storeu_ps(dst + i, w);
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) dst[i] = narrow_to_f32(src[i], kind);
}

__attribute__((target("avx2,f16c"))) void widen_avx2(const uint16_t* src, float* dst, size_t n, Narrow kind,
                                                     bool stream) {
  size_t i = 0;
  if (stream) {
    for (; i < n && (reinterpret_cast<uintptr_t>(dst + i) & 31) != 0; ++i) dst[i] = narrow_to_f32(src[i], kind);
  }
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m256 w = kind == Narrow::kBf16 ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
                                           : _mm256_cvtph_ps(h);
    if (stream)
      _mm256_stream_ps(dst + i, w);
    else
      _mm256_storeu_ps(dst + i, w);
  }
  if (stream) _mm_sfence();
  for (; i < n; ++i) dst[i] = narrow_to_f32(src[i], kind);
}

void widen_range(const uint16_t* src, float* dst, size_t n, Narrow kind, bool stream) {
  switch (zinf::adam::simd_level()) {
    case zinf::adam::SimdLevel::kAvx512:
      widen_avx512(src, dst, n, kind, stream);
      return;
    case zinf::adam::SimdLevel::kAvx2:
      widen_avx2(src, dst, n, kind, stream);
      return;
    default:
      widen_scalar(src, dst, n, kind);
  }
}

}  // namespace

void widen(const uint16_t* src, float* dst, size_t n, Narrow kind, int threads) {
  const bool stream = n * sizeof(float) >= kStreamBytes;
  const size_t per_thread = kStreamBytes / sizeof(float);  // no slice under 1 MiB of output
  const int nt = static_cast<int>(std::min<size_t>(std::max(threads, 1), std::max<size_t>(n / per_thread, 1)));
  if (nt <= 1) {
    widen_range(src, dst, n, kind, stream);
    return;
  }
  const size_t chunk = (n / nt + 15) / 16 * 16;  // slices start 64 bytes apart in dst's alignment
#pragma omp parallel num_threads(nt)
  {
    const size_t begin = std::min(n, chunk * static_cast<size_t>(omp_get_thread_num()));
    const size_t end = omp_get_thread_num() == nt - 1 ? n : std::min(n, begin + chunk);
    widen_range(src + begin, dst + begin, end - begin, kind, stream);  // each slice fences its own stores
  }
}

}  // namespace zinf::convert
