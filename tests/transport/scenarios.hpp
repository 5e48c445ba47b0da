// SPDX-License-Identifier: Apache-2.0
// Collective and point-to-point checks written against the `transport` concept, shared by the
// in-process Catch2 tests and the MPI / ZeroMQ multi-process workers. Each check builds
// deterministic inputs from (rank, seed), runs the operation and compares every byte with an
// oracle computed independently; a mismatch throws scenario_failure.
#pragma once

#include <stellatrain/stellatrain.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace stellatrain::test {

struct scenario_failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const std::string& what) { throw scenario_failure(what); }

inline std::uint64_t mix(std::uint64_t x) noexcept {  // splitmix64
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

/// Byte i of rank r's message under `seed`.
inline std::byte pattern(int rank, std::uint64_t seed, std::size_t i) noexcept {
  const std::uint64_t w =
      mix(seed * 1315423911ull + static_cast<std::uint64_t>(rank) * 2654435761ull + (i >> 3));
  return static_cast<std::byte>((w >> ((i & 7u) * 8)) & 0xFFu);
}

inline void fill(std::span<std::byte> b, int rank, std::uint64_t seed) {
  std::size_t i = 0;
  for (; i + 8 <= b.size(); i += 8) {
    const std::uint64_t w =
        mix(seed * 1315423911ull + static_cast<std::uint64_t>(rank) * 2654435761ull + (i >> 3));
    for (std::size_t k = 0; k < 8; ++k) b[i + k] = static_cast<std::byte>((w >> (k * 8)) & 0xFFu);
  }
  for (; i < b.size(); ++i) b[i] = pattern(rank, seed, i);
}

inline std::vector<std::byte> message_of(int rank, std::size_t n, std::uint64_t seed) {
  std::vector<std::byte> v(n);
  fill(v, rank, seed);
  return v;
}

inline void expect_message(std::span<const std::byte> got, int rank, std::size_t n,
                           std::uint64_t seed, const std::string& where) {
  if (got.size() != n) {
    fail(where + ": message of rank " + std::to_string(rank) + " has " +
         std::to_string(got.size()) + " bytes, expected " + std::to_string(n));
  }
  std::vector<std::byte> want(n);
  fill(want, rank, seed);
  if (n != 0 && std::memcmp(got.data(), want.data(), n) != 0) {
    std::size_t i = 0;
    while (got[i] == want[i]) ++i;
    fail(where + ": message of rank " + std::to_string(rank) + " differs at byte " +
         std::to_string(i));
  }
}

/// All-gather of messages of length `length_of(rank)`; checks every received byte.
template <transport T>
void allgather_case(T& t, const std::function<std::size_t(int)>& length_of,
                    const allgather_options& opt, std::uint64_t seed, collective_workspace<T>& ws,
                    std::vector<message_buffer>& out) {
  const int p = t.size();
  const auto mine = message_of(t.rank(), length_of(t.rank()), seed);
  out.resize(static_cast<std::size_t>(p));
  sparse_allgather(t, mine, out, opt, ws);
  for (int r = 0; r < p; ++r) {
    expect_message(out[static_cast<std::size_t>(r)].span(), r, length_of(r), seed,
                   "sparse_allgather on rank " + std::to_string(t.rank()));
  }
}

template <transport T>
void allgather_case(T& t, const std::function<std::size_t(int)>& length_of,
                    const allgather_options& opt, std::uint64_t seed) {
  collective_workspace<T> ws;
  std::vector<message_buffer> out;
  allgather_case(t, length_of, opt, seed, ws, out);
}

/// Input element i of rank r: small integers, so that every sum is exact in float.
template <class V>
V input_value(int rank, std::size_t i, std::uint64_t seed) {
  return static_cast<V>(
      static_cast<int>(mix(seed + static_cast<std::uint64_t>(rank) * 1000003ull + i) % 201) - 100);
}

/// All-reduce of `n` elements; checks every element against a sum computed in 64-bit
/// integers (exact), and with `average` against the same rounding the library promises.
template <class V, transport T>
std::vector<V> allreduce_case(T& t, std::size_t n, const allreduce_options& opt,
                              std::uint64_t seed) {
  const int p = t.size();
  std::vector<V> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input_value<V>(t.rank(), i, seed);
  dense_allreduce(t, std::span<V>(v), opt);
  for (std::size_t i = 0; i < n; ++i) {
    long long sum = 0;
    for (int r = 0; r < p; ++r) sum += static_cast<long long>(input_value<V>(r, i, seed));
    V want = static_cast<V>(sum);
    if constexpr (std::is_floating_point_v<V>) {
      if (opt.average && p > 1)
        want = static_cast<V>(want * (static_cast<V>(1) / static_cast<V>(p)));
    }
    if (!(v[i] == want)) {
      fail("dense_allreduce on rank " + std::to_string(t.rank()) + " of " + std::to_string(p) +
           ": element " + std::to_string(i) + " of " + std::to_string(n) + " is " +
           std::to_string(v[i]) + ", expected " + std::to_string(want));
    }
  }
  return v;
}

/// Reduce-scatter of `n` elements: this rank's segment checked like `allreduce_case`.
template <class V, transport T>
void reduce_scatter_case(T& t, std::size_t n, const allreduce_options& opt, std::uint64_t seed) {
  const int p = t.size();
  std::vector<V> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = input_value<V>(t.rank(), i, seed);
  dense_reduce_scatter(t, std::span<V>(v), opt);
  const auto mine = segment_of(n, p, t.rank());
  for (std::uint64_t i = mine.begin; i < mine.end; ++i) {
    long long sum = 0;
    for (int r = 0; r < p; ++r) sum += static_cast<long long>(input_value<V>(r, i, seed));
    V want = static_cast<V>(sum);
    if constexpr (std::is_floating_point_v<V>) {
      if (opt.average && p > 1)
        want = static_cast<V>(want * (static_cast<V>(1) / static_cast<V>(p)));
    }
    if (!(v[i] == want)) {
      fail("dense_reduce_scatter on rank " + std::to_string(t.rank()) + " of " + std::to_string(p) +
           ": element " + std::to_string(i) + " of " + std::to_string(n) + " is " +
           std::to_string(v[i]) + ", expected " + std::to_string(want));
    }
  }
}

/// Broadcast of `n` bytes from `root`, into a message_buffer and into a span.
template <transport T>
void broadcast_case(T& t, int root, std::size_t n, const broadcast_options& opt,
                    std::uint64_t seed) {
  message_buffer m;
  if (t.rank() == root) m.assign(message_of(root, n, seed));
  broadcast(t, root, m, opt);
  expect_message(m.span(), root, n, seed, "broadcast (buffer) on rank " + std::to_string(t.rank()));
  std::vector<std::byte> s(n);
  if (t.rank() == root) fill(s, root, seed + 1);
  broadcast(t, root, std::span<std::byte>(s), opt);
  expect_message(s, root, n, seed + 1, "broadcast (span) on rank " + std::to_string(t.rank()));
}

/// Point-to-point: several messages per pair with the same tag arrive in order; receives
/// posted for tags in the opposite order of the sends still match by tag; the variable
/// length receive (where the transport has it) gets the exact size.
template <transport T>
void p2p_case(T& t, std::uint64_t seed, tag_type base_tag) {
  const int p = t.size();
  const int r = t.rank();
  const int right = (r + 1) % p;
  const int left = (r + p - 1) % p;
  const auto deadline = deadline_after(std::chrono::seconds(30));
  constexpr int count = 5;
  std::vector<std::vector<std::byte>> out;
  std::vector<typename T::request_type> sends;
  for (int k = 0; k < count; ++k) {
    out.push_back(message_of(r, 100 + static_cast<std::size_t>(k) * 37,
                             seed + static_cast<std::uint64_t>(k)));
  }
  // Same tag, in order.
  for (int k = 0; k < count; ++k)
    sends.push_back(t.isend(right, base_tag, out[static_cast<std::size_t>(k)]));
  // Two tags sent A then B, received B then A.
  const auto a = message_of(r, 3000, seed + 100);
  const auto b = message_of(r, 10, seed + 101);
  sends.push_back(t.isend(right, base_tag + 1, a));
  sends.push_back(t.isend(right, base_tag + 2, b));
  std::vector<std::vector<std::byte>> in(count);
  std::vector<typename T::request_type> recvs;
  for (int k = 0; k < count; ++k) {
    in[static_cast<std::size_t>(k)].resize(100 + static_cast<std::size_t>(k) * 37);
    recvs.push_back(t.irecv(left, base_tag, std::span<std::byte>(in[static_cast<std::size_t>(k)])));
  }
  std::vector<std::byte> got_b(10);
  auto rb = t.irecv(left, base_tag + 2, std::span<std::byte>(got_b));
  if (!rb.wait_until(deadline)) fail("p2p: timed out on tag B");
  expect_message(got_b, left, 10, seed + 101, "p2p tag B");
  if constexpr (message_transport<T>) {
    message_buffer got_a;
    auto ra = t.irecv(left, base_tag + 1, got_a);
    if (!ra.wait_until(deadline)) fail("p2p: timed out on tag A");
    expect_message(got_a.span(), left, 3000, seed + 100, "p2p tag A (variable length)");
  } else {
    std::vector<std::byte> got_a(3000);
    auto ra = t.irecv(left, base_tag + 1, std::span<std::byte>(got_a));
    if (!ra.wait_until(deadline)) fail("p2p: timed out on tag A");
    expect_message(got_a, left, 3000, seed + 100, "p2p tag A");
  }
  for (int k = 0; k < count; ++k) {
    if (!recvs[static_cast<std::size_t>(k)].wait_until(deadline))
      fail("p2p: timed out on an ordered message");
    expect_message(in[static_cast<std::size_t>(k)], left, 100 + static_cast<std::size_t>(k) * 37,
                   seed + static_cast<std::uint64_t>(k),
                   "p2p ordered message " + std::to_string(k));
  }
  for (auto& s : sends) {
    if (!s.wait_until(deadline)) fail("p2p: timed out on a send");
  }
}

/// Every collective on every algorithm at a few sizes (what the multi-process workers run).
/// `big` is the size of the largest message (per rank).
template <transport T>
void run_all_scenarios(T& t, std::size_t big, std::uint64_t seed) {
  const int p = t.size();
  p2p_case(t, seed, 100);
  barrier(t, {.tag = 7});
  collective_workspace<T> ws;
  std::vector<message_buffer> out;
  const std::size_t sizes[] = {0, 1, 4095, 65537, big};
  for (auto algorithm :
       {allgather_algorithm::automatic, allgather_algorithm::ring, allgather_algorithm::direct}) {
    for (std::size_t base : sizes) {
      for (std::size_t chunk : {std::size_t{0}, std::size_t{4096}, std::size_t{256} << 10}) {
        allgather_case(
            t, [&](int r) { return base == 0 ? 0 : base + static_cast<std::size_t>(r) * 13; },
            {.tag = 11, .algorithm = algorithm, .chunk_bytes = chunk}, seed + base, ws, out);
      }
    }
    // Lengths that differ a lot: one empty, one big.
    allgather_case(
        t, [&](int r) { return r == 0 ? 0 : (r == p - 1 ? big : 17); },
        {.tag = 12, .algorithm = algorithm, .chunk_bytes = 8192}, seed + 5, ws, out);
  }
  for (std::size_t n :
       {std::size_t{0}, std::size_t{1}, std::size_t{3}, std::size_t{1000}, big / 4 + 1}) {
    for (std::size_t chunk : {std::size_t{0}, std::size_t{1024}, std::size_t{256} << 10}) {
      allreduce_case<float>(t, n, {.tag = 13, .chunk_bytes = chunk}, seed + n);
      allreduce_case<double>(
          t, n, {.tag = 13, .algorithm = allreduce_algorithm::ring, .chunk_bytes = chunk},
          seed + n);
    }
    allreduce_case<float>(t, n, {.tag = 14, .average = true}, seed + n + 1);
    reduce_scatter_case<float>(t, n, {.tag = 17, .chunk_bytes = 4096}, seed + n + 3);
    allreduce_case<std::int64_t>(t, n, {.tag = 14}, seed + n + 2);
  }
  for (int root = 0; root < p; ++root) {
    broadcast_case(t, root, root == 0 ? big : 1000 + static_cast<std::size_t>(root),
                   {.tag = 15, .chunk_bytes = 65536}, seed + 77);
  }
  broadcast_case(t, p - 1, 0, {.tag = 15}, seed + 78);
  barrier(t, {.tag = 16});
}

}  // namespace stellatrain::test
