// CRC32C: table-driven fallback, hardware dispatch, and the shift tables that join interleaved streams.
#include "crc32c.h"

#include <algorithm>
#include <array>
#include <vector>

namespace zinf::checksum {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // reflected Castagnoli polynomial
constexpr size_t kLane = 8192;           // bytes per stream in the three-way hardware loop

struct Tables {
  uint32_t slice[8][256];
  uint32_t shift_lane[4][256];    // state -> state after kLane zero bytes (a linear map, by byte of the state)
  uint32_t shift_2lanes[4][256];  // the same for 2 * kLane zero bytes
  bool hardware;

  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      slice[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int t = 1; t < 8; ++t) slice[t][i] = (slice[t - 1][i] >> 8) ^ slice[0][slice[t - 1][i] & 0xFF];
    fill_shift(shift_lane, kLane);
    fill_shift(shift_2lanes, 2 * kLane);
#if defined(__x86_64__) || defined(__i386__)
    hardware = __builtin_cpu_supports("sse4.2");
#else
    hardware = false;
#endif
  }

  uint32_t raw_zeros(uint32_t state, size_t n) const {
    for (size_t i = 0; i < n; ++i) state = (state >> 8) ^ slice[0][state & 0xFF];
    return state;
  }

  void fill_shift(uint32_t (*out)[256], size_t zeros) {
    uint32_t basis[32];
    for (int b = 0; b < 32; ++b) basis[b] = raw_zeros(1u << b, zeros);
    for (int byte = 0; byte < 4; ++byte)
      for (uint32_t v = 0; v < 256; ++v) {
        uint32_t r = 0;
        for (int bit = 0; bit < 8; ++bit)
          if (v & (1u << bit)) r ^= basis[8 * byte + bit];
        out[byte][v] = r;
      }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

uint32_t raw_update_portable(uint32_t state, const uint8_t* p, size_t n) {
  const Tables& t = tables();
  while (n >= 8) {
    uint32_t lo = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
                  static_cast<uint32_t>(p[3]) << 24;
    lo ^= state;
    state = t.slice[7][lo & 0xFF] ^ t.slice[6][(lo >> 8) & 0xFF] ^ t.slice[5][(lo >> 16) & 0xFF] ^
            t.slice[4][lo >> 24] ^ t.slice[3][p[4]] ^ t.slice[2][p[5]] ^ t.slice[1][p[6]] ^ t.slice[0][p[7]];
    p += 8;
    n -= 8;
  }
  while (n--) state = (state >> 8) ^ t.slice[0][(state ^ *p++) & 0xFF];
  return state;
}

}  // namespace

uint32_t crc32c_portable(const void* data, size_t n, uint32_t crc) {
  return ~raw_update_portable(~crc, static_cast<const uint8_t*>(data), n);
}

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const Tables& t = tables();
  if (!t.hardware) return crc32c_portable(data, n, crc);
  return ~detail::raw_update_sse42_3way(~crc, static_cast<const uint8_t*>(data), n, t.shift_lane, t.shift_2lanes,
                                        kLane);
}

namespace {

// a(x) * b(x) modulo the polynomial, both reflected (zlib's multmodp)
uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(n * 2^k) modulo the polynomial
uint32_t x2nmodp(size_t n, unsigned k) {
  static const std::array<uint32_t, 32> powers = [] {
    std::array<uint32_t, 32> t{};
    uint32_t p = 1u << 30;  // x^1
    for (auto& v : t) {
      v = p;
      p = multmodp(p, p);
    }
    return t;
  }();
  uint32_t p = 1u << 31;  // x^0
  while (n) {
    if (n & 1) p = multmodp(powers[k & 31], p);
    n >>= 1;
    ++k;
  }
  return p;
}

constexpr size_t kParallelBelow = size_t{4} << 20;

}  // namespace

uint32_t crc32c_combine(uint32_t crc1, uint32_t crc2, size_t len2) {
  return multmodp(x2nmodp(len2, 3), crc1) ^ crc2;
}

uint32_t crc32c_parallel(const void* data, size_t n, uint32_t crc, int threads) {
  if (threads <= 1 || n < kParallelBelow) return crc32c(data, n, crc);
  const size_t slices = static_cast<size_t>(threads);
  const size_t slice = (n / slices + 4095) / 4096 * 4096;
  std::vector<uint32_t> crcs(slices, 0);
  std::vector<size_t> lens(slices, 0);
  const uint8_t* p = static_cast<const uint8_t*>(data);
#pragma omp parallel for num_threads(threads) schedule(static, 1)
  for (long i = 0; i < static_cast<long>(slices); ++i) {
    const size_t lo = std::min(n, static_cast<size_t>(i) * slice), hi = std::min(n, lo + slice);
    lens[i] = hi - lo;
    crcs[i] = crc32c(p + lo, hi - lo, 0);
  }
  for (size_t i = 0; i < slices; ++i) crc = crc32c_combine(crc, crcs[i], lens[i]);
  return crc;
}

void raw_update_streams(uint32_t* states, const uint8_t* const* p, const size_t* n, int k) {
  if (tables().hardware) {
    detail::raw_update_sse42_streams(states, p, n, k);
    return;
  }
  for (int i = 0; i < k; ++i) states[i] = raw_update_portable(states[i], p[i], n[i]);
}

std::string crc32c_backend() { return tables().hardware ? "sse4.2" : "portable"; }

}  // namespace zinf::checksum
