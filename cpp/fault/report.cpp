#include "report.h"

#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace zinf::fault {
namespace {

constexpr int kSignals[] = {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL};
constexpr size_t kPhaseBytes = 96;
constexpr size_t kAltStackBytes = 64 * 1024;

std::atomic<bool> g_installed{false};
std::atomic<int> g_rank{-1};
std::atomic<int> g_world{0};
std::atomic<int> g_reporting{0};  // the first fatal signal reports; one raised while reporting goes straight on
char g_phase[2][kPhaseBytes] = {"", ""};
std::atomic<int> g_phase_index{0};
struct sigaction g_previous[NSIG];

// A small append-only buffer: no allocation, no locale, nothing that is unsafe in a signal handler.
struct Line {
  char text[512];
  size_t size = 0;
  void add(const char* s) {
    while (*s != '\0' && size + 1 < sizeof(text)) text[size++] = *s++;
    text[size] = '\0';
  }
  void add(long value) {
    char digits[24];
    size_t n = 0;
    bool negative = value < 0;
    unsigned long v = negative ? 0UL - static_cast<unsigned long>(value) : static_cast<unsigned long>(value);
    do {
      digits[n++] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0 && n < sizeof(digits));
    if (negative) add("-");
    while (n > 0 && size + 1 < sizeof(text)) text[size++] = digits[--n];
    text[size] = '\0';
  }
};

const char* signal_name(int signum) {
  switch (signum) {
    case SIGSEGV: return "SIGSEGV (an invalid memory access)";
    case SIGABRT: return "SIGABRT (abort(): a C++ std::terminate, a failed assertion or an explicit abort)";
    case SIGBUS: return "SIGBUS (a bad memory access: a truncated mapped file, an unaligned access)";
    case SIGFPE: return "SIGFPE (an arithmetic fault: an integer division by zero)";
    case SIGILL: return "SIGILL (an illegal instruction: code built for another CPU)";
    default: return "a fatal signal";
  }
}

void format(int signum, Line& line) {
  line.add("zinf: rank ");
  int rank = g_rank.load(std::memory_order_relaxed);
  if (rank >= 0) {
    line.add(static_cast<long>(rank));
    line.add(" of ");
    line.add(static_cast<long>(g_world.load(std::memory_order_relaxed)));
  } else {
    line.add("?");
  }
  line.add(" (pid ");
  line.add(static_cast<long>(getpid()));
  line.add(") killed by ");
  line.add(signal_name(signum));
  long tid = syscall(SYS_gettid);
  if (tid == getpid()) {
    line.add(" in its main thread");
  } else {
    char name[17] = {0};
    prctl(PR_GET_NAME, name, 0, 0, 0);
    line.add(" in thread ");
    line.add(tid);
    line.add(" (");
    line.add(name);
    line.add(")");
  }
  line.add(" during ");
  const char* phase = g_phase[g_phase_index.load(std::memory_order_acquire)];
  line.add(phase[0] != '\0' ? phase : "the script's own code (outside zinf's calls)");
  line.add("\n");
}

void on_fatal(int signum, siginfo_t*, void*) {
  if (g_reporting.fetch_add(1) == 0) {
    Line line;
    format(signum, line);
    ssize_t ignored = write(STDERR_FILENO, line.text, line.size);
    (void)ignored;
  }
  // On to what handled this signal before (faulthandler's traceback dump, the default action): restored, unblocked
  // and raised again in this thread, so it is delivered before this handler returns.
  sigaction(signum, &g_previous[signum], nullptr);
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, signum);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  raise(signum);
}

void alternate_stack() {
  stack_t current;
  if (sigaltstack(nullptr, &current) == 0 && !(current.ss_flags & SS_DISABLE)) return;  // the thread has one
  stack_t stack;
  stack.ss_sp = std::malloc(kAltStackBytes);  // kept for the life of the process
  if (stack.ss_sp == nullptr) return;
  stack.ss_size = kAltStackBytes;
  stack.ss_flags = 0;
  sigaltstack(&stack, nullptr);
}

}  // namespace

void install(int rank, int world) {
  g_rank.store(rank, std::memory_order_relaxed);
  g_world.store(world, std::memory_order_relaxed);
  if (g_installed.exchange(true)) return;
  alternate_stack();
  for (int signum : kSignals) {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_fatal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    sigaction(signum, &action, &g_previous[signum]);
  }
}

bool installed() { return g_installed.load(); }

void set_phase(const std::string& phase) {
  int next = 1 - g_phase_index.load(std::memory_order_relaxed);
  size_t n = phase.size() < kPhaseBytes - 1 ? phase.size() : kPhaseBytes - 1;
  std::memcpy(g_phase[next], phase.data(), n);
  g_phase[next][n] = '\0';
  g_phase_index.store(next, std::memory_order_release);
}

std::string phase() { return g_phase[g_phase_index.load(std::memory_order_acquire)]; }

std::string describe(int signum) {
  Line line;
  format(signum, line);
  return std::string(line.text, line.size);
}

}  // namespace zinf::fault
