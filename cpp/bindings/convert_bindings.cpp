// Python bindings of zinf::convert (binding only; logic lives in cpp/convert).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../convert/widen.h"
#include "bindings.h"

namespace py = pybind11;

namespace zinf::bindings {

void bind_convert(py::module_& m) {
  m.doc() = "Exact widening of 16-bit floats to fp32, streaming the stores of large outputs; with a CRC32C taken in the same pass.";
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
  m.def(
      "widen_crc",
      [](uintptr_t src, uintptr_t dst, size_t n, zinf::convert::Narrow kind, int threads, uint32_t crc) {
        py::gil_scoped_release release;
        return zinf::convert::widen_crc(reinterpret_cast<const uint16_t*>(src), reinterpret_cast<float*>(dst), n,
                                        kind, threads, crc);
      },
      py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("kind"), py::arg("threads") = 1, py::arg("crc") = 0);
  m.def(
      "copy_crc",
      [](uintptr_t src, uintptr_t dst, size_t nbytes, int threads, uint32_t crc) {
        py::gil_scoped_release release;
        return zinf::convert::copy_crc(reinterpret_cast<const void*>(src), reinterpret_cast<void*>(dst), nbytes,
                                       threads, crc);
      },
      py::arg("src"), py::arg("dst"), py::arg("nbytes"), py::arg("threads") = 1, py::arg("crc") = 0);
}

}  // namespace zinf::bindings
