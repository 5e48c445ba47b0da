// SPDX-License-Identifier: Apache-2.0
// The payloads of a chunked section (index encoding `chunked_topk`, values `chunk_sign` or
// `chunk_2bit`; docs/wire-format.md, "Chunked sections"): written by the packer in one pass,
// checked and decoded by the unpacker in ranges of sent elements, on any thread.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace stellatrain::detail {

/// The first bytes of a `chunked_topk` index payload.
struct chunked_prefix {
  unsigned chunk_bits = 0;
  unsigned reserved = 0;  // the three bytes after b, zero on the wire
  std::uint64_t k = 0;

  [[nodiscard]] static chunked_prefix read(const std::byte* p) noexcept {
    chunked_prefix r;
    r.chunk_bits = std::to_integer<unsigned>(p[0]);
    r.reserved = std::to_integer<unsigned>(p[1]) | std::to_integer<unsigned>(p[2]) |
                 std::to_integer<unsigned>(p[3]);
    r.k = load_le<std::uint32_t>(p + 4);
    return r;
  }
};

/// A chunked section's payloads as the unpacker found them (header and prefix checked).
struct chunked_payload {
  const std::byte* indices = nullptr;  // the packed indices, after the prefix
  const std::byte* scales = nullptr;
  const std::byte* codes = nullptr;
  std::uint64_t dense_size = 0;
  unsigned chunk_bits = 0;
  std::uint64_t k = 0;
  unsigned code_bits = 0;
  wire::chunked_shape shape{};

  [[nodiscard]] std::uint64_t index_data_bytes() const noexcept {
    return shape.index_bytes - wire::chunked_prefix_bytes;
  }
  [[nodiscard]] std::uint64_t code_bytes() const noexcept {
    return shape.value_bytes - shape.scale_bytes;
  }
  /// Elements of chunk c.
  [[nodiscard]] std::uint64_t chunk_length(std::uint64_t c) const noexcept {
    return std::min<std::uint64_t>(std::uint64_t{1} << chunk_bits, dense_size - (c << chunk_bits));
  }
};

/// What is wrong with a chunked section held in memory (`chunked_section`), if anything: its
/// parameters, the sizes of its spans, or an index not inside its chunk (`range`) or not above
/// the one before it in its chunk (`order`). The sender and the codec map the kinds to their
/// error codes.
struct chunked_fault {
  enum class kind { none, parameters, sizes, order, range };
  kind what = kind::none;
  std::string message;
  explicit operator bool() const noexcept { return what != kind::none; }
};

[[nodiscard]] inline chunked_fault find_chunked_fault(const chunked_section& c) {
  using k = chunked_fault::kind;
  if (c.chunk_bits < 1 || c.chunk_bits > 16)
    return {k::parameters, "b = " + std::to_string(c.chunk_bits) + ", not in [1, 16]"};
  if (c.k < 1 || c.k > (std::uint64_t{1} << c.chunk_bits))
    return {k::parameters, "k = " + std::to_string(c.k) + ", not in [1, 2^b]"};
  if (c.code_bits != 1 && c.code_bits != 2)
    return {k::parameters, std::to_string(c.code_bits) + " code bits, not 1 or 2"};
  if (c.dense_size > wire::max_chunked_elements)
    return {k::parameters, "a tensor of more than 2^56 elements"};
  const auto shape = wire::chunked_shape_of(c.dense_size, c.chunk_bits, c.k, c.code_bits);
  const std::uint64_t code_bytes = shape.value_bytes - shape.scale_bytes;
  if (c.indices.size() != shape.count || c.scales.size() != c.code_bits * shape.chunks ||
      c.codes.size() != code_bytes) {
    return {k::sizes, std::to_string(c.indices.size()) + " indices, " +
                          std::to_string(c.codes.size()) + " code bytes and " +
                          std::to_string(c.scales.size()) + " scales; " +
                          std::to_string(shape.count) + ", " + std::to_string(code_bytes) +
                          " and " + std::to_string(c.code_bits * shape.chunks) + " expected"};
  }
  for (std::uint64_t chunk = 0, j = 0; chunk < shape.chunks; ++chunk) {
    const std::uint64_t length =
        std::min(std::uint64_t{1} << c.chunk_bits, c.dense_size - (chunk << c.chunk_bits));
    const std::uint64_t end = j + std::min<std::uint64_t>(c.k, length);
    for (const std::uint64_t first = j; j < end; ++j) {
      if (c.indices[j] >= length) {
        return {k::range, "chunk " + std::to_string(chunk) + ": index " +
                              std::to_string(c.indices[j]) + " at position " + std::to_string(j) +
                              " is not below its " + std::to_string(length) + " elements"};
      }
      if (j > first && c.indices[j] <= c.indices[j - 1]) {
        return {k::order, "chunk " + std::to_string(chunk) +
                              ": indices not strictly ascending at position " + std::to_string(j)};
      }
    }
  }
  return {};
}

/// The `width`-bit field (width <= 16) at bit `bit` of `len` bytes from `p`, lowest bit first.
[[nodiscard]] STELLATRAIN_FORCE_INLINE std::uint32_t read_bit_field(const std::byte* p,
                                                                    std::uint64_t len,
                                                                    std::uint64_t bit,
                                                                    unsigned width) noexcept {
  const std::uint64_t byte = bit >> 3;
  std::uint32_t w = 0;
  if (byte + 4 <= len) [[likely]] {
    w = load_le<std::uint32_t>(p + byte);
  } else {
    for (std::uint64_t i = 0; i < 3 && byte + i < len; ++i)
      w |= std::to_integer<std::uint32_t>(p[byte + i]) << (8 * i);
  }
  return (w >> (bit & 7)) & ((std::uint32_t{1} << width) - 1);
}

/// Writes both payloads of `s` (checked by the packer) from `out`: the index payload, then
/// the value payload right after it.
inline void write_chunked_payloads(const chunked_section& s, const wire::chunked_shape& shape,
                                   std::byte* out) {
  const unsigned b = s.chunk_bits;
  std::memset(out, 0, wire::chunked_prefix_bytes);
  out[0] = static_cast<std::byte>(b);
  store_le<std::uint32_t>(out + 4, s.k);
  // Indices, b bits each, through a 64-bit accumulator.
  std::byte* q = out + wire::chunked_prefix_bytes;
  std::uint64_t acc = 0;
  unsigned held = 0;
  for (const std::uint16_t x : s.indices) {
    acc |= static_cast<std::uint64_t>(x) << held;
    held += b;
    if (held >= 32) {
      store_le<std::uint32_t>(q, static_cast<std::uint32_t>(acc));
      q += 4;
      acc >>= 32;
      held -= 32;
    }
  }
  for (; held > 0; held = held > 8 ? held - 8 : 0, acc >>= 8) *q++ = static_cast<std::byte>(acc);
  std::byte* v = out + shape.index_bytes;
  for (const bf16 x : s.scales) {
    store_le<std::uint16_t>(v, x.bits());
    v += 2;
  }
  const std::size_t code_bytes = static_cast<std::size_t>(shape.value_bytes - shape.scale_bytes);
  std::memcpy(v, s.codes.data(), code_bytes);
  // The codes' unused high bits of the last byte go out as zero, whatever the sender held.
  const unsigned used = static_cast<unsigned>((shape.count * s.code_bits) % 8);
  if (used != 0) v[code_bytes - 1] &= static_cast<std::byte>((1u << used) - 1);
}

/// Checks sent elements [first, last) of `p`: each chunk's indices ascend strictly and lie
/// inside the chunk; with the last element, the bits after the last index and after the last
/// code are zero.
[[nodiscard]] inline bool check_chunked_range(const chunked_payload& p, std::uint64_t first,
                                              std::uint64_t last, codec_failure& f) {
  const unsigned b = p.chunk_bits;
  const std::uint64_t len = p.index_data_bytes();
  for (std::uint64_t j = first, c = first / p.k; j < last; ++c) {
    const std::uint64_t end = std::min(last, (c + 1) * p.k);
    const std::uint64_t length = p.chunk_length(c);
    // The chunk's indices, all below its length and each above the one before.
    std::int64_t prev =
        j == c * p.k ? -1
                     : static_cast<std::int64_t>(read_bit_field(p.indices, len, (j - 1) * b, b));
    std::uint32_t bad = 0;  // nonzero once an index fails (checked after the chunk, branch-free)
    for (std::uint64_t i = j; i < end; ++i) {
      const auto x = static_cast<std::int64_t>(read_bit_field(p.indices, len, i * b, b));
      bad |= static_cast<std::uint32_t>(x <= prev) |
             static_cast<std::uint32_t>(static_cast<std::uint64_t>(x) >= length);
      prev = x;
    }
    if (bad != 0) {
      std::int64_t before =
          j == c * p.k ? -1
                       : static_cast<std::int64_t>(read_bit_field(p.indices, len, (j - 1) * b, b));
      for (std::uint64_t i = j; i < end; ++i) {
        const std::uint32_t x = read_bit_field(p.indices, len, i * b, b);
        if (static_cast<std::int64_t>(x) <= before) {
          return fail(f, errc::malformed_message,
                      "chunk " + std::to_string(c) +
                          ": indices not strictly ascending at position " + std::to_string(i) +
                          " (" + std::to_string(before) + " then " + std::to_string(x) + ")");
        }
        if (x >= length) {
          return fail(f, errc::out_of_range,
                      "chunk " + std::to_string(c) + ": index " + std::to_string(x) +
                          " at position " + std::to_string(i) + " is not below the chunk's " +
                          std::to_string(length) + " elements");
        }
        before = x;
      }
    }
    j = end;
  }
  if (last == p.shape.count) {
    auto tail_clear = [](const std::byte* data, std::uint64_t bytes, std::uint64_t bits) {
      const unsigned used = static_cast<unsigned>(bits % 8);
      return used == 0 || (std::to_integer<unsigned>(data[bytes - 1]) >> used) == 0;
    };
    if (!tail_clear(p.indices, len, p.shape.count * b))
      return fail(f, errc::malformed_message, "bits set after the last index");
    if (!tail_clear(p.codes, p.code_bytes(), p.shape.count * p.code_bits))
      return fail(f, errc::malformed_message, "bits set after the last value code");
  }
  return true;
}

/// Decodes sent elements [first, last) of `p` (checked) to tensor indices and values.
template <class V, class I>
void decode_chunked_range(const chunked_payload& p, std::uint64_t first, std::uint64_t last,
                          I* indices, V* values) noexcept {
  const unsigned b = p.chunk_bits;
  const unsigned w = p.code_bits;  // also the scales per chunk
  const std::uint64_t len = p.index_data_bytes();
  const std::uint64_t code_len = p.code_bytes();
  for (std::uint64_t j = first, c = first / p.k; j < last; ++c) {
    const std::uint64_t end = std::min(last, (c + 1) * p.k);
    const std::uint64_t base = c << b;
    // The chunk's two levels (equal with 1-bit codes), and their negations.
    float level[4];
    level[0] = float_from_bf16_bits(load_le<std::uint16_t>(p.scales + 2 * w * c));
    level[2] = float_from_bf16_bits(load_le<std::uint16_t>(p.scales + 2 * (w * c + w - 1)));
    level[1] = -level[0];
    level[3] = -level[2];
    for (; j < end; ++j) {
      indices[j - first] = static_cast<I>(base + read_bit_field(p.indices, len, j * b, b));
      values[j - first] = from_float<V>(level[read_bit_field(p.codes, code_len, j * w, w)]);
    }
  }
}

}  // namespace stellatrain::detail
