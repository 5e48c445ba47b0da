// SPDX-License-Identifier: Apache-2.0
// Packing, unpacking and aggregation against memcpy baselines, in one run:
//   BM_pack_memcpy/k:K/threads:T            memcpy of 8 K bytes (a u32 index + an fp32 value per
//                                           pair: what the reference sends), T threads
//   BM_pack_pack/<index>/<value>/ppm:P/threads:T    pack K = P * 25M / 1e6 pairs of a 25M tensor
//   BM_pack_unpack/<index>/<value>/ppm:P/threads:T  parse (checksum + full validation) and decode
//                                           into u32 indices and float values, under one
//                                           stay_awake guard (as the unpacker's comment advises)
//   BM_pack_merge/lists:4/k:250000/threads:T      k-way merge of 4 sorted lists into one
//   BM_pack_merge_memcpy/lists:4/k:250000/threads:T  memcpy of the merge's input bytes
//   BM_pack_scatter_add/lists:4/ppm:P/threads:T   the dense alternative of the merge
//   BM_pack_chunked/<op>/bits:W/threads:T   pack, or parse and decode, the chunked section of
//                                           25M (64 of every 4096, W-bit values, as
//                                           chunked_codec selects them); baseline: BM_pack_memcpy
//                                           at k:390656, the same pairs
//   BM_pack_crc32c/bytes:B                  the checksum alone
//   BM_pack_bits/<op>/<kernel>/b:B          the vertical bit packing of full index blocks: 64
//                                           blocks of 256 values of B bits, op pack or unpack,
//                                           kernel simd (what the packer runs) or scalar (the
//                                           test oracle), in L2
// Indices are uniformly random, sorted (core sample_sorted_indices), values N(0, 1). Pack and
// unpack report the user counter bytes_per_element: message bytes (headers and checksum
// included) per pair. Buffers are pre-faulted and packer/unpacker warmed up before timing.
#include <stellatrain/compress/chunked_codec.hpp>
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/random_indices.hpp>
#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/detail/bit_packing.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>

#include "bench_support.hpp"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace sb = stellatrain::bench;
namespace st = stellatrain;

namespace {

constexpr std::uint64_t n = static_cast<std::uint64_t>(sb::n25m);

struct selection {
  st::aligned_buffer<std::uint32_t> indices;
  st::aligned_buffer<float> values;
  st::sparse_view<const float, const std::uint32_t> view() const {
    return {indices.span(), values.span(), n};
  }
};

// Sorted, uniformly random selections of `k` out of 25M, made once per (k, seed).
const selection& random_selection(std::uint64_t k, std::uint32_t seed = 0) {
  static std::map<std::pair<std::uint64_t, std::uint32_t>, std::unique_ptr<selection>> cache;
  auto& entry = cache[{k, seed}];
  if (!entry) {
    entry = std::make_unique<selection>();
    entry->indices = sb::prefaulted<std::uint32_t>(k);
    std::vector<std::uint64_t> ws(st::sample_indices_workspace_words(n));
    st::sample_sorted_indices<std::uint32_t>({.seed = 12345, .step = seed, .tensor = 0}, n, k,
                                             entry->indices.span(), ws);
    entry->values = sb::gaussian(k, seed + 1);
  }
  return *entry;
}

std::uint64_t pairs_of(std::int64_t ppm) { return n * static_cast<std::uint64_t>(ppm) / 1'000'000; }

void BM_pack_memcpy(benchmark::State& state) {
  const auto k = static_cast<std::size_t>(state.range(0));
  const auto threads = static_cast<std::size_t>(state.range(1));
  auto src = sb::prefaulted<std::byte>(8 * k);
  auto dst = sb::prefaulted<std::byte>(8 * k);
  for (auto _ : state) {
    sb::split_per_thread(threads, 8 * k, 64, [&](std::size_t b, std::size_t e) {
      std::memcpy(dst.data() + b, src.data() + b, e - b);
    });
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * k));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * 16 * k));
}

void pack_case(benchmark::State& state, st::index_encoding ie, st::value_encoding ve,
               std::int64_t ppm, std::size_t threads) {
  const auto& sel = random_selection(pairs_of(ppm));
  auto& ex = sb::pool(threads);
  st::message_packer packer;
  packer.clear();
  packer.add(0, sel.view(), {.indices = ie, .values = ve});
  const std::size_t bytes = packer.prepare(ex);
  auto out = sb::prefaulted<std::byte>(bytes);
  packer.write(out.span(), ex);  // warm up
  for (auto _ : state) {
    packer.clear();
    packer.add(0, sel.view(), {.indices = ie, .values = ve});
    benchmark::DoNotOptimize(packer.pack(out.span(), ex).data());
    benchmark::ClobberMemory();
  }
  const auto k = static_cast<double>(sel.indices.size());
  state.counters["bytes_per_element"] = static_cast<double>(bytes) / k;
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * sel.indices.size()));
  state.SetBytesProcessed(
      static_cast<std::int64_t>(state.iterations() * (8 * sel.indices.size() + bytes)));
}

void unpack_case(benchmark::State& state, st::index_encoding ie, st::value_encoding ve,
                 std::int64_t ppm, std::size_t threads) {
  const auto& sel = random_selection(pairs_of(ppm));
  auto& ex = sb::pool(threads);
  st::message_packer packer;
  std::span<const std::byte> message;
  st::aligned_buffer<std::byte> buffer;
  if (ie == st::index_encoding::random_k) {
    packer.add_random_k<float>(0, {.seed = 1}, n, sel.values.span(), ve);
  } else {
    packer.add(0, sel.view(), {.indices = ie, .values = ve});
  }
  buffer = sb::prefaulted<std::byte>(packer.prepare(ex));
  message = packer.write(buffer.span(), ex);
  const std::vector<st::tensor_info> tensors = {{0, n}};
  st::message_unpacker unpacker(tensors);
  unpacker.reserve_random_k(n);
  auto indices = sb::prefaulted<std::uint32_t>(sel.indices.size());
  auto values = sb::prefaulted<float>(sel.indices.size());
  for (auto _ : state) {
    const auto awake = st::stay_awake(ex);  // parse and decode back to back, as documented
    const auto& info = unpacker.parse(message, ex);
    unpacker.decode(0, indices.span(), values.span(), ex);
    benchmark::DoNotOptimize(info.sections.data());
    benchmark::ClobberMemory();
  }
  if (ie != st::index_encoding::random_k &&
      std::memcmp(indices.data(), sel.indices.data(), indices.size_bytes()) != 0) {
    state.SkipWithError("unpacked indices differ from the packed ones");
  }
  state.counters["bytes_per_element"] =
      static_cast<double>(message.size()) / static_cast<double>(sel.indices.size());
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * sel.indices.size()));
  state.SetBytesProcessed(
      static_cast<std::int64_t>(state.iterations() * (8 * sel.indices.size() + message.size())));
}

std::vector<st::sparse_view<const float, const std::uint32_t>> merge_inputs(std::size_t lists,
                                                                            std::uint64_t k) {
  std::vector<st::sparse_view<const float, const std::uint32_t>> in;
  for (std::size_t w = 0; w < lists; ++w)
    in.push_back(random_selection(k, static_cast<std::uint32_t>(w + 1)).view());
  return in;
}

void BM_pack_merge(benchmark::State& state) {
  const auto lists = static_cast<std::size_t>(state.range(0));
  const auto k = static_cast<std::uint64_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto in = merge_inputs(lists, k);
  st::sparse_buffer<float> out(n, lists * k, {.prefault = true});
  st::sparse_merger merger;
  auto& ex = sb::pool(threads);
  merger.merge<float, std::uint32_t>(in, out, st::reduction::sum, ex);
  for (auto _ : state) {
    merger.merge<float, std::uint32_t>(in, out, st::reduction::sum, ex);
    benchmark::ClobberMemory();
  }
  state.counters["merged"] = static_cast<double>(out.size());
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * lists * k));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * lists * k * 8));
}

void BM_pack_merge_memcpy(benchmark::State& state) {
  const auto lists = static_cast<std::size_t>(state.range(0));
  const auto k = static_cast<std::size_t>(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const std::size_t bytes = lists * k * 8;
  auto src = sb::prefaulted<std::byte>(bytes);
  auto dst = sb::prefaulted<std::byte>(bytes);
  for (auto _ : state) {
    sb::split_per_thread(threads, bytes, 64, [&](std::size_t b, std::size_t e) {
      std::memcpy(dst.data() + b, src.data() + b, e - b);
    });
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * lists * k));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes * 2));
}

void BM_pack_scatter_add(benchmark::State& state) {
  const auto lists = static_cast<std::size_t>(state.range(0));
  const auto k = pairs_of(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto in = merge_inputs(lists, k);
  auto dense = sb::prefaulted<float>(n);
  st::sparse_merger merger;
  auto& ex = sb::pool(threads);
  for (auto _ : state) {
    merger.scatter_add<float, std::uint32_t>(in, dense.span(), st::reduction::sum, ex);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * lists * k));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * (lists * k * 8 + n * 4)));
}

void BM_pack_merge_ppm(benchmark::State& state) {
  const auto lists = static_cast<std::size_t>(state.range(0));
  const auto k = pairs_of(state.range(1));
  const auto threads = static_cast<std::size_t>(state.range(2));
  const auto in = merge_inputs(lists, k);
  st::sparse_buffer<float> out(n, lists * k, {.prefault = true});
  st::sparse_merger merger;
  auto& ex = sb::pool(threads);
  for (auto _ : state) {
    merger.merge<float, std::uint32_t>(in, out, st::reduction::sum, ex);
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * lists * k));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * lists * k * 8));
}

// The chunked selection of 25M N(0, 1) values, 64 of every 4096, per value width.
const st::chunked_selection& chunked_of(st::chunk_value_bits bits) {
  static std::map<st::chunk_value_bits, std::unique_ptr<st::chunked_selection>> cache;
  auto& entry = cache[bits];
  if (!entry) {
    entry = std::make_unique<st::chunked_selection>();
    const auto g = sb::gaussian(n, 3);
    std::vector<float> feedback(n, 0.0f);
    st::chunked_codec({.chunk_bits = 12, .k = 64, .bits = bits}).encode(g.span(), feedback, *entry);
  }
  return *entry;
}

void chunked_case(benchmark::State& state, bool pack, st::chunk_value_bits bits,
                  std::size_t threads) {
  const auto& sel = chunked_of(bits);
  auto& ex = sb::pool(threads);
  st::message_packer packer;
  packer.add_chunked(0, sel.section());
  auto buffer = sb::prefaulted<std::byte>(packer.prepare(ex));
  const auto message = packer.write(buffer.span(), ex);
  const std::vector<st::tensor_info> tensors = {{0, n}};
  st::message_unpacker unpacker(tensors);
  auto indices = sb::prefaulted<std::uint32_t>(sel.indices.size());
  auto values = sb::prefaulted<float>(sel.indices.size());
  for (auto _ : state) {
    if (pack) {
      packer.clear();
      packer.add_chunked(0, sel.section());
      benchmark::DoNotOptimize(packer.pack(buffer.span(), ex).data());
    } else {
      const auto awake = st::stay_awake(ex);
      const auto& info = unpacker.parse(message, ex);
      unpacker.decode(0, indices.span(), values.span(), ex);
      benchmark::DoNotOptimize(info.sections.data());
    }
    benchmark::ClobberMemory();
  }
  if (!pack) {
    for (std::size_t j = 0; j < sel.indices.size(); ++j) {
      if (indices[j] % 4096 != sel.indices[j]) {
        state.SkipWithError("unpacked indices differ from the packed ones");
        break;
      }
    }
  }
  state.counters["bytes_per_element"] =
      static_cast<double>(message.size()) / static_cast<double>(sel.indices.size());
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * sel.indices.size()));
}

void BM_pack_crc32c(benchmark::State& state) {
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto data = sb::prefaulted<std::byte>(bytes);
  for (std::size_t i = 0; i < bytes; ++i) data[i] = static_cast<std::byte>(i * 2654435761u >> 24);
  for (auto _ : state) benchmark::DoNotOptimize(st::crc32c(data.span()));
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * bytes));
}

// 64 blocks of 256 values below 2^b, and the same packed; each unpacked block is checked.
void bits_case(benchmark::State& state, bool pack, bool simd, unsigned b) {
  namespace sd = st::detail;
  constexpr std::size_t blocks = 64;
  constexpr std::size_t per = st::wire::block_elements;
  auto v = sb::prefaulted<std::uint32_t>(blocks * per);
  auto out = sb::prefaulted<std::uint32_t>(blocks * per);
  auto packed = sb::prefaulted<std::byte>(blocks * per * 4);
  std::uint64_t x = 0x9e3779b97f4a7c15u * (b + 1);
  for (auto& e : v.span()) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    e = static_cast<std::uint32_t>(x) & sd::low_mask32(b);
  }
  const std::size_t bytes = per * b / 8;
  for (std::size_t i = 0; i < blocks; ++i) sd::pack_vertical(&v[i * per], b, &packed[i * bytes]);
  for (auto _ : state) {
    for (std::size_t i = 0; i < blocks; ++i) {
      if (pack && simd) sd::pack_vertical(&v[i * per], b, &packed[i * bytes]);
      if (pack && !simd) sd::pack_vertical_scalar(&v[i * per], b, &packed[i * bytes]);
      if (!pack && simd) sd::unpack_vertical(&packed[i * bytes], b, &out[i * per]);
      if (!pack && !simd) sd::unpack_vertical_scalar(&packed[i * bytes], b, &out[i * per]);
    }
    benchmark::ClobberMemory();
  }
  if (!pack && std::memcmp(out.data(), v.data(), blocks * per * sizeof(std::uint32_t)) != 0) {
    state.SkipWithError("unpacked values differ");
  }
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * blocks * per));
}

constexpr std::int64_t densities_ppm[] = {1000, 10000, 100000};  // 0.1%, 1%, 10%
constexpr int thread_counts[] = {1, 2};

const bool registered = [] {
  for (std::int64_t ppm : densities_ppm) {
    for (int t : thread_counts) {
      benchmark::RegisterBenchmark("BM_pack_memcpy", BM_pack_memcpy)
          ->Args({static_cast<std::int64_t>(pairs_of(ppm)), t})
          ->ArgNames({"k", "threads"})
          ->UseRealTime();
    }
  }
  const st::index_encoding index_encodings[] = {
      st::index_encoding::delta_bitpacked, st::index_encoding::delta_varint,
      st::index_encoding::raw_u32,         st::index_encoding::raw_u64,
      st::index_encoding::bitmap,          st::index_encoding::random_k,
      st::index_encoding::automatic};
  const st::value_encoding value_encodings[] = {st::value_encoding::fp32, st::value_encoding::bf16,
                                                st::value_encoding::fp16};
  for (auto ie : index_encodings) {
    for (auto ve : value_encodings) {
      for (std::int64_t ppm : densities_ppm) {
        for (int t : thread_counts) {
          const std::string suffix = std::string(st::name_of(ie)) + "/" +
                                     std::string(st::name_of(ve)) + "/ppm:" + std::to_string(ppm) +
                                     "/threads:" + std::to_string(t);
          if (ie != st::index_encoding::random_k) {
            benchmark::RegisterBenchmark(("BM_pack_pack/" + suffix).c_str(), pack_case, ie, ve, ppm,
                                         static_cast<std::size_t>(t))
                ->UseRealTime();
          }
          if (ie != st::index_encoding::automatic) {
            benchmark::RegisterBenchmark(("BM_pack_unpack/" + suffix).c_str(), unpack_case, ie, ve,
                                         ppm, static_cast<std::size_t>(t))
                ->UseRealTime();
          }
        }
      }
    }
  }
  for (int t : thread_counts) {
    benchmark::RegisterBenchmark("BM_pack_memcpy", BM_pack_memcpy)
        ->Args({static_cast<std::int64_t>(st::wire::chunked_shape_of(n, 12, 64, 2).count), t})
        ->ArgNames({"k", "threads"})
        ->UseRealTime();
    for (auto bits : {st::chunk_value_bits::one, st::chunk_value_bits::two}) {
      for (bool pack : {true, false}) {
        const std::string name = std::string("BM_pack_chunked/") + (pack ? "pack" : "unpack") +
                                 "/bits:" + std::to_string(static_cast<int>(bits)) +
                                 "/threads:" + std::to_string(t);
        benchmark::RegisterBenchmark(name.c_str(), chunked_case, pack, bits,
                                     static_cast<std::size_t>(t))
            ->UseRealTime();
      }
    }
  }
  for (int t : thread_counts) {
    benchmark::RegisterBenchmark("BM_pack_merge", BM_pack_merge)
        ->Args({4, 250000, t})
        ->ArgNames({"lists", "k", "threads"})
        ->UseRealTime();
    benchmark::RegisterBenchmark("BM_pack_merge_memcpy", BM_pack_merge_memcpy)
        ->Args({4, 250000, t})
        ->ArgNames({"lists", "k", "threads"})
        ->UseRealTime();
    for (std::int64_t ppm : {10000, 50000, 100000, 250000}) {
      benchmark::RegisterBenchmark("BM_pack_merge_ppm", BM_pack_merge_ppm)
          ->Args({4, ppm, t})
          ->ArgNames({"lists", "ppm", "threads"})
          ->UseRealTime();
      benchmark::RegisterBenchmark("BM_pack_scatter_add", BM_pack_scatter_add)
          ->Args({4, ppm, t})
          ->ArgNames({"lists", "ppm", "threads"})
          ->UseRealTime();
    }
  }
  benchmark::RegisterBenchmark("BM_pack_crc32c", BM_pack_crc32c)->Arg(1 << 20)->ArgName("bytes");
  for (const bool pack : {true, false}) {
    for (const bool simd : {true, false}) {
      for (const unsigned b : {4u, 8u, 13u, 20u}) {
        const std::string name = std::string("BM_pack_bits/") + (pack ? "pack/" : "unpack/") +
                                 (simd ? "simd" : "scalar") + "/b:" + std::to_string(b);
        benchmark::RegisterBenchmark(name.c_str(), bits_case, pack, simd, b);
      }
    }
  }
  return true;
}();

}  // namespace
