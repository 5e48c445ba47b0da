// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpus of the unpack fuzzer: valid messages (each file is one options byte,
// then the message) covering every index and value encoding, chunk directories, exceptions,
// 64-bit indices, random_k, chunked sections, control sections, empty messages and sections.
// Deterministic: rerunning it rewrites the same files.   make_corpus <output folder>
#include "fuzz_unpack_body.hpp"

#include <stellatrain/core/random_indices.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

using namespace stellatrain;
using stellatrain::fuzz::registered_size;

namespace {

std::vector<std::uint64_t> sorted_random(std::uint64_t n, std::uint64_t k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::set<std::uint64_t> s;
  while (s.size() < k) s.insert(rng() % n);
  return {s.begin(), s.end()};
}

std::vector<float> some_values(std::size_t k, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(k);
  for (auto& x : v) x = d(rng);
  return v;
}

// A chunked section of a tensor of n elements: k of every 2^b, random codes and scales.
struct chunked_parts {
  std::vector<std::uint16_t> indices;
  std::vector<std::uint8_t> codes;
  std::vector<bf16> scales;

  chunked_section make(std::uint64_t n, unsigned b, std::uint32_t k, unsigned code_bits,
                       std::uint64_t seed) {
    const auto shape = wire::chunked_shape_of(n, b, k, code_bits);
    std::mt19937_64 rng(seed);
    indices.clear();
    for (std::uint64_t c = 0; c < shape.chunks; ++c) {
      const std::uint64_t length = std::min(std::uint64_t{1} << b, n - (c << b));
      for (auto x : sorted_random(length, std::min<std::uint64_t>(k, length), rng()))
        indices.push_back(static_cast<std::uint16_t>(x));
    }
    codes.resize(static_cast<std::size_t>(shape.value_bytes - shape.scale_bytes));
    for (auto& x : codes) x = static_cast<std::uint8_t>(rng());
    scales.clear();
    for (float v : some_values(static_cast<std::size_t>(code_bits * shape.chunks), seed))
      scales.push_back(bf16(std::fabs(v)));
    return {n, b, k, code_bits, indices, codes, scales};
  }
};

struct writer {
  std::string folder;
  int written = 0;

  void save(const std::string& name, message_packer& p, std::uint8_t options = 0) {
    inline_executor ex;
    std::vector<std::byte> m(p.prepare(ex));
    p.write(m, ex);
    const std::string path = folder + "/" + name + ".bin";
    std::FILE* f = std::fopen(path.c_str(), "wb");
    if (f == nullptr) {
      std::perror(path.c_str());
      std::exit(1);
    }
    std::fputc(options, f);
    std::fwrite(m.data(), 1, m.size(), f);
    std::fclose(f);
    ++written;
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_corpus <output folder>\n");
    return 2;
  }
  writer w{argv[1]};
  const index_encoding encodings[] = {index_encoding::raw_u16,         index_encoding::raw_u32,
                                      index_encoding::raw_u64,         index_encoding::delta_varint,
                                      index_encoding::delta_bitpacked, index_encoding::bitmap};
  // One small section per index encoding, values cycling through the encodings.
  int e = 0;
  for (auto ie : encodings) {
    const std::uint32_t tensor = ie == index_encoding::bitmap ? 7 : 2;
    const std::uint64_t n = ie == index_encoding::bitmap ? 1000 : 65536;
    const auto idx = sorted_random(n, 120, static_cast<std::uint64_t>(e));
    const auto val = some_values(idx.size(), static_cast<std::uint64_t>(e));
    message_packer p;
    p.clear(static_cast<std::uint64_t>(e));
    p.add(tensor, sparse_view<const float, const std::uint64_t>(idx, val, n),
          {.indices = ie, .values = static_cast<value_encoding>(1 + e % 3)});
    w.save(std::string("single_") + std::string(name_of(ie)), p,
           static_cast<std::uint8_t>(e % 2 == 0 ? 0 : 2));
    ++e;
  }
  {  // Every encoding in one message, and a random_k section.
    message_packer p;
    p.clear(77);
    std::vector<std::vector<std::uint64_t>> keep_i;
    std::vector<std::vector<float>> keep_v;
    const std::uint32_t tensors[] = {0, 1, 2, 3, 4, 7};
    const index_encoding mixed[] = {index_encoding::bitmap,       index_encoding::raw_u64,
                                    index_encoding::delta_varint, index_encoding::delta_bitpacked,
                                    index_encoding::raw_u32,      index_encoding::bitmap};
    for (int t = 0; t < 6; ++t) {
      const std::uint64_t n = registered_size(tensors[t]);
      keep_i.push_back(
          sorted_random(n, std::min<std::uint64_t>(n, 30), static_cast<std::uint64_t>(t) + 100));
      keep_v.push_back(some_values(keep_i.back().size(), static_cast<std::uint64_t>(t)));
    }
    for (int t = 0; t < 6; ++t) {
      const std::uint64_t n = registered_size(tensors[t]);
      p.add(tensors[t],
            sparse_view<const float, const std::uint64_t>(keep_i[static_cast<std::size_t>(t)],
                                                          keep_v[static_cast<std::size_t>(t)], n),
            {.indices = mixed[t], .values = static_cast<value_encoding>(1 + t % 3)});
    }
    const auto rv = some_values(7, 9);
    p.add_random_k<float>(11, {.seed = 5, .step = 2, .tensor = 11}, 50, rv, value_encoding::fp16);
    w.save("every_encoding", p);
    w.save("every_encoding_reseal", p, 1);
  }
  {  // Exceptions: mostly small gaps, a few huge ones.
    std::vector<std::uint64_t> idx;
    std::uint64_t x = 0;
    for (std::uint64_t i = 0; i < 600; ++i) idx.push_back(x += (i % 97 == 0 ? 50000 : 3));
    const auto val = some_values(idx.size(), 3);
    message_packer p;
    p.add(4, sparse_view<const float, const std::uint64_t>(idx, val, std::uint64_t{1} << 20),
          {.indices = index_encoding::delta_bitpacked, .values = value_encoding::bf16});
    w.save("bitpacked_exceptions", p);
  }
  {  // Two chunks (a directory): 16400 indices of a 65536-element tensor.
    const auto idx = sorted_random(65536, 16400, 4);
    const auto val = some_values(idx.size(), 4);
    for (auto ie : {index_encoding::delta_bitpacked, index_encoding::delta_varint}) {
      message_packer p;
      p.add(2, sparse_view<const float, const std::uint64_t>(idx, val, 65536),
            {.indices = ie, .values = value_encoding::fp16});
      w.save(std::string("two_chunks_") + std::string(name_of(ie)), p);
    }
  }
  {  // 64-bit indices past 2^32.
    const std::uint64_t n = (std::uint64_t{1} << 33) + 3;
    auto idx = sorted_random(n, 200, 5);
    idx.back() = n - 1;
    const auto val = some_values(idx.size(), 5);
    for (auto ie :
         {index_encoding::raw_u64, index_encoding::delta_varint, index_encoding::delta_bitpacked}) {
      message_packer p;
      p.add(5, sparse_view<const float, const std::uint64_t>(idx, val, n), {.indices = ie});
      w.save(std::string("wide_") + std::string(name_of(ie)), p);
    }
  }
  {  // Empty message; empty sections.
    message_packer p;
    p.clear(1);
    w.save("empty_message", p);
    const std::vector<std::uint64_t> none;
    const std::vector<float> no_values;
    p.add(1, sparse_view<const float, const std::uint64_t>(none, no_values, 100),
          {.indices = index_encoding::delta_bitpacked});
    p.add(9, sparse_view<const float, const std::uint64_t>(none, no_values, 16),
          {.indices = index_encoding::bitmap});
    p.add_random_k<float>(11, {.seed = 1}, 50, no_values);
    w.save("empty_sections", p);
    message_packer q;
    const std::vector<std::uint64_t> all = {0};
    const std::vector<float> one = {1.0f};
    q.add(0, sparse_view<const float, const std::uint64_t>(all, one, 1));
    w.save("full_single_element", q);
  }
  {  // Control sections: with tensors, alone, empty.
    const auto idx = sorted_random(1000, 40, 6);
    const auto val = some_values(idx.size(), 6);
    std::vector<std::byte> reports(88);
    for (std::size_t i = 0; i < reports.size(); ++i)
      reports[i] = static_cast<std::byte>(i * 13 + 1);
    const std::vector<std::byte> app = {std::byte{0xca}, std::byte{0xfe}};
    message_packer p;
    p.clear(3);
    p.add(7, sparse_view<const float, const std::uint64_t>(idx, val, 1000),
          {.values = value_encoding::bf16});
    p.add_control(control_type::step_reports, reports);
    p.add_control(control_type::first_application, app);
    w.save("control_sections", p);
    message_packer q;
    q.add_control(control_type::first_application + 7, {});
    w.save("control_only", q, 2);
  }
  {  // Chunked sections: 1-bit and 2-bit codes, a short last chunk, beside other sections.
    chunked_parts a, b;
    message_packer p;
    p.clear(4);
    p.add_chunked(4, a.make(std::uint64_t{1} << 20, 12, 16, 1, 7));
    w.save("chunked_sign", p);
    message_packer q;
    q.clear(5);
    const auto idx = sorted_random(1000, 40, 8);
    const auto val = some_values(idx.size(), 8);
    q.add(7, sparse_view<const float, const std::uint64_t>(idx, val, 1000),
          {.values = value_encoding::fp16});
    q.add_chunked(3, b.make(70000, 10, 5, 2, 9));
    w.save("chunked_2bit_mixed", q, 2);
  }
  std::printf("make_corpus: wrote %d files to %s\n", w.written, argv[1]);
  return 0;
}
