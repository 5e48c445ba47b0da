// SPDX-License-Identifier: Apache-2.0
// Packs the sparse selections of many tensors into one self-describing, checksummed wire
// message (docs/wire-format.md), choosing each section's index encoding by size.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/pack/detail/chunked_payload.hpp>
#include <stellatrain/pack/detail/crc32c_combine.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/detail/packer_tables.hpp>
#include <stellatrain/pack/detail/value_codec.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace stellatrain {

/// How one section is packed.
struct section_options {
  /// Index encoding; `automatic` picks the one with the fewest bytes for this section.
  index_encoding indices = index_encoding::automatic;
  /// Value encoding; values are rounded to nearest even when it is narrower than their type.
  value_encoding values = value_encoding::fp32;
};

/// Builds wire messages: one section per tensor, each with its own index and value encoding,
/// optionally control sections (typed payloads that are not tensors, `add_control`), then a
/// CRC-32C over the whole message. docs/wire-format.md describes the bytes.
///
/// Use: `clear(tag)`, `add(...)` once per tensor, then `prepare(ex)` (encodes the indices,
/// checks the input, returns the exact message size) and `write(out, ex)`; or `pack(out, ex)`
/// for both. The added views and control payloads must stay valid and unchanged until `write`
/// returns.
///
/// Checks (throwing `stellatrain::error` before anything is written to `out`): indices ascend
/// strictly and lie below the tensor size (`invalid_argument` / `out_of_range`, naming the
/// section, tensor and position), a tensor appears once per message, a forced encoding can
/// hold the tensor (raw_u16 needs at most 65536 elements, raw_u32 at most 2^32).
///
/// Cost: linear in the indices and values, in cache-sized chunks of 16384 elements spread over
/// `ex`; each chunk's task also checksums the bytes it wrote while they are in cache, and the
/// pieces are joined in order (two hand-offs to `ex` per message: `prepare` and `write`).
/// Memory: the packer keeps its tables and an encoding scratch between messages, so once warm
/// (a message as large as any before) it allocates nothing. One packer is used by one thread
/// at a time.
///
/// \code
///   stellatrain::message_packer packer;
///   packer.clear(/*tag=*/step);
///   packer.add(/*tensor=*/0, selection.view(), {.values = stellatrain::value_encoding::bf16});
///   packer.add(/*tensor=*/1, other.view());
///   std::vector<std::byte> wire(packer.prepare(pool));
///   packer.write(wire, pool);
/// \endcode
class message_packer {
 public:
  message_packer() = default;

  /// Starts a new message carrying `tag` (any 64-bit value, for example the step); the
  /// sections added before are forgotten, the memory is kept.
  void clear(std::uint64_t tag = 0) noexcept {
    tag_ = tag;
    sections_.clear();
    controls_.clear();
    chunks_.clear();
    prepared_ = false;
    message_bytes_ = 0;
  }

  /// Adds the selection of tensor `tensor` (indices strictly ascending, below
  /// `selection.dense_size()`).
  template <class V, class I>
  void add(std::uint32_t tensor, sparse_view<const V, const I> selection,
           section_options options = {}) {
    static_assert(value_type<V> && index_type<I>);
    detail::packer_section s;
    s.tensor = tensor;
    s.dense_size = selection.dense_size();
    s.count = selection.size();
    s.indices = selection.indices().data();
    s.wide = sizeof(I) == 8;
    s.values = selection.values().data();
    s.source = value_encoding_of<V>;
    s.wire_values = options.values;
    s.requested = options.indices;
    check_value_encoding(options.values);
    if (options.indices == index_encoding::random_k) {
      throw_error(errc::invalid_argument, "pack: tensor " + std::to_string(tensor) +
                                              ": random_k sections are added with add_random_k");
    }
    if (options.indices == index_encoding::chunked_topk) {
      throw_error(errc::invalid_argument, "pack: tensor " + std::to_string(tensor) +
                                              ": chunked sections are added with add_chunked");
    }
    if (static_cast<std::uint8_t>(options.indices) >
        static_cast<std::uint8_t>(index_encoding::chunked_topk)) {
      throw_error(errc::invalid_argument,
                  "pack: tensor " + std::to_string(tensor) + ": unknown index encoding " +
                      std::to_string(static_cast<unsigned>(options.indices)));
    }
    push(s);
  }

  /// Same for a view of mutable elements.
  template <class V, class I>
  requires(!std::is_const_v<V> && !std::is_const_v<I>) void add(std::uint32_t tensor,
                                                                sparse_view<V, I> selection,
                                                                section_options options = {}) {
    add(tensor, sparse_view<const V, const I>(selection), options);
  }

  /// Adds a random-k section: its indices are `sample_sorted_indices(key, dense_size,
  /// values.size())` (core/random_indices.hpp), which the receiver regenerates, so only the
  /// key and the values travel. `values[j]` belongs to the j-th of those indices.
  template <class V>
  void add_random_k(std::uint32_t tensor, random_key key, std::uint64_t dense_size,
                    std::span<const V> values, value_encoding encoding = value_encoding::fp32) {
    static_assert(value_type<V>);
    check_value_encoding(encoding);
    detail::packer_section s;
    s.tensor = tensor;
    s.dense_size = dense_size;
    s.count = values.size();
    s.values = values.data();
    s.source = value_encoding_of<V>;
    s.wire_values = encoding;
    s.requested = index_encoding::random_k;
    s.key = key;
    push(s);
  }

  /// Adds a chunked section (index encoding `chunked_topk`, values `chunk_sign` for 1-bit
  /// codes or `chunk_2bit` for 2-bit codes): the message is then written as format version 3.
  /// Throws `errc::invalid_argument` for parameters out of range (1 <= b <= 16, 1 <= k <= 2^b,
  /// code bits 1 or 2, a tensor of at most 2^56 elements), spans whose sizes do not match them,
  /// or a chunk whose indices do not ascend strictly; `errc::out_of_range` for an index not
  /// inside its chunk. The spans must stay valid and unchanged until `write` returns.
  void add_chunked(std::uint32_t tensor, const chunked_section& c) {
    if (const detail::chunked_fault f = detail::find_chunked_fault(c)) {
      throw_error(f.what == detail::chunked_fault::kind::range ? errc::out_of_range
                                                               : errc::invalid_argument,
                  "pack: tensor " + std::to_string(tensor) + ": chunked section: " + f.message);
    }
    const auto shape = wire::chunked_shape_of(c.dense_size, c.chunk_bits, c.k, c.code_bits);
    detail::packer_section s;
    s.tensor = tensor;
    s.dense_size = c.dense_size;
    s.count = shape.count;
    s.wire_values = c.code_bits == 2 ? value_encoding::chunk_2bit : value_encoding::chunk_sign;
    s.requested = index_encoding::chunked_topk;
    s.chunked = c;
    s.shape = shape;
    push(s);
  }

  /// Adds a control section of type `type` carrying `payload` (copied into the message as it
  /// is; its layout is the type's). The library's types are `control_type::*`; an application
  /// uses ids at or above `control_type::first_application`. A message holds at most
  /// `wire::max_control_sections`, each of another type; they follow the tensor sections.
  /// Throws `errc::invalid_argument` for a repeated type or one too many.
  void add_control(std::uint32_t type, std::span<const std::byte> payload) {
    for (const auto& c : controls_) {
      if (c.type == type) {
        throw_error(errc::invalid_argument,
                    "pack: control type " + std::to_string(type) + " appears twice in one message");
      }
    }
    if (controls_.size() == wire::max_control_sections) {
      throw_error(errc::invalid_argument, "pack: more than " +
                                              std::to_string(wire::max_control_sections) +
                                              " control sections in one message");
    }
    prepared_ = false;
    controls_.push_back({type, payload, 0});
  }

  /// Tensor sections added since `clear`.
  [[nodiscard]] std::size_t section_count() const noexcept { return sections_.size(); }

  /// Control sections added since `clear`.
  [[nodiscard]] std::size_t control_count() const noexcept { return controls_.size(); }

  /// The index encoding of section `i` (in the order added), valid after `prepare`.
  [[nodiscard]] index_encoding chosen_encoding(std::size_t i) const noexcept {
    STELLATRAIN_ASSERT(prepared_ && i < sections_.size(), "chosen_encoding: prepare first");
    return sections_[i].chosen;
  }

  /// Bytes of the prepared message (0 before `prepare`).
  [[nodiscard]] std::size_t message_bytes() const noexcept {
    return static_cast<std::size_t>(message_bytes_);
  }

  /// Checks the sections, encodes their indices (in parallel on `ex`), picks the encodings and
  /// returns the exact size of the message in bytes.
  template <executor Executor>
  std::size_t prepare(Executor& ex) {
    prepared_ = false;
    check_sections();
    plan_chunks();
    run_chunk_checks(ex);
    choose_and_lay_out();
    prepared_ = true;
    return static_cast<std::size_t>(message_bytes_);
  }

  /// Writes the prepared message to the front of `out` (at least `message_bytes()` long) and
  /// returns that part of it.
  template <executor Executor>
  std::span<std::byte> write(std::span<std::byte> out, Executor& ex) {
    if (!prepared_) throw_error(errc::invalid_argument, "pack: write before prepare");
    if (out.size() < message_bytes_) {
      throw_error(errc::invalid_argument, "pack: output holds " + std::to_string(out.size()) +
                                              " bytes, the message needs " +
                                              std::to_string(message_bytes_));
    }
    std::byte* const m = out.data();
    write_headers(m);
    write_payloads(m, ex);
    detail::store_le<std::uint32_t>(m + message_bytes_ - wire::message_trailer_bytes,
                                    message_checksum(m));
    return out.first(static_cast<std::size_t>(message_bytes_));
  }

  /// `prepare` then `write`.
  template <executor Executor>
  std::span<std::byte> pack(std::span<std::byte> out, Executor& ex) {
    [[maybe_unused]] const auto awake = stay_awake(ex);  // two bulk calls follow
    prepare(ex);
    return write(out, ex);
  }

 private:
  static void check_value_encoding(value_encoding e) {
    if (e == value_encoding::chunk_sign || e == value_encoding::chunk_2bit) {
      throw_error(errc::invalid_argument, "pack: " + std::string(name_of(e)) +
                                              " values go in chunked sections (add_chunked)");
    }
    if (value_bytes(e) == 0) {
      throw_error(errc::invalid_argument,
                  "pack: unknown value encoding " + std::to_string(static_cast<unsigned>(e)));
    }
  }

  void push(const detail::packer_section& s) {
    prepared_ = false;
    sections_.push_back(s);
  }

  std::string where(std::size_t i) const {
    return "pack: section " + std::to_string(i) + " (tensor " +
           std::to_string(sections_[i].tensor) + ")";
  }

  void check_sections() {
    if (sections_.size() + controls_.size() > std::numeric_limits<std::uint32_t>::max()) {
      throw_error(errc::invalid_argument, "pack: more than 2^32 - 1 sections in one message");
    }
    ids_.clear();
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      const auto& s = sections_[i];
      if (s.count > s.dense_size) {
        throw_error(errc::invalid_argument, where(i) + ": " + std::to_string(s.count) +
                                                " pairs exceed the tensor size " +
                                                std::to_string(s.dense_size));
      }
      if (s.requested == index_encoding::raw_u16 && s.dense_size > 65536) {
        throw_error(errc::invalid_argument,
                    where(i) + ": raw_u16 holds tensors of up to 65536 elements, not " +
                        std::to_string(s.dense_size));
      }
      if (s.requested == index_encoding::raw_u32 && s.dense_size > (std::uint64_t{1} << 32)) {
        throw_error(errc::invalid_argument,
                    where(i) + ": raw_u32 holds tensors of up to 2^32 elements, not " +
                        std::to_string(s.dense_size));
      }
      ids_.push_back(s.tensor);
    }
    std::sort(ids_.begin(), ids_.end());
    const auto dup = std::adjacent_find(ids_.begin(), ids_.end());
    if (dup != ids_.end()) {
      throw_error(errc::invalid_argument,
                  "pack: tensor " + std::to_string(*dup) + " appears twice in one message");
    }
  }

  [[nodiscard]] static bool encodes_bitpacked(const detail::packer_section& s) noexcept {
    return s.requested == index_encoding::automatic ||
           s.requested == index_encoding::delta_bitpacked;
  }

  // Cuts every section with indices into chunks and reserves encoding scratch.
  void plan_chunks() {
    chunks_.clear();
    std::uint64_t scratch = 0;
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      auto& s = sections_[i];
      s.first_chunk = chunks_.size();
      s.chunks =
          s.requested == index_encoding::random_k || is_chunked(s) ? 0 : wire::chunk_count(s.count);
      s.scratch_offset = scratch;
      for (std::uint64_t c = 0; c < s.chunks; ++c) {
        detail::packer_chunk ch;
        ch.section = i;
        ch.begin = c * wire::chunk_elements;
        ch.count = std::min(wire::chunk_elements, s.count - ch.begin);
        chunks_.push_back(ch);
      }
      if (encodes_bitpacked(s)) scratch += s.chunks * chunk_stride(s);
    }
    if (scratch > scratch_.size()) {
      scratch_ = aligned_buffer<std::byte>(static_cast<std::size_t>(scratch));
    }
  }

  [[nodiscard]] static std::uint64_t chunk_stride(const detail::packer_section& s) noexcept {
    return s.wide ? detail::bitpacked_chunk_bound<std::uint64_t>(wire::chunk_elements)
                  : detail::bitpacked_chunk_bound<std::uint32_t>(wire::chunk_elements);
  }

  // Per chunk, in parallel: check order and range; encode delta_bitpacked into the scratch
  // (automatic or requested) and measure the varint size.
  template <executor Executor>
  void run_chunk_checks(Executor& ex) {
    ex.bulk(chunks_.size(), [&](std::size_t k) {
      auto& ch = chunks_[k];
      const auto& s = sections_[ch.section];
      detail::with_indices(s, [&](const auto* idx) {
        const auto* first = idx + ch.begin;
        const std::uint64_t base =
            ch.begin == 0 ? 0 : static_cast<std::uint64_t>(idx[ch.begin - 1]) + 1;
        ch.out_of_range = static_cast<std::uint64_t>(first[ch.count - 1]) >= s.dense_size;
        if (encodes_bitpacked(s)) {
          const std::uint64_t c = k - s.first_chunk;
          auto r = detail::encode_bitpacked_chunk(
              first, static_cast<std::size_t>(ch.count), base,
              scratch_.data() + s.scratch_offset + c * chunk_stride(s));
          ch.bitpacked_bytes = r.bytes;
          ch.varint_bytes = r.varint_bytes;
          ch.bad = r.bad_position;
        } else if (s.requested == index_encoding::delta_varint) {
          std::uint64_t bytes = 0;
          std::uint64_t expect = base;
          for (std::uint64_t j = 0; j < ch.count; ++j) {
            const std::uint64_t x = first[j];
            if (x < expect || (expect == 0 && j > 0)) {
              ch.bad = j;
              break;
            }
            bytes += detail::varint_bytes(x - expect);
            expect = x + 1;
          }
          ch.varint_bytes = bytes;
        } else {
          ch.bad = detail::first_not_ascending(first, static_cast<std::size_t>(ch.count), base);
        }
      });
    });
  }

  void choose_and_lay_out() {
    std::uint64_t offset = wire::message_header_bytes;
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      auto& s = sections_[i];
      std::uint64_t bitpacked = wire::directory_bytes(s.count);
      std::uint64_t varint = bitpacked;
      for (std::uint64_t c = 0; c < s.chunks; ++c) {
        const auto& ch = chunks_[s.first_chunk + c];
        if (ch.bad != detail::no_position) report_disorder(i, ch.begin + ch.bad);
        if (ch.out_of_range) report_range(i, ch.begin + ch.count - 1);
        bitpacked += ch.bitpacked_bytes;
        varint += ch.varint_bytes;
      }
      const std::uint64_t n = s.dense_size;
      const std::uint64_t k = s.count;
      s.chosen = s.requested;
      if (s.requested == index_encoding::automatic) {
        // Fewest bytes; on a tie the earlier entry (the faster decoder) wins.
        struct candidate {
          index_encoding e;
          std::uint64_t bytes;
          bool ok;
        };
        const candidate options[] = {
            {index_encoding::raw_u16, 2 * k, n <= 65536},
            {index_encoding::raw_u32, 4 * k, n <= (std::uint64_t{1} << 32)},
            {index_encoding::bitmap, wire::bitmap_bytes(n), true},
            {index_encoding::delta_bitpacked, bitpacked, true},
            {index_encoding::delta_varint, varint, true},
            {index_encoding::raw_u64, 8 * k, true},
        };
        std::uint64_t best = std::numeric_limits<std::uint64_t>::max();
        for (const auto& o : options) {
          if (o.ok && o.bytes < best) {
            best = o.bytes;
            s.chosen = o.e;
          }
        }
      }
      switch (s.chosen) {
        case index_encoding::raw_u16:
          s.index_bytes = 2 * k;
          break;
        case index_encoding::raw_u32:
          s.index_bytes = 4 * k;
          break;
        case index_encoding::raw_u64:
          s.index_bytes = 8 * k;
          break;
        case index_encoding::bitmap:
          s.index_bytes = wire::bitmap_bytes(n);
          break;
        case index_encoding::delta_bitpacked:
          s.index_bytes = bitpacked;
          break;
        case index_encoding::delta_varint:
          s.index_bytes = varint;
          break;
        case index_encoding::random_k:
          s.index_bytes = wire::random_k_payload_bytes;
          break;
        case index_encoding::chunked_topk:
          s.index_bytes = s.shape.index_bytes;
          break;
        case index_encoding::automatic:
          break;
      }
      s.value_bytes = is_chunked(s) ? s.shape.value_bytes : k * value_bytes(s.wire_values);
      // Offsets of the chunks after the directory.
      std::uint64_t data = 0;
      for (std::uint64_t c = 0; c < s.chunks; ++c) {
        auto& ch = chunks_[s.first_chunk + c];
        ch.data_offset = data;
        data += s.chosen == index_encoding::delta_bitpacked ? ch.bitpacked_bytes : ch.varint_bytes;
      }
      s.offset = offset;
      offset += wire::section_header_bytes + s.index_bytes + s.value_bytes;
    }
    for (auto& c : controls_) {
      c.offset = offset;
      offset += wire::section_header_bytes + c.payload.size();
    }
    message_bytes_ = offset + wire::message_trailer_bytes;
  }

  [[noreturn]] void report_disorder(std::size_t i, std::uint64_t j) const {
    std::string what =
        where(i) + ": indices not strictly ascending at position " + std::to_string(j);
    detail::with_indices(sections_[i], [&](const auto* idx) {
      what += " (" + std::to_string(idx[j - 1]) + " then " + std::to_string(idx[j]) + ")";
    });
    throw_error(errc::invalid_argument, what);
  }

  [[noreturn]] void report_range(std::size_t i, std::uint64_t last_of_chunk) const {
    const auto& s = sections_[i];
    // The chunk ascends strictly, so its first index not below the size is the one to name.
    std::uint64_t j = last_of_chunk;
    detail::with_indices(s, [&](const auto* idx) {
      while (j > 0 && static_cast<std::uint64_t>(idx[j - 1]) >= s.dense_size) --j;
      throw_error(errc::out_of_range, where(i) + ": index " + std::to_string(idx[j]) +
                                          " at position " + std::to_string(j) +
                                          " is not below the tensor size " +
                                          std::to_string(s.dense_size));
    });
    throw_error(errc::out_of_range, where(i));
  }

  void write_headers(std::byte* m) const {
    using detail::store_le;
    std::memcpy(m, wire::magic.data(), 4);
    // Version 2 unless a chunked section needs 3, so that a reader of version 2 reads it.
    const bool chunked = std::any_of(sections_.begin(), sections_.end(), is_chunked);
    store_le<std::uint16_t>(m + wire::offset_version,
                            chunked ? wire::version : wire::oldest_version);
    store_le<std::uint16_t>(m + wire::offset_flags, 0);
    store_le<std::uint32_t>(m + wire::offset_section_count,
                            static_cast<std::uint32_t>(sections_.size() + controls_.size()));
    store_le<std::uint32_t>(m + wire::offset_header_bytes,
                            static_cast<std::uint32_t>(wire::message_header_bytes));
    store_le<std::uint64_t>(m + wire::offset_message_bytes, message_bytes_);
    store_le<std::uint64_t>(m + wire::offset_tag, tag_);
    for (const auto& s : sections_) {
      std::byte* h = m + s.offset;
      store_le<std::uint32_t>(h + wire::offset_tensor, s.tensor);
      h[wire::offset_index_encoding] = static_cast<std::byte>(s.chosen);
      h[wire::offset_value_encoding] = static_cast<std::byte>(s.wire_values);
      store_le<std::uint16_t>(h + wire::offset_section_kind,
                              static_cast<std::uint16_t>(section_kind::tensor));
      store_le<std::uint64_t>(h + wire::offset_dense_size, s.dense_size);
      store_le<std::uint64_t>(h + wire::offset_count, s.count);
      store_le<std::uint64_t>(h + wire::offset_index_bytes, s.index_bytes);
      store_le<std::uint64_t>(h + wire::offset_value_bytes, s.value_bytes);
      std::byte* payload = h + wire::section_header_bytes;
      if (s.chosen == index_encoding::random_k) {
        store_le<std::uint64_t>(payload, s.key.seed);
        store_le<std::uint32_t>(payload + 8, s.key.step);
        store_le<std::uint32_t>(payload + 12, s.key.tensor);
      } else if (s.chosen == index_encoding::delta_bitpacked ||
                 s.chosen == index_encoding::delta_varint) {
        detail::with_indices(s, [&](const auto* idx) {
          for (std::uint64_t c = 1; c < s.chunks; ++c) {
            const auto& ch = chunks_[s.first_chunk + c];
            std::byte* e = payload + (c - 1) * wire::directory_entry_bytes;
            store_le<std::uint64_t>(e, static_cast<std::uint64_t>(idx[ch.begin - 1]) + 1);
            store_le<std::uint64_t>(e + 8, ch.data_offset);
          }
        });
      }
    }
    for (const auto& c : controls_) {
      // Type, kind and the payload's size; the tensor fields are zero.
      std::byte* h = m + c.offset;
      std::memset(h, 0, wire::section_header_bytes);
      store_le<std::uint32_t>(h + wire::offset_tensor, c.type);
      store_le<std::uint16_t>(h + wire::offset_section_kind,
                              static_cast<std::uint16_t>(section_kind::control));
      store_le<std::uint64_t>(h + wire::offset_index_bytes, c.payload.size());
      if (!c.payload.empty())
        std::memcpy(h + wire::section_header_bytes, c.payload.data(), c.payload.size());
    }
  }

  // Index and value payloads, one task per chunk (its indices, then its values, then the
  // checksums of both, while the chunk is in cache) plus one task per 64 KiB of every bitmap.
  template <executor Executor>
  void write_payloads(std::byte* m, Executor& ex) {
    tasks_.clear();
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      const auto& s = sections_[i];
      if (is_chunked(s)) {  // both payloads in one task
        tasks_.push_back({i, 0, true});
        continue;
      }
      const std::uint64_t value_chunks = wire::chunk_count(s.count);
      for (std::uint64_t c = 0; c < value_chunks; ++c) tasks_.push_back({i, c, false});
      if (s.chosen == index_encoding::bitmap) {
        const std::uint64_t pieces =
            (wire::bitmap_bytes(s.dense_size) + detail::bitmap_piece_bytes - 1) /
            detail::bitmap_piece_bytes;
        for (std::uint64_t p = 0; p < pieces; ++p) tasks_.push_back({i, p, true});
      }
    }
    task_crcs_.resize(tasks_.size());
    ex.bulk(tasks_.size(), [&](std::size_t t) {
      const task& job = tasks_[t];
      const auto& s = sections_[job.section];
      std::byte* const payload = m + s.offset + wire::section_header_bytes;
      if (is_chunked(s)) {
        detail::write_chunked_payloads(s.chunked, s.shape, payload);
        task_crcs_[t] = {detail::crc32c_piece::of(
                             {payload, static_cast<std::size_t>(s.index_bytes + s.value_bytes)}),
                         {}};
        return;
      }
      if (job.bitmap) {
        task_crcs_[t] = {
            detail::crc32c_piece::of(detail::write_bitmap_piece(s, payload, job.piece)), {}};
        return;
      }
      const std::uint64_t begin = job.piece * wire::chunk_elements;
      const std::uint64_t count = std::min(wire::chunk_elements, s.count - begin);
      const auto indices = write_index_chunk(s, payload, job.piece, begin, count);
      const std::size_t vb = value_bytes(s.wire_values);
      std::byte* const values = payload + s.index_bytes + begin * vb;
      detail::with_values(s, [&](const auto* v) {
        detail::encode_values(v + begin, static_cast<std::size_t>(count), s.wire_values, values);
      });
      task_crcs_[t] = {detail::crc32c_piece::of(indices),
                       detail::crc32c_piece::of({values, static_cast<std::size_t>(count * vb)})};
    });
  }

  // The CRC-32C of the message body: the headers (message, section headers, chunk
  // directories) here, the payloads from the checksums their tasks took, appended in message
  // order (per section: its index pieces, then its value chunks).
  [[nodiscard]] std::uint32_t message_checksum(const std::byte* m) const {
    std::uint32_t crc = crc32c({m, wire::message_header_bytes});
    std::size_t t = 0;
    for (std::size_t i = 0; i < sections_.size(); ++i) {
      const auto& s = sections_[i];
      std::uint64_t fixed = 0;  // payload bytes the headers wrote
      if (s.chosen == index_encoding::random_k) fixed = wire::random_k_payload_bytes;
      if (s.chosen == index_encoding::delta_bitpacked || s.chosen == index_encoding::delta_varint) {
        fixed = wire::directory_bytes(s.count);
      }
      crc =
          crc32c({m + s.offset, static_cast<std::size_t>(wire::section_header_bytes + fixed)}, crc);
      const std::size_t chunk_tasks =
          is_chunked(s) ? 0 : static_cast<std::size_t>(wire::chunk_count(s.count));
      std::size_t end = t + chunk_tasks;
      while (end < tasks_.size() && tasks_[end].section == i) ++end;  // its bitmap pieces
      // Index pieces: one per chunk, or (empty for the chunks) the bitmap's pieces.
      for (std::size_t j = t; j < end; ++j) crc = task_crcs_[j].first.after(crc);
      for (std::size_t j = t; j < t + chunk_tasks; ++j) crc = task_crcs_[j].second.after(crc);
      t = end;
    }
    for (const auto& c : controls_) {
      crc = crc32c({m + c.offset, wire::section_header_bytes + c.payload.size()}, crc);
    }
    return crc;
  }

  // Writes the index bytes of chunk c and returns them (empty for bitmap and random_k sections).
  std::span<const std::byte> write_index_chunk(const detail::packer_section& s, std::byte* payload,
                                               std::uint64_t c, std::uint64_t begin,
                                               std::uint64_t count) const {
    const auto raw = [&](auto width) {
      using W = decltype(width);
      std::byte* const at = payload + sizeof(W) * begin;
      detail::with_indices(s, [&](const auto* idx) {
        using I = std::remove_cv_t<std::remove_reference_t<decltype(*idx)>>;
        detail::encode_raw<I, W>(idx + begin, static_cast<std::size_t>(count), at);
      });
      return std::span<const std::byte>(at, static_cast<std::size_t>(sizeof(W) * count));
    };
    switch (s.chosen) {
      case index_encoding::delta_bitpacked:
      case index_encoding::delta_varint: {
        const auto& ch = chunks_[s.first_chunk + c];
        std::byte* const at = payload + wire::directory_bytes(s.count) + ch.data_offset;
        std::uint64_t bytes = ch.bitpacked_bytes;
        if (s.chosen == index_encoding::delta_bitpacked) {
          std::memcpy(at, scratch_.data() + s.scratch_offset + c * chunk_stride(s),
                      static_cast<std::size_t>(bytes));
        } else {
          bytes = ch.varint_bytes;
          detail::with_indices(s, [&](const auto* idx) {
            const std::uint64_t base =
                begin == 0 ? 0 : static_cast<std::uint64_t>(idx[begin - 1]) + 1;
            detail::encode_varint_chunk(idx + begin, static_cast<std::size_t>(count), base, at);
          });
        }
        return {at, static_cast<std::size_t>(bytes)};
      }
      case index_encoding::raw_u16:
        return raw(std::uint16_t{});
      case index_encoding::raw_u32:
        return raw(std::uint32_t{});
      case index_encoding::raw_u64:
        return raw(std::uint64_t{});
      case index_encoding::bitmap:
      case index_encoding::random_k:
      case index_encoding::chunked_topk:
      case index_encoding::automatic:
        break;
    }
    return {};
  }

  [[nodiscard]] static bool is_chunked(const detail::packer_section& s) noexcept {
    return s.requested == index_encoding::chunked_topk;
  }

  struct task {
    std::size_t section;
    std::uint64_t piece;
    bool bitmap;  // a piece of a bitmap, or a chunked section's payloads, written whole
  };

  std::uint64_t tag_ = 0;
  bool prepared_ = false;
  std::uint64_t message_bytes_ = 0;
  std::vector<detail::packer_section> sections_;
  std::vector<detail::packer_control> controls_;
  std::vector<detail::packer_chunk> chunks_;
  std::vector<std::uint32_t> ids_;
  std::vector<task> tasks_;
  std::vector<std::pair<detail::crc32c_piece, detail::crc32c_piece>> task_crcs_;  // index, values
  aligned_buffer<std::byte> scratch_;
};

}  // namespace stellatrain
