// Python bindings of zinf::aio (binding only; logic lives in cpp/aio).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "../aio/aio.h"
#include "bindings.h"

namespace py = pybind11;
using namespace zinf::aio;

namespace zinf::bindings {

void bind_aio(py::module_& m) {
  m.doc() = "Asynchronous file I/O (io_uring or pread/pwrite threads), buffers passed as addresses.";
  m.attr("DIRECT_ALIGN_BYTES") = kDirectAlignBytes;
  m.def("uring_available", &uring_available);
  py::class_<WaitResult>(m, "WaitResult")
      .def_readonly("nbytes", &WaitResult::nbytes)
      .def_readonly("err", &WaitResult::err)
      .def_readonly("short_read", &WaitResult::short_read)
      .def_readonly("err_offset", &WaitResult::err_offset)
      .def_readonly("message", &WaitResult::message)
      .def_readonly("path", &WaitResult::path)
      .def_readonly("unlinked", &WaitResult::unlinked);
  py::class_<Engine>(m, "Engine")
      .def(py::init<size_t, unsigned, int, bool, const std::string&, double>(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("num_threads"), py::arg("direct"), py::arg("backend") = "auto",
           py::arg("bytes_per_s") = 0.0)
      .def(
          "submit",
          [](Engine& e, bool write, uintptr_t addr, size_t nbytes, const std::string& path, int64_t offset) {
            py::gil_scoped_release release;
            return e.submit(write ? Op::kWrite : Op::kRead, addr, nbytes, path, offset);
          },
          py::arg("write"), py::arg("addr"), py::arg("nbytes"), py::arg("path"), py::arg("offset"))
      .def("wait", &Engine::wait, py::arg("handle"), py::call_guard<py::gil_scoped_release>())
      .def("done", &Engine::done, py::arg("handle"))
      .def("wait_all", &Engine::wait_all, py::call_guard<py::gil_scoped_release>())
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("backend", &Engine::backend_name)
      .def_property_readonly("last_direct", &Engine::last_direct)
      .def_property_readonly("block_size", &Engine::block_size)
      .def_property_readonly("queue_depth", &Engine::queue_depth)
      .def_property_readonly("num_threads", &Engine::num_threads)
      .def_property_readonly("bytes_per_s", &Engine::bytes_per_s)
      .def_property_readonly("num_pending", &Engine::num_pending);
}

}  // namespace zinf::bindings
