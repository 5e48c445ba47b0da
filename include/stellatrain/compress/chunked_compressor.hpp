// SPDX-License-Identifier: Apache-2.0
// The chunked low-bit codec as a `compressor`: what a pipeline (or local steps) plugs in to
// send the top k of every chunk with 1- or 2-bit values, as chunked sections on the wire.
#pragma once

#include <stellatrain/compress/chunked_codec.hpp>
#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/compress/detail/tensor_states.hpp>
#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/select/selection.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

namespace detail {
inline constexpr state_kind chunked_state_kind = state_kind::of("STELLCHK", 1);
}  // namespace detail

/// Options of `chunked_compressor` (as `chunked_codec_options`, but k comes from each call).
struct chunked_compressor_options {
  unsigned chunk_bits = 12;  ///< b: chunks of 2^b elements, 1 <= b <= 16
  chunk_value_bits bits = chunk_value_bits::two;
  float decay = 1.0f;  ///< the error feedback's decay, in (0, 1]
};

/// A `compressor` over `chunked_codec`: per tensor, the error feedback, a codec and the last
/// selection. The k a call asks for (the pipeline's density times n) becomes k per chunk,
/// ceil(k 2^b / n) within [1, 2^b], so a density policy sets the density of every chunk.
/// `compress` writes the selection as (tensor index, dequantised value) pairs, and
/// `wire_section(id)` the same selection as the wire carries it: the flat exchange packs it
/// as a chunked section (format version 3; at b = 12, 64 per chunk and 2-bit values, 14.5
/// bits per pair instead of about 25 for bf16 values and delta indices), and so does the
/// hierarchical exchange between owners of the same shard (clusters of one size); where
/// shards overlap only in part, it cuts the selection by index range and sends fp32 pairs.
/// The residual is the codec's feedback, the quantisation error included.
///
/// \code
///   stellatrain::pipeline p(transport, pool,
///       stellatrain::chunked_compressor<>({.chunk_bits = 12, .decay = 0.95f}),
///       stellatrain::sgd_optimizer({.lr = 1.0f}), {}, stellatrain::fixed_density{64.0 / 4096});
/// \endcode
///
/// Cost per call: the codec's, on the calling thread (the executor is not used; tensors are
/// compressed concurrently by the pipeline). Memory per tensor: the feedback (4 bytes per
/// element), the codec's workspace (12 bytes per chunk element) and the selection.
template <class Index = std::uint32_t>
class chunked_compressor {
 public:
  using value_type = float;
  using index_type = Index;

  explicit chunked_compressor(const chunked_compressor_options& options = {}) : options_(options) {
    chunked_codec::check_options(codec_options(1));
  }

  [[nodiscard]] const chunked_compressor_options& options() const noexcept { return options_; }

  /// Registers tensor `id` of `n` elements (zero feedback, pre-faulted across `ex`).
  template <executor Ex>
  void add_tensor(Ex& ex, std::uint32_t id, std::uint64_t n) {
    check_size("chunked_compressor::add_tensor", id, n);
    const auto at = lower_bound(id);
    if (at != tensors_.end() && (*at)->id == id) {
      throw_error(errc::invalid_argument,
                  "chunked_compressor: tensor " + std::to_string(id) + " registered twice");
    }
    auto t = std::make_unique<tensor>(codec_options(1));
    t->id = id;
    t->feedback = aligned_buffer<float>(n, {.prefault = true}, ex);
    std::fill(t->feedback.begin(), t->feedback.end(), 0.0f);
    tensors_.insert(at, std::move(t));
  }

  /// Whether tensor `id` is registered.
  [[nodiscard]] bool has_tensor(std::uint32_t id) const noexcept {
    const auto at = detail::lower_bound_id(tensors_, id);
    return at != tensors_.end() && (*at)->id == id;
  }

  /// One step of tensor `id`: the codec encodes `g` with the feedback at ceil(k 2^b / n) per
  /// chunk; `out` gets the pairs.
  template <executor Ex>
  selection_stats compress(Ex&, std::uint32_t id, std::span<const float> g, std::uint64_t k,
                           sparse_buffer<float, Index>& out) {
    tensor& t = find(id);
    const std::uint64_t n = t.feedback.size();
    if (g.size() != n) {
      throw_error(errc::invalid_argument, "chunked_compressor: tensor " + std::to_string(id) +
                                              " has " + std::to_string(n) + " elements, got " +
                                              std::to_string(g.size()));
    }
    t.codec.set_k(per_chunk(k, n));
    t.codec.encode(g, t.feedback.span(), t.sent);
    const chunked_selection& s = t.sent;
    const std::uint64_t count = s.indices.size();
    if (out.capacity() < count) out.reserve(count);
    out.resize(count);
    out.set_dense_size(n);
    chunked_codec::decode_pairs(s, out.indices(), out.values());
    return {.count = count, .exact = false, .passes = 1};
  }

  /// The last selection of tensor `id` as a wire section (`message_packer::add_chunked`);
  /// valid until the next `compress` of the tensor.
  [[nodiscard]] chunked_section wire_section(std::uint32_t id) const {
    return find(id).sent.section();
  }

  /// The feedback of tensor `id`: what was not sent, the quantisation error included.
  [[nodiscard]] std::span<const float> residual(std::uint32_t id) const {
    return find(id).feedback.span();
  }

  /// Every tensor's feedback, with the options it was built with.
  [[nodiscard]] std::vector<std::byte> save_state() const {
    return save_state_bytes(detail::chunked_state_kind, [&](state_writer& w) {
      w.record("CONF", [&](state_record_writer& r) {
        r.put(static_cast<std::uint8_t>(options_.chunk_bits));
        r.put(static_cast<std::uint8_t>(options_.bits));
        r.put(options_.decay);
        r.put(static_cast<std::uint8_t>(sizeof(Index)));
        r.put(static_cast<std::uint64_t>(tensors_.size()));
      });
      for (const auto& t : tensors_) {
        w.record("TNSR", [&](state_record_writer& r) {
          r.put(t->id);
          r.put(static_cast<std::uint64_t>(t->feedback.size()));
        });
        w.record("FEED", [&](state_record_writer& r) { r.put_array(t->feedback.span()); });
      }
    });
  }

  /// Replaces every tensor with the state in `saved` (from a compressor with the same options
  /// and index type). Nothing changes when it throws.
  template <executor Ex>
  void load_state(Ex& ex, std::span<const std::byte> saved) {
    constexpr const char* what = "chunked_compressor::load_state";
    state_reader rd(saved, detail::chunked_state_kind, what);
    auto conf = rd.next("CONF");
    const auto b = conf.get<std::uint8_t>();
    const auto bits = conf.get<std::uint8_t>();
    const auto decay = conf.get<float>();
    const auto index_bytes = conf.get<std::uint8_t>();
    const auto count = conf.get<std::uint64_t>();
    conf.finish();
    if (b != options_.chunk_bits || bits != static_cast<std::uint8_t>(options_.bits) ||
        decay != options_.decay || index_bytes != sizeof(Index)) {
      throw_error(errc::invalid_argument,
                  std::string(what) +
                      ": the state was saved by a compressor with other options "
                      "(chunk bits, value bits, decay or index type)");
    }
    if (count > rd.remaining()) {
      rd.malformed("claims " + std::to_string(count) + " tensors, " +
                   std::to_string(rd.remaining()) + " records follow");
    }
    std::vector<std::unique_ptr<tensor>> loaded;
    for (std::uint64_t j = 0; j < count; ++j) {
      auto head = rd.next("TNSR");
      const auto id = head.get<std::uint32_t>();
      const auto n = head.get<std::uint64_t>();
      head.finish();
      if (!loaded.empty() && loaded.back()->id >= id) {
        rd.malformed("tensor ids not ascending at tensor " + std::to_string(j));
      }
      check_size(what, id, n);
      auto feedback = rd.next("FEED");
      if (feedback.remaining() != n * sizeof(float)) {
        feedback.fail("tensor " + std::to_string(id) + " of " + std::to_string(n) +
                      " elements has " + std::to_string(feedback.remaining()) +
                      " bytes of feedback");
      }
      auto t = std::make_unique<tensor>(codec_options(1));
      t->id = id;
      t->feedback = aligned_buffer<float>(n, {.prefault = true}, ex);
      feedback.get_array(t->feedback.span());
      loaded.push_back(std::move(t));
    }
    rd.finish();
    tensors_ = std::move(loaded);
  }

  /// Serial-executor form of `load_state`.
  void load_state(std::span<const std::byte> saved) {
    inline_executor ex;
    load_state(ex, saved);
  }

 private:
  struct tensor {
    explicit tensor(const chunked_codec_options& o) : codec(o) {}
    std::uint32_t id = 0;
    aligned_buffer<float> feedback;
    chunked_codec codec;
    chunked_selection sent;
  };

  [[nodiscard]] chunked_codec_options codec_options(std::uint32_t k) const noexcept {
    return {
        .chunk_bits = options_.chunk_bits, .k = k, .bits = options_.bits, .decay = options_.decay};
  }

  [[nodiscard]] std::uint32_t per_chunk(std::uint64_t k, std::uint64_t n) const noexcept {
    const std::uint64_t chunk = std::uint64_t{1} << options_.chunk_bits;
    if (n == 0) return 1;
    // ceil(k chunk / n) without overflow: k <= n, chunk <= 2^16.
    const std::uint64_t q = k / n * chunk + ((k % n) * chunk + n - 1) / n;
    return static_cast<std::uint32_t>(std::clamp<std::uint64_t>(q, 1, chunk));
  }

  static void check_size(const char* who, std::uint32_t id, std::uint64_t n) {
    if (n > 0 && n - 1 > std::numeric_limits<Index>::max()) {
      throw_error(errc::out_of_range, std::string(who) + ": tensor " + std::to_string(id) + " of " +
                                          std::to_string(n) +
                                          " elements does not fit the index type");
    }
    if (n > wire::max_chunked_elements) {
      throw_error(errc::invalid_argument, std::string(who) + ": tensor " + std::to_string(id) +
                                              " of more than 2^56 elements");
    }
  }

  auto lower_bound(std::uint32_t id) { return detail::lower_bound_id(tensors_, id); }
  tensor& find(std::uint32_t id) { return detail::state_of(tensors_, id, "chunked_compressor"); }
  const tensor& find(std::uint32_t id) const {
    return detail::state_of(tensors_, id, "chunked_compressor");
  }

  chunked_compressor_options options_;
  std::vector<std::unique_ptr<tensor>> tensors_;
};

static_assert(compressor<chunked_compressor<>>);

}  // namespace stellatrain
