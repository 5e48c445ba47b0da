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
    throw_error(errc::invalid_argument, "sample_sorted_indices: workspace holds " +
                                            std::to_string(workspace.size()) + " words, " +
                                            std::to_string(words) + " needed for n = " +
                                            std::to_string(n));
  }
  std::uint64_t* const bits = workspace.data();
  const bool complement = k > n / 2;
  const std::uint64_t m = complement ? n - k : k;

  random_stream rng(key);
  auto draw = [&](auto&& on_drawn) {
    for (std::uint64_t j = n - m; j < n; ++j) {
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
  for (std::uint64_t w = 0; w < words; ++w) {
    std::uint64_t word = bits[w];
    bits[w] = 0;
    if (complement) {
      word = ~word;
      if (w == words - 1 && (n & 63) != 0) word &= (std::uint64_t{1} << (n & 63)) - 1;
    }
    while (word != 0) {
      out[c++] = static_cast<Index>((w << 6) + static_cast<std::uint64_t>(std::countr_zero(word)));
      word &= word - 1;
    }
  }
}

}  // namespace stellatrain
