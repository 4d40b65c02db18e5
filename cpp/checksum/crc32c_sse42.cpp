// The crc32 instruction path of CRC32C, compiled with -msse4.2 and reached only after a CPU check.
#include <nmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "crc32c.h"

namespace zinf::checksum::detail {
namespace {

inline uint32_t shift(uint32_t state, const uint32_t (*table)[256]) {
  return table[0][state & 0xFF] ^ table[1][(state >> 8) & 0xFF] ^ table[2][(state >> 16) & 0xFF] ^
         table[3][state >> 24];
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

}  // namespace

uint32_t raw_update_sse42(uint32_t state, const uint8_t* p, size_t n) {
  uint64_t s = state;
  while (n >= 8) {
    s = _mm_crc32_u64(s, load64(p));
    p += 8;
    n -= 8;
  }
  auto s32 = static_cast<uint32_t>(s);
  while (n--) s32 = _mm_crc32_u8(s32, *p++);
  return s32;
}

// Three streams over consecutive lanes A, B, C run in parallel (the instruction has a latency of three
// cycles and a throughput of one); then state(A B C) = shift2(state(A)) ^ shift1(state_0(B)) ^ state_0(C),
// since the raw update is linear in the state.
uint32_t raw_update_sse42_3way(uint32_t state, const uint8_t* p, size_t n, const uint32_t (*shift_lane)[256],
                               const uint32_t (*shift_2lanes)[256], size_t lane) {
  while (n >= 3 * lane) {
    uint64_t a = state, b = 0, c = 0;
    const uint8_t* pb = p + lane;
    const uint8_t* pc = p + 2 * lane;
    for (size_t i = 0; i < lane; i += 8) {
      a = _mm_crc32_u64(a, load64(p + i));
      b = _mm_crc32_u64(b, load64(pb + i));
      c = _mm_crc32_u64(c, load64(pc + i));
    }
    state = shift(static_cast<uint32_t>(a), shift_2lanes) ^ shift(static_cast<uint32_t>(b), shift_lane) ^
            static_cast<uint32_t>(c);
    p += 3 * lane;
    n -= 3 * lane;
  }
  return raw_update_sse42(state, p, n);
}

// Up to four streams advance together over their common length, eight bytes a step each, then each finishes
// its own tail.
void raw_update_sse42_streams(uint32_t* states, const uint8_t* const* p, const size_t* n, int k) {
  for (int first = 0; first < k; first += 4) {
    const int m = std::min(4, k - first);
    uint64_t s[4] = {0, 0, 0, 0};
    size_t common = SIZE_MAX;
    for (int i = 0; i < m; ++i) {
      s[i] = states[first + i];
      common = std::min(common, n[first + i]);
    }
    common &= ~size_t{7};
    const uint8_t* q[4] = {p[first], m > 1 ? p[first + 1] : nullptr, m > 2 ? p[first + 2] : nullptr,
                           m > 3 ? p[first + 3] : nullptr};
    size_t off = 0;
    if (m == 4) {
      for (; off < common; off += 8) {
        s[0] = _mm_crc32_u64(s[0], load64(q[0] + off));
        s[1] = _mm_crc32_u64(s[1], load64(q[1] + off));
        s[2] = _mm_crc32_u64(s[2], load64(q[2] + off));
        s[3] = _mm_crc32_u64(s[3], load64(q[3] + off));
      }
    } else if (m == 3) {
      for (; off < common; off += 8) {
        s[0] = _mm_crc32_u64(s[0], load64(q[0] + off));
        s[1] = _mm_crc32_u64(s[1], load64(q[1] + off));
        s[2] = _mm_crc32_u64(s[2], load64(q[2] + off));
      }
    }
    for (int i = 0; i < m; ++i)
      states[first + i] = raw_update_sse42(static_cast<uint32_t>(s[i]), q[i] + off, n[first + i] - off);
  }
}

}  // namespace zinf::checksum::detail
