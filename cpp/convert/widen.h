// Widening 16-bit floats (bf16, fp16) to fp32: the copy a gather makes of a shard stored narrower than it computes.
#pragma once
#include <cstddef>
#include <cstdint>

namespace zinf::convert {

enum class Narrow : int { kBf16 = 0, kFp16 = 1 };

// dst[i] = src[i] widened exactly as torch does (an fp16 signalling NaN quieted), i < n; the ranges must not overlap.
// Large outputs (kStreamBytes and up) are written with non-temporal stores where the SIMD level has them: the full
// buffer is read back by the compute long after, from memory either way, and streaming skips reading each
// destination line before writing it (about twice the speed on one core). Up to ``threads`` OpenMP threads, each
// given at least kStreamBytes of output.
void widen(const uint16_t* src, float* dst, size_t n, Narrow kind, int threads);

constexpr size_t kStreamBytes = size_t{1} << 20;

}  // namespace zinf::convert
