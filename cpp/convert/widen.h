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

// widen() that also returns the CRC32C of src's 2n bytes, continuing from ``crc`` (zinf::checksum::crc32c's
// chaining): one pass over src. Each block of kCrcBlockBytes is checksummed, then widened while it is still in the
// core's cache, so src is read from memory once where a checksum and a widening read it twice.
uint32_t widen_crc(const uint16_t* src, float* dst, size_t n, Narrow kind, int threads, uint32_t crc);

// std::memcpy of n bytes that also returns their CRC32C, continuing from ``crc``, in the same blocks and threads.
uint32_t copy_crc(const void* src, void* dst, size_t n, int threads, uint32_t crc);

constexpr size_t kCrcBlockBytes = size_t{48} << 10;  // six of the checksum's 8 KiB streams, well inside a core's L2

}  // namespace zinf::convert
