// Cross-process flags in memory that every rank of one host maps (a shared file): the signal a rank gives
// when its part of a collective is in shared memory, and the wait for every other rank's.
#pragma once
#include <cstdint>
#include <vector>

namespace zinf::shm {

// Makes every store before it (non-temporal ones included) visible, then sets `*flag = seq` and wakes the
// ranks waiting on it.
void post(uint32_t* flag, uint32_t seq);

// Waits until every flag has reached `seq` (sequence numbers wrap: compared modulo 2^32). Checks each flag up to
// `spins` times (a pause between checks), then sleeps on it (a futex keyed by the shared page, so it works across
// processes); spin only where every rank has a core of its own. While it sleeps on flag i it looks, every
// kLivenessMs, whether process `pids[i]` (same PID namespace) still runs. Returns -1 when every flag reached it;
// i when flag i had not after `timeout_s` seconds; -2 - i when process `pids[i]` exited (or is a zombie) first.
int wait_all(const std::vector<uint32_t*>& flags, const std::vector<int>& pids, uint32_t seq, double timeout_s,
             int spins);

}  // namespace zinf::shm
