// SPDX-License-Identifier: Apache-2.0
// The checks of every index payload of a received message (docs/wire-format.md, "What a
// reader checks", 5): each payload is decoded without storing it, chunk by chunk or bitmap
// piece by piece, in one hand-off to the executor together with the message's checksum.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/pack/detail/chunked_payload.hpp>
#include <stellatrain/pack/detail/crc32c_combine.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/detail/index_payload.hpp>
#include <stellatrain/pack/detail/message_header_check.hpp>
#include <stellatrain/pack/detail/unpack_error.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace stellatrain::detail {

/// Checks the chunk directory of a delta payload: offsets ascending inside the payload, bases
/// at least a chunk apart and within the tensor.
[[nodiscard]] inline bool check_chunk_directory(const index_payload& p, codec_failure& f) {
  const std::uint64_t chunks = wire::chunk_count(p.count);
  const std::uint64_t data = p.bytes - wire::directory_bytes(p.count);
  std::uint64_t prev_offset = 0;
  std::uint64_t prev_base = 0;
  for (std::uint64_t c = 1; c < chunks; ++c) {
    const std::uint64_t base = load_le<std::uint64_t>(p.data + (c - 1) * 16);
    const std::uint64_t off = load_le<std::uint64_t>(p.data + (c - 1) * 16 + 8);
    if (off <= prev_offset || off >= data) {
      return fail(f, errc::malformed_message,
                  "directory entry " + std::to_string(c) + ": chunk offset " + std::to_string(off) +
                      " not between " + std::to_string(prev_offset) + " and " +
                      std::to_string(data) + " (exclusive)");
    }
    if (base - prev_base < wire::chunk_elements || base < prev_base || base > p.dense_size) {
      return fail(f, errc::malformed_message,
                  "directory entry " + std::to_string(c) + ": chunk base index " +
                      std::to_string(base) + " after " + std::to_string(prev_base) +
                      " is impossible in a tensor of " + std::to_string(p.dense_size));
    }
    prev_offset = off;
    prev_base = base;
  }
  return true;
}

/// Checks chunk c of a raw or delta payload: indices strictly ascending and below the tensor
/// size, and a delta chunk decoding exactly its share within its bytes.
[[nodiscard]] inline bool check_index_chunk(const index_payload& p, std::uint64_t c,
                                            codec_failure& f) {
  const std::uint64_t begin = c * wire::chunk_elements;
  const std::uint64_t count = std::min(wire::chunk_elements, p.count - begin);
  const std::byte* const d = p.data;
  auto raw = [&](auto width) {
    using W = decltype(width);
    const std::uint64_t base =
        begin == 0 ? 0 : static_cast<std::uint64_t>(load_le<W>(d + (begin - 1) * sizeof(W))) + 1;
    const std::uint64_t bad =
        check_raw<W>(d + begin * sizeof(W), static_cast<std::size_t>(count), base, p.dense_size);
    if (bad == no_position) return true;
    const std::uint64_t j = begin + bad;
    const std::uint64_t x = load_le<W>(d + j * sizeof(W));
    if (x >= p.dense_size) {
      return fail(f, errc::out_of_range,
                  "index " + std::to_string(x) + " at position " + std::to_string(j) +
                      " is not below the tensor size " + std::to_string(p.dense_size));
    }
    return fail(f, errc::malformed_message,
                "indices not strictly ascending at position " + std::to_string(j) + " (" +
                    std::to_string(load_le<W>(d + (j - 1) * sizeof(W))) + " then " +
                    std::to_string(x) + ")");
  };
  switch (p.encoding) {
    case index_encoding::raw_u16:
      return raw(std::uint16_t{});
    case index_encoding::raw_u32:
      return raw(std::uint32_t{});
    case index_encoding::raw_u64:
      return raw(std::uint64_t{});
    case index_encoding::delta_bitpacked:
    case index_encoding::delta_varint: {
      const delta_chunk_span span = delta_chunk(p, c);
      const std::byte* data = d + wire::directory_bytes(p.count);
      const std::byte* q = data + span.first;
      const std::byte* end = data + span.last;
      std::uint64_t base = span.base;
      codec_failure inner;
      const bool ok = p.encoding == index_encoding::delta_bitpacked
                          ? decode_bitpacked_chunk<void>(q, end, count, base, nullptr, inner)
                          : decode_varint_chunk<void>(q, end, count, base, nullptr, inner);
      auto chunk = [&] { return "chunk " + std::to_string(c) + ": "; };
      if (!ok) return fail(f, inner.code, chunk() + inner.what);
      if (q != end) {
        return fail(f, errc::malformed_message,
                    chunk() + std::to_string(end - q) + " bytes left after its last index");
      }
      const bool last_chunk = begin + count == p.count;
      if (last_chunk && base > p.dense_size) {
        return fail(f, errc::out_of_range,
                    chunk() + "index " + std::to_string(base - 1) +
                        " is not below the tensor size " + std::to_string(p.dense_size));
      }
      if (!last_chunk && base != span.next_base) {
        return fail(f, errc::malformed_message,
                    chunk() + "ends at index " + std::to_string(base - 1) +
                        ", but the directory starts the next chunk at " +
                        std::to_string(span.next_base));
      }
      return true;
    }
    case index_encoding::bitmap:
    case index_encoding::random_k:
    case index_encoding::chunked_topk:
    case index_encoding::automatic:
      return true;
  }
  return true;
}

/// Checks a bitmap payload that has `bits` bits set: none past the tensor size, and as many
/// as the section's count.
[[nodiscard]] inline bool check_bitmap_bits(const index_payload& p, std::uint64_t bits,
                                            codec_failure& f) {
  if (p.dense_size % 8 != 0) {
    const auto last = std::to_integer<unsigned>(p.data[p.bytes - 1]);
    if ((last >> (p.dense_size % 8)) != 0) {
      return fail(f, errc::out_of_range,
                  "bitmap bits set past the tensor size " + std::to_string(p.dense_size));
    }
  }
  if (bits != p.count) {
    return fail(f, errc::malformed_message,
                "bitmap holds " + std::to_string(bits) + " indices, the header says " +
                    std::to_string(p.count));
  }
  return true;
}

/// How one task of a parallel pass over index payloads went (filled only on failure).
struct index_task_result {
  bool failed = false;
  codec_failure failure;
};

/// The payload checks of one message: planned section by section (`add`), then run in one
/// hand-off to the executor together with the message's checksum (`run`). Keeps its memory
/// from message to message.
class index_payload_checks {
 public:
  /// Forgets the planned checks.
  void clear() noexcept {
    sections_.clear();
    tasks_.clear();
    chunked_.clear();
  }

  /// Plans the checks of `payload`, the index payload of section `section` (of tensor
  /// `tensor`); checks a delta payload's chunk directory now, so that the chunks can be
  /// checked in parallel.
  void add(std::size_t section, std::uint32_t tensor, const index_payload& payload) {
    const auto s = static_cast<std::uint32_t>(sections_.size());
    sections_.push_back({section, tensor, payload});
    switch (payload.encoding) {
      case index_encoding::delta_bitpacked:
      case index_encoding::delta_varint: {
        codec_failure f;
        if (!check_chunk_directory(payload, f))
          fail_unpack_section(section, tensor, f.code, f.what);
        [[fallthrough]];
      }
      case index_encoding::raw_u16:
      case index_encoding::raw_u32:
      case index_encoding::raw_u64:
        for (std::uint64_t c = 0; c < wire::chunk_count(payload.count); ++c) {
          tasks_.push_back({s, false, c, 0});
        }
        break;
      case index_encoding::bitmap:
        for (std::uint64_t p = 0; p < bitmap_pieces(payload); ++p)
          tasks_.push_back({s, true, p, 0});
        break;
      case index_encoding::random_k:
      case index_encoding::chunked_topk:  // add_chunked
      case index_encoding::automatic:
        break;
    }
  }

  /// Plans the checks of the payloads of chunked section `section`, in ranges of
  /// `wire::chunk_elements` sent elements.
  void add_chunked(std::size_t section, std::uint32_t tensor, const chunked_payload& payload) {
    const auto s = static_cast<std::uint32_t>(sections_.size());
    sections_.push_back({section, tensor, {index_encoding::chunked_topk}});
    const auto c = static_cast<std::uint32_t>(chunked_.size());
    chunked_.push_back(payload);
    for (std::uint64_t r = 0; r < wire::chunk_count(payload.shape.count); ++r)
      tasks_.push_back({s, false, r, c});
  }

  /// Runs the planned checks and the checksum of `message`. The checksum is compared before
  /// any check's result is looked at, so that a corrupted message is reported as such; then
  /// the first failing check in message order throws.
  template <executor Executor>
  void run(std::span<const std::byte> message, Executor& ex) {
    results_.assign(tasks_.size(), {});
    counts_.assign(tasks_.size(), 0);
    // The checksum's pieces come first in the hand-off: they are the largest tasks.
    const auto body = message_body(message);
    const crc32c_split split(body.size(), ex.concurrency());
    crcs_.resize(split.pieces);
    ex.bulk(split.pieces + tasks_.size(), [&](std::size_t t) {
      if (t < split.pieces) {
        crcs_[t] = crc32c_piece::of(split.piece(body, t));
        return;
      }
      t -= split.pieces;
      const task& job = tasks_[t];
      const index_payload& p = sections_[job.section].payload;
      if (p.encoding == index_encoding::chunked_topk) {
        const chunked_payload& cp = chunked_[job.chunked];
        const std::uint64_t first = job.piece * wire::chunk_elements;
        const std::uint64_t last = std::min(cp.shape.count, first + wire::chunk_elements);
        if (!check_chunked_range(cp, first, last, results_[t].failure)) results_[t].failed = true;
        return;
      }
      if (job.bitmap) {
        counts_[t] = popcount_bytes(p.data + job.piece * bitmap_piece_bytes,
                                    bitmap_piece_size(p, job.piece));
        return;
      }
      if (!check_index_chunk(p, job.piece, results_[t].failure)) results_[t].failed = true;
    });
    check_message_checksum(crc32c_join(crcs_), message);
    std::uint64_t bits = 0;
    for (std::size_t t = 0; t < tasks_.size(); ++t) {
      const task& job = tasks_[t];
      const planned& s = sections_[job.section];
      if (results_[t].failed) {
        fail_unpack_section(s.section, s.tensor, results_[t].failure.code,
                            results_[t].failure.what);
      }
      if (job.bitmap) {
        bits += counts_[t];
        if (job.piece + 1 == bitmap_pieces(s.payload)) {
          codec_failure f;
          if (!check_bitmap_bits(s.payload, bits, f))
            fail_unpack_section(s.section, s.tensor, f.code, f.what);
          bits = 0;
        }
      }
    }
  }

 private:
  struct planned {
    std::size_t section;
    std::uint32_t tensor;
    index_payload payload;
  };
  struct task {
    std::uint32_t section;  // into sections_
    bool bitmap;            // a piece of a bitmap, else a chunk of indices
    std::uint64_t piece;
    std::uint32_t chunked = 0;  // of a chunked section: into chunked_
  };

  std::vector<planned> sections_;
  std::vector<chunked_payload> chunked_;
  std::vector<task> tasks_;
  std::vector<index_task_result> results_;
  std::vector<std::uint64_t> counts_;
  std::vector<crc32c_piece> crcs_;
};

}  // namespace stellatrain::detail
