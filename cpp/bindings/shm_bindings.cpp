// Python bindings of zinf::shm (binding only; logic lives in cpp/shm).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <utility>

#include "../shm/flags.h"
#include "bindings.h"

namespace py = pybind11;

namespace zinf::bindings {
namespace {

std::vector<uint32_t*> pointers(const std::vector<uintptr_t>& addresses) {
  std::vector<uint32_t*> ptrs;
  ptrs.reserve(addresses.size());
  for (uintptr_t a : addresses) ptrs.push_back(reinterpret_cast<uint32_t*>(a));
  return ptrs;
}

}  // namespace

void bind_shm(py::module_& m) {
  m.doc() = "Flags in shared memory for collectives between the ranks of one host (addresses as integers).";
  m.def(
      "post", [](uintptr_t flag, uint32_t seq) { zinf::shm::post(reinterpret_cast<uint32_t*>(flag), seq); },
      py::arg("flag"), py::arg("seq"));
  m.def(
      "mark_closed",
      [](uintptr_t closed, uintptr_t flag) {
        zinf::shm::mark_closed(reinterpret_cast<uint32_t*>(closed), reinterpret_cast<uint32_t*>(flag));
      },
      py::arg("closed"), py::arg("flag"));
  m.def(
      "wait_all",
      [](const std::vector<uintptr_t>& flags, const std::vector<uintptr_t>& closed, const std::vector<int>& pids,
         uint32_t seq, double timeout_s, int spins) {
        const std::vector<uint32_t*> flag_ptrs = pointers(flags), closed_ptrs = pointers(closed);
        py::gil_scoped_release release;
        const zinf::shm::WaitResult r = zinf::shm::wait_all(flag_ptrs, closed_ptrs, pids, seq, timeout_s, spins);
        return std::make_pair(static_cast<int>(r.outcome), r.index);
      },
      py::arg("flags"), py::arg("closed"), py::arg("pids"), py::arg("seq"), py::arg("timeout_s"), py::arg("spins"));
}

}  // namespace zinf::bindings
