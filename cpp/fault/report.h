// The fatal-signal line: when a process dies by SIGSEGV, SIGABRT, SIGBUS, SIGFPE or SIGILL (a C++ std::terminate,
// a failed assertion, a bad memory access, in any thread), one line on stderr names the rank, the thread and the
// phase of the run it was in, before the signal goes on to whatever handled it before (Python's faulthandler, the
// default action). Everything the handler does is async-signal-safe: it formats into a stack buffer and write()s.
#pragma once
#include <string>

namespace zinf::fault {

// Installs the handlers (once per process; later calls only update the rank) and an alternate signal stack for the
// calling thread, so that a stack overflow there is reported too. `rank` < 0: not known yet.
void install(int rank, int world);

// Whether the handlers are installed.
bool installed();

// The phase the line names (truncated to 95 bytes). Safe against a signal arriving mid-update: the handler reads
// whichever of two buffers was published last.
void set_phase(const std::string& phase);
std::string phase();

// The line the handler writes for `signum` in the calling thread (without writing it): for the tests.
std::string describe(int signum);

}  // namespace zinf::fault
