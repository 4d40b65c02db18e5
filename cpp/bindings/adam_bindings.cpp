// Python bindings of zinf::adam (binding only; logic lives in cpp/adam).
#include <pybind11/operators.h>
#include <pybind11/pybind11.h>

#include <array>
#include <stdexcept>

#include "../adam/adam.h"
#include "bindings.h"

namespace py = pybind11;
using namespace zinf::adam;

namespace zinf::bindings {
namespace {

// One step's AdamArgs from the addresses and names Python passes, checked as adam_step documents.
AdamArgs step_args(uintptr_t param, uintptr_t grad, const std::string& grad_dtype, uintptr_t exp_avg,
                   uintptr_t exp_avg_sq, uintptr_t param_out, const std::string& out_dtype, const AdamHyper& hyper,
                   int64_t step, double grad_scale, double clip_coef, bool zero_grad, const std::string& state_dtype,
                   uint32_t seed, uint32_t index_base, uintptr_t exp_avg_scale, uintptr_t exp_avg_sq_scale) {
  AdamArgs a = make_args(StepConfig{hyper, step, grad_scale, clip_coef});
  a.param = reinterpret_cast<float*>(param);
  a.grad = reinterpret_cast<const void*>(grad);
  a.grad_dtype = parse_dtype(grad_dtype);
  a.exp_avg = reinterpret_cast<void*>(exp_avg);
  a.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
  a.state_dtype = parse_dtype(state_dtype);
  if (a.state_dtype != DType::kFloat32 && a.state_dtype != DType::kBFloat16 && a.state_dtype != DType::kInt8)
    throw std::invalid_argument("state_dtype must be float32, bfloat16 or int8, got " + state_dtype);
  if (a.state_dtype == DType::kInt8 && !(exp_avg_scale && exp_avg_sq_scale))
    throw std::invalid_argument("int8 moments need exp_avg_scale and exp_avg_sq_scale");
  a.exp_avg_scale = reinterpret_cast<int8_t*>(exp_avg_scale);
  a.exp_avg_sq_scale = reinterpret_cast<int8_t*>(exp_avg_sq_scale);
  a.seed = seed;
  a.index_base = index_base;
  a.param_out = reinterpret_cast<void*>(param_out);
  a.out_dtype = param_out ? parse_dtype(out_dtype) : DType::kNone;
  if (zero_grad && a.grad_dtype != DType::kFloat32) throw std::invalid_argument("zero_grad needs a float32 gradient");
  a.grad_zero = zero_grad ? reinterpret_cast<float*>(grad) : nullptr;
  return a;
}

}  // namespace

void bind_adam(py::module_& m) {
  m.doc() = "Fused CPU Adam/AdamW kernels (tensors passed as data_ptr addresses).";
  py::class_<AdamHyper>(m, "AdamHyper",
                        "One param group's Adam/AdamW hyper-parameters (zinf::adam::AdamHyper); immutable.")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled) {
             return AdamHyper{lr, beta1, beta2, eps, weight_decay, decoupled};
           }),
           py::arg("lr") = 1e-3, py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
           py::arg("weight_decay") = 0.0, py::arg("decoupled") = false)
      .def_readonly("lr", &AdamHyper::lr)
      .def_readonly("beta1", &AdamHyper::beta1)
      .def_readonly("beta2", &AdamHyper::beta2)
      .def_readonly("eps", &AdamHyper::eps)
      .def_readonly("weight_decay", &AdamHyper::weight_decay)
      .def_readonly("decoupled", &AdamHyper::decoupled)
      .def(py::self == py::self)
      .def(py::self != py::self);
  m.def(
      "adam_step",
      [](uintptr_t param, uintptr_t grad, const std::string& grad_dtype, uintptr_t exp_avg,
         uintptr_t exp_avg_sq, uintptr_t param_out, const std::string& out_dtype, size_t numel,
         const AdamHyper& hyper, int64_t step, double grad_scale, double clip_coef, bool zero_grad,
         const std::string& state_dtype, uint32_t seed, uint32_t index_base, uintptr_t exp_avg_scale,
         uintptr_t exp_avg_sq_scale) {
        const AdamArgs a = step_args(param, grad, grad_dtype, exp_avg, exp_avg_sq, param_out, out_dtype, hyper, step,
                                     grad_scale, clip_coef, zero_grad, state_dtype, seed, index_base, exp_avg_scale,
                                     exp_avg_sq_scale);
        py::gil_scoped_release release;
        adam_step(a, numel);
      },
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("param_out"), py::arg("out_dtype"), py::arg("numel"), py::arg("hyper"), py::kw_only(),
      py::arg("step"), py::arg("grad_scale") = 1.0, py::arg("clip_coef") = 1.0, py::arg("zero_grad") = false,
      py::arg("state_dtype") = "float32", py::arg("seed") = 0u, py::arg("index_base") = 0u,
      py::arg("exp_avg_scale") = 0u, py::arg("exp_avg_sq_scale") = 0u);
  m.def(
      "adam_step_checked",
      [](uintptr_t param, uintptr_t grad, const std::string& grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         size_t numel, const AdamHyper& hyper, int64_t step, double clip_coef, bool zero_grad,
         const std::string& state_dtype, uint32_t seed, uint32_t index_base, bool grad_checksum) {
        const AdamArgs a = step_args(param, grad, grad_dtype, exp_avg, exp_avg_sq, 0, "none", hyper, step, 1.0,
                                     clip_coef, zero_grad, state_dtype, seed, index_base, 0, 0);
        std::array<uint32_t, 4> in{};
        std::array<uint32_t, 3> out{};
        {
          py::gil_scoped_release release;
          adam_step_checked(a, numel, grad_checksum, in.data(), out.data());
        }
        return py::make_tuple(py::make_tuple(in[0], in[1], in[2], in[3]), py::make_tuple(out[0], out[1], out[2]));
      },
      "adam_step with the CRC32C of its inputs and outputs taken in the same pass ([Note: checksums in the Adam "
      "pass] in cpp/adam/adam.h): ((master, exp_avg, exp_avg_sq, grad) before, (master, exp_avg, exp_avg_sq) after)",
      py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
      py::arg("numel"), py::arg("hyper"), py::kw_only(), py::arg("step"), py::arg("clip_coef") = 1.0,
      py::arg("zero_grad") = false, py::arg("state_dtype") = "float32", py::arg("seed") = 0u,
      py::arg("index_base") = 0u, py::arg("grad_checksum") = false);
  m.def(
      "grad_norm_sq",
      [](uintptr_t data, const std::string& dtype, size_t numel) {
        const DType t = parse_dtype(dtype);
        py::gil_scoped_release release;
        return grad_norm_sq(reinterpret_cast<const void*>(data), t, numel);
      },
      py::arg("data"), py::arg("dtype"), py::arg("numel"));
  m.def(
      "stream_bound",
      [](uintptr_t p, uintptr_t g, uintptr_t m_, uintptr_t v, size_t numel) {
        py::gil_scoped_release release;
        stream_bound(reinterpret_cast<float*>(p), reinterpret_cast<const float*>(g),
                     reinterpret_cast<float*>(m_), reinterpret_cast<float*>(v), numel);
      },
      py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("numel"));
  m.def("simd_level", [] { return simd_level_name(simd_level()); });
  m.def("best_simd_level", [] { return simd_level_name(detect_simd_level()); });
  m.def("set_simd_level", [](const std::string& name) { set_simd_level(parse_simd_level(name)); },
        py::arg("level"));
  m.def("num_threads", &num_threads);
  m.def("set_num_threads", &set_num_threads, py::arg("n"));
}

}  // namespace zinf::bindings
