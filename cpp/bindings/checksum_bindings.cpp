// Python bindings of zinf::checksum (binding only; logic lives in cpp/checksum).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../checksum/crc32c.h"
#include "bindings.h"

namespace py = pybind11;

namespace zinf::bindings {

void bind_checksum(py::module_& m) {
  m.doc() = "CRC32C content checksums of memory ranges (SSE4.2 where available).";
  m.def(
      "crc32c",
      [](uintptr_t address, size_t nbytes, uint32_t crc) {
        py::gil_scoped_release release;
        return zinf::checksum::crc32c(reinterpret_cast<const void*>(address), nbytes, crc);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0);
  m.def(
      "crc32c_parallel",
      [](uintptr_t address, size_t nbytes, uint32_t crc, int threads) {
        py::gil_scoped_release release;
        return zinf::checksum::crc32c_parallel(reinterpret_cast<const void*>(address), nbytes, crc, threads);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0, py::arg("threads") = 1);
  m.def("crc32c_combine", &zinf::checksum::crc32c_combine, py::arg("crc1"), py::arg("crc2"), py::arg("len2"));
  m.def(
      "crc32c_portable",
      [](uintptr_t address, size_t nbytes, uint32_t crc) {
        py::gil_scoped_release release;
        return zinf::checksum::crc32c_portable(reinterpret_cast<const void*>(address), nbytes, crc);
      },
      py::arg("address"), py::arg("nbytes"), py::arg("crc") = 0);
  m.def("backend", &zinf::checksum::crc32c_backend);
}

}  // namespace zinf::bindings
