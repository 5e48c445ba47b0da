// SPDX-License-Identifier: Apache-2.0
// Every kernel that takes an xsimd architecture, instantiated for every architecture this unit
// can target (xsimd::supported_architectures: SSE2 alone in a plain x86-64 build, SSE2 to AVX2
// or AVX-512 in the builds of targets.cmake, which compile this folder for each) and for
// scalar_arch where the kernel has a scalar path: a kernel that does not compile for one of them
// breaks the build. The selector and lane classes are instantiated explicitly (every member);
// the function and member templates by `run_kernels<Arch>`, which also runs them on small
// inputs for the architectures this CPU executes, against the scalar oracle where one exists.
// (Here rather than in a part of its own: this folder is the one built for every ISA.) Where
// the AVX2 unit is built too, the AVX-512 unit takes only the AVX-512 architectures
// (STELLATRAIN_TEST_AVX512_ONLY), so that no architecture is compiled twice for nothing.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/detail/cpu_dispatch.hpp>
#include <stellatrain/core/detail/simd_lanes.hpp>
#include <stellatrain/core/detail/value_convert.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/pack/detail/bit_packing.hpp>
#include <stellatrain/pack/detail/index_codec.hpp>
#include <stellatrain/pack/detail/value_codec.hpp>
#include <stellatrain/select/block_topk.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/runtime_selector.hpp>
#include <stellatrain/select/sampled_threshold.hpp>
#include <stellatrain/select/selection_source.hpp>
#include <stellatrain/select/threshold.hpp>

#include "catch.hpp"
#include "select_test_support.hpp"

#include <xsimd/xsimd.hpp>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace st = stellatrain;
namespace sd = stellatrain::detail;

// ------------------------------------------------------------------------------------------
// Explicit instantiations of the class templates, one line per architecture this unit targets.

template <class Arch>
inline constexpr bool classes_instantiated = false;

#ifdef STELLATRAIN_TEST_AVX512_ONLY
#define STELLATRAIN_BELOW_AVX512 0
template <class Arch>
inline constexpr bool unit_covers = sd::lane_isa_of<Arch>() == sd::lane_isa::avx512;
#else
#define STELLATRAIN_BELOW_AVX512 1
template <class Arch>
inline constexpr bool unit_covers = true;
#endif

#define STELLATRAIN_INSTANTIATE_SELECTORS(A)        \
  template class st::exact_topk_selector<A>;        \
  template class st::threshold_selector<A>;         \
  template class st::sampled_threshold_selector<A>; \
  template class st::block_topk_selector<A>;        \
  template class st::random_k_selector<A>;          \
  template class st::runtime_selector<A>;

#define STELLATRAIN_INSTANTIATE_CLASSES(A)              \
  template <>                                           \
  inline constexpr bool classes_instantiated<A> = true; \
  STELLATRAIN_INSTANTIATE_SELECTORS(A)                  \
  template struct sd::lane_ops<A>;

STELLATRAIN_INSTANTIATE_SELECTORS(st::scalar_arch)
#if XSIMD_WITH_SSE2 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::sse2)
#endif
#if XSIMD_WITH_SSE3 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::sse3)
#endif
#if XSIMD_WITH_SSSE3 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::ssse3)
#endif
#if XSIMD_WITH_SSE4_1 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::sse4_1)
#endif
#if XSIMD_WITH_SSE4_2 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::sse4_2)
#endif
#if XSIMD_WITH_FMA3_SSE && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::fma3<xsimd::sse4_2>)
#endif
#if XSIMD_WITH_FMA4 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::fma4)
#endif
#if XSIMD_WITH_AVX && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx)
#endif
#if XSIMD_WITH_FMA3_AVX && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::fma3<xsimd::avx>)
#endif
#if XSIMD_WITH_AVX2 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx2)
#endif
#if XSIMD_WITH_FMA3_AVX2 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::fma3<xsimd::avx2>)
#endif
#if XSIMD_WITH_AVX512F
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512f)
#endif
#if XSIMD_WITH_AVX512CD
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512cd)
#endif
#if XSIMD_WITH_AVX512DQ
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512dq)
#endif
#if XSIMD_WITH_AVX512BW
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512bw)
#endif
// The architectures of newer xsimd releases: the AVX-512 extensions and AVX-VNNI (12), their
// 128- and 256-bit forms and plain AVX-512 VL (14.3).
#define STELLATRAIN_XSIMD_AT_LEAST(major, minor) \
  (XSIMD_VERSION_MAJOR > (major) ||              \
   (XSIMD_VERSION_MAJOR == (major) && XSIMD_VERSION_MINOR >= (minor)))
#if STELLATRAIN_XSIMD_AT_LEAST(12, 0)
#if XSIMD_WITH_AVXVNNI && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avxvnni)
#endif
#if XSIMD_WITH_AVX512ER
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512er)
#endif
#if XSIMD_WITH_AVX512PF
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512pf)
#endif
#if XSIMD_WITH_AVX512IFMA
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512ifma)
#endif
#if XSIMD_WITH_AVX512VBMI
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vbmi)
#endif
#if XSIMD_WITH_AVX512VNNI_AVX512BW
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vnni<xsimd::avx512bw>)
#endif
#endif
#if STELLATRAIN_XSIMD_AT_LEAST(12, 0) && !STELLATRAIN_XSIMD_AT_LEAST(14, 0)
#if XSIMD_WITH_AVX512VNNI_AVX512VBMI
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vnni<xsimd::avx512vbmi>)
#endif
#endif
#if STELLATRAIN_XSIMD_AT_LEAST(14, 0)
#if XSIMD_WITH_AVX512VBMI2
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vbmi2)
#endif
#if XSIMD_WITH_AVX512VNNI_AVX512VBMI2
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vnni<xsimd::avx512vbmi2>)
#endif
#endif
#if STELLATRAIN_XSIMD_AT_LEAST(14, 3)
#if XSIMD_WITH_AVX && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx_128)
#endif
#if XSIMD_WITH_AVX2 && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx2_128)
#endif
#if XSIMD_WITH_AVX512VL && STELLATRAIN_BELOW_AVX512
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vl_128)
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vl_256)
#endif
#if XSIMD_WITH_AVX512VL
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::avx512vl)
#endif
#endif
#if XSIMD_WITH_NEON
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::neon)
#endif
#if XSIMD_WITH_NEON64
STELLATRAIN_INSTANTIATE_CLASSES(xsimd::neon64)
#endif

// The list above misses none of the architectures xsimd says this unit supports.
static_assert([]<class... A>(xsimd::arch_list<A...>) {
  return ((classes_instantiated<A> || !unit_covers<A>)&&...);
}(xsimd::supported_architectures{}));

namespace {

// ------------------------------------------------------------------------------------------
// The function and member templates, run on small inputs.

constexpr std::uint64_t n = 4099;  // no multiple of any width or block
constexpr std::uint64_t k = 41;

// What one selector emitted: (index, raw bits) in position order.
using picks = std::vector<std::pair<std::uint64_t, std::uint32_t>>;

template <class Selector, class T>
picks select_with(st::thread_pool& pool, const Selector& sel, const std::vector<T>& x) {
  typename Selector::tensor_state state{};
  typename Selector::workspace ws;
  sel.reserve(pool, ws, n, k);
  picks out(k);
  const auto stats =
      sel.select_from(pool, state, ws, st::plain_source<T>{x.data()}, n, k, {.step = 1},
                      [&](std::uint64_t pos, std::uint64_t i, std::uint32_t bits) {
                        out[pos] = {i, bits};
                      });
  out.resize(stats.count);
  return out;
}

template <class Arch, class T>
std::vector<picks> select_all(st::thread_pool& pool, const std::vector<T>& x) {
  std::vector<picks> r;
  r.push_back(select_with(pool, st::exact_topk_selector<Arch>(), x));
  r.push_back(select_with(pool, st::threshold_selector<Arch>(), x));
  r.push_back(select_with(pool, st::sampled_threshold_selector<Arch>(), x));
  r.push_back(select_with(pool, st::block_topk_selector<Arch>(), x));
  r.push_back(select_with(pool, st::random_k_selector<Arch>(7), x));
  for (auto method : {st::selection_method::exact_topk, st::selection_method::threshold,
                      st::selection_method::sampled_threshold, st::selection_method::block_topk,
                      st::selection_method::random_k}) {
    r.push_back(select_with(pool, st::runtime_selector<Arch>({.method = method}), x));
  }
  return r;
}

// The compressor over an Arch's selector (its values depend on how the unit contracts
// multiply-adds, so only the count is checked).
template <class Arch>
void compress_with(st::thread_pool& pool) {
  st::error_feedback_compressor<st::threshold_selector<Arch>, st::bf16> ef;
  ef.add_tensor(pool, 0, n);
  st::sparse_buffer<st::bf16> sent;
  const auto g = st::test::gaussian(n, 9);
  for (int step = 0; step < 2; ++step) {
    ef.compress(pool, 0, g, k, sent);
    REQUIRE(sent.size() == k);
  }
}

template <class Arch, class Optimizer, class Grad, class Out>
void step_dense(st::thread_pool& pool, Optimizer& opt, std::size_t t, const std::vector<Grad>& g) {
  std::vector<Out> copy(n);
  opt.template step<Arch>(t, std::span<const Grad>(g), pool, st::param_copy<Out>{copy});
  for (std::size_t i = 0; i < n; i += 97) {
    REQUIRE(std::bit_cast<std::uint32_t>(st::to_float(copy[i])) ==
            std::bit_cast<std::uint32_t>(st::to_float(st::from_float<Out>(opt.params(t)[i]))));
  }
}

template <class Arch, class Optimizer, class Options>
void step_all(st::thread_pool& pool, const Options& options) {
  Optimizer opt(options);
  const auto t = opt.add_tensor(st::test::gaussian(n, 3), pool);
  const auto g = st::test::gaussian(n, 4);
  // Each gradient type and each copy type once (every pair would only cost compile time).
  step_dense<Arch, Optimizer, float, st::fp16>(pool, opt, t, g);
  step_dense<Arch, Optimizer, st::bf16, st::bf16>(pool, opt, t, st::test::gaussian<st::bf16>(n, 5));
  step_dense<Arch, Optimizer, st::fp16, float>(pool, opt, t, st::test::gaussian<st::fp16>(n, 6));
  std::vector<std::uint32_t> idx;
  std::vector<float> val;
  for (std::uint32_t i = 0; i < n; i += 13) {
    idx.push_back(i);
    val.push_back(0.25f);
  }
  std::vector<st::bf16> copy(idx.size());
  const st::sparse_view<const float, const std::uint32_t> sparse{idx, val, n};
  opt.template step<Arch>(t, sparse, pool, st::param_copy<st::bf16>{copy});
}

// Values that exercise every rounding path of the 16-bit conversions.
std::vector<float> tricky_floats() {
  std::vector<float> v{0.0f,
                       -0.0f,
                       1.0f,
                       1.00390625f,
                       65504.0f,
                       65520.0f,
                       3.0e-8f,
                       1.0e-6f,
                       std::bit_cast<float>(0x7f800000u),
                       std::bit_cast<float>(0xff812345u),
                       std::bit_cast<float>(0x7fa00001u),
                       std::bit_cast<float>(0x3f808000u),
                       std::bit_cast<float>(0x3f818000u),
                       std::bit_cast<float>(0x3f801000u)};
  for (std::uint32_t b = 0; b < 4000; ++b) v.push_back(std::bit_cast<float>(b * 0x0010c6f7u));
  return v;
}

template <class Arch, class T>
void convert_batches() {
  using batch = xsimd::batch<float, Arch>;
  const auto v = tricky_floats();
  std::vector<T> h(v.size() + batch::size);
  for (std::size_t i = 0; i + batch::size <= v.size(); i += batch::size) {
    sd::store_from_float<Arch>(h.data() + i, batch::load_unaligned(v.data() + i));
    alignas(64) float back[batch::size];
    sd::load_as_float<Arch>(h.data() + i).store_aligned(back);
    for (std::size_t l = 0; l < batch::size; ++l) {
      REQUIRE(h[i + l].bits() == T(v[i + l]).bits());
      REQUIRE(std::bit_cast<std::uint32_t>(back[l]) ==
              std::bit_cast<std::uint32_t>(st::to_float(h[i + l])));
    }
  }
  std::vector<float> f(v.size());
  for (std::size_t i = 0; i + batch::size <= v.size(); i += batch::size) {
    sd::store_from_float<Arch>(f.data() + i, sd::load_as_float<Arch>(v.data() + i));
  }
}

template <class Arch, class T>
void convert_arrays() {
  const auto v = tricky_floats();
  std::vector<std::byte> wire(2 * v.size());
  const std::size_t m = sd::halves_from_floats<Arch, T>(v.data(), v.size(), wire.data());
  REQUIRE(m <= v.size());
  std::vector<float> back(m);
  REQUIRE(sd::floats_from_halves<Arch, T>(wire.data(), m, back.data()) == m);
  for (std::size_t i = 0; i < m; ++i) {
    std::uint16_t bits;
    std::memcpy(&bits, wire.data() + 2 * i, 2);
    REQUIRE(bits == T(v[i]).bits());
    REQUIRE(std::bit_cast<std::uint32_t>(back[i]) ==
            std::bit_cast<std::uint32_t>(st::to_float(T::from_bits(bits))));
  }
}

template <class Arch>
void pack_kernels() {
  std::vector<std::uint32_t> v(256), back(256);
  for (std::uint32_t i = 0; i < 256; ++i) v[i] = (i * 2654435761u) & 0x1fffu;
  std::vector<std::byte> packed(32 * 13);
  sd::pack_vertical<Arch>(v.data(), 13, packed.data());
  sd::unpack_vertical<Arch>(packed.data(), 13, back.data());
  REQUIRE(back == v);
  std::vector<std::uint32_t> out(256);
  sd::store_indices_u32<Arch>(v.data(), 256, 5, out.data());
  std::uint32_t expect = 5;
  for (std::size_t j = 0; j < 256; ++j) {
    expect += v[j];
    REQUIRE(out[j] == expect++);
  }
  const unsigned t[8] = {1, 2, 3, 5, 8, 10, 11, 12};
  std::uint32_t counts[8];
  sd::count_wider<std::uint32_t, Arch>(v.data(), 256, t, 8, counts);
  std::vector<std::uint64_t> v64(v.begin(), v.end());
  sd::count_wider<std::uint64_t, Arch>(v64.data(), 256, t, 8, counts);
  std::uint8_t pos[256 + 8];
  REQUIRE(sd::exception_positions<std::uint32_t, Arch>(v.data(), 256, 12, pos) ==
          sd::exception_positions<std::uint64_t, Arch>(v64.data(), 256, 12, pos));

  // A chunk of indices through the delta_bitpacked codec, 32 and 64 bits wide.
  std::vector<std::uint32_t> idx;
  for (std::uint32_t i = 0, x = 3; i < 1000; ++i, x += 1 + (i * 7919u) % 300u) idx.push_back(x);
  std::vector<std::uint64_t> idx64(idx.begin(), idx.end());
  std::vector<std::byte> chunk(sd::bitpacked_chunk_bound<std::uint64_t>(idx.size()));
  const auto e32 =
      sd::encode_bitpacked_chunk<std::uint32_t, Arch>(idx.data(), idx.size(), 0, chunk.data());
  const auto e64 =
      sd::encode_bitpacked_chunk<std::uint64_t, Arch>(idx64.data(), idx64.size(), 0, chunk.data());
  REQUIRE(e32.bytes == e64.bytes);
  sd::codec_failure failure;
  std::vector<std::uint32_t> d32(idx.size());
  std::vector<std::uint64_t> d64(idx.size());
  const std::byte* p = chunk.data();
  std::uint64_t base = 0;
  REQUIRE(sd::decode_bitpacked_chunk<void, Arch>(p, chunk.data() + e64.bytes, idx.size(), base,
                                                 static_cast<void*>(nullptr), failure));
  p = chunk.data();
  base = 0;
  REQUIRE(sd::decode_bitpacked_chunk<std::uint32_t, Arch>(p, chunk.data() + e64.bytes, idx.size(),
                                                          base, d32.data(), failure));
  p = chunk.data();
  base = 0;
  REQUIRE(sd::decode_bitpacked_chunk<std::uint64_t, Arch>(p, chunk.data() + e64.bytes, idx.size(),
                                                          base, d64.data(), failure));
  REQUIRE(d32 == idx);
  REQUIRE(d64 == idx64);
}

// Value payloads through the unit's codec for Arch (its conversions may be dispatched beyond
// Arch), against the scalar conversions.
template <class Arch, class V>
void value_codec() {
  const auto x = st::test::gaussian<V>(1001, 8);
  for (auto enc : {st::value_encoding::fp32, st::value_encoding::fp16, st::value_encoding::bf16}) {
    std::vector<std::byte> wire(x.size() * st::value_bytes(enc));
    std::vector<V> back(x.size());
    sd::encode_values<V, Arch>(x.data(), x.size(), enc, wire.data());
    sd::decode_values<V, Arch>(wire.data(), x.size(), enc, back.data());
    for (std::size_t i = 0; i < x.size(); ++i) {
      float w = st::to_float(x[i]);
      if (enc == st::value_encoding::fp16) w = st::to_float(st::fp16(w));
      if (enc == st::value_encoding::bf16) w = st::to_float(st::bf16(w));
      REQUIRE(std::bit_cast<std::uint32_t>(st::to_float(back[i])) ==
              std::bit_cast<std::uint32_t>(st::to_float(st::from_float<V>(w))));
    }
  }
}

template <class Arch>
std::uint32_t checksum(std::span<const std::byte> data) {
  const auto* p = reinterpret_cast<const unsigned char*>(data.data());
  return ~sd::crc32c_update<Arch>(~0u, p, data.size());
}

struct scalar_results {
  std::vector<picks> f32, f16, b16;
};

template <class Arch>
void run_kernels(st::thread_pool& pool, const scalar_results* oracle) {
  const auto x = st::test::row_correlated(n, 2);
  const auto xh = st::test::row_correlated<st::fp16>(n, 2);
  const auto xb = st::test::row_correlated<st::bf16>(n, 2);
  const auto f32 = select_all<Arch>(pool, x);
  const auto f16 = select_all<Arch>(pool, xh);
  const auto b16 = select_all<Arch>(pool, xb);
  if (oracle != nullptr) {
    REQUIRE(f32 == oracle->f32);
    REQUIRE(f16 == oracle->f16);
    REQUIRE(b16 == oracle->b16);
  }
  compress_with<Arch>(pool);
  convert_arrays<Arch, st::fp16>();
  convert_arrays<Arch, st::bf16>();
  const std::vector<std::byte> bytes(10007, std::byte{0x5a});
  REQUIRE(checksum<Arch>(bytes) == sd::crc32c_software(bytes));
  if constexpr (!sd::is_scalar_arch<Arch>) {
    step_all<Arch, st::adam_optimizer>(pool,
                                       st::adam_options{.weight_decay = 0.01f, .amsgrad = true});
    step_all<Arch, st::adam_optimizer>(pool, st::adamw_defaults);
    step_all<Arch, st::sgd_optimizer>(pool, st::sgd_options{.momentum = 0.9f, .nesterov = true});
    convert_batches<Arch, st::fp16>();
    convert_batches<Arch, st::bf16>();
    pack_kernels<Arch>();
    value_codec<Arch, float>();
    value_codec<Arch, st::fp16>();
    value_codec<Arch, st::bf16>();
  }
}

template <class... A>
std::string run_all(st::thread_pool& pool, const scalar_results& oracle, xsimd::arch_list<A...>) {
  std::string ran;
  auto one = [&]<class Arch>() {
    if constexpr (unit_covers<Arch>) {
      if (!sd::cpu_runs<Arch>()) return;
      INFO("architecture " << Arch::name());
      run_kernels<Arch>(pool, &oracle);
      ran += std::string(" ") + Arch::name();
    }
  };
  (one.template operator()<A>(), ...);
  return ran;
}

}  // namespace

TEST_CASE(
    "every kernel instantiates for every architecture this unit targets, and agrees with "
    "scalar_arch",
    "[select][arch]") {
  st::thread_pool pool{2};
  scalar_results oracle;
  oracle.f32 = select_all<st::scalar_arch>(pool, st::test::row_correlated(n, 2));
  oracle.f16 = select_all<st::scalar_arch>(pool, st::test::row_correlated<st::fp16>(n, 2));
  oracle.b16 = select_all<st::scalar_arch>(pool, st::test::row_correlated<st::bf16>(n, 2));
  run_kernels<st::scalar_arch>(pool, nullptr);
  const std::string ran = run_all(pool, oracle, xsimd::supported_architectures{});
  // The unit's own architecture always runs here (the unit itself would not run otherwise).
  WARN("ran on:" << ran);
  REQUIRE(!ran.empty());
}
