// Python bindings of zinf::quant (binding only; logic lives in cpp/quant).
#include <pybind11/pybind11.h>

#include <cstdint>

#include "../quant/four_bit.h"
#include "bindings.h"

namespace py = pybind11;

namespace zinf::bindings {

void bind_four_bit(py::module_& m) {
  m.doc() = "4-bit block codes (bitsandbytes' NF4 / FP4): encoding and decoding of memory ranges.";
  m.def(
      "decode",
      [](uintptr_t codes, uintptr_t scales, uintptr_t out, size_t n, size_t blocksize, uintptr_t code, bool out_bf16,
         int threads) {
        py::gil_scoped_release release;
        zinf::quant::decode_four_bit(reinterpret_cast<const uint8_t*>(codes), reinterpret_cast<const float*>(scales),
                                     reinterpret_cast<void*>(out), n, blocksize, reinterpret_cast<const float*>(code),
                                     out_bf16, threads);
      },
      py::arg("codes"), py::arg("scales"), py::arg("out"), py::arg("n"), py::arg("blocksize"), py::arg("code"),
      py::arg("out_bf16"), py::arg("threads") = 1);
  m.def(
      "encode",
      [](uintptr_t values, size_t n, size_t blocksize, uintptr_t midpoints, uintptr_t order, uintptr_t codes,
         uintptr_t absmax, int threads) {
        py::gil_scoped_release release;
        zinf::quant::encode_four_bit(reinterpret_cast<const float*>(values), n, blocksize,
                                     reinterpret_cast<const float*>(midpoints), reinterpret_cast<const uint8_t*>(order),
                                     reinterpret_cast<uint8_t*>(codes), reinterpret_cast<float*>(absmax), threads);
      },
      py::arg("values"), py::arg("n"), py::arg("blocksize"), py::arg("midpoints"), py::arg("order"), py::arg("codes"),
      py::arg("absmax"), py::arg("threads") = 1);
  m.def(
      "block_absmax",
      [](uintptr_t values, size_t n, size_t blocksize, uintptr_t absmax, int threads) {
        py::gil_scoped_release release;
        zinf::quant::block_absmax(reinterpret_cast<const float*>(values), n, blocksize,
                                  reinterpret_cast<float*>(absmax), threads);
      },
      py::arg("values"), py::arg("n"), py::arg("blocksize"), py::arg("absmax"), py::arg("threads") = 1);
}

}  // namespace zinf::bindings
