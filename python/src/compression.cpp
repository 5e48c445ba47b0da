// SPDX-License-Identifier: Apache-2.0
// The compression side of stellatrain._native: error feedback with selection, packing into the
// wire format, and unpacking with the mean over ranks, on raw fp32 buffers (the Python layer
// checks every tensor first). `Codec` is what the DDP communication hook runs per bucket;
// `select_topk`, `pack`, `unpack` and `merge_mean` are the same kernels one at a time.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/runtime_selector.hpp>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <xsimd/xsimd.hpp>

#include "native_support.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
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

// (address, bytes) of one received message.
using message_ref = std::pair<std::uintptr_t, std::uint64_t>;

std::span<const std::byte> bytes_at(const message_ref& m) {
  return span_at<const std::byte>(m.first, m.second);
}

// Decodes the one section of tensor `id` (of `n` elements) in each of `messages` into
// `decoded` (one float buffer per message), through `unpacker`, which has `id` registered.
template <class Executor>
void decode_all(st::message_unpacker& unpacker, std::uint32_t id, std::uint64_t n,
                const std::vector<message_ref>& messages,
                std::vector<st::sparse_buffer<float>>& decoded, Executor& ex) {
  decoded.resize(std::max(decoded.size(), messages.size()));
  for (std::size_t w = 0; w < messages.size(); ++w) {
    const auto& info = unpacker.parse(bytes_at(messages[w]), ex);
    if (info.sections.size() != 1 || info.sections[0].tensor != id) {
      throw st::error(st::errc::malformed_message,
                      "stellatrain: message " + std::to_string(w) + " holds " +
                          std::to_string(info.sections.size()) +
                          " sections, expected one of tensor " + std::to_string(id));
    }
    auto& buf = decoded[w];
    buf.set_dense_size(n);
    buf.reserve(info.sections[0].count);
    buf.resize(info.sections[0].count);
    unpacker.decode(0, buf, ex);
  }
}

// Error feedback + selection + packing of registered tensors, and the mean of the messages
// of every rank. Calls are serialised: the hook compresses the next bucket on its thread while
// the exchange's callback reduces the previous one on another. The mutex is taken with the
// GIL released, and nothing under it takes the GIL.
class codec {
 public:
  codec(const std::string& selector, const std::string& values, std::uint64_t seed,
        std::shared_ptr<executor_handle> threads)
      : ex_(std::move(threads)),
        impl_(make(values, {.method = method_from(selector), .seed = seed})) {}

  void add(std::uint32_t id, std::uint64_t n, std::uint64_t max_k) {
    py::gil_scoped_release unlocked;
    const std::lock_guard lock(mutex_);
    std::visit([&](auto& c) { ex_->run([&](auto& ex) { c.ef.add_tensor(ex, id, n, max_k); }); },
               impl_);
    sizes_[id] = n;
  }

  [[nodiscard]] bool has(std::uint32_t id) const { return sizes_.count(id) != 0; }

  // acc = g + r; selects min(k, n) of acc; r = acc - sent; packs the selection as a message of
  // tensor `id` tagged `tag`. Returns the message's size in bytes (see `write`).
  std::uint64_t compress(std::uint32_t id, std::uintptr_t grad, std::uint64_t n, std::uint64_t k,
                         std::uint64_t tag) {
    const auto g = span_at<const float>(grad, n);
    py::gil_scoped_release unlocked;
    const std::lock_guard lock(mutex_);
    return std::visit(
        [&](auto& c) -> std::uint64_t {
          using V = typename std::decay_t<decltype(c)>::value;
          std::uint64_t bytes = 0;
          ex_->run([&](auto& ex) {
            const auto stats = c.ef.compress(ex, id, g, k, c.selection);
            last_count_ = stats.count;
            last_exact_ = stats.exact;
            packer_.clear(tag);
            packer_.add(id, c.selection.view(), {.values = encoding_of<V>()});
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

  // The mean (or sum) over `messages` (one per rank, each from `compress` of tensor `id`) into
  // the dense `out` of n floats, every element written; summed in message order, so every
  // rank computes the same bits.
  void reduce(std::uint32_t id, std::uint64_t n, const std::vector<message_ref>& messages,
              std::uintptr_t out, bool mean) {
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
      decode_all(it->second.first, id, n, messages, decoded_, ex);
      views_.clear();
      for (std::size_t w = 0; w < messages.size(); ++w) views_.push_back(decoded_[w].view());
      merger_.scatter_add<float, std::uint32_t>(
          views_, o, mean ? st::reduction::mean : st::reduction::sum, ex);
    });
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

  using any_compressor =
      std::variant<compressor<float>, compressor<st::fp16>, compressor<st::bf16>>;

  static any_compressor make(const std::string& values, const st::runtime_selector_options& o) {
    if (values == "fp32") return compressor<float>(st::runtime_selector<>(o));
    if (values == "fp16") return compressor<st::fp16>(st::runtime_selector<>(o));
    if (values == "bf16") return compressor<st::bf16>(st::runtime_selector<>(o));
    throw py::value_error("stellatrain: values must be 'fp32', 'fp16' or 'bf16', got '" + values +
                          "'");
  }

  mutable std::mutex mutex_;
  std::shared_ptr<executor_handle> ex_;
  any_compressor impl_;
  std::map<std::uint32_t, std::uint64_t> sizes_;
  st::message_packer packer_;
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

// One message of one tensor: `count` (index, value) pairs, indices strictly ascending int64.
// Returns the message's bytes.
py::bytes pack(std::uint32_t tensor, std::uint64_t n, std::uintptr_t indices, std::uintptr_t values,
               std::uint64_t count, const std::string& encoding, std::uint64_t tag,
               const std::shared_ptr<executor_handle>& threads) {
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
    threads->run([&](auto& ex) {
      out.resize(packer.prepare(ex));
      packer.write(std::as_writable_bytes(std::span<char>(out)), ex);
    });
  }
  return py::bytes(out);
}

// Parses and validates a message of tensor `tensor` (n elements); returns its pair count and
// keeps the decoder ready for `unpack_into`.
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

 private:
  std::shared_ptr<executor_handle> ex_;
  st::message_unpacker impl_;
  message_ref message_{};
};

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
  py::class_<codec>(m, "Codec")
      .def(py::init<const std::string&, const std::string&, std::uint64_t,
                    std::shared_ptr<executor_handle>>(),
           py::arg("selector"), py::arg("values"), py::arg("seed"), py::arg("threads"))
      .def("add", &codec::add, py::arg("id"), py::arg("elements"), py::arg("max_k"))
      .def("has", &codec::has, py::arg("id"))
      .def("compress", &codec::compress, py::arg("id"), py::arg("grad"), py::arg("elements"),
           py::arg("k"), py::arg("tag"))
      .def("write", &codec::write, py::arg("out"), py::arg("capacity"))
      .def("reduce", &codec::reduce, py::arg("id"), py::arg("elements"), py::arg("messages"),
           py::arg("out"), py::arg("mean"))
      .def("residual", &codec::residual, py::arg("id"))
      .def("last_selection", &codec::last_selection)
      .def("selection_into", &codec::selection_into, py::arg("indices"), py::arg("values"),
           py::arg("count"));
  m.def("select_topk", &select_topk, py::arg("x"), py::arg("elements"), py::arg("k"),
        py::arg("indices"), py::arg("values"), py::arg("threads"));
  m.def("pack", &pack, py::arg("tensor"), py::arg("elements"), py::arg("indices"),
        py::arg("values"), py::arg("count"), py::arg("encoding"), py::arg("tag"),
        py::arg("threads"));
  py::class_<unpacker>(m, "Unpacker")
      .def(py::init<std::shared_ptr<executor_handle>>(), py::arg("threads"))
      .def("parse", &unpacker::parse, py::arg("tensor"), py::arg("elements"), py::arg("message"),
           py::arg("bytes"))
      .def("decode_into", &unpacker::decode_into, py::arg("indices"), py::arg("values"),
           py::arg("count"));
  m.def("stream_read", &stream_read, py::arg("x"), py::arg("elements"));
  m.def("feedback_floor", &feedback_floor, py::arg("grad"), py::arg("residual"), py::arg("out"),
        py::arg("elements"));
  m.def("merge_dense", &merge_dense, py::arg("inputs"), py::arg("elements"), py::arg("out"),
        py::arg("mean"), py::arg("threads"));
}

}  // namespace stellatrain_python
