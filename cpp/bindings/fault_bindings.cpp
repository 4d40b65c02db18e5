// Python bindings of zinf::fault (binding only; logic lives in cpp/fault).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../fault/report.h"
#include "bindings.h"

namespace py = pybind11;

namespace zinf::bindings {

void bind_fault(py::module_& m) {
  m.doc() = "The one line a process killed by a fatal signal writes: its rank, thread and phase.";
  m.def("install", &zinf::fault::install, py::arg("rank"), py::arg("world"));
  m.def("installed", &zinf::fault::installed);
  m.def("set_phase", &zinf::fault::set_phase, py::arg("phase"));
  m.def("phase", &zinf::fault::phase);
  m.def("describe", &zinf::fault::describe, py::arg("signum"));
}

}  // namespace zinf::bindings
