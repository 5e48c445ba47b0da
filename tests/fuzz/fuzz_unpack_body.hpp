// SPDX-License-Identifier: Apache-2.0
// The body of the unpack fuzzer, shared by the libFuzzer target (fuzz_unpack.cpp, built with
// clang) and by the corpus test of the normal build (tests/pack/test_fuzz_corpus.cpp).
//
// Input: one options byte, then the message. The receiver registers a fixed set of tensors. A
// message that parses is decoded into every output type, its invariants checked (count, strict
// order, range), then packed again with the same encodings and compared after a second decode:
// any difference, crash or sanitizer report is a bug. Control sections are carried over as
// they are and must come back with the same bytes. Options byte: bit 0 recomputes the
// checksum first (so that mutations reach the structural checks instead of stopping at the
// CRC), bit 1 decodes on a two-thread pool.
#pragma once

#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace stellatrain::fuzz {

/// The tensors the fuzzed receiver expects.
inline std::vector<tensor_info> registered_tensors() {
  return {{0, 1},
          {1, 100},
          {2, 65536},
          {3, 70000},
          {4, std::uint64_t{1} << 20},
          {5, (std::uint64_t{1} << 33) + 3},
          {7, 1000},
          {9, 16},
          {11, 50}};
}

/// The registered size of `tensor` (0 if it is not registered).
inline std::uint64_t registered_size(std::uint32_t tensor) {
  for (const auto& t : registered_tensors()) {
    if (t.id == tensor) return t.size;
  }
  return 0;
}

inline void require(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_unpack: invariant violated: %s\n", what);
    std::abort();
  }
}

// Equal bits, or both NaN: converting a float NaN to bf16 or fp16 makes it quiet, so a
// signalling NaN on the wire comes back quiet after a second trip (documented behaviour).
inline bool same_value(float a, float b) {
  return std::bit_cast<std::uint32_t>(a) == std::bit_cast<std::uint32_t>(b) || (a != a && b != b);
}

// A chunked section rebuilt from its decoded pairs and its scales (read from the message), to
// be packed again.
struct chunked_parts {
  std::vector<std::uint16_t> indices;
  std::vector<std::uint8_t> codes;
  std::vector<bf16> scales;
};

inline chunked_section rebuild_chunked(const section_info& s, const std::vector<std::byte>& message,
                                       const std::vector<std::uint64_t>& idx,
                                       const std::vector<float>& val, chunked_parts& out) {
  const unsigned code_bits = code_bits_of(s.values);
  const auto shape = wire::chunked_shape_of(s.dense_size, s.chunk_bits, s.chunk_k, code_bits);
  const std::byte* scales = message.data() + s.offset + wire::section_header_bytes + s.index_bytes;
  out.scales.resize(static_cast<std::size_t>(shape.scale_bytes / 2));
  for (std::size_t j = 0; j < out.scales.size(); ++j)
    out.scales[j] = bf16::from_bits(detail::load_le<std::uint16_t>(scales + 2 * j));
  out.indices.resize(idx.size());
  out.codes.assign(static_cast<std::size_t>(shape.value_bytes - shape.scale_bytes), 0);
  const std::uint64_t mask = (std::uint64_t{1} << s.chunk_bits) - 1;
  for (std::size_t j = 0; j < idx.size(); ++j) {
    const std::uint64_t c = j / s.chunk_k;
    out.indices[j] = static_cast<std::uint16_t>(idx[j] & mask);
    std::uint32_t code = 0;
    float scale = to_float(out.scales[code_bits * c]);
    if (code_bits == 2 && !same_value(std::fabs(val[j]), std::fabs(scale))) {
      code = 2;
      scale = to_float(out.scales[2 * c + 1]);
    }
    if (std::signbit(val[j]) != std::signbit(scale)) code |= 1;
    const std::uint64_t bit = j * code_bits;
    out.codes[bit / 8] = static_cast<std::uint8_t>(out.codes[bit / 8] | (code << (bit % 8)));
  }
  return {.dense_size = s.dense_size,
          .chunk_bits = s.chunk_bits,
          .k = static_cast<std::uint32_t>(s.chunk_k),
          .code_bits = code_bits,
          .indices = out.indices,
          .codes = out.codes,
          .scales = out.scales};
}

// random_k decoding needs n / 8 bytes of workspace: tensors past this are not decoded here.
inline constexpr std::uint64_t max_random_k_decode = std::uint64_t{1} << 22;

template <class Executor>
int unpack_one(const std::uint8_t* data, std::size_t size, Executor& ex) {
  if (size == 0) return 0;
  const std::uint8_t options = data[0];
  std::vector<std::byte> message(size - 1);
  if (size > 1) std::memcpy(message.data(), data + 1, size - 1);
  if ((options & 1u) != 0 &&
      message.size() >= wire::message_header_bytes + wire::message_trailer_bytes) {
    const auto body = std::span<const std::byte>(message).first(message.size() - 4);
    detail::store_le<std::uint32_t>(message.data() + message.size() - 4, crc32c(body));
  }
  const auto tensors = registered_tensors();
  message_unpacker unpacker(tensors);
  try {
    unpacker.parse(message, ex);
  } catch (const error&) {
    require(unpacker.info().sections.empty() && unpacker.info().controls.empty(),
            "a failed parse left sections behind");
    try {
      sparse_buffer<float, std::uint64_t> none(0, 1);
      unpacker.decode(0, none, ex);
    } catch (const error&) {
      return 0;
    }
    require(false, "decode after a failed parse did not throw");
    return 0;
  }
  const auto controls =
      std::vector<control_info>(unpacker.info().controls.begin(), unpacker.info().controls.end());
  const auto sections =
      std::vector<section_info>(unpacker.info().sections.begin(), unpacker.info().sections.end());
  require(unpacker.info().bytes == message.size(), "message size");

  message_packer packer;
  packer.clear(unpacker.info().tag);
  std::vector<std::vector<std::uint64_t>> indices(sections.size());
  std::vector<std::vector<float>> values(sections.size());
  std::vector<chunked_parts> chunked(sections.size());
  for (std::size_t i = 0; i < sections.size(); ++i) {
    const auto& s = sections[i];
    require(s.count <= s.dense_size, "count <= dense size");
    if (s.indices == index_encoding::random_k && s.dense_size > max_random_k_decode) return 0;
    indices[i].assign(s.count, 0);
    values[i].assign(s.count, 0.0f);
    unpacker.decode(i, std::span<std::uint64_t>(indices[i]), std::span<float>(values[i]), ex);
    for (std::size_t j = 0; j < s.count; ++j) {
      require(indices[i][j] < s.dense_size, "index below the tensor size");
      require(j == 0 || indices[i][j] > indices[i][j - 1], "indices strictly ascending");
    }
    // The other output types agree with the 64-bit / float decode.
    if (s.dense_size <= (std::uint64_t{1} << 32)) {
      sparse_buffer<bf16, std::uint32_t> narrow(0, s.count);
      unpacker.decode(i, narrow, ex);
      require(narrow.size() == s.count, "sparse_buffer size");
      for (std::size_t j = 0; j < s.count; ++j) {
        require(narrow.indices()[j] == indices[i][j], "32-bit decode");
        require(same_value(to_float(narrow.values()[j]), to_float(bf16(values[i][j]))),
                "bf16 decode");
      }
    }
    if (s.indices == index_encoding::random_k) {
      packer.add_random_k<float>(s.tensor, s.random, s.dense_size, values[i], s.values);
    } else if (s.indices == index_encoding::chunked_topk) {
      packer.add_chunked(s.tensor, rebuild_chunked(s, message, indices[i], values[i], chunked[i]));
    } else {
      packer.add(s.tensor,
                 sparse_view<const float, const std::uint64_t>(indices[i], values[i], s.dense_size),
                 {.indices = s.indices, .values = s.values});
    }
  }
  for (const auto& c : controls) {
    require(c.payload.data() >= message.data() &&
                c.payload.data() + c.payload.size() <= message.data() + message.size(),
            "control payload inside the message");
    packer.add_control(c.type, c.payload);
  }
  // Pack what was decoded with the same encodings, parse and decode again: the same pairs.
  std::vector<std::byte> again(packer.prepare(ex));
  packer.write(again, ex);
  const auto& info = unpacker.parse(again, ex);
  require(info.sections.size() == sections.size(), "repacked section count");
  require(info.controls.size() == controls.size(), "repacked control count");
  for (std::size_t i = 0; i < controls.size(); ++i) {
    require(info.controls[i].type == controls[i].type, "repacked control type");
    require(std::equal(info.controls[i].payload.begin(), info.controls[i].payload.end(),
                       controls[i].payload.begin(), controls[i].payload.end()),
            "repacked control payload");
  }
  for (std::size_t i = 0; i < sections.size(); ++i) {
    require(info.sections[i].tensor == sections[i].tensor, "repacked tensor");
    require(info.sections[i].indices == sections[i].indices, "repacked index encoding");
    std::vector<std::uint64_t> idx(sections[i].count);
    std::vector<float> val(sections[i].count);
    unpacker.decode(i, std::span<std::uint64_t>(idx), std::span<float>(val), ex);
    require(idx == indices[i], "repacked indices");
    for (std::size_t j = 0; j < val.size(); ++j)
      require(same_value(val[j], values[i][j]), "repacked values");
  }
  return 0;
}

/// Runs one input on the executor its options byte asks for.
inline int unpack_one(const std::uint8_t* data, std::size_t size) {
  if (size > 0 && (data[0] & 2u) != 0) {
    static thread_pool pool(2);
    return unpack_one(data, size, pool);
  }
  inline_executor ex;
  return unpack_one(data, size, ex);
}

}  // namespace stellatrain::fuzz
