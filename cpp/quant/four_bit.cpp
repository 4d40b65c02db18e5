// See four_bit.h. Loops compiled with -ffp-contract=off: one IEEE multiply (and one reciprocal or division) per value,
// so the results are bitsandbytes' and torch's to the bit on every x86-64 CPU; the fp32 decoding also in AVX-512 and
// AVX2 loops, chosen by the CPU-Adam's SIMD level (ZINF_SIMD).
#include "four_bit.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "../adam/adam.h"

namespace zinf::quant {

namespace {

inline uint16_t to_bf16(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  if (std::isnan(v)) return 0x7FC0;
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest, ties to even
  return static_cast<uint16_t>(bits >> 16);
}

inline uint8_t bucket(float x, const float* midpoints) {
  if (x != x) return 15;  // NaN sorts after every midpoint, as in torch.bucketize
  uint8_t i = 0;
  for (int k = 0; k < 15; ++k) i += midpoints[k] < x;  // the sorted midpoints below x: torch.bucketize(right=False)
  return i;
}

inline float block_max(const float* v, size_t n) {
  float m = 0.0f;
  for (size_t j = 0; j < n; ++j) m = std::max(m, std::fabs(v[j]));
  return m;
}

}  // namespace

namespace {

// fp32 decoding of whole blocks of a multiple of 16 values, each instruction set's loop in a function of its own
// target (as cpp/convert/widen.cpp): the codebook looked up 16 (8) values at a time by a permute of its 16 entries,
// then the same one IEEE multiply per value as the scalar loop, so the bits are the same.
__attribute__((target("avx512f,avx512bw"))) void decode_avx512(const uint8_t* codes, const float* scales, float* out,
                                                               size_t blocks, size_t blocksize, const float* code) {
  const __m512 table = _mm512_loadu_ps(code);
  const __m128i low = _mm_set1_epi8(0x0F);
  for (size_t b = 0; b < blocks; ++b) {
    const __m512 s = _mm512_set1_ps(scales[b]);
    for (size_t j = 0; j < blocksize; j += 16) {
      const size_t i = b * blocksize + j;
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i / 2));
      // byte k -> nibbles 2k (high) and 2k + 1 (low)
      const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
      const __m512 v = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibbles), table);
      _mm512_storeu_ps(out + i, _mm512_mul_ps(v, s));
    }
  }
}

__attribute__((target("avx2"))) void decode_avx2(const uint8_t* codes, const float* scales, float* out, size_t blocks,
                                                 size_t blocksize, const float* code) {
  const __m256 first = _mm256_loadu_ps(code), second = _mm256_loadu_ps(code + 8);
  const __m128i low = _mm_set1_epi8(0x0F);
  const __m256i seven = _mm256_set1_epi32(7);
  for (size_t b = 0; b < blocks; ++b) {
    const __m256 s = _mm256_set1_ps(scales[b]);
    for (size_t j = 0; j < blocksize; j += 8) {
      const size_t i = b * blocksize + j;
      int32_t four;
      std::memcpy(&four, codes + i / 2, 4);
      const __m128i bytes = _mm_cvtsi32_si128(four);
      const __m128i nibbles = _mm_unpacklo_epi8(_mm_and_si128(_mm_srli_epi16(bytes, 4), low), _mm_and_si128(bytes, low));
      const __m256i idx = _mm256_cvtepu8_epi32(nibbles);
      const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(idx, seven));  // entries 8-15 from the second half
      const __m256 v = _mm256_blendv_ps(_mm256_permutevar8x32_ps(first, idx), _mm256_permutevar8x32_ps(second, idx), upper);
      _mm256_storeu_ps(out + i, _mm256_mul_ps(v, s));
    }
  }
}

}  // namespace

void decode_four_bit(const uint8_t* codes, const float* scales, void* out, size_t n, size_t blocksize,
                     const float* code, bool out_bf16, int threads) {
  const long long blocks = static_cast<long long>(n / blocksize);
  float* out32 = static_cast<float*>(out);
  uint16_t* out16 = static_cast<uint16_t*>(out);
  const zinf::adam::SimdLevel level = zinf::adam::simd_level();
  if (!out_bf16 && blocksize % 16 == 0 && level != zinf::adam::SimdLevel::kScalar) {
    const long long per = std::max(1LL, (blocks + threads - 1) / std::max(threads, 1));
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long long first = 0; first < blocks; first += per) {
      const size_t count = static_cast<size_t>(std::min(per, blocks - first)), at = static_cast<size_t>(first) * blocksize;
      if (level == zinf::adam::SimdLevel::kAvx512)
        decode_avx512(codes + at / 2, scales + first, out32 + at, count, blocksize, code);
      else
        decode_avx2(codes + at / 2, scales + first, out32 + at, count, blocksize, code);
    }
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long long b = 0; b < blocks; ++b) {
    const float s = scales[b];
    float pair[2];
    for (size_t j = 0; j < blocksize; j += 2) {
      const size_t i = static_cast<size_t>(b) * blocksize + j;
      const uint8_t byte = codes[i / 2];
      pair[0] = code[byte >> 4] * s;
      pair[1] = code[byte & 15] * s;
      if (out_bf16) {
        out16[i] = to_bf16(pair[0]);
        out16[i + 1] = to_bf16(pair[1]);
      } else {
        out32[i] = pair[0];
        out32[i + 1] = pair[1];
      }
    }
  }
}

void block_absmax(const float* values, size_t n, size_t blocksize, float* absmax, int threads) {
  const long long full = static_cast<long long>(n / blocksize);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long long b = 0; b < full; ++b) absmax[b] = block_max(values + b * blocksize, blocksize);
  if (n % blocksize) absmax[full] = std::max(block_max(values + full * blocksize, n % blocksize), 1e-38f);
}

void encode_four_bit(const float* values, size_t n, size_t blocksize, const float* midpoints, const uint8_t* order,
                     uint8_t* codes, float* absmax, int threads) {
  block_absmax(values, n, blocksize, absmax, threads);
  const long long full = static_cast<long long>(n / blocksize);
  const size_t rem = n % blocksize;
  auto quantize = [&](float scaled) { return order[bucket(std::min(std::max(scaled, -1.0f), 1.0f), midpoints)]; };
#pragma omp parallel for num_threads(threads) schedule(static)
  for (long long b = 0; b < full; ++b) {
    const float inv = 1.0f / std::max(absmax[b], 1e-38f);
    const float* v = values + b * blocksize;
    uint8_t* c = codes + b * blocksize / 2;
    for (size_t j = 0; j < blocksize; j += 2) c[j / 2] = static_cast<uint8_t>(quantize(v[j] * inv) << 4 | quantize(v[j + 1] * inv));
  }
  if (rem) {  // the partial last block: divided by its clamped absmax (bitsandbytes' remainder path)
    const float am = absmax[full];
    const float* v = values + full * blocksize;
    uint8_t* c = codes + full * blocksize / 2;
    for (size_t j = 0; j < rem; j += 2) {
      const uint8_t hi = quantize(v[j] / am);
      const uint8_t lo = j + 1 < rem ? quantize(v[j + 1] / am) : quantize(0.0f);
      c[j / 2] = static_cast<uint8_t>(hi << 4 | lo);
    }
  }
}

}  // namespace zinf::quant
