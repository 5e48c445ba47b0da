// SPDX-License-Identifier: Apache-2.0
// Reads wire messages without trusting them: `parse` checks every byte against the message size
// and the receiver's registered tensors before `decode` writes into caller-owned buffers.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/core/random_indices.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/detail/chunked_payload.hpp>
#include <stellatrain/pack/detail/crc32c_combine.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/detail/index_payload.hpp>
#include <stellatrain/pack/detail/index_payload_check.hpp>
#include <stellatrain/pack/detail/message_header_check.hpp>
#include <stellatrain/pack/detail/section_header_check.hpp>
#include <stellatrain/pack/detail/unpack_error.hpp>
#include <stellatrain/pack/detail/value_codec.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <vector>

namespace stellatrain {

/// A tensor the receiver expects: its id on the wire and its number of elements.
struct tensor_info {
  std::uint32_t id = 0;
  std::uint64_t size = 0;
};

/// One section of a parsed message.
struct section_info {
  std::uint32_t tensor = 0;      ///< tensor id
  std::uint64_t dense_size = 0;  ///< elements of the tensor (equal to its registered size)
  std::uint64_t count = 0;       ///< (index, value) pairs: what `decode` writes
  index_encoding indices = index_encoding::automatic;
  value_encoding values = value_encoding::fp32;
  random_key random{};            ///< the key of a random_k section (else zero)
  unsigned chunk_bits = 0;        ///< b of a chunked_topk section (else zero)
  std::uint64_t chunk_k = 0;      ///< its elements sent per chunk (else zero)
  std::uint64_t offset = 0;       ///< byte offset of the section header in the message
  std::uint64_t index_bytes = 0;  ///< bytes of the index payload
  std::uint64_t value_bytes = 0;  ///< bytes of the value payload
};

/// One control section of a parsed message: a typed payload that is not a tensor
/// (`message_packer::add_control`). The format checks only its bounds; its type's reader
/// checks the payload.
struct control_info {
  std::uint32_t type = 0;              ///< control type id (`control_type::*` or the application's)
  std::span<const std::byte> payload;  ///< its bytes, inside the parsed message
  std::uint64_t offset = 0;            ///< byte offset of the section header in the message
};

/// What `parse` found: the sender's tag, the tensor sections and the control sections, each
/// in message order.
struct message_info {
  std::uint64_t tag = 0;
  std::uint64_t bytes = 0;
  std::span<const section_info> sections;
  std::span<const control_info> controls;

  /// Pairs over all sections.
  [[nodiscard]] std::uint64_t total_count() const noexcept {
    std::uint64_t t = 0;
    for (const auto& s : sections) t += s.count;
    return t;
  }
};

/// Limits of `message_unpacker`.
struct unpack_options {
  /// Messages larger than this are refused (`errc::resource_exhausted`) before their bytes are
  /// read, so that a peer cannot make the receiver checksum a huge buffer.
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
};

/// Reads messages written by `message_packer`.
///
/// Register the tensors the receiver expects (`tensor_info{id, size}`), then per message:
/// `parse(bytes, ex)` validates the whole message and returns its sections (with the number of
/// pairs each holds, so that the caller can size buffers), and `decode(i, indices, values,
/// ex)` writes section i into caller-owned spans or a `sparse_buffer`, converting values to
/// the caller's type and indices to 32 or 64 bits.
///
/// Nothing is trusted: `parse` checks the header, the checksum, every length, count, offset
/// and encoding id against the message size and the registered tensor sizes, and decodes every
/// index payload without storing it (order, range, exact lengths). A truncated, corrupted,
/// oversized, wrong-version, wrong-tensor or out-of-range message throws `stellatrain::error`
/// saying what and where (section, tensor, block or position), and nothing outside the
/// unpacker has been written. After a successful `parse`, `decode` cannot fail on the
/// message's content; it checks only the caller's buffers (before writing anything). After a
/// failed `parse` the unpacker holds no message: `decode` throws `errc::invalid_argument`.
/// Control sections come back as `message_info::controls` (bounds checked, payload untouched).
///
/// `parse` and each `decode` are separate parallel calls on `ex`. With a `thread_pool`, hold
/// `stellatrain::stay_awake(pool)` from `parse` to the last `decode` (as in the example): the
/// workers then poll between the calls instead of sleeping, and only the first call pays for
/// waking them (tens of microseconds each, as much as decoding 100K pairs).
///
/// The message bytes must stay valid and unchanged from `parse` to the last `decode`.
/// Once warm the unpacker allocates nothing (random_k sections use a workspace of n / 8 bytes,
/// kept between messages; `reserve_random_k` allocates it up front). One unpacker is used by
/// one thread at a time.
///
/// \code
///   std::vector<stellatrain::tensor_info> model = {{0, 4096}, {1, 25'000'000}};
///   stellatrain::message_unpacker unpacker(model);
///   const auto awake = stellatrain::stay_awake(pool);         // for the calls that follow
///   const auto& msg = unpacker.parse(bytes, pool);            // throws on bad input
///   for (std::size_t i = 0; i < msg.sections.size(); ++i) {
///     auto& buf = buffers[msg.sections[i].tensor];             // capacity >= count
///     unpacker.decode(i, buf, pool);
///   }
/// \endcode
class message_unpacker {
 public:
  /// `find` result when no section holds the tensor.
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  message_unpacker() = default;

  /// Registers every tensor of `tensors` (see `register_tensor`).
  explicit message_unpacker(std::span<const tensor_info> tensors, unpack_options options = {})
      : options_(options) {
    for (const auto& t : tensors) register_tensor(t.id, t.size);
  }

  /// Expects tensor `id` with `size` elements; throws `errc::invalid_argument` if `id` is
  /// already registered.
  void register_tensor(std::uint32_t id, std::uint64_t size) {
    const auto it = std::lower_bound(registry_.begin(), registry_.end(), id,
                                     [](const entry& e, std::uint32_t key) { return e.id < key; });
    if (it != registry_.end() && it->id == id) {
      throw_error(errc::invalid_argument,
                  "unpack: tensor " + std::to_string(id) + " registered twice");
    }
    registry_.insert(it, entry{id, size, 0});
  }

  /// Number of registered tensors.
  [[nodiscard]] std::size_t tensor_count() const noexcept { return registry_.size(); }

  /// Allocates the random_k workspace for tensors of up to `dense_size` elements now.
  void reserve_random_k(std::uint64_t dense_size) {
    const std::uint64_t words = sample_indices_workspace_words(dense_size);
    if (words > workspace_.size()) {
      workspace_ =
          aligned_buffer<std::uint64_t>(static_cast<std::size_t>(words), {.prefault = true});
    }
  }

  /// Validates `message` completely (see the class comment) and returns its sections. On
  /// failure throws and forgets the previous message.
  template <executor Executor>
  const message_info& parse(std::span<const std::byte> message, Executor& ex) {
    reset();
    try {
      info_.tag = detail::check_message_header(message, options_.max_message_bytes);
      info_.bytes = message.size();
      try {
        parse_sections(message);
        plan_payload_checks(message);
      } catch (const error&) {
        // Corruption first: a bad section in a corrupted message is reported as corruption.
        detail::check_message_checksum(detail::crc32c_parallel(detail::message_body(message), ex),
                                       message);
        throw;
      }
      checks_.run(message, ex);
    } catch (...) {
      reset();
      throw;
    }
    message_ = message;
    info_.sections = sections_;
    info_.controls = controls_;
    return info_;
  }

  /// The last message parsed (no sections after a failure).
  [[nodiscard]] const message_info& info() const noexcept { return info_; }

  /// The section of the last message that holds `tensor`, or `npos`.
  [[nodiscard]] std::size_t find(std::uint32_t tensor) const noexcept {
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      if (sections_[i].tensor == tensor) return i;
    }
    return npos;
  }

  /// The control section of the last message of type `type` (an index into
  /// `info().controls`), or `npos`.
  [[nodiscard]] std::size_t find_control(std::uint32_t type) const noexcept {
    for (std::size_t i = 0; i < controls_.size(); ++i) {
      if (controls_[i].type == type) return i;
    }
    return npos;
  }

  /// Writes the `count` pairs of section i of the last parsed message to the front of
  /// `indices` and `values` (strictly ascending indices). Throws `errc::invalid_argument` if a
  /// span is shorter than `count`, `errc::out_of_range` if I cannot hold the tensor's indices;
  /// both before writing anything.
  template <class V, class I, executor Executor>
  void decode(std::size_t i, std::span<I> indices, std::span<V> values, Executor& ex) {
    static_assert(value_type<V> && index_type<I>);
    check_output<I>(i, indices.size(), values.size());
    decode_section(i, indices.data(), values.data(), ex);
  }

  /// Decodes section i into `out` (capacity at least its count), setting its size and dense
  /// size. Same checks as the span overload; `out` is unchanged when they fail.
  template <class V, class I, executor Executor>
  void decode(std::size_t i, sparse_buffer<V, I>& out, Executor& ex) {
    check_output<I>(i, out.capacity(), out.capacity());
    const auto& s = sections_[i];
    out.resize(s.count);
    out.set_dense_size(s.dense_size);
    decode_section(i, out.indices().data(), out.values().data(), ex);
  }

 private:
  struct entry {
    std::uint32_t id;
    std::uint64_t size;
    std::uint64_t seen;  // generation of the last message that held it
  };

  void reset() noexcept {
    info_ = {};
    sections_.clear();
    controls_.clear();
    message_ = {};
  }

  [[noreturn]] void fail_section(std::size_t i, errc code, const std::string& what) const {
    detail::fail_unpack_section(i, sections_[i].tensor, code, what);
  }

  // The section table: each header checked against the message and the registered tensors.
  void parse_sections(std::span<const std::byte> message) {
    const std::byte* m = message.data();
    const std::uint64_t end = message.size() - wire::message_trailer_bytes;
    const std::uint64_t count = detail::load_le<std::uint32_t>(m + wire::offset_section_count);
    const auto version = detail::load_le<std::uint16_t>(m + wire::offset_version);
    detail::check_section_count(count, message.size(), registry_.size());
    ++generation_;
    std::uint64_t offset = wire::message_header_bytes;
    for (std::uint64_t i = 0; i < count; ++i) {
      // Messages are built only on failure: the success path allocates nothing.
      auto at = [&] {
        return "section " + std::to_string(i) + " at byte " + std::to_string(offset);
      };
      if (end - offset < wire::section_header_bytes) {
        detail::fail_unpack(errc::malformed_message,
                            at() + ": header runs past the end of the message");
      }
      const std::byte* h = m + offset;
      const auto w = detail::wire_section_header::read(h);
      const std::uint64_t room = end - offset - wire::section_header_bytes;
      if (w.kind == static_cast<std::uint16_t>(section_kind::control)) {
        parse_control(w, offset, h, room, at);
        offset += wire::section_header_bytes + w.index_bytes;
        continue;
      }
      if (w.kind != static_cast<std::uint16_t>(section_kind::tensor)) {
        detail::fail_unpack(errc::unsupported,
                            at() + ": unknown section kind " + std::to_string(w.kind));
      }
      auto what = [&] { return at() + " (tensor " + std::to_string(w.id) + ")"; };
      const auto it =
          std::lower_bound(registry_.begin(), registry_.end(), w.id,
                           [](const entry& e, std::uint32_t key) { return e.id < key; });
      if (it == registry_.end() || it->id != w.id) {
        detail::fail_unpack(errc::malformed_message,
                            what() + ": tensor " + std::to_string(w.id) + " is not registered");
      }
      if (it->seen == generation_)
        detail::fail_unpack(errc::malformed_message, what() + ": the tensor appears twice");
      it->seen = generation_;
      if (w.dense_size != it->size) {
        detail::fail_unpack(errc::size_mismatch,
                            what() + ": tensor size " + std::to_string(w.dense_size) +
                                ", registered size " + std::to_string(it->size));
      }
      detail::check_tensor_header(w, room, version, what);
      section_info s;
      s.tensor = w.id;
      s.dense_size = w.dense_size;
      s.count = w.count;
      s.indices = static_cast<index_encoding>(w.index_id);
      s.values = static_cast<value_encoding>(w.value_id);
      s.offset = offset;
      s.index_bytes = w.index_bytes;
      s.value_bytes = w.value_bytes;
      if (s.indices == index_encoding::random_k) {
        s.random = detail::read_random_key(h + wire::section_header_bytes);
      }
      if (s.indices == index_encoding::chunked_topk) {
        const auto prefix = detail::check_chunked_sizes(w, h + wire::section_header_bytes, what);
        s.chunk_bits = prefix.chunk_bits;
        s.chunk_k = prefix.k;
      }
      sections_.push_back(s);
      offset += wire::section_header_bytes + s.index_bytes + s.value_bytes;
    }
    if (offset != end) {
      detail::fail_unpack(errc::malformed_message,
                          std::to_string(end - offset) + " unused bytes after the last section");
    }
  }

  // A control section at `offset` (header `h`, `room` bytes after it).
  template <class At>
  void parse_control(const detail::wire_section_header& w, std::uint64_t offset, const std::byte* h,
                     std::uint64_t room, const At& at) {
    auto what = [&] { return at() + " (control type " + std::to_string(w.id) + ")"; };
    detail::check_control_header(w, room, what);
    for (const auto& c : controls_) {
      if (c.type == w.id)
        detail::fail_unpack(errc::malformed_message, what() + ": the control type appears twice");
    }
    if (controls_.size() == wire::max_control_sections) {
      detail::fail_unpack(errc::malformed_message, what() + ": more than " +
                                                       std::to_string(wire::max_control_sections) +
                                                       " control sections");
    }
    const auto bytes = static_cast<std::size_t>(w.index_bytes);
    controls_.push_back({w.id, {h + wire::section_header_bytes, bytes}, offset});
  }

  // The index payload of section `s` of `message`.
  [[nodiscard]] static detail::index_payload index_payload_of(std::span<const std::byte> message,
                                                              const section_info& s) noexcept {
    return {s.indices, s.count, s.dense_size, s.index_bytes,
            message.data() + s.offset + wire::section_header_bytes};
  }

  // The payloads of chunked section `s` of `message`.
  [[nodiscard]] static detail::chunked_payload chunked_payload_of(
      std::span<const std::byte> message, const section_info& s) noexcept {
    detail::chunked_payload p;
    const std::byte* index = message.data() + s.offset + wire::section_header_bytes;
    p.indices = index + wire::chunked_prefix_bytes;
    p.dense_size = s.dense_size;
    p.chunk_bits = s.chunk_bits;
    p.k = s.chunk_k;
    p.code_bits = code_bits_of(s.values);
    p.shape = wire::chunked_shape_of(s.dense_size, s.chunk_bits, s.chunk_k, p.code_bits);
    p.scales = index + s.index_bytes;
    p.codes = p.scales + p.shape.scale_bytes;
    return p;
  }

  // Checks the chunk directories and plans the checks of every index payload.
  void plan_payload_checks(std::span<const std::byte> message) {
    checks_.clear();
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      if (sections_[i].indices == index_encoding::chunked_topk) {
        checks_.add_chunked(i, sections_[i].tensor, chunked_payload_of(message, sections_[i]));
      } else {
        checks_.add(i, sections_[i].tensor, index_payload_of(message, sections_[i]));
      }
    }
  }

  template <class I>
  void check_output(std::size_t i, std::size_t index_room, std::size_t value_room) const {
    if (i >= sections_.size()) {
      throw_error(errc::invalid_argument, "unpack: decode of section " + std::to_string(i) +
                                              ", the message has " +
                                              std::to_string(sections_.size()));
    }
    const auto& s = sections_[i];
    if (index_room < s.count || value_room < s.count) {
      fail_section(i, errc::invalid_argument,
                   "output holds " + std::to_string(std::min(index_room, value_room)) +
                       " pairs, the section has " + std::to_string(s.count));
    }
    if (s.dense_size > 0 && s.dense_size - 1 > std::numeric_limits<I>::max()) {
      fail_section(i, errc::out_of_range,
                   "indices of a tensor of " + std::to_string(s.dense_size) +
                       " elements do not fit " + std::to_string(8 * sizeof(I)) + "-bit indices");
    }
  }

  template <class V, class I, executor Executor>
  void decode_section(std::size_t i, I* indices, V* values, Executor& ex) {
    const auto& s = sections_[i];
    if (s.indices == index_encoding::chunked_topk) {
      const detail::chunked_payload cp = chunked_payload_of(message_, s);
      ex.bulk(static_cast<std::size_t>(wire::chunk_count(s.count)), [&](std::size_t t) {
        const std::uint64_t first = t * wire::chunk_elements;
        const std::uint64_t last = std::min(s.count, first + wire::chunk_elements);
        detail::decode_chunked_range(cp, first, last, indices + first, values + first);
      });
      return;
    }
    const detail::index_payload ip = index_payload_of(message_, s);
    const std::byte* p = ip.data;
    const std::byte* vp = p + s.index_bytes;
    const std::size_t vb = value_bytes(s.values);
    const std::uint64_t chunks = wire::chunk_count(s.count);
    if (s.indices == index_encoding::random_k && s.count > 0) {
      reserve_random_k(s.dense_size);
      sample_sorted_indices<I>(s.random, s.dense_size, s.count,
                               std::span<I>(indices, static_cast<std::size_t>(s.count)),
                               workspace_.span());
    }
    std::uint64_t pieces = 0;
    if (s.indices == index_encoding::bitmap) {
      pieces = detail::bitmap_pieces(ip);
      counts_.assign(pieces + 1, 0);
      ex.bulk(pieces, [&](std::size_t t) {
        counts_[t + 1] = detail::popcount_bytes(p + t * detail::bitmap_piece_bytes,
                                                detail::bitmap_piece_size(ip, t));
      });
      for (std::uint64_t t = 0; t < pieces; ++t) counts_[t + 1] += counts_[t];
      if (counts_[pieces] != s.count)
        fail_section(i, errc::malformed_message, "the message changed after parse");
    }
    results_.assign(static_cast<std::size_t>(chunks), {});
    ex.bulk(static_cast<std::size_t>(chunks + pieces), [&](std::size_t t) {
      if (t >= chunks) {
        const std::uint64_t piece = t - chunks;
        const std::uint64_t first = piece * detail::bitmap_piece_bytes;
        detail::decode_bitmap_range(p, first, first + detail::bitmap_piece_size(ip, piece),
                                    indices + counts_[piece]);
        return;
      }
      const std::uint64_t begin = t * wire::chunk_elements;
      const std::uint64_t count = std::min(wire::chunk_elements, s.count - begin);
      if (!decode_index_chunk(ip, t, begin, count, indices + begin, results_[t].failure))
        results_[t].failed = true;
      detail::decode_values(vp + begin * vb, static_cast<std::size_t>(count), s.values,
                            values + begin);
    });
    for (std::size_t t = 0; t < chunks; ++t) {
      if (results_[t].failed)
        fail_section(i, errc::malformed_message,
                     "the message changed after parse: " + results_[t].failure.what);
    }
  }

  // Decodes indices [begin, begin + count) (chunk c) of a raw or delta payload to `out`.
  template <class I>
  static bool decode_index_chunk(const detail::index_payload& ip, std::uint64_t c,
                                 std::uint64_t begin, std::uint64_t count, I* out,
                                 detail::codec_failure& f) {
    const std::byte* const p = ip.data;
    switch (ip.encoding) {
      case index_encoding::raw_u16:
        detail::decode_raw<std::uint16_t>(p + 2 * begin, static_cast<std::size_t>(count), out);
        return true;
      case index_encoding::raw_u32:
        detail::decode_raw<std::uint32_t>(p + 4 * begin, static_cast<std::size_t>(count), out);
        return true;
      case index_encoding::raw_u64:
        detail::decode_raw<std::uint64_t>(p + 8 * begin, static_cast<std::size_t>(count), out);
        return true;
      case index_encoding::delta_bitpacked:
      case index_encoding::delta_varint: {
        const detail::delta_chunk_span span = detail::delta_chunk(ip, c);
        const std::byte* data = p + wire::directory_bytes(ip.count);
        const std::byte* q = data + span.first;
        std::uint64_t base = span.base;
        return ip.encoding == index_encoding::delta_bitpacked
                   ? detail::decode_bitpacked_chunk<I>(q, data + span.last, count, base, out, f)
                   : detail::decode_varint_chunk<I>(q, data + span.last, count, base, out, f);
      }
      case index_encoding::bitmap:
      case index_encoding::random_k:
      case index_encoding::chunked_topk:
      case index_encoding::automatic:
        return true;
    }
    return true;
  }

  unpack_options options_{};
  std::vector<entry> registry_;
  std::uint64_t generation_ = 0;
  std::vector<section_info> sections_;
  std::vector<control_info> controls_;
  message_info info_{};
  std::span<const std::byte> message_{};
  detail::index_payload_checks checks_;
  std::vector<detail::index_task_result> results_;  // of decode's chunks
  std::vector<std::uint64_t> counts_;               // bits before each piece of a bitmap
  aligned_buffer<std::uint64_t> workspace_;
};

}  // namespace stellatrain
