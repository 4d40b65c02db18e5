#pragma once
#include <pybind11/pybind11.h>

namespace zinf::bindings {
void bind_adam(pybind11::module_& m);
void bind_aio(pybind11::module_& m);
void bind_pool(pybind11::module_& m);
void bind_checksum(pybind11::module_& m);
void bind_shm(pybind11::module_& m);
void bind_fault(pybind11::module_& m);
void bind_four_bit(pybind11::module_& m);
void bind_convert(pybind11::module_& m);
}  // namespace zinf::bindings
