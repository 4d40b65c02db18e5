#include "flags.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
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
constexpr int kLivenessMs = 200;        // how often a sleeping waiter looks whether the rank it waits for still runs

bool reached(uint32_t value, uint32_t seq) { return static_cast<int32_t>(value - seq) >= 0; }

long futex(uint32_t* addr, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, addr, op, value, timeout, nullptr, 0);
}

// Whether process `pid` is running (not gone, not a zombie waiting to be reaped).
bool process_alive(int pid) {
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return true;  // no /proc: kill() said it is there
  char buf[512];
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = '\0';
  const char* close = std::strrchr(buf, ')');  // "pid (comm) S ...": the state follows the last ')'
  if (close == nullptr || close[1] == '\0') return true;
  const char state = close[2];
  return state != 'Z' && state != 'X';
}

}  // namespace

void post(uint32_t* flag, uint32_t seq) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_store_n(flag, seq, __ATOMIC_RELEASE);
  futex(flag, FUTEX_WAKE, INT_MAX, nullptr);
}

void mark_closed(uint32_t* closed, uint32_t* flag) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  __atomic_store_n(closed, 1u, __ATOMIC_RELEASE);
  futex(flag, FUTEX_WAKE, INT_MAX, nullptr);
}

WaitResult wait_all(const std::vector<uint32_t*>& flags, const std::vector<uint32_t*>& closed,
                    const std::vector<int>& pids, uint32_t seq, double timeout_s, int spins) {
  using clock = std::chrono::steady_clock;
  // at most a year: a longer (or infinite) timeout must not overflow the clock's integer ticks into no wait at all
  const double bounded_s = timeout_s < 365.0 * 24 * 3600 ? timeout_s : 365.0 * 24 * 3600;
  const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(bounded_s));
  for (size_t i = 0; i < flags.size(); ++i) {
    uint32_t* flag = flags[i];
    int spun = 0;
    auto next_look = clock::now() + std::chrono::milliseconds(kLivenessMs);
    for (;;) {
      const uint32_t value = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
      if (reached(value, seq)) break;
      if (spun < spins) {
        ++spun;
        ZINF_PAUSE();
        continue;
      }
      const auto now = clock::now();
      const int at = static_cast<int>(i);
      if (now >= deadline) return {Outcome::kTimedOut, at};
      // closed, or exited, and the flag still short of `seq` after that was seen: its last post came before
      if (i < closed.size() && __atomic_load_n(closed[i], __ATOMIC_ACQUIRE) != 0 &&
          !reached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), seq))
        return {Outcome::kClosed, at};
      if (i < pids.size() && now >= next_look) {
        if (!process_alive(pids[i]) && !reached(__atomic_load_n(flag, __ATOMIC_ACQUIRE), seq)) return {Outcome::kExited, at};
        next_look = now + std::chrono::milliseconds(kLivenessMs);
      }
      const timespec nap{0, kSleepNs};
      futex(flag, FUTEX_WAIT, value, &nap);  // returns at once if the flag moved on since it was read
    }
  }
  __atomic_thread_fence(__ATOMIC_ACQUIRE);
  return {Outcome::kReached, -1};
}

}  // namespace zinf::shm
