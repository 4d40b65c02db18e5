// Python bindings of zinf::shm (binding only; logic lives in cpp/shm).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../shm/flags.h"
#include "bindings.h"

namespace py = pybind11;

namespace zinf::bindings {

void bind_shm(py::module_& m) {
  m.doc() = "Flags in shared memory for collectives between the ranks of one host (addresses as integers).";
  m.def(
      "post", [](uintptr_t flag, uint32_t seq) { zinf::shm::post(reinterpret_cast<uint32_t*>(flag), seq); },
      py::arg("flag"), py::arg("seq"));
  m.def(
      "wait_all",
      [](const std::vector<uintptr_t>& flags, const std::vector<int>& pids, uint32_t seq, double timeout_s,
         int spins) {
        std::vector<uint32_t*> ptrs;
        ptrs.reserve(flags.size());
        for (uintptr_t f : flags) ptrs.push_back(reinterpret_cast<uint32_t*>(f));
        py::gil_scoped_release release;
        return zinf::shm::wait_all(ptrs, pids, seq, timeout_s, spins);
      },
      py::arg("flags"), py::arg("pids"), py::arg("seq"), py::arg("timeout_s"), py::arg("spins"));
}

}  // namespace zinf::bindings
