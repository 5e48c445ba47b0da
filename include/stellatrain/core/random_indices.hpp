// SPDX-License-Identifier: Apache-2.0
// Deterministic uniform sampling of k distinct indices out of n, in ascending order: the index
// set of random-k selection, which a receiver regenerates from the key instead of receiving it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/philox.hpp>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <limits>
#include <span>
#include <string>

namespace stellatrain {

namespace detail {

// The values of `random_stream(key)` from position 0 on, the same sequence as its `next()`,
// computed a batch of Philox blocks at a time: the blocks are independent, so a batch keeps
// the multipliers busy, and the loop that consumes the values stays short enough for many of
// its bitmap probes to be in flight at once.
class batched_random_stream {
 public:
  explicit batched_random_stream(random_key key) noexcept : key_(key) {}

  std::uint64_t next() noexcept {
    if (at_ == batch_values) refill();
    return values_[at_++];
  }

  // The values already computed and not consumed yet (refilling first if none are left).
  std::span<const std::uint64_t> upcoming() noexcept {
    if (at_ == batch_values) refill();
    return {values_ + at_, values_ + batch_values};
  }

  // random_stream::uniform_below, drawing from this stream.
  std::uint64_t uniform_below(std::uint64_t bound) noexcept {
    __extension__ using u128 = unsigned __int128;
    u128 m = static_cast<u128>(next()) * bound;
    auto low = static_cast<std::uint64_t>(m);
    if (low < bound) {
      const std::uint64_t threshold = (0 - bound) % bound;
      while (low < threshold) {
        m = static_cast<u128>(next()) * bound;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }

 private:
  static constexpr unsigned batch_blocks = 32;
  static constexpr unsigned batch_values = 2 * batch_blocks;

  void refill() noexcept {
    const philox_key k{
        {static_cast<std::uint32_t>(key_.seed), static_cast<std::uint32_t>(key_.seed >> 32)}};
    for (unsigned b = 0; b < batch_blocks; ++b) {
      const std::uint64_t block = block_ + b;
      const philox_counter w =
          philox4x32_10({{static_cast<std::uint32_t>(block),
                          static_cast<std::uint32_t>(block >> 32), key_.step, key_.tensor}},
                        k);
      values_[2 * b] = (std::uint64_t{w.word[1]} << 32) | w.word[0];
      values_[2 * b + 1] = (std::uint64_t{w.word[3]} << 32) | w.word[2];
    }
    block_ += batch_blocks;
    at_ = 0;
  }

  random_key key_;
  std::uint64_t block_ = 0;
  unsigned at_ = batch_values;
  std::uint64_t values_[batch_values];
};

}  // namespace detail

/// Words of workspace that `sample_sorted_indices` needs for a tensor of `n` elements: one bit
/// per element (n / 8 bytes: 3 MiB for 25M elements).
[[nodiscard]] constexpr std::uint64_t sample_indices_workspace_words(std::uint64_t n) noexcept {
  return (n + 63) / 64;
}

/// Writes min(k, n) distinct indices drawn uniformly without replacement from [0, n) (every
/// subset of that size equally likely) to `out`, strictly ascending.
///
/// The result is a pure function of (key, n, k): the same on every rank, run and platform
/// (integer arithmetic only), different for any other seed, step or tensor. The definition, which
/// any other implementation must follow to regenerate the same set: with m = min(k, n - k) when
/// k > n / 2 (the complement is drawn) and m = k otherwise, Robert Floyd's algorithm runs over
/// the values of `random_stream(key)`: for j = n - m, ..., n - 1, t = uniform_below(j + 1); t
/// joins the drawn set unless it is already in it, in which case j joins. The output is the
/// drawn set (or its complement), ascending.
///
/// `workspace` holds at least `sample_indices_workspace_words(n)` words that are all zero on
/// entry; they are all zero again on return (so one workspace serves every call without being
/// cleared). Cost: O(m) generator draws and random bit tests in n / 8 bytes, plus a scan of the
/// bitmap (n / 64 words) when m is not small against n, else a sort of m indices.
///
/// Throws `errc::invalid_argument` if `out` has fewer than min(k, n) elements or the workspace
/// is too small, `errc::out_of_range` if `Index` cannot hold n - 1.
template <index_type Index>
void sample_sorted_indices(random_key key, std::uint64_t n, std::uint64_t k, std::span<Index> out,
                           std::span<std::uint64_t> workspace) {
  k = std::min(k, n);
  if (out.size() < k) {
    throw_error(errc::invalid_argument, "sample_sorted_indices: output holds " +
                                            std::to_string(out.size()) + " indices, " +
                                            std::to_string(k) + " needed");
  }
  if (k == 0) return;
  if (n - 1 > std::numeric_limits<Index>::max()) {
    throw_error(errc::out_of_range, "sample_sorted_indices: " + std::to_string(n) +
                                        " elements do not fit the index type");
  }
  const std::uint64_t words = sample_indices_workspace_words(n);
  if (workspace.size() < words) {
    throw_error(errc::invalid_argument,
                "sample_sorted_indices: workspace holds " + std::to_string(workspace.size()) +
                    " words, " + std::to_string(words) + " needed for n = " + std::to_string(n));
  }
  std::uint64_t* const bits = workspace.data();
  const bool complement = k > n / 2;
  const std::uint64_t m = complement ? n - k : k;

  detail::batched_random_stream rng(key);  // random_stream(key)'s values, faster
  auto draw = [&](auto&& on_drawn) {
    for (std::uint64_t j = n - m; j < n; ++j) {
      if (((j - (n - m)) & 31) == 0) {
        // Warm the bitmap words the next draws will most likely probe (without a rejection,
        // draw d is (value d * (j + d + 1)) >> 64): the probes then overlap.
        __extension__ using u128 = unsigned __int128;
        const auto ahead = rng.upcoming();
        for (std::size_t d = 0; d < ahead.size() && d < 32; ++d) {
          const auto t =
              static_cast<std::uint64_t>((static_cast<u128>(ahead[d]) * (j + d + 1)) >> 64);
          __builtin_prefetch(bits + (t >> 6), 1);
        }
      }
      std::uint64_t t = rng.uniform_below(j + 1);
      const std::uint64_t mask_t = std::uint64_t{1} << (t & 63);
      if (bits[t >> 6] & mask_t) t = j;
      bits[t >> 6] |= std::uint64_t{1} << (t & 63);
      on_drawn(t);
    }
  };

  // Few draws in a large tensor: sort the drawn values instead of scanning n / 64 words.
  if (!complement && m * 1024 < n) {
    std::uint64_t c = 0;
    draw([&](std::uint64_t t) { out[c++] = static_cast<Index>(t); });
    std::sort(out.begin(), out.begin() + static_cast<std::ptrdiff_t>(m));
    for (std::uint64_t i = 0; i < m; ++i) bits[out[i] >> 6] = 0;
    return;
  }

  draw([](std::uint64_t) {});
  std::uint64_t c = 0;
  auto word_at = [&](std::uint64_t w) {
    std::uint64_t word = bits[w];
    bits[w] = 0;
    if (complement) {
      word = ~word;
      if (w == words - 1 && (n & 63) != 0) word &= (std::uint64_t{1} << (n & 63)) - 1;
    }
    return word;
  };
  std::uint64_t w = 0;
  if (k * 16 < n) {
    // Sparse: most words hold 0 to 3 set bits. Write the first 4 positions of each word
    // unconditionally and advance by the popcount (no branch per bit); the rare word with
    // more takes the loop. Stops 4 short of the end of `out`, where the writes must stop.
    for (; w < words && c + 4 <= k; ++w) {
      std::uint64_t word = word_at(w);
      const auto count = static_cast<std::uint64_t>(std::popcount(word));
      const std::uint64_t base = w << 6;
      for (int r = 0; r < 4; ++r) {
        out[c + static_cast<std::uint64_t>(r)] =
            static_cast<Index>(base + static_cast<std::uint64_t>(std::countr_zero(word)));
        word &= word - 1;
      }
      c += std::min<std::uint64_t>(count, 4);
      for (; word != 0; word &= word - 1)
        out[c++] = static_cast<Index>(base + static_cast<std::uint64_t>(std::countr_zero(word)));
    }
  }
  for (; w < words; ++w) {
    for (std::uint64_t word = word_at(w); word != 0; word &= word - 1) {
      out[c++] = static_cast<Index>((w << 6) + static_cast<std::uint64_t>(std::countr_zero(word)));
    }
  }
}

}  // namespace stellatrain
