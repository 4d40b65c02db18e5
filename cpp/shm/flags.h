// Cross-process flags in memory that every rank of one host maps (a shared file): the signal a rank gives
// when its part of a collective is in shared memory, the mark it leaves when it closes, and the wait for every
// other rank's.
#pragma once
#include <cstdint>
#include <vector>

namespace zinf::shm {

// Makes every store before it (non-temporal ones included) visible, then sets `*flag = seq` and wakes the
// ranks waiting on it.
void post(uint32_t* flag, uint32_t seq);

// Sets `*closed = 1` once every store before it (the last post included) is visible, and wakes the ranks sleeping
// on `flag`: a rank that waits for this one's flag learns at once that it will never move again.
void mark_closed(uint32_t* closed, uint32_t* flag);

// How a wait ended; `index` names the flag that stopped it (-1 when every flag reached the sequence number).
enum class Outcome : int { kReached = 0, kTimedOut = 1, kExited = 2, kClosed = 3 };
struct WaitResult {
  Outcome outcome;
  int index;
};

// Waits until every flag has reached `seq` (sequence numbers wrap: compared modulo 2^32). Checks each flag up to
// `spins` times (a pause between checks), then sleeps on it (a futex keyed by the shared page, so it works across
// processes); spin only where every rank has a core of its own. Before each sleep on flag i it reads `closed[i]`
// (the mark of mark_closed), and every kLivenessMs it looks whether process `pids[i]` (same PID namespace) still
// runs; empty `closed` or `pids`: no such check. Ends kTimedOut when flag i had not reached `seq` after `timeout_s`
// seconds, kClosed when its rank marked it closed first, kExited when process `pids[i]` exited (or is a zombie)
// first.
WaitResult wait_all(const std::vector<uint32_t*>& flags, const std::vector<uint32_t*>& closed,
                    const std::vector<int>& pids, uint32_t seq, double timeout_s, int spins);

}  // namespace zinf::shm
