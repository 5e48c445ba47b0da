// SPDX-License-Identifier: Apache-2.0
// The compression side of stellatrain._native: error feedback with selection, packing into the
// wire format, and unpacking with the mean over ranks, on raw fp32 buffers (the Python layer
// checks every tensor first). `Codec` is what the DDP communication hook runs per bucket,
// including the step reports its messages carry for the adaptive density (the pipeline's
// control section, pipeline/step_reports.hpp); `select_topk`, `pack`, `unpack` and
// `merge_dense` are the same kernels one at a time.
#include <stellatrain/compress/chunked_compressor.hpp>
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/detail/bucket_message.hpp>
#include <stellatrain/pipeline/step_reports.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/runtime_selector.hpp>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <xsimd/xsimd.hpp>

#include "native_support.hpp"

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

namespace stellatrain_python {

namespace {

st::selection_method method_from(const std::string& name) {
  if (name == "exact") return st::selection_method::exact_topk;
  if (name == "threshold") return st::selection_method::threshold;
  if (name == "sampled_threshold") return st::selection_method::sampled_threshold;
  if (name == "block") return st::selection_method::block_topk;
  if (name == "random") return st::selection_method::random_k;
  throw py::value_error(
      "stellatrain: selector must be 'exact', 'threshold', "
      "'sampled_threshold', 'block' or 'random', got '" +
      name + "'");
}

template <class V>
constexpr st::value_encoding encoding_of() {
  if constexpr (std::is_same_v<V, float>) {
    return st::value_encoding::fp32;
  } else if constexpr (std::is_same_v<V, st::fp16>) {
    return st::value_encoding::fp16;
  } else {
    return st::value_encoding::bf16;
  }
}

// (address, bytes) of one received message, or of the buffer that holds one at its front.
using message_ref = std::pair<std::uintptr_t, std::uint64_t>;

std::span<const std::byte> bytes_at(const message_ref& m) {
  return span_at<const std::byte>(m.first, m.second);
}

// The message at the front of a received buffer (the hook pads every rank's message to one
// size for its all_gather): as many bytes as its header says. A buffer whose header gives no
// size that fits is handed over whole, for the unpacker to say what is wrong with it.
std::span<const std::byte> message_in(const message_ref& buffer) {
  const auto b = bytes_at(buffer);
  if (b.size() >= st::wire::message_header_bytes) {
    const auto stated =
        st::detail::load_le<std::uint64_t>(b.data() + st::wire::offset_message_bytes);
    if (stated >= st::wire::message_header_bytes + st::wire::message_trailer_bytes &&
        stated <= b.size()) {
      return b.first(static_cast<std::size_t>(stated));
    }
  }
  return b;
}

// The step a message was sent at: its tag, which the hook and the pipeline set to their step,
// a signed 64-bit count from 0. A tag at or above 2^63 is no step, and reports cannot be
// checked against it.
std::int64_t step_of_tag(std::uint64_t tag, const std::string& who) {
  if (tag > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
    throw st::error(st::errc::malformed_message, who + ": message tag " + std::to_string(tag) +
                                                     " is not a step (at or above 2^63)");
  }
  return static_cast<std::int64_t>(tag);
}

// The step reports of one message: up to `max_reports`, steps ascending.
struct message_reports {
  std::array<st::rank_report, st::step_reports_layout::max_reports> reports{};
  std::size_t count = 0;
};

// Reads the step-reports section of the message `unpacker` parsed last (none: count 0) with the
// pipeline's reader, which checks it against the message's step.
void read_reports(const st::message_unpacker& unpacker, message_reports& out,
                  const std::string& who) {
  out.count = 0;
  const std::size_t c = unpacker.find_control(st::control_type::step_reports);
  if (c == st::message_unpacker::npos) return;
  const st::message_info& info = unpacker.info();
  out.count =
      st::read_step_reports(info.controls[c].payload, step_of_tag(info.tag, who), out.reports, who);
}

// The measurement of one exchange, the same on every rank since every rank reads the same
// messages in rank order: when every rank's message carries step reports and the latest of
// them are of one step, those reports combined as the pipeline combines a step's
// (report_aggregate, pipeline/step_reports.hpp); otherwise none (a rank without a complete
// step yet, or ranks at different steps).
std::optional<st::rank_report> combine_latest(std::span<const message_reports> ranks) {
  if (ranks.empty() || ranks.front().count == 0) return std::nullopt;
  const std::int64_t step = ranks.front().reports[ranks.front().count - 1].step;
  st::detail::report_aggregate agg;
  for (const auto& r : ranks) {
    if (r.count == 0 || r.reports[r.count - 1].step != step) return std::nullopt;
    agg.add(r.reports[r.count - 1]);
  }
  return agg.result(step);
}


// Decodes the one section of tensor `id` (of `n` elements) in each of `messages` (one buffer
// per rank, the message at its front) into `decoded` (one float buffer per rank) and reads its
// step reports into `reports`, through `unpacker`, which has `id` registered. Errors name
// `who` and the rank.
template <class Executor>
void decode_all(st::message_unpacker& unpacker, std::uint32_t id, std::uint64_t n,
                const std::vector<message_ref>& messages,
                std::vector<st::sparse_buffer<float>>& decoded,
                std::vector<message_reports>& reports, const std::string& who, Executor& ex) {
  decoded.resize(std::max(decoded.size(), messages.size()));
  reports.resize(messages.size());
  for (std::size_t w = 0; w < messages.size(); ++w) {
    try {
      const auto& info = unpacker.parse(message_in(messages[w]), ex);
      if (info.sections.size() != 1 || info.sections[0].tensor != id) {
        throw st::error(st::errc::malformed_message,
                        "the message holds " + std::to_string(info.sections.size()) +
                            " tensor sections, expected one of tensor " + std::to_string(id));
      }
      read_reports(unpacker, reports[w], "unpack");
      auto& buf = decoded[w];
      buf.set_dense_size(n);
      buf.reserve(info.sections[0].count);
      buf.resize(info.sections[0].count);
      unpacker.decode(0, buf, ex);
    } catch (const st::error& e) {
      st::detail::rethrow_with_context(e, who + ": rank " + std::to_string(w));
    }
  }
}

// Error feedback + selection + packing of registered tensors, and the mean of the messages
// of every rank. The selector "chunked" is the chunked low-bit codec (compress/
// chunked_compressor.hpp: values "1bit" or "2bit", k per chunk ceil(k 2^b / n)), whose
// selections travel as chunked sections. Calls are serialised: the hook compresses the next
// bucket on its thread while the exchange's callback reduces the previous one on another. The
// mutex is taken with the GIL released, and nothing under it takes the GIL.
class codec {
 public:
  codec(const std::string& selector, const std::string& values, std::uint64_t seed,
        std::shared_ptr<executor_handle> threads, unsigned chunk_bits, float decay)
      : ex_(std::move(threads)), impl_(make(selector, values, seed, chunk_bits, decay)) {}

  void add(std::uint32_t id, std::uint64_t n, std::uint64_t max_k) {
    py::gil_scoped_release unlocked;
    const std::lock_guard lock(mutex_);
    std::visit(
        [&](auto& c) {
          ex_->run([&](auto& ex) {
            if constexpr (is_chunked<decltype(c)>) {
              c.ef.add_tensor(ex, id, n);
            } else {
              c.ef.add_tensor(ex, id, n, max_k);
            }
          });
        },
        impl_);
  }

  [[nodiscard]] bool has(std::uint32_t id) const {
    const std::lock_guard lock(mutex_);
    return std::visit([&](const auto& c) { return c.ef.has_tensor(id); }, impl_);
  }

  // acc = g + r; selects min(k, n) of acc; r = acc - sent; packs the selection as a message of
  // tensor `id` tagged `tag`, with `reports` (at most `max_reports`, steps ascending and before
  // `tag`; none: no section) as its step-reports control section, written and checked by the
  // pipeline's own writer and reader. Returns the message's size in bytes (see `write`).
  std::uint64_t compress(std::uint32_t id, std::uintptr_t grad, std::uint64_t n, std::uint64_t k,
                         std::uint64_t tag, const std::vector<st::rank_report>& reports) {
    const auto g = span_at<const float>(grad, n);
    py::gil_scoped_release unlocked;
    const std::lock_guard lock(mutex_);
    if (!reports.empty()) set_reports(reports, tag);
    return std::visit(
        [&](auto& c) -> std::uint64_t {
          std::uint64_t bytes = 0;
          ex_->run([&](auto& ex) {
            const auto stats = c.ef.compress(ex, id, g, k, c.selection);
            last_count_ = stats.count;
            last_exact_ = stats.exact;
            packer_.clear(tag);
            if constexpr (is_chunked<decltype(c)>) {
              packer_.add_chunked(id, c.ef.wire_section(id));
            } else {
              using V = typename std::decay_t<decltype(c)>::value;
              packer_.add(id, c.selection.view(), {.values = encoding_of<V>()});
            }
            if (!reports.empty()) packer_.add_control(st::control_type::step_reports, payload_);
            bytes = packer_.prepare(ex);
          });
          return bytes;
        },
        impl_);
  }

  // Writes the message of the last `compress` to `out` (at least its size).
  void write(std::uintptr_t out, std::uint64_t capacity) {
    const auto o = span_at<std::byte>(out, capacity);
    py::gil_scoped_release unlocked;
    const std::lock_guard lock(mutex_);
    ex_->run([&](auto& ex) { packer_.write(o, ex); });
  }

  // The mean (or sum) over `messages` (one buffer per rank, each holding a message from
  // `compress` of tensor `id` at its front) into the dense `out` of n floats, every element
  // written; summed in message order, so every rank computes the same bits. Returns the
  // messages' step reports combined (`combine_latest`), or None. Errors name `who` and the rank.
  std::optional<st::rank_report> reduce(std::uint32_t id, std::uint64_t n,
                                        const std::vector<message_ref>& messages,
                                        std::uintptr_t out, bool mean, const std::string& who) {
    const auto o = span_at<float>(out, n);
    py::gil_scoped_release unlocked;
    const std::lock_guard lock(mutex_);
    auto it = unpackers_.find(id);
    if (it == unpackers_.end() || it->second.second != n) {
      const st::tensor_info info{id, n};
      it = unpackers_.insert_or_assign(id, std::make_pair(st::message_unpacker({&info, 1}), n))
               .first;
    }
    ex_->run([&](auto& ex) {
      decode_all(it->second.first, id, n, messages, decoded_, reports_, who, ex);
      views_.clear();
      for (std::size_t w = 0; w < messages.size(); ++w) views_.push_back(decoded_[w].view());
      merger_.scatter_add<float, std::uint32_t>(
          views_, o, mean ? st::reduction::mean : st::reduction::sum, ex);
    });
    return combine_latest(reports_);
  }

  // The residual of tensor `id` (a copy of its n floats).
  [[nodiscard]] py::bytes residual(std::uint32_t id) const {
    const std::lock_guard lock(mutex_);
    return std::visit(
        [&](const auto& c) {
          const auto r = c.ef.residual(id);
          return py::bytes(reinterpret_cast<const char*>(r.data()), r.size_bytes());
        },
        impl_);
  }

  // Every tensor's error-feedback state (the compressor's own versioned, checksummed format).
  [[nodiscard]] py::bytes save_state() const {
    const std::lock_guard lock(mutex_);
    const auto b = std::visit([](const auto& c) { return c.ef.save_state(); }, impl_);
    return py::bytes(reinterpret_cast<const char*>(b.data()), b.size());
  }

  // Replaces every tensor's state with `saved` (from `save_state` of a codec with the same
  // options); nothing changes when it throws.
  void load_state(const std::string& saved) {
    py::gil_scoped_release unlocked;
    const std::lock_guard lock(mutex_);
    std::visit(
        [&](auto& c) {
          ex_->run([&](auto& ex) { c.ef.load_state(ex, std::as_bytes(std::span(saved))); });
        },
        impl_);
  }

  // The last compress call's selection: its size and whether it is exactly the top k.
  [[nodiscard]] std::tuple<std::uint64_t, bool> last_selection() const {
    return {last_count_, last_exact_};
  }

  // Copies the last selection's indices (as int64) and values (as fp32) to the caller.
  void selection_into(std::uintptr_t indices, std::uintptr_t values, std::uint64_t count) const {
    const auto idx = span_at<std::int64_t>(indices, count);
    const auto val = span_at<float>(values, count);
    std::visit(
        [&](const auto& c) {
          if (count != c.selection.size()) {
            throw st::error(st::errc::size_mismatch, "stellatrain: the selection has " +
                                                         std::to_string(c.selection.size()) +
                                                         " elements, not " + std::to_string(count));
          }
          const auto si = c.selection.indices();
          const auto sv = c.selection.values();
          for (std::size_t j = 0; j < si.size(); ++j) {
            idx[j] = static_cast<std::int64_t>(si[j]);
            val[j] = st::to_float(sv[j]);
          }
        },
        impl_);
  }

 private:
  template <class V>
  struct compressor {
    using value = V;
    explicit compressor(st::runtime_selector<> s) : ef(std::move(s)) {}
    st::error_feedback_compressor<st::runtime_selector<>, V> ef;
    st::sparse_buffer<V> selection;
  };

  struct chunked {
    using value = float;
    explicit chunked(const st::chunked_compressor_options& o) : ef(o) {}
    st::chunked_compressor<> ef;
    st::sparse_buffer<float> selection;
  };

  template <class C>
  static constexpr bool is_chunked = std::is_same_v<std::decay_t<C>, chunked>;

  using any_compressor =
      std::variant<compressor<float>, compressor<st::fp16>, compressor<st::bf16>, chunked>;

  static any_compressor make(const std::string& selector, const std::string& values,
                             std::uint64_t seed, unsigned chunk_bits, float decay) {
    if (selector == "chunked") {
      if (values != "1bit" && values != "2bit") {
        throw py::value_error(
            "stellatrain: the chunked codec's values must be '1bit' or '2bit', got '" + values +
            "'");
      }
      const st::chunked_compressor_options o{
          .chunk_bits = chunk_bits,
          .bits = values == "1bit" ? st::chunk_value_bits::one : st::chunk_value_bits::two,
          .decay = decay};
      try {
        return chunked(o);
      } catch (const st::error& e) {
        throw py::value_error(e.what());
      }
    }
    const st::runtime_selector_options o{.method = method_from(selector), .seed = seed};
    if (values == "fp32") return compressor<float>(st::runtime_selector<>(o));
    if (values == "fp16") return compressor<st::fp16>(st::runtime_selector<>(o));
    if (values == "bf16") return compressor<st::bf16>(st::runtime_selector<>(o));
    throw py::value_error("stellatrain: values must be 'fp32', 'fp16' or 'bf16', got '" + values +
                          "'");
  }

  // The step-reports payload of the next message; the sender checks it as a receiver will.
  void set_reports(const std::vector<st::rank_report>& reports, std::uint64_t tag) {
    payload_.resize(st::step_reports_bytes(reports.size()));
    st::write_step_reports(reports, payload_);
    message_reports check;
    st::read_step_reports(payload_, step_of_tag(tag, "stellatrain: compress"), check.reports,
                          "stellatrain: compress");
  }

  mutable std::mutex mutex_;
  std::shared_ptr<executor_handle> ex_;
  any_compressor impl_;
  st::message_packer packer_;
  std::vector<std::byte> payload_;
  std::vector<message_reports> reports_;
  std::map<std::uint32_t, std::pair<st::message_unpacker, std::uint64_t>> unpackers_;
  std::vector<st::sparse_buffer<float>> decoded_;
  std::vector<st::sparse_view<const float, const std::uint32_t>> views_;
  st::sparse_merger merger_;
  std::uint64_t last_count_ = 0;
  bool last_exact_ = true;
};

// ------------------------------------------------------------------- one kernel at a time

// The exact top k of x by magnitude: indices ascending (int64) and their values.
void select_topk(std::uintptr_t x, std::uint64_t n, std::uint64_t k, std::uintptr_t indices,
                 std::uintptr_t values, const std::shared_ptr<executor_handle>& threads) {
  const auto in = span_at<const float>(x, n);
  const std::uint64_t m = std::min(k, n);
  const auto idx = span_at<std::uint64_t>(indices, m);
  const auto val = span_at<float>(values, m);
  py::gil_scoped_release unlocked;
  st::exact_topk_selector<> sel;
  threads->run([&](auto& ex) { sel.select(ex, in, k, idx, val); });
}

// One message of one tensor: `count` (index, value) pairs, indices strictly ascending int64,
// and `controls`, control sections (type, payload) as they are. Returns the message's bytes.
py::bytes pack(std::uint32_t tensor, std::uint64_t n, std::uintptr_t indices, std::uintptr_t values,
               std::uint64_t count, const std::string& encoding, std::uint64_t tag,
               const std::shared_ptr<executor_handle>& threads,
               const std::vector<std::pair<std::uint32_t, std::string>>& controls) {
  st::value_encoding e = st::value_encoding::fp32;
  if (encoding == "fp16") {
    e = st::value_encoding::fp16;
  } else if (encoding == "bf16") {
    e = st::value_encoding::bf16;
  } else if (encoding != "fp32") {
    throw py::value_error("stellatrain: values must be 'fp32', 'fp16' or 'bf16', got '" + encoding +
                          "'");
  }
  const st::sparse_view<const float, const std::uint64_t> sel{
      span_at<const std::uint64_t>(indices, count), span_at<const float>(values, count), n};
  std::string out;
  {
    py::gil_scoped_release unlocked;
    st::message_packer packer;
    packer.clear(tag);
    packer.add(tensor, sel, {.values = e});
    for (const auto& [type, payload] : controls)
      packer.add_control(type, std::as_bytes(std::span<const char>(payload)));
    threads->run([&](auto& ex) {
      out.resize(packer.prepare(ex));
      packer.write(std::as_writable_bytes(std::span<char>(out)), ex);
    });
  }
  return py::bytes(out);
}

// Parses and validates a message of tensor `tensor` (n elements); returns its pair count and
// keeps the decoder ready for `unpack_into`, and the message's tag and step reports.
class unpacker {
 public:
  explicit unpacker(std::shared_ptr<executor_handle> threads) : ex_(std::move(threads)) {}

  std::uint64_t parse(std::uint32_t tensor, std::uint64_t n, std::uintptr_t message,
                      std::uint64_t bytes) {
    const st::tensor_info info{tensor, n};
    impl_ = st::message_unpacker({&info, 1});
    message_ = {message, bytes};
    std::uint64_t count = 0;
    ex_->run([&](auto& ex) {
      const auto& msg = impl_.parse(bytes_at(message_), ex);
      if (msg.sections.size() != 1) {
        throw st::error(st::errc::malformed_message, "stellatrain: the message holds " +
                                                         std::to_string(msg.sections.size()) +
                                                         " sections, expected one");
      }
      count = msg.sections[0].count;
    });
    return count;
  }

  void decode_into(std::uintptr_t indices, std::uintptr_t values, std::uint64_t count) {
    const auto idx = span_at<std::uint64_t>(indices, count);
    const auto val = span_at<float>(values, count);
    ex_->run([&](auto& ex) { impl_.decode(0, idx, val, ex); });
  }

  // The parsed message's tag (0 before a successful parse).
  [[nodiscard]] std::uint64_t tag() const noexcept { return impl_.info().tag; }

  // The parsed message's step reports, read by the pipeline's reader against its tag (none
  // without a step-reports section).
  [[nodiscard]] std::vector<st::rank_report> step_reports() const {
    message_reports r;
    read_reports(impl_, r, "stellatrain");
    return {r.reports.begin(), r.reports.begin() + static_cast<std::ptrdiff_t>(r.count)};
  }

 private:
  std::shared_ptr<executor_handle> ex_;
  st::message_unpacker impl_;
  message_ref message_{};
};

// The size of the largest message `codec::compress` writes for a tensor of `n` elements with
// `values` on the wire and `reports` step reports (0: no section), as (fixed bytes, bytes per
// pair): the headers, and per pair a raw index (the packer never picks an encoding larger than
// the raw one that holds n) and a value.
std::pair<std::uint64_t, std::uint64_t> message_bound(std::uint64_t n, const std::string& values,
                                                      std::uint64_t reports) {
  std::uint64_t value = 0;
  if (values == "fp32") {
    value = st::value_bytes(st::value_encoding::fp32);
  } else if (values == "fp16") {
    value = st::value_bytes(st::value_encoding::fp16);
  } else if (values == "bf16") {
    value = st::value_bytes(st::value_encoding::bf16);
  } else {
    throw py::value_error("stellatrain: values must be 'fp32', 'fp16' or 'bf16', got '" + values +
                          "'");
  }
  if (reports > st::step_reports_layout::max_reports) {
    throw py::value_error("stellatrain: a message carries at most " +
                          std::to_string(st::step_reports_layout::max_reports) +
                          " step reports, not " + std::to_string(reports));
  }
  const std::uint64_t index = n <= 65536 ? 2 : (n <= (std::uint64_t{1} << 32) ? 4 : 8);
  std::uint64_t fixed = st::wire::message_header_bytes + st::wire::message_trailer_bytes +
                        st::wire::section_header_bytes;
  if (reports > 0) fixed += st::wire::section_header_bytes + st::step_reports_bytes(reports);
  return {fixed, index + value};
}

// The size of the message at the front of a buffer, as its header says (the whole buffer when
// the header gives no size that fits: the unpacker then says what is wrong).
std::uint64_t message_bytes(std::uintptr_t buffer, std::uint64_t capacity) {
  return message_in({buffer, capacity}).size();
}

// The mean (or sum) of W sparse tensors (int64 indices ascending, fp32 values) into a dense
// fp32 `out` of n elements.
void merge_dense(const std::vector<std::tuple<std::uintptr_t, std::uintptr_t, std::uint64_t>>& in,
                 std::uint64_t n, std::uintptr_t out, bool mean,
                 const std::shared_ptr<executor_handle>& threads) {
  std::vector<st::sparse_view<const float, const std::uint64_t>> views;
  for (const auto& [i, v, c] : in)
    views.push_back({span_at<const std::uint64_t>(i, c), span_at<const float>(v, c), n});
  const auto o = span_at<float>(out, n);
  py::gil_scoped_release unlocked;
  st::sparse_merger merger;
  threads->run([&](auto& ex) {
    merger.scatter_add<float, std::uint64_t>(views, o,
                                             mean ? st::reduction::mean : st::reduction::sum, ex);
  });
}

// The benchmarks' baseline: one streaming read of n floats (their sum, four SIMD accumulators
// so that the adds do not serialise), what "a pass over the bucket" costs.
double stream_read(std::uintptr_t x, std::uint64_t n) {
  using batch = xsimd::batch<float>;
  constexpr std::size_t w = batch::size;
  const auto in = span_at<const float>(x, n);
  py::gil_scoped_release unlocked;
  batch a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
  std::size_t i = 0;
  for (; i + 4 * w <= in.size(); i += 4 * w) {
    a0 += batch::load_unaligned(in.data() + i);
    a1 += batch::load_unaligned(in.data() + i + w);
    a2 += batch::load_unaligned(in.data() + i + 2 * w);
    a3 += batch::load_unaligned(in.data() + i + 3 * w);
  }
  double sum = static_cast<double>(st::detail::reduce_add((a0 + a1) + (a2 + a3)));
  for (; i < in.size(); ++i) sum += static_cast<double>(in[i]);
  return sum;
}

// The least memory traffic of an error-feedback hook that returns a dense mean, for the
// benchmarks: r += g and out = 0 in one pass (reads g and r, writes r and out); selection,
// packing and merging come on top of it.
void feedback_floor(std::uintptr_t g, std::uintptr_t r, std::uintptr_t out, std::uint64_t n) {
  using batch = xsimd::batch<float>;
  constexpr std::size_t w = batch::size;
  const auto in = span_at<const float>(g, n);
  const auto res = span_at<float>(r, n);
  const auto o = span_at<float>(out, n);
  py::gil_scoped_release unlocked;
  const batch zero(0.0f);
  std::size_t i = 0;
  for (; i + w <= n; i += w) {
    (batch::load_unaligned(res.data() + i) + batch::load_unaligned(in.data() + i))
        .store_unaligned(res.data() + i);
    zero.store_unaligned(o.data() + i);
  }
  for (; i < n; ++i) {
    res[i] += in[i];
    o[i] = 0.0f;
  }
}

}  // namespace

void bind_compression(py::module_& m) {
  py::class_<st::rank_report>(m, "StepReport",
                              "One rank's measurements of one completed step, as the step-reports "
                              "control section carries them (pipeline/step_reports.hpp).")
      .def(py::init([](std::int64_t step, double exchange_seconds, double compute_seconds,
                       std::uint64_t link_bytes, double bytes_per_element, double latency_rounds) {
             return st::rank_report{.step = step,
                                    .exchange_seconds = exchange_seconds,
                                    .compute_seconds = compute_seconds,
                                    .link_bytes = link_bytes,
                                    .bytes_per_element = bytes_per_element,
                                    .latency_rounds = latency_rounds};
           }),
           py::arg("step") = -1, py::arg("exchange_seconds") = 0.0,
           py::arg("compute_seconds") = 0.0, py::arg("link_bytes") = 0,
           py::arg("bytes_per_element") = 0.0, py::arg("latency_rounds") = 0.0)
      .def_readwrite("step", &st::rank_report::step)
      .def_readwrite("exchange_seconds", &st::rank_report::exchange_seconds)
      .def_readwrite("compute_seconds", &st::rank_report::compute_seconds)
      .def_readwrite("link_bytes", &st::rank_report::link_bytes)
      .def_readwrite("bytes_per_element", &st::rank_report::bytes_per_element)
      .def_readwrite("latency_rounds", &st::rank_report::latency_rounds)
      .def(
          "__eq__",
          [](const st::rank_report& a, const st::rank_report& b) {
            return a.step == b.step && a.exchange_seconds == b.exchange_seconds &&
                   a.compute_seconds == b.compute_seconds && a.link_bytes == b.link_bytes &&
                   a.bytes_per_element == b.bytes_per_element &&
                   a.latency_rounds == b.latency_rounds;
          },
          py::is_operator())
      .def(py::pickle(
          [](const st::rank_report& r) {
            return py::make_tuple(r.step, r.exchange_seconds, r.compute_seconds, r.link_bytes,
                                  r.bytes_per_element, r.latency_rounds);
          },
          [](const py::tuple& t) {
            if (t.size() != 6) throw py::value_error("stellatrain: a StepReport has 6 fields");
            return st::rank_report{.step = t[0].cast<std::int64_t>(),
                                   .exchange_seconds = t[1].cast<double>(),
                                   .compute_seconds = t[2].cast<double>(),
                                   .link_bytes = t[3].cast<std::uint64_t>(),
                                   .bytes_per_element = t[4].cast<double>(),
                                   .latency_rounds = t[5].cast<double>()};
          }))
      .def("__repr__", [](const st::rank_report& r) {
        return "StepReport(step=" + std::to_string(r.step) + ", exchange_seconds=" +
               py::repr(py::float_(r.exchange_seconds)).cast<std::string>() +
               ", compute_seconds=" + py::repr(py::float_(r.compute_seconds)).cast<std::string>() +
               ", link_bytes=" + std::to_string(r.link_bytes) + ", bytes_per_element=" +
               py::repr(py::float_(r.bytes_per_element)).cast<std::string>() +
               ", latency_rounds=" + py::repr(py::float_(r.latency_rounds)).cast<std::string>() +
               ")";
      });
  py::class_<codec>(m, "Codec")
      .def(py::init<const std::string&, const std::string&, std::uint64_t,
                    std::shared_ptr<executor_handle>, unsigned, float>(),
           py::arg("selector"), py::arg("values"), py::arg("seed"), py::arg("threads"),
           py::arg("chunk_bits") = 12u, py::arg("decay") = 1.0f)
      .def("save_state", &codec::save_state)
      .def("load_state", &codec::load_state, py::arg("state"))
      .def("add", &codec::add, py::arg("id"), py::arg("elements"), py::arg("max_k"))
      .def("has", &codec::has, py::arg("id"))
      .def("compress", &codec::compress, py::arg("id"), py::arg("grad"), py::arg("elements"),
           py::arg("k"), py::arg("tag"), py::arg("reports") = std::vector<st::rank_report>{})
      .def("write", &codec::write, py::arg("out"), py::arg("capacity"))
      .def("reduce", &codec::reduce, py::arg("id"), py::arg("elements"), py::arg("messages"),
           py::arg("out"), py::arg("mean"), py::arg("who") = std::string("stellatrain"))
      .def("residual", &codec::residual, py::arg("id"))
      .def("last_selection", &codec::last_selection)
      .def("selection_into", &codec::selection_into, py::arg("indices"), py::arg("values"),
           py::arg("count"));
  m.def("select_topk", &select_topk, py::arg("x"), py::arg("elements"), py::arg("k"),
        py::arg("indices"), py::arg("values"), py::arg("threads"));
  m.def("pack", &pack, py::arg("tensor"), py::arg("elements"), py::arg("indices"),
        py::arg("values"), py::arg("count"), py::arg("encoding"), py::arg("tag"),
        py::arg("threads"),
        py::arg("controls") = std::vector<std::pair<std::uint32_t, std::string>>{});
  py::class_<unpacker>(m, "Unpacker")
      .def(py::init<std::shared_ptr<executor_handle>>(), py::arg("threads"))
      .def("parse", &unpacker::parse, py::arg("tensor"), py::arg("elements"), py::arg("message"),
           py::arg("bytes"))
      .def("decode_into", &unpacker::decode_into, py::arg("indices"), py::arg("values"),
           py::arg("count"))
      .def_property_readonly("tag", &unpacker::tag)
      .def("step_reports", &unpacker::step_reports);
  m.def("message_bound", &message_bound, py::arg("elements"), py::arg("values"),
        py::arg("reports"));
  m.def("message_bytes", &message_bytes, py::arg("buffer"), py::arg("capacity"));
  m.def("stream_read", &stream_read, py::arg("x"), py::arg("elements"));
  m.def("feedback_floor", &feedback_floor, py::arg("grad"), py::arg("residual"), py::arg("out"),
        py::arg("elements"));
  m.def("merge_dense", &merge_dense, py::arg("inputs"), py::arg("elements"), py::arg("out"),
        py::arg("mean"), py::arg("threads"));
}

}  // namespace stellatrain_python
