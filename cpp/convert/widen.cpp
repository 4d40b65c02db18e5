// See widen.h. One translation unit, each ISA's loop in a function of its own target (internal linkage, so no
// symbol is shared between instruction sets: tests/unit/native/test_isa_isolation.py), chosen by the same SIMD
// level as the CPU-Adam (ZINF_SIMD).
#include "widen.h"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../adam/adam.h"
#include "../checksum/crc32c.h"
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

// The widening of [src, src + n) in blocks, each checksummed first (its bytes then come from the cache).
uint32_t widen_crc_range(const uint16_t* src, float* dst, size_t n, Narrow kind, bool stream, uint32_t crc) {
  const size_t per = kCrcBlockBytes / sizeof(uint16_t);
  for (size_t i = 0; i < n; i += per) {
    const size_t m = std::min(per, n - i);
    crc = zinf::checksum::crc32c(src + i, m * sizeof(uint16_t), crc);
    widen_range(src + i, dst + i, m, kind, stream);
  }
  return crc;
}

uint32_t copy_crc_range(const uint8_t* src, uint8_t* dst, size_t n, uint32_t crc) {
  for (size_t i = 0; i < n; i += kCrcBlockBytes) {
    const size_t m = std::min(kCrcBlockBytes, n - i);
    crc = zinf::checksum::crc32c(src + i, m, crc);
    std::memcpy(dst + i, src + i, m);
  }
  return crc;
}

// Calls ``slice(t, begin, end)`` for the slices of [0, n) elements on up to ``threads`` threads, each slice at least
// ``min_per_thread`` elements and starting at a multiple of ``align`` elements; returns how many slices there were.
// A loop over the slices, not one slice per thread: OpenMP may give the region fewer threads than asked for (a
// thread limit, or a call from inside another parallel region), and every slice must still be done.
template <typename Slice>
int for_slices(size_t n, size_t min_per_thread, size_t align, int threads, Slice slice) {
  const int nt = static_cast<int>(std::min<size_t>(std::max(threads, 1), std::max<size_t>(n / min_per_thread, 1)));
  if (nt <= 1) {
    slice(0, size_t{0}, n);
    return 1;
  }
  const size_t chunk = (n / nt + align - 1) / align * align;
#pragma omp parallel for num_threads(nt) schedule(static, 1)
  for (int t = 0; t < nt; ++t) {
    const size_t begin = std::min(n, chunk * static_cast<size_t>(t));
    const size_t end = t == nt - 1 ? n : std::min(n, begin + chunk);
    slice(t, begin, end);
  }
  return nt;
}

// for_slices where ``range(begin, end)`` returns its slice's CRC32C from 0: the slices' CRCs joined in order onto
// ``crc``.
template <typename Range>
uint32_t crc_slices(size_t n, size_t elem_bytes, size_t min_per_thread, size_t align, int threads, uint32_t crc,
                    Range range) {
  std::vector<uint32_t> crcs(static_cast<size_t>(std::max(threads, 1)), 0);
  std::vector<size_t> lens(crcs.size(), 0);
  const int nt = for_slices(n, min_per_thread, align, threads, [&](int t, size_t begin, size_t end) {
    lens[t] = end - begin;
    crcs[t] = range(begin, end);
  });
  for (int t = 0; t < nt; ++t) crc = zinf::checksum::crc32c_combine(crc, crcs[t], lens[t] * elem_bytes);
  return crc;
}

}  // namespace

uint32_t widen_crc(const uint16_t* src, float* dst, size_t n, Narrow kind, int threads, uint32_t crc) {
  const bool stream = n * sizeof(float) >= kStreamBytes;
  return crc_slices(n, sizeof(uint16_t), kStreamBytes / sizeof(float), 16, threads, crc, [&](size_t b, size_t e) {
    return widen_crc_range(src + b, dst + b, e - b, kind, stream, 0);  // each slice fences its own stores
  });
}

uint32_t copy_crc(const void* src, void* dst, size_t n, int threads, uint32_t crc) {
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  return crc_slices(n, 1, kStreamBytes, 64, threads, crc,
                    [&](size_t b, size_t e) { return copy_crc_range(s + b, d + b, e - b, 0); });
}

void widen(const uint16_t* src, float* dst, size_t n, Narrow kind, int threads) {
  const bool stream = n * sizeof(float) >= kStreamBytes;
  // no slice under 1 MiB of output; slices start 64 bytes apart in dst's alignment; each fences its own stores
  for_slices(n, kStreamBytes / sizeof(float), 16, threads,
             [&](int, size_t b, size_t e) { widen_range(src + b, dst + b, e - b, kind, stream); });
}

}  // namespace zinf::convert
