// SPDX-License-Identifier: Apache-2.0
// stellatrain._native: the optimizers behind stellatrain.torch.optim and the compression behind
// stellatrain.torch's communication hook (compression.cpp), bound with pybind11.
//
// The module works on raw addresses and element counts of contiguous fp32 CPU buffers: the
// Python layer (stellatrain/torch/_checks.py) checks every tensor (dtype, device, layout,
// contiguity, size) and names the argument that fails before an address reaches this file.
// Leaving torch's C++ headers out keeps the module's build short and independent of the torch
// build it runs with.
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/version.hpp>

#include <pybind11/pybind11.h>

#include "native_support.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace py = pybind11;
namespace st = stellatrain;

namespace {

using stellatrain_python::executor_handle;
using stellatrain_python::span_at;

st::nonfinite_policy nonfinite_from(const std::string& name) {
  if (name == "skip_elements") return st::nonfinite_policy::skip_elements;
  if (name == "skip_tensor") return st::nonfinite_policy::skip_tensor;
  if (name == "raise") return st::nonfinite_policy::raise;
  throw py::value_error(
      "stellatrain: nonfinite must be 'skip_elements', 'skip_tensor' or "
      "'raise', got '" +
      name + "'");
}

// One optimizer of stellatrain (adam_optimizer, sgd_optimizer) over a parameter group whose
// tensors the Python layer owns. Steps update the tensors in place (registered with
// `add_tensor_in_place`), as torch.optim does: writes made outside the optimizer, such as
// loading a model's weights, count, and no master copy costs memory or traffic.
template <class Optimizer>
class group_optimizer {
 public:
  group_optimizer(Optimizer optimizer, std::shared_ptr<executor_handle> ex)
      : opt_(std::move(optimizer)), ex_(std::move(ex)) {}

  std::size_t add(std::uintptr_t params, std::uint64_t elements) {
    return opt_.add_tensor_in_place(span_at<float>(params, elements));
  }

  // Returns the number of gradient values that were NaN or infinite.
  std::uint64_t step(std::size_t t, std::uintptr_t params, std::uintptr_t grad,
                     std::uint64_t elements) {
    const auto p = span_at<float>(params, elements);
    const auto g = span_at<const float>(grad, elements);
    if (elements != opt_.tensor_size(t)) {
      throw st::error(st::errc::size_mismatch,
                      "stellatrain: tensor " + std::to_string(t) + " was registered with " +
                          std::to_string(opt_.tensor_size(t)) + " elements, now has " +
                          std::to_string(elements));
    }
    // The tensor's storage may have been replaced since the last step (`p.data = ...`).
    if (opt_.params(t).data() != p.data()) opt_.rebind_params(t, p);
    py::gil_scoped_release unlocked;
    st::step_report report;
    ex_->run([&](auto& ex) { report = opt_.step(t, g, ex); });
    return report.nonfinite;
  }

  void set_lr(float lr) { opt_.set_lr(lr); }
  [[nodiscard]] std::uint64_t step_count(std::size_t t) const { return opt_.step_count_of(t); }
  [[nodiscard]] std::size_t tensor_count() const noexcept { return opt_.tensor_count(); }

  [[nodiscard]] py::bytes save_state() const {
    std::string bytes(static_cast<std::size_t>(opt_.state_size_bytes()), '\0');
    opt_.save_state(std::as_writable_bytes(std::span<char>(bytes)));
    return py::bytes(bytes);
  }
  // Restores the optimizer's state but not the parameters the state also holds: loading a
  // torch optimizer's state never changes the model's weights.
  void load_state(const py::bytes& state) {
    const std::string_view v = state;
    std::vector<std::vector<float>> weights;
    for (std::size_t t = 0; t < opt_.tensor_count(); ++t) {
      const auto p = opt_.params(t);
      weights.emplace_back(p.begin(), p.end());
    }
    opt_.load_state(std::as_bytes(std::span<const char>(v.data(), v.size())));
    for (std::size_t t = 0; t < opt_.tensor_count(); ++t)
      std::copy(weights[t].begin(), weights[t].end(), opt_.params(t).begin());
  }

  // Copies of the state arrays, for inspection and tests.
  [[nodiscard]] py::bytes master_params(std::size_t t) const { return copy_of(opt_.params(t)); }
  [[nodiscard]] static py::bytes copy_of(std::span<const float> s) {
    return py::bytes(reinterpret_cast<const char*>(s.data()), s.size_bytes());
  }
  [[nodiscard]] const Optimizer& optimizer() const noexcept { return opt_; }

 private:
  Optimizer opt_;
  std::shared_ptr<executor_handle> ex_;
};

using adam_group = group_optimizer<st::adam_optimizer>;
using sgd_group = group_optimizer<st::sgd_optimizer>;

template <class Group>
void bind_common(py::class_<Group>& c) {
  c.def("add", &Group::add, py::arg("params"), py::arg("elements"))
      .def("step", &Group::step, py::arg("tensor"), py::arg("params"), py::arg("grad"),
           py::arg("elements"))
      .def("set_lr", &Group::set_lr, py::arg("lr"))
      .def("step_count", &Group::step_count, py::arg("tensor"))
      .def_property_readonly("tensor_count", &Group::tensor_count)
      .def("save_state", &Group::save_state)
      .def("load_state", &Group::load_state, py::arg("state"))
      .def("master_params", &Group::master_params, py::arg("tensor"));
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "stellatrain's kernels for the Python package (raw buffers; see stellatrain.torch)";
  m.attr("version") = STELLATRAIN_VERSION_STRING;

  static py::exception<st::error> base(m, "Error", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const st::error& e) {
      switch (static_cast<st::errc>(e.code().value())) {
        case st::errc::invalid_argument:
        case st::errc::size_mismatch:
        case st::errc::malformed_message:
        case st::errc::checksum_mismatch:
        case st::errc::version_mismatch:
          PyErr_SetString(PyExc_ValueError, e.what());
          break;
        case st::errc::out_of_range:
          PyErr_SetString(PyExc_IndexError, e.what());
          break;
        case st::errc::not_finite:
          PyErr_SetString(PyExc_FloatingPointError, e.what());
          break;
        default:
          PyErr_SetString(base.ptr(), e.what());  // base(...) is deprecated in pybind11 3
      }
    }
  });

  py::class_<executor_handle, std::shared_ptr<executor_handle>>(m, "Threads")
      .def(py::init<std::size_t>(), py::arg("threads"))
      .def_property_readonly("threads", &executor_handle::threads);

  stellatrain_python::bind_compression(m);
  stellatrain_python::bind_density(m);

  py::class_<adam_group> adam(m, "AdamGroup");
  adam.def(py::init([](float lr, float beta1, float beta2, float eps, float weight_decay,
                       bool decoupled, bool amsgrad, bool maximize, const std::string& nonfinite,
                       std::shared_ptr<executor_handle> ex) {
             st::adam_options o;
             o.lr = lr;
             o.beta1 = beta1;
             o.beta2 = beta2;
             o.eps = eps;
             o.weight_decay = weight_decay;
             o.decay = decoupled ? st::weight_decay_mode::decoupled : st::weight_decay_mode::l2;
             o.amsgrad = amsgrad;
             o.maximize = maximize;
             o.nonfinite = nonfinite_from(nonfinite);
             return adam_group(st::adam_optimizer(o), std::move(ex));
           }),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
           py::arg("weight_decay"), py::arg("decoupled"), py::arg("amsgrad"), py::arg("maximize"),
           py::arg("nonfinite"), py::arg("threads"));
  bind_common(adam);
  adam.def("exp_avg", [](const adam_group& g,
                         std::size_t t) { return adam_group::copy_of(g.optimizer().exp_avg(t)); })
      .def("exp_avg_sq",
           [](const adam_group& g, std::size_t t) {
             return adam_group::copy_of(g.optimizer().exp_avg_sq(t));
           })
      .def("max_exp_avg_sq", [](const adam_group& g, std::size_t t) {
        return adam_group::copy_of(g.optimizer().max_exp_avg_sq(t));
      });

  py::class_<sgd_group> sgd(m, "SGDGroup");
  sgd.def(py::init([](float lr, float momentum, float dampening, float weight_decay, bool nesterov,
                      bool maximize, const std::string& nonfinite,
                      std::shared_ptr<executor_handle> ex) {
            st::sgd_options o;
            o.lr = lr;
            o.momentum = momentum;
            o.dampening = dampening;
            o.weight_decay = weight_decay;
            o.nesterov = nesterov;
            o.maximize = maximize;
            o.nonfinite = nonfinite_from(nonfinite);
            return sgd_group(st::sgd_optimizer(o), std::move(ex));
          }),
          py::arg("lr"), py::arg("momentum"), py::arg("dampening"), py::arg("weight_decay"),
          py::arg("nesterov"), py::arg("maximize"), py::arg("nonfinite"), py::arg("threads"));
  bind_common(sgd);
  sgd.def("momentum_buffer", [](const sgd_group& g, std::size_t t) {
    return sgd_group::copy_of(g.optimizer().momentum_buffer(t));
  });
}
