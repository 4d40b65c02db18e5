// Python bindings of zinf::pool (binding only; logic lives in cpp/pool).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../pool/pool.h"
#include "bindings.h"

namespace py = pybind11;
using zinf::pool::BufferPool;

namespace zinf::bindings {

void bind_pool(py::module_& m) {
  m.doc() = "Aligned host buffer pool (buddy allocator in one allocation); exposes the buffer protocol.";
  py::class_<BufferPool>(m, "BufferPool", py::buffer_protocol())
      .def(py::init<size_t, size_t>(), py::arg("total_bytes"), py::arg("alignment") = 4096)
      .def(py::init<uintptr_t, size_t, size_t>(), py::arg("address"), py::arg("total_bytes"), py::arg("alignment"))
      .def("allocate", &BufferPool::allocate, py::arg("nbytes"))
      .def("free", &BufferPool::free, py::arg("offset"))
      .def("block_size_for", &BufferPool::block_size_for, py::arg("nbytes"))
      .def_property_readonly("address", &BufferPool::address)
      .def_property_readonly("capacity_bytes", &BufferPool::capacity_bytes)
      .def_property_readonly("alignment", &BufferPool::alignment)
      .def_property_readonly("bytes_in_use", &BufferPool::bytes_in_use)
      .def_property_readonly("requested_bytes_in_use", &BufferPool::requested_bytes_in_use)
      .def_property_readonly("peak_bytes_in_use", &BufferPool::peak_bytes_in_use)
      .def_property_readonly("largest_free_block", &BufferPool::largest_free_block)
      .def_property_readonly("num_blocks_in_use", &BufferPool::num_blocks_in_use)
      .def_buffer([](BufferPool& p) {
        return py::buffer_info(reinterpret_cast<void*>(p.address()), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(p.capacity_bytes())}, {py::ssize_t{1}}, false);
      });
}

}  // namespace zinf::bindings
