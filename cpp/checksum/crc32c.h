// CRC32C (Castagnoli) of byte ranges: zinf's content checksum for offloaded records and checkpoint tensors.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace zinf::checksum {

// The CRC32C of `n` bytes at `data`, continuing from `crc` (0 for a fresh checksum): crc32c(a + b) ==
// crc32c(b, crc32c(a)). Uses the SSE4.2 crc32 instruction (three interleaved streams) where the CPU has it,
// else a slicing-by-8 table. Safe to call from any thread; holds no state besides read-only tables.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

// crc32c(a + b) from crc1 = crc32c(a), crc2 = crc32c(b) and the length of b (zlib's crc32_combine, for the
// Castagnoli polynomial): O(log len2) multiplications in GF(2)[x] modulo the polynomial.
uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2);

// crc32c() computed on up to `threads` threads (OpenMP), each over its own slice, the slices' CRCs joined with
// crc32c_combine: the same value, in a fraction of the time on a multi-core host. Ranges under 4 MiB, or one
// thread, take the serial path.
uint32_t crc32c_parallel(const void* data, size_t n, uint32_t crc, int threads);

// Raw register updates (no pre/post inversion: a fresh CRC starts from ~0u and ends inverted) of `k` streams
// at once: states[i] over n[i] bytes at p[i]. The streams are independent, so the crc32 instruction's latency
// is hidden as in the three-way loop; a caller that checksums several arrays tile by tile (the CPU-Adam's
// checked pass) keeps one state per array.
void raw_update_streams(uint32_t* states, const uint8_t* const* p, const size_t* n, int k);

// The software path alone (the test oracle for the hardware path).
uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc = 0);

// "sse4.2" or "portable": what crc32c() uses on this CPU.
std::string crc32c_backend();

namespace detail {
// Raw register update (no pre/post inversion) with the crc32 instruction; defined in crc32c_sse42.cpp,
// compiled with -msse4.2 and called only when the CPU supports it.
uint32_t raw_update_sse42(uint32_t state, const uint8_t* p, size_t n);
uint32_t raw_update_sse42_3way(uint32_t state, const uint8_t* p, size_t n, const uint32_t (*shift_lane)[256],
                               const uint32_t (*shift_2lanes)[256], size_t lane);
void raw_update_sse42_streams(uint32_t* states, const uint8_t* const* p, const size_t* n, int k);
}  // namespace detail

}  // namespace zinf::checksum
