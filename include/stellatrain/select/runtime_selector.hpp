// SPDX-License-Identifier: Apache-2.0
// A selector chosen at run time (from a command line, say) among the shipped ones: a thin
// adapter over the compile-time selectors, for applications that need the choice late.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/select/block_topk.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/sampled_threshold.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/threshold.hpp>

#include <xsimd/xsimd.hpp>

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

namespace stellatrain {

/// Which shipped selector a `runtime_selector` runs.
enum class selection_method : std::uint8_t {
  exact_topk = 1,  ///< `exact_topk_selector`: the k largest |x|
  threshold = 2,   ///< `threshold_selector`: persistent per-tensor bound, exact in steady state
  sampled_threshold = 3,  ///< `sampled_threshold_selector`: DGC-style estimate, one pass
  block_topk = 4,         ///< `block_topk_selector`: whole 64-byte blocks
  random_k = 5,           ///< `random_k_selector`: indices from (seed + slice, step, tensor id)
};

/// Options of `runtime_selector`.
struct runtime_selector_options {
  selection_method method = selection_method::threshold;
  /// Rank r of P selects k / P from the rotating slice (r + step) mod P of every tensor
  /// (`partitioned_selector`). {0, 1}: the whole tensor.
  partition part{};
  /// Seed of random-k.
  std::uint64_t seed = 0;
  exact_topk_options exact{};
  threshold_options threshold{};
  sampled_threshold_options sampled{};
  block_topk_options block{};
};

/// One of the shipped selectors, partitioned, chosen by `runtime_selector_options::method`
/// when it is constructed (models `selector`). Every call dispatches with one switch; the
/// kernels are those of the chosen selector, so results are bit-identical to using it
/// directly as `partitioned_selector<that selector>`. The price is compile time: a
/// translation unit that uses it instantiates all five. Prefer the selector's own type where
/// the choice is known when the trainer is built.
///
/// \code
///   stellatrain::runtime_selector<> sel({.method = parse_method(argv[1])});
///   stellatrain::error_feedback_compressor<stellatrain::runtime_selector<>, stellatrain::bf16>
///   ef(sel);
/// \endcode
template <class Arch = xsimd::default_arch>
class runtime_selector {
  using alternatives = std::variant<partitioned_selector<exact_topk_selector<Arch>>,
                                    partitioned_selector<threshold_selector<Arch>>,
                                    partitioned_selector<sampled_threshold_selector<Arch>>,
                                    partitioned_selector<block_topk_selector<Arch>>,
                                    partitioned_selector<random_k_selector<Arch>>>;

  template <class V>
  struct per_alternative;
  template <class... S>
  struct per_alternative<std::variant<S...>> {
    using tensor_state = std::variant<typename S::tensor_state...>;
    using workspace = std::variant<typename S::workspace...>;
  };

 public:
  using arch_type = Arch;
  /// The chosen selector's state and scratch.
  using tensor_state = typename per_alternative<alternatives>::tensor_state;
  using workspace = typename per_alternative<alternatives>::workspace;

  runtime_selector() : runtime_selector(runtime_selector_options{}) {}
  /// Throws `errc::invalid_argument` for an unknown method or an invalid partition.
  explicit runtime_selector(runtime_selector_options options)
      : options_(options), selector_(make(options)) {}

  [[nodiscard]] const runtime_selector_options& options() const noexcept { return options_; }
  [[nodiscard]] selection_method method() const noexcept { return options_.method; }

  template <executor Ex>
  void reserve(Ex& ex, workspace& ws, std::uint64_t n, std::uint64_t k) const {
    visit([&](const auto& sel, auto index) {
      sel.reserve(ex, alternative<decltype(index)::value>(ws), n, k);
    });
  }

  template <executor Ex, class Source, class Emit>
  selection_stats select_from(Ex& ex, tensor_state& state, workspace& ws, const Source& src,
                              std::uint64_t n, std::uint64_t k, const selection_context& ctx,
                              Emit&& emit) const {
    return visit([&](const auto& sel, auto index) -> selection_stats {
      return sel.select_from(ex, alternative<decltype(index)::value>(state),
                             alternative<decltype(index)::value>(ws), src, n, k, ctx, emit);
    });
  }

  /// Writes / reads the method and the chosen selector's state; a state of another method is
  /// refused with `errc::invalid_argument`.
  void save(const tensor_state& state, state_record_writer& w) const {
    w.put(options_.method);
    visit([&](const auto& sel, auto index) {
      constexpr std::size_t i = decltype(index)::value;
      if (state.index() == i) {
        sel.save(std::get<i>(state), w);
      } else {
        sel.save(std::variant_alternative_t<i, tensor_state>{}, w);
      }
    });
  }
  void load(tensor_state& state, state_record_reader& r) const {
    const auto method = r.get<selection_method>();
    if (method != options_.method) {
      throw_error(errc::invalid_argument, "runtime_selector::load: a state of selection method " +
                                              std::to_string(static_cast<int>(method)) +
                                              ", this selector runs " +
                                              std::to_string(static_cast<int>(options_.method)));
    }
    visit([&](const auto& sel, auto index) {
      constexpr std::size_t i = decltype(index)::value;
      std::variant_alternative_t<i, tensor_state> s;
      sel.load(s, r);
      state.template emplace<i>(std::move(s));
    });
  }

 private:
  static alternatives make(const runtime_selector_options& o) {
    switch (o.method) {
      case selection_method::exact_topk:
        return partitioned_selector<exact_topk_selector<Arch>>(o.part,
                                                               exact_topk_selector<Arch>(o.exact));
      case selection_method::threshold:
        return partitioned_selector<threshold_selector<Arch>>(
            o.part, threshold_selector<Arch>(o.threshold));
      case selection_method::sampled_threshold:
        return partitioned_selector<sampled_threshold_selector<Arch>>(
            o.part, sampled_threshold_selector<Arch>(o.sampled));
      case selection_method::block_topk:
        return partitioned_selector<block_topk_selector<Arch>>(o.part,
                                                               block_topk_selector<Arch>(o.block));
      case selection_method::random_k:
        return partitioned_selector<random_k_selector<Arch>>(o.part,
                                                             random_k_selector<Arch>(o.seed));
    }
    throw_error(errc::invalid_argument, "runtime_selector: unknown selection method " +
                                            std::to_string(static_cast<int>(o.method)));
  }

  // The state or workspace of alternative I, switched to it if it holds another.
  template <std::size_t I, class V>
  static auto& alternative(V& v) {
    if (v.index() != I) v.template emplace<I>();
    return std::get<I>(v);
  }

  template <class Fn>
  decltype(auto) visit(Fn&& fn) const {
    return std::visit(
        [&](const auto& sel) -> decltype(auto) {
          using S = std::remove_cvref_t<decltype(sel)>;
          return fn(sel, std::integral_constant<std::size_t, index_of<S>()>{});
        },
        selector_);
  }

  template <class S, std::size_t I = 0>
  static constexpr std::size_t index_of() {
    if constexpr (std::is_same_v<S, std::variant_alternative_t<I, alternatives>>) {
      return I;
    } else {
      return index_of<S, I + 1>();
    }
  }

  runtime_selector_options options_;
  alternatives selector_;
};

static_assert(selector<runtime_selector<>>);

}  // namespace stellatrain
