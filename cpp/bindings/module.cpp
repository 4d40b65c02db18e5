// zinf._native: one extension module with submodules adam, aio, pool, checksum, shm, fault, four_bit and convert.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_native, m) {
  m.doc() = "zinf native core: CPU Adam, async file I/O, aligned host buffer pool, checksums, shared-memory flags, the fatal-signal line, 4-bit block codes, widening 16-bit floats.";
  m.attr("source_fingerprint") = ZINF_SOURCE_FINGERPRINT;  // cpp/CMakeLists.txt
  auto adam = m.def_submodule("adam");
  zinf::bindings::bind_adam(adam);
  auto aio = m.def_submodule("aio");
  zinf::bindings::bind_aio(aio);
  auto pool = m.def_submodule("pool");
  zinf::bindings::bind_pool(pool);
  auto checksum = m.def_submodule("checksum");
  zinf::bindings::bind_checksum(checksum);
  auto shm = m.def_submodule("shm");
  zinf::bindings::bind_shm(shm);
  auto fault = m.def_submodule("fault");
  zinf::bindings::bind_fault(fault);
  auto four_bit = m.def_submodule("four_bit");
  zinf::bindings::bind_four_bit(four_bit);
  auto convert = m.def_submodule("convert");
  zinf::bindings::bind_convert(convert);
}
