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
// processes); spin only where every rank has a core of its own. Returns -1 when every flag reached it, else the
// index in `flags` of the first one that had not after `timeout_s` seconds.
int wait_all(const std::vector<uint32_t*>& flags, uint32_t seq, double timeout_s, int spins);

}  // namespace zinf::shm
