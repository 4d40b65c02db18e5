#include "flags.h"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <climits>
#include <ctime>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ZINF_PAUSE() _mm_pause()
#else
#define ZINF_PAUSE() ((void)0)
#endif

namespace zinf::shm {
namespace {

constexpr long kSleepNs = 1'000'000;    // one futex sleep at most: the deadline is checked between them

bool reached(uint32_t value, uint32_t seq) { return static_cast<int32_t>(value - seq) >= 0; }

long futex(uint32_t* addr, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, addr, op, value, timeout, nullptr, 0);
}

}  // namespace

void post(uint32_t* flag, uint32_t seq) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_store_n(flag, seq, __ATOMIC_RELEASE);
  futex(flag, FUTEX_WAKE, INT_MAX, nullptr);
}

int wait_all(const std::vector<uint32_t*>& flags, uint32_t seq, double timeout_s, int spins) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  for (size_t i = 0; i < flags.size(); ++i) {
    uint32_t* flag = flags[i];
    int spun = 0;
    for (;;) {
      const uint32_t value = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
      if (reached(value, seq)) break;
      if (spun < spins) {
        ++spun;
        ZINF_PAUSE();
        continue;
      }
      if (clock::now() >= deadline) return static_cast<int>(i);
      const timespec nap{0, kSleepNs};
      futex(flag, FUTEX_WAIT, value, &nap);  // returns at once if the flag moved on since it was read
    }
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  return -1;
}

}  // namespace zinf::shm
