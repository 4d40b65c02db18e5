// See four_bit.h. Plain loops compiled with -ffp-contract=off: one IEEE multiply (and one reciprocal or division)
// per value, so the results are bitsandbytes' and torch's to the bit on every x86-64 CPU.
#include "four_bit.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

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

void decode_four_bit(const uint8_t* codes, const float* scales, void* out, size_t n, size_t blocksize,
                     const float* code, bool out_bf16, int threads) {
  const long long blocks = static_cast<long long>(n / blocksize);
  float* out32 = static_cast<float*>(out);
  uint16_t* out16 = static_cast<uint16_t*>(out);
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
