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
#include <stellatrain/pack/detail/crc32c_combine.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/detail/value_codec.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
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

namespace detail {

struct unpack_task {
  std::uint32_t section = 0;
  std::uint32_t kind = 0;  // 0 = chunk of elements, 1 = bitmap piece
  std::uint64_t piece = 0;
};

struct unpack_result {
  bool failed = false;
  codec_failure failure;
};

}  // namespace detail

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
      parse_header(message);
      try {
        parse_sections(message);
        plan_payload_checks(message);
      } catch (const error&) {
        check_checksum(detail::crc32c_parallel(body_of(message), ex), message);  // corruption first
        throw;
      }
      validate_payloads(message, ex);
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

  [[noreturn]] static void fail_message(errc code, const std::string& what) {
    throw_error(code, "unpack: " + what);
  }

  [[noreturn]] void fail_section(std::size_t i, errc code, const std::string& what) const {
    throw_error(code, "unpack: section " + std::to_string(i) + " (tensor " +
                          std::to_string(sections_[i].tensor) + "): " + what);
  }

  static std::string hex(std::uint64_t v) {
    char buf[24];
    std::snprintf(buf, sizeof buf, "0x%llx", static_cast<unsigned long long>(v));
    return buf;
  }

  // Everything before the checksum: the header's fields, and the size against the limit.
  void parse_header(std::span<const std::byte> message) {
    const std::uint64_t size = message.size();
    const std::byte* m = message.data();
    constexpr std::uint64_t minimum = wire::message_header_bytes + wire::message_trailer_bytes;
    if (size < minimum) {
      fail_message(errc::malformed_message,
                   "truncated: " + std::to_string(size) + " bytes, shorter than the " +
                       std::to_string(minimum) + " bytes of header and checksum");
    }
    if (size > options_.max_message_bytes) {
      fail_message(errc::resource_exhausted, "message of " + std::to_string(size) +
                                                 " bytes exceeds the limit of " +
                                                 std::to_string(options_.max_message_bytes));
    }
    if (std::memcmp(m, wire::magic.data(), 4) != 0) {
      fail_message(errc::malformed_message,
                   "bad magic " + hex(detail::load_le<std::uint32_t>(m)) +
                       " (expected the bytes \"STPK\"): not a stellatrain message");
    }
    const auto version = detail::load_le<std::uint16_t>(m + wire::offset_version);
    if (version != wire::version) {
      fail_message(errc::version_mismatch, "format version " + std::to_string(version) +
                                               ", this build reads version " +
                                               std::to_string(wire::version));
    }
    const auto flags = detail::load_le<std::uint16_t>(m + wire::offset_flags);
    if (flags != 0) fail_message(errc::unsupported, "unknown message flags " + hex(flags));
    const auto header_bytes = detail::load_le<std::uint32_t>(m + wire::offset_header_bytes);
    if (header_bytes != wire::message_header_bytes) {
      fail_message(errc::malformed_message, "header size " + std::to_string(header_bytes) +
                                                ", version " + std::to_string(wire::version) +
                                                " has " +
                                                std::to_string(wire::message_header_bytes));
    }
    const auto stated = detail::load_le<std::uint64_t>(m + wire::offset_message_bytes);
    if (stated > size) {
      fail_message(errc::malformed_message, "truncated: the header says " + std::to_string(stated) +
                                                " bytes, " + std::to_string(size) + " arrived");
    }
    if (stated < size) {
      fail_message(errc::malformed_message, "oversized: " + std::to_string(size) +
                                                " bytes arrived, the header says " +
                                                std::to_string(stated));
    }
    info_.tag = detail::load_le<std::uint64_t>(m + wire::offset_tag);
    info_.bytes = size;
  }

  static std::span<const std::byte> body_of(std::span<const std::byte> message) noexcept {
    return message.first(message.size() - wire::message_trailer_bytes);
  }

  static void check_checksum(std::uint32_t computed, std::span<const std::byte> message) {
    const std::uint32_t stored =
        detail::load_le<std::uint32_t>(message.data() + body_of(message).size());
    if (stored != computed) {
      fail_message(errc::checksum_mismatch, "CRC-32C " + hex(computed) +
                                                " of the message does not match the stored " +
                                                hex(stored) + ": corrupted in transit");
    }
  }

  void parse_sections(std::span<const std::byte> message) {
    const std::byte* m = message.data();
    const std::uint64_t end = message.size() - wire::message_trailer_bytes;
    const std::uint64_t count = detail::load_le<std::uint32_t>(m + wire::offset_section_count);
    if (count > (end - wire::message_header_bytes) / wire::section_header_bytes) {
      fail_message(errc::malformed_message, std::to_string(count) + " sections cannot fit in " +
                                                std::to_string(message.size()) + " bytes");
    }
    if (count > registry_.size() + wire::max_control_sections) {
      fail_message(errc::invalid_argument,
                   std::to_string(count) + " sections, but only " +
                       std::to_string(registry_.size()) + " tensors are registered (and " +
                       std::to_string(wire::max_control_sections) + " control sections allowed)");
    }
    ++generation_;
    std::uint64_t offset = wire::message_header_bytes;
    for (std::uint64_t i = 0; i < count; ++i) {
      // Messages are built only on failure: the success path allocates nothing.
      auto at = [&] {
        return "section " + std::to_string(i) + " at byte " + std::to_string(offset);
      };
      if (end - offset < wire::section_header_bytes) {
        fail_message(errc::malformed_message, at() + ": header runs past the end of the message");
      }
      const std::byte* h = m + offset;
      section_info s;
      s.offset = offset;
      s.tensor = detail::load_le<std::uint32_t>(h + wire::offset_tensor);
      const auto ie = std::to_integer<std::uint8_t>(h[wire::offset_index_encoding]);
      const auto ve = std::to_integer<std::uint8_t>(h[wire::offset_value_encoding]);
      const auto kind = detail::load_le<std::uint16_t>(h + wire::offset_section_kind);
      s.dense_size = detail::load_le<std::uint64_t>(h + wire::offset_dense_size);
      s.count = detail::load_le<std::uint64_t>(h + wire::offset_count);
      s.index_bytes = detail::load_le<std::uint64_t>(h + wire::offset_index_bytes);
      s.value_bytes = detail::load_le<std::uint64_t>(h + wire::offset_value_bytes);
      if (kind == static_cast<std::uint16_t>(section_kind::control)) {
        offset += parse_control(s, ie, ve, h, end - offset, at);
        continue;
      }
      if (kind != static_cast<std::uint16_t>(section_kind::tensor)) {
        fail_message(errc::unsupported, at() + ": unknown section kind " + std::to_string(kind));
      }
      auto what = [&] { return at() + " (tensor " + std::to_string(s.tensor) + ")"; };

      const auto it =
          std::lower_bound(registry_.begin(), registry_.end(), s.tensor,
                           [](const entry& e, std::uint32_t key) { return e.id < key; });
      if (it == registry_.end() || it->id != s.tensor) {
        fail_message(errc::invalid_argument,
                     what() + ": tensor " + std::to_string(s.tensor) + " is not registered");
      }
      if (it->seen == generation_)
        fail_message(errc::malformed_message, what() + ": the tensor appears twice");
      it->seen = generation_;
      if (s.dense_size != it->size) {
        fail_message(errc::size_mismatch, what() + ": tensor size " + std::to_string(s.dense_size) +
                                              ", registered size " + std::to_string(it->size));
      }
      if (ie < 1 || ie > static_cast<std::uint8_t>(index_encoding::random_k)) {
        fail_message(errc::malformed_message,
                     what() + ": unknown index encoding " + std::to_string(ie));
      }
      if (ve < 1 || ve > static_cast<std::uint8_t>(value_encoding::bf16)) {
        fail_message(errc::malformed_message,
                     what() + ": unknown value encoding " + std::to_string(ve));
      }
      s.indices = static_cast<index_encoding>(ie);
      s.values = static_cast<value_encoding>(ve);
      if (s.count > s.dense_size) {
        fail_message(errc::malformed_message, what() + ": " + std::to_string(s.count) +
                                                  " pairs in a tensor of " +
                                                  std::to_string(s.dense_size) + " elements");
      }
      const std::uint64_t vb = value_bytes(s.values);
      if (s.value_bytes % vb != 0 || s.value_bytes / vb != s.count) {
        fail_message(errc::malformed_message, what() + ": value payload of " +
                                                  std::to_string(s.value_bytes) + " bytes for " +
                                                  std::to_string(s.count) + " " +
                                                  std::string(name_of(s.values)) + " values");
      }
      check_index_bytes(s, what);
      const std::uint64_t room = end - offset - wire::section_header_bytes;
      if (s.index_bytes > room || s.value_bytes > room - s.index_bytes) {
        fail_message(errc::malformed_message, what() + ": payloads of " +
                                                  std::to_string(s.index_bytes) + " + " +
                                                  std::to_string(s.value_bytes) +
                                                  " bytes run past the end of the message (" +
                                                  std::to_string(room) + " bytes left)");
      }
      if (s.indices == index_encoding::random_k) {
        const std::byte* p = h + wire::section_header_bytes;
        s.random.seed = detail::load_le<std::uint64_t>(p);
        s.random.step = detail::load_le<std::uint32_t>(p + 8);
        s.random.tensor = detail::load_le<std::uint32_t>(p + 12);
      }
      sections_.push_back(s);
      offset += wire::section_header_bytes + s.index_bytes + s.value_bytes;
    }
    if (offset != end) {
      fail_message(errc::malformed_message,
                   std::to_string(end - offset) + " unused bytes after the last section");
    }
  }

  // A control section whose header fields were read into `s` (its type in `s.tensor`, its
  // payload size in `s.index_bytes`); returns its size.
  template <class At>
  std::uint64_t parse_control(const section_info& s, std::uint8_t ie, std::uint8_t ve,
                              const std::byte* h, std::uint64_t left, const At& at) {
    auto what = [&] { return at() + " (control type " + std::to_string(s.tensor) + ")"; };
    if (ie != 0 || ve != 0 || s.dense_size != 0 || s.count != 0 || s.value_bytes != 0) {
      fail_message(errc::malformed_message,
                   what() + ": a control section has no encodings, size, count or values");
    }
    if (s.index_bytes > left - wire::section_header_bytes) {
      fail_message(errc::malformed_message,
                   what() + ": payload of " + std::to_string(s.index_bytes) +
                       " bytes runs past the end of the message (" +
                       std::to_string(left - wire::section_header_bytes) + " bytes left)");
    }
    for (const auto& c : controls_) {
      if (c.type == s.tensor)
        fail_message(errc::malformed_message, what() + ": the control type appears twice");
    }
    if (controls_.size() == wire::max_control_sections) {
      fail_message(errc::malformed_message, what() + ": more than " +
                                                std::to_string(wire::max_control_sections) +
                                                " control sections");
    }
    const auto bytes = static_cast<std::size_t>(s.index_bytes);
    controls_.push_back({s.tensor, {h + wire::section_header_bytes, bytes}, s.offset});
    return wire::section_header_bytes + s.index_bytes;
  }

  template <class What>
  static void check_index_bytes(const section_info& s, const What& what_fn) {
    auto what = [&] { return what_fn(); };
    const std::uint64_t k = s.count;
    const std::uint64_t n = s.dense_size;
    auto expect = [&](std::uint64_t width) {
      if (s.index_bytes % width != 0 || s.index_bytes / width != k) {
        fail_message(errc::malformed_message, what() + ": " + std::string(name_of(s.indices)) +
                                                  " payload of " + std::to_string(s.index_bytes) +
                                                  " bytes for " + std::to_string(k) + " indices");
      }
    };
    switch (s.indices) {
      case index_encoding::raw_u16:
        if (n > 65536)
          fail_message(errc::malformed_message, what() + ": raw_u16 indices for a tensor of " +
                                                    std::to_string(n) + " elements");
        expect(2);
        return;
      case index_encoding::raw_u32:
        if (n > (std::uint64_t{1} << 32)) {
          fail_message(errc::malformed_message, what() + ": raw_u32 indices for a tensor of " +
                                                    std::to_string(n) + " elements");
        }
        expect(4);
        return;
      case index_encoding::raw_u64:
        expect(8);
        return;
      case index_encoding::bitmap:
        if (s.index_bytes != wire::bitmap_bytes(n)) {
          fail_message(errc::malformed_message,
                       what() + ": bitmap of " + std::to_string(s.index_bytes) +
                           " bytes for a tensor of " + std::to_string(n) + " elements");
        }
        return;
      case index_encoding::random_k:
        if (s.index_bytes != wire::random_k_payload_bytes) {
          fail_message(
              errc::malformed_message,
              what() + ": random_k payload of " + std::to_string(s.index_bytes) + " bytes, not 16");
        }
        return;
      case index_encoding::delta_varint:
      case index_encoding::delta_bitpacked:
        // At least the directory and one byte (varint) or one block header per chunk.
        if (k == 0 ? s.index_bytes != 0
                   : s.index_bytes < wire::directory_bytes(k) + wire::chunk_count(k) ||
                         s.index_bytes - wire::directory_bytes(k) >
                             10 * k + wire::block_header_bytes * k) {
          fail_message(errc::malformed_message, what() + ": " + std::string(name_of(s.indices)) +
                                                    " payload of " + std::to_string(s.index_bytes) +
                                                    " bytes cannot hold " + std::to_string(k) +
                                                    " indices");
        }
        return;
      case index_encoding::automatic:
        return;
    }
  }

  [[nodiscard]] const std::byte* payload(std::span<const std::byte> message,
                                         const section_info& s) const noexcept {
    return message.data() + s.offset + wire::section_header_bytes;
  }

  // Chunk c of a delta section: its bytes [first, last) and starting index, from the directory
  // (checked by validate_directory).
  struct chunk_span {
    std::uint64_t first, last, base, next_base;
  };

  [[nodiscard]] static chunk_span delta_chunk(const std::byte* index_payload, const section_info& s,
                                              std::uint64_t c) noexcept {
    const std::uint64_t chunks = wire::chunk_count(s.count);
    const std::uint64_t dir = wire::directory_bytes(s.count);
    const std::uint64_t data = s.index_bytes - dir;
    auto entry_base = [&](std::uint64_t k) {
      return detail::load_le<std::uint64_t>(index_payload + (k - 1) * 16);
    };
    auto entry_offset = [&](std::uint64_t k) {
      return detail::load_le<std::uint64_t>(index_payload + (k - 1) * 16 + 8);
    };
    chunk_span r;
    r.first = c == 0 ? 0 : entry_offset(c);
    r.last = c + 1 < chunks ? entry_offset(c + 1) : data;
    r.base = c == 0 ? 0 : entry_base(c);
    r.next_base = c + 1 < chunks ? entry_base(c + 1) : s.dense_size;
    return r;
  }

  void validate_directory(std::size_t i, const std::byte* index_payload) const {
    const auto& s = sections_[i];
    const std::uint64_t chunks = wire::chunk_count(s.count);
    const std::uint64_t data = s.index_bytes - wire::directory_bytes(s.count);
    std::uint64_t prev_offset = 0;
    std::uint64_t prev_base = 0;
    for (std::uint64_t c = 1; c < chunks; ++c) {
      const std::uint64_t base = detail::load_le<std::uint64_t>(index_payload + (c - 1) * 16);
      const std::uint64_t off = detail::load_le<std::uint64_t>(index_payload + (c - 1) * 16 + 8);
      if (off <= prev_offset || off >= data) {
        fail_section(i, errc::malformed_message,
                     "directory entry " + std::to_string(c) + ": chunk offset " +
                         std::to_string(off) + " not between " + std::to_string(prev_offset) +
                         " and " + std::to_string(data) + " (exclusive)");
      }
      if (base - prev_base < wire::chunk_elements || base < prev_base || base > s.dense_size) {
        fail_section(i, errc::malformed_message,
                     "directory entry " + std::to_string(c) + ": chunk base index " +
                         std::to_string(base) + " after " + std::to_string(prev_base) +
                         " is impossible in a tensor of " + std::to_string(s.dense_size));
      }
      prev_offset = off;
      prev_base = base;
    }
  }

  // Checks the chunk directories and lists the payload checks (tasks_).
  void plan_payload_checks(std::span<const std::byte> message) {
    tasks_.clear();
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      const auto& s = sections_[i];
      switch (s.indices) {
        case index_encoding::delta_bitpacked:
        case index_encoding::delta_varint:
          validate_directory(i, payload(message, s));
          [[fallthrough]];
        case index_encoding::raw_u16:
        case index_encoding::raw_u32:
        case index_encoding::raw_u64:
          for (std::uint64_t c = 0; c < wire::chunk_count(s.count); ++c) {
            tasks_.push_back({static_cast<std::uint32_t>(i), 0, c});
          }
          break;
        case index_encoding::bitmap:
          for (std::uint64_t p = 0; p < bitmap_pieces(s); ++p)
            tasks_.push_back({static_cast<std::uint32_t>(i), 1, p});
          break;
        case index_encoding::random_k:
        case index_encoding::automatic:
          break;
      }
    }
  }

  // Runs the payload checks and the checksum.
  template <executor Executor>
  void validate_payloads(std::span<const std::byte> message, Executor& ex) {
    results_.assign(tasks_.size(), {});
    counts_.assign(tasks_.size(), 0);
    // The checksum's pieces run in the same hand-off as the checks (first: they are the
    // largest tasks); the checksum is compared before any check's result is looked at, so that
    // a corrupted message is reported as such.
    const auto body = body_of(message);
    const detail::crc32c_split split(body.size(), ex.concurrency());
    crcs_.resize(split.pieces);
    ex.bulk(split.pieces + tasks_.size(), [&](std::size_t t) {
      if (t < split.pieces) {
        crcs_[t] = detail::crc32c_piece::of(split.piece(body, t));
        return;
      }
      t -= split.pieces;
      const auto& job = tasks_[t];
      const auto& s = sections_[job.section];
      const std::byte* p = payload(message, s);
      if (job.kind == 1) {
        counts_[t] =
            detail::popcount_bytes(p + job.piece * piece_bytes, bitmap_piece_size(s, job.piece));
        return;
      }
      if (!validate_chunk(s, p, job.piece, results_[t].failure)) results_[t].failed = true;
    });
    check_checksum(detail::crc32c_join(crcs_), message);
    std::uint64_t bits = 0;
    for (std::size_t t = 0; t < tasks_.size(); ++t) {
      const auto& job = tasks_[t];
      if (results_[t].failed)
        fail_section(job.section, results_[t].failure.code, results_[t].failure.what);
      if (job.kind == 1) {
        bits += counts_[t];
        const auto& s = sections_[job.section];
        if (job.piece + 1 == bitmap_pieces(s)) {
          check_bitmap(job.section, payload(message, s), bits);
          bits = 0;
        }
      }
    }
  }

  static constexpr std::uint64_t piece_bytes = std::uint64_t{1} << 16;

  [[nodiscard]] static std::uint64_t bitmap_pieces(const section_info& s) noexcept {
    return (s.index_bytes + piece_bytes - 1) / piece_bytes;
  }
  [[nodiscard]] static std::size_t bitmap_piece_size(const section_info& s,
                                                     std::uint64_t piece) noexcept {
    return static_cast<std::size_t>(std::min(piece_bytes, s.index_bytes - piece * piece_bytes));
  }

  void check_bitmap(std::size_t i, const std::byte* bitmap, std::uint64_t bits) const {
    const auto& s = sections_[i];
    if (s.dense_size % 8 != 0) {
      const auto last = std::to_integer<unsigned>(bitmap[s.index_bytes - 1]);
      if ((last >> (s.dense_size % 8)) != 0) {
        fail_section(i, errc::out_of_range,
                     "bitmap bits set past the tensor size " + std::to_string(s.dense_size));
      }
    }
    if (bits != s.count) {
      fail_section(i, errc::malformed_message,
                   "bitmap holds " + std::to_string(bits) + " indices, the header says " +
                       std::to_string(s.count));
    }
  }

  // Validates chunk c of a raw or delta section.
  static bool validate_chunk(const section_info& s, const std::byte* p, std::uint64_t c,
                             detail::codec_failure& f) {
    const std::uint64_t begin = c * wire::chunk_elements;
    const std::uint64_t count = std::min(wire::chunk_elements, s.count - begin);
    auto raw = [&](auto width) {
      using W = decltype(width);
      const std::uint64_t base =
          begin == 0
              ? 0
              : static_cast<std::uint64_t>(detail::load_le<W>(p + (begin - 1) * sizeof(W))) + 1;
      const std::uint64_t bad = detail::check_raw<W>(
          p + begin * sizeof(W), static_cast<std::size_t>(count), base, s.dense_size);
      if (bad == detail::no_position) return true;
      const std::uint64_t j = begin + bad;
      const std::uint64_t x = detail::load_le<W>(p + j * sizeof(W));
      if (x >= s.dense_size) {
        return detail::fail(f, errc::out_of_range,
                            "index " + std::to_string(x) + " at position " + std::to_string(j) +
                                " is not below the tensor size " + std::to_string(s.dense_size));
      }
      return detail::fail(f, errc::malformed_message,
                          "indices not strictly ascending at position " + std::to_string(j) + " (" +
                              std::to_string(detail::load_le<W>(p + (j - 1) * sizeof(W))) +
                              " then " + std::to_string(x) + ")");
    };
    switch (s.indices) {
      case index_encoding::raw_u16:
        return raw(std::uint16_t{});
      case index_encoding::raw_u32:
        return raw(std::uint32_t{});
      case index_encoding::raw_u64:
        return raw(std::uint64_t{});
      case index_encoding::delta_bitpacked:
      case index_encoding::delta_varint: {
        const chunk_span span = delta_chunk(p, s, c);
        const std::byte* data = p + wire::directory_bytes(s.count);
        const std::byte* q = data + span.first;
        const std::byte* end = data + span.last;
        std::uint64_t base = span.base;
        detail::codec_failure inner;
        const bool ok =
            s.indices == index_encoding::delta_bitpacked
                ? detail::decode_bitpacked_chunk<void>(q, end, count, base, nullptr, inner)
                : detail::decode_varint_chunk<void>(q, end, count, base, nullptr, inner);
        auto chunk = [&] { return "chunk " + std::to_string(c) + ": "; };
        if (!ok) return detail::fail(f, inner.code, chunk() + inner.what);
        if (q != end) {
          return detail::fail(
              f, errc::malformed_message,
              chunk() + std::to_string(end - q) + " bytes left after its last index");
        }
        const bool last_chunk = begin + count == s.count;
        if (last_chunk && base > s.dense_size) {
          return detail::fail(f, errc::out_of_range,
                              chunk() + "index " + std::to_string(base - 1) +
                                  " is not below the tensor size " + std::to_string(s.dense_size));
        }
        if (!last_chunk && base != span.next_base) {
          return detail::fail(f, errc::malformed_message,
                              chunk() + "ends at index " + std::to_string(base - 1) +
                                  ", but the directory starts the next chunk at " +
                                  std::to_string(span.next_base));
        }
        return true;
      }
      case index_encoding::bitmap:
      case index_encoding::random_k:
      case index_encoding::automatic:
        return true;
    }
    return true;
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
    const std::byte* p = payload(message_, s);
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
      pieces = bitmap_pieces(s);
      counts_.assign(pieces + 1, 0);
      ex.bulk(pieces, [&](std::size_t t) {
        counts_[t + 1] = detail::popcount_bytes(p + t * piece_bytes, bitmap_piece_size(s, t));
      });
      for (std::uint64_t t = 0; t < pieces; ++t) counts_[t + 1] += counts_[t];
      if (counts_[pieces] != s.count)
        fail_section(i, errc::malformed_message, "the message changed after parse");
    }
    results_.assign(static_cast<std::size_t>(chunks), {});
    ex.bulk(static_cast<std::size_t>(chunks + pieces), [&](std::size_t t) {
      if (t >= chunks) {
        const std::uint64_t piece = t - chunks;
        detail::decode_bitmap_range(p, piece * piece_bytes,
                                    piece * piece_bytes + bitmap_piece_size(s, piece),
                                    indices + counts_[piece]);
        return;
      }
      const std::uint64_t begin = t * wire::chunk_elements;
      const std::uint64_t count = std::min(wire::chunk_elements, s.count - begin);
      if (!decode_index_chunk(s, p, t, begin, count, indices + begin, results_[t].failure))
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

  template <class I>
  static bool decode_index_chunk(const section_info& s, const std::byte* p, std::uint64_t c,
                                 std::uint64_t begin, std::uint64_t count, I* out,
                                 detail::codec_failure& f) {
    switch (s.indices) {
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
        const chunk_span span = delta_chunk(p, s, c);
        const std::byte* data = p + wire::directory_bytes(s.count);
        const std::byte* q = data + span.first;
        std::uint64_t base = span.base;
        return s.indices == index_encoding::delta_bitpacked
                   ? detail::decode_bitpacked_chunk<I>(q, data + span.last, count, base, out, f)
                   : detail::decode_varint_chunk<I>(q, data + span.last, count, base, out, f);
      }
      case index_encoding::bitmap:
      case index_encoding::random_k:
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
  std::vector<detail::unpack_task> tasks_;
  std::vector<detail::unpack_result> results_;
  std::vector<detail::crc32c_piece> crcs_;
  std::vector<std::uint64_t> counts_;
  aligned_buffer<std::uint64_t> workspace_;
};

}  // namespace stellatrain
