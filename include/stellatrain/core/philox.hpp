// SPDX-License-Identifier: Apache-2.0
// Philox4x32-10, the counter-based random generator of Salmon et al. (SC 2011), on host and
// device, and a stream of 64-bit values keyed by (seed, step, tensor).
//
// Counter-based means: the output for counter c and key k is a pure function of (c, k). Every
// rank that knows the key and the position reproduces the same numbers without sharing state,
// which is what lets a receiver regenerate random-k indices instead of receiving them.
#pragma once

#include <stellatrain/config.hpp>

#include <cstdint>

namespace stellatrain {

/// 128-bit counter of Philox4x32 as four 32-bit words.
struct philox_counter {
  std::uint32_t word[4];
};

/// 64-bit key of Philox4x32 as two 32-bit words.
struct philox_key {
  std::uint32_t word[2];
};

namespace detail {

STELLATRAIN_HOST_DEVICE constexpr philox_counter philox_round(philox_counter c,
                                                              philox_key k) noexcept {
  const std::uint64_t p0 = std::uint64_t{0xD2511F53u} * c.word[0];
  const std::uint64_t p1 = std::uint64_t{0xCD9E8D57u} * c.word[2];
  return {{static_cast<std::uint32_t>(p1 >> 32) ^ c.word[1] ^ k.word[0],
           static_cast<std::uint32_t>(p1),
           static_cast<std::uint32_t>(p0 >> 32) ^ c.word[3] ^ k.word[1],
           static_cast<std::uint32_t>(p0)}};
}

}  // namespace detail

/// Philox4x32 with 10 rounds: four independent uniform 32-bit words for counter `c` under key
/// `k`. Matches the Random123 reference (known-answer vectors in the tests). About 20 integer
/// multiplies; no state.
[[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr philox_counter philox4x32_10(
    philox_counter c, philox_key k) noexcept {
  c = detail::philox_round(c, k);
  for (int r = 1; r < 10; ++r) {
    k.word[0] += 0x9E3779B9u;
    k.word[1] += 0xBB67AE85u;
    c = detail::philox_round(c, k);
  }
  return c;
}

/// Who a random stream belongs to: the user's seed, the training step and the tensor.
/// Streams with any field different are independent.
struct random_key {
  std::uint64_t seed = 0;
  std::uint32_t step = 0;
  std::uint32_t tensor = 0;
};

/// The sequence of uniform 64-bit values of one `random_key`: value j is the pair of words
/// (2 (j mod 2), 2 (j mod 2) + 1) of Philox block j / 2, whose counter is (j / 2 as 64 bits,
/// step, tensor) and whose key is `seed`. Value j is the same on every host and device for the
/// same key; `next()` walks the sequence from the given position.
class random_stream {
 public:
  STELLATRAIN_HOST_DEVICE constexpr explicit random_stream(random_key key,
                                                           std::uint64_t position = 0) noexcept
      : key_(key), position_(position) {}

  /// Value number `j` of the stream, without moving it.
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint64_t at(std::uint64_t j) const noexcept {
    return pick(block(j >> 1), j);
  }

  /// The next value of the stream.
  STELLATRAIN_HOST_DEVICE constexpr std::uint64_t next() noexcept {
    const std::uint64_t b = position_ >> 1;
    if (!cached_ || cached_block_ != b) {
      cached_words_ = block(b);
      cached_block_ = b;
      cached_ = true;
    }
    return pick(cached_words_, position_++);
  }

  /// A uniform integer in [0, bound) for bound >= 1, without modulo bias (Lemire's
  /// multiply-and-reject: almost always one value of the stream, rarely more).
  STELLATRAIN_HOST_DEVICE constexpr std::uint64_t uniform_below(std::uint64_t bound) noexcept {
    __extension__ using u128 = unsigned __int128;
    u128 m = static_cast<u128>(next()) * bound;
    auto low = static_cast<std::uint64_t>(m);
    if (low < bound) {
      const std::uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
      while (low < threshold) {
        m = static_cast<u128>(next()) * bound;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

  /// How many values were consumed (the position of the next one).
  [[nodiscard]] STELLATRAIN_HOST_DEVICE constexpr std::uint64_t position() const noexcept {
    return position_;
  }

 private:
  STELLATRAIN_HOST_DEVICE constexpr philox_counter block(std::uint64_t b) const noexcept {
    return philox4x32_10(
        {{static_cast<std::uint32_t>(b), static_cast<std::uint32_t>(b >> 32), key_.step,
          key_.tensor}},
        {{static_cast<std::uint32_t>(key_.seed), static_cast<std::uint32_t>(key_.seed >> 32)}});
  }
  STELLATRAIN_HOST_DEVICE static constexpr std::uint64_t pick(const philox_counter& words,
                                                              std::uint64_t j) noexcept {
    const unsigned w = static_cast<unsigned>(j & 1u) * 2u;
    return (std::uint64_t{words.word[w + 1]} << 32) | words.word[w];
  }

  random_key key_;
  std::uint64_t position_ = 0;
  std::uint64_t cached_block_ = 0;
  philox_counter cached_words_{};
  bool cached_ = false;
};

}  // namespace stellatrain
