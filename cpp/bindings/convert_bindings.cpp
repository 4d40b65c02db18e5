// Python bindings of zinf::convert (binding only; logic lives in cpp/convert).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../convert/widen.h"
#include "bindings.h"

namespace py = pybind11;

namespace zinf::bindings {

void bind_convert(py::module_& m) {
  m.doc() = "Exact widening of 16-bit floats to fp32, streaming the stores of large outputs.";
  py::enum_<zinf::convert::Narrow>(m, "Narrow")
      .value("BF16", zinf::convert::Narrow::kBf16)
      .value("FP16", zinf::convert::Narrow::kFp16);
  m.def(
      "widen",
      [](uintptr_t src, uintptr_t dst, size_t n, zinf::convert::Narrow kind, int threads) {
        py::gil_scoped_release release;
        zinf::convert::widen(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<float*>(dst), n, kind,
                             threads);
      },
      py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("kind"), py::arg("threads") = 1);
}

}  // namespace zinf::bindings
