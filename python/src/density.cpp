// SPDX-License-Identifier: Apache-2.0
// The density side of stellatrain._native: `DensityController`, the adaptive density
// controller of pipeline/density_controller.hpp, for the DDP hook to feed with its own
// timings (the ranks' step reports, combined alike on every rank, so that every rank's
// controller decides the same density), and `inner_steps_for`, the local steps' choice of H
// (pipeline/local_steps.hpp).
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/pipeline/local_steps.hpp>
#include <stellatrain/pipeline/step_reports.hpp>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "native_support.hpp"

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace stellatrain_python {

namespace {

inline constexpr st::state_kind density_state_kind = st::state_kind::of("STELLDEN", 1);

class density_controller {
 public:
  density_controller(double min_density, double max_density, double initial_density,
                     double target_ratio, double latency_seconds)
      : c_({.min_density = min_density,
            .max_density = max_density,
            .initial_density = initial_density,
            .target_ratio = target_ratio,
            .latency_seconds = latency_seconds}) {
    if (!(latency_seconds >= 0) || !std::isfinite(latency_seconds)) {
      throw py::value_error("stellatrain: latency_seconds must be finite and >= 0");
    }
  }

  void set_model(std::uint64_t elements, std::uint32_t ranks, double bytes_per_element,
                 double header_bytes, double latency_rounds) {
    if (ranks == 0 || !(bytes_per_element > 0) || !(header_bytes >= 0) || !(latency_rounds >= 0)) {
      throw py::value_error(
          "stellatrain: the cost model needs ranks >= 1, bytes_per_element > 0, header_bytes "
          ">= 0 and latency_rounds >= 0");
    }
    c_.set_model({.elements = elements,
                  .ranks = ranks,
                  .bytes_per_element = bytes_per_element,
                  .header_bytes = header_bytes,
                  .latency_rounds = latency_rounds});
  }

  void observe(double compute_seconds, double comm_seconds, std::uint64_t link_bytes) {
    check_times(compute_seconds, comm_seconds);
    c_.observe({.compute_seconds = compute_seconds,
                .comm_seconds = comm_seconds,
                .link_bytes = link_bytes});
  }

  // One step's measurement from the ranks' step reports, combined as the C++ pipeline
  // combines them (the hook's Codec.reduce does): observed as the pipeline observes it.
  void observe_report(const st::rank_report& r) {
    check_times(r.compute_seconds, r.exchange_seconds);
    c_.observe({.compute_seconds = r.compute_seconds,
                .comm_seconds = r.exchange_seconds,
                .link_bytes = r.link_bytes,
                .latency_rounds = r.latency_rounds});
  }

  [[nodiscard]] py::bytes save_state() const {
    const auto bytes = st::save_state_bytes(density_state_kind, [&](st::state_writer& w) {
      w.record("DCTL", [&](st::state_record_writer& r) { c_.save(r); });
    });
    return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
  }

  // A damaged state or one of another kind throws and changes nothing.
  void load_state(const py::bytes& state) {
    const std::string_view s = state;
    st::state_reader rd(std::span(reinterpret_cast<const std::byte*>(s.data()), s.size()),
                        density_state_kind, "DensityController.load_state");
    st::adaptive_density_controller loaded = c_;
    auto rec = rd.next("DCTL");
    loaded.load(rec);
    rec.finish();
    rd.finish();
    c_ = loaded;
  }

  const st::adaptive_density_controller& get() const noexcept { return c_; }

 private:
  static void check_times(double compute_seconds, double comm_seconds) {
    for (const double x : {compute_seconds, comm_seconds}) {
      if (!std::isfinite(x) || x < 0) {
        throw py::value_error("stellatrain: measured times must be finite and >= 0, got " +
                              std::to_string(x));
      }
    }
  }

  st::adaptive_density_controller c_;
};

}  // namespace

void bind_density(py::module_& m) {
  py::class_<density_controller>(m, "DensityController")
      .def(py::init<double, double, double, double, double>(), py::arg("min_density"),
           py::arg("max_density"), py::arg("initial_density"), py::arg("target_ratio"),
           py::arg("latency_seconds"))
      .def("set_model", &density_controller::set_model, py::arg("elements"), py::arg("ranks"),
           py::arg("bytes_per_element"), py::arg("header_bytes"), py::arg("latency_rounds"))
      .def("observe", &density_controller::observe, py::arg("compute_seconds"),
           py::arg("comm_seconds"), py::arg("link_bytes"))
      .def("observe_report", &density_controller::observe_report, py::arg("report"))
      .def_property_readonly("density",
                             [](const density_controller& c) { return c.get().density(); })
      .def_property_readonly("bandwidth",
                             [](const density_controller& c) { return c.get().bandwidth(); })
      .def_property_readonly("latency",
                             [](const density_controller& c) { return c.get().latency(); })
      .def_property_readonly("compute_seconds",
                             [](const density_controller& c) { return c.get().compute_seconds(); })
      .def("save_state", &density_controller::save_state)
      .def("load_state", &density_controller::load_state, py::arg("state"));
  m.def("inner_steps_for", &st::inner_steps_for, py::arg("exchange_seconds"),
        py::arg("inner_step_seconds"), py::arg("share"), py::arg("lo"), py::arg("hi"),
        py::arg("fallback"));
}

}  // namespace stellatrain_python
