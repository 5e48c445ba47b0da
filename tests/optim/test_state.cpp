// SPDX-License-Identifier: Apache-2.0
// Saving and restoring optimizer state: bit-identical continuation, and refusal (with a clear
// error, changing nothing) of corrupted, truncated, foreign or mismatched states.
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/optim/state_format.hpp>

#include "catch.hpp"
#include "optim_test_support.hpp"

#include <cstdint>
#include <cstring>
#include <sstream>
#include <vector>

using namespace stellatrain;
using namespace optim_test;

namespace {

using view32 = sparse_view<const float, const std::uint32_t>;

// Two tensors (one empty, one odd-sized), a few dense and sparse steps.
template <class Optimizer>
void train(Optimizer& opt, int first_step, int steps) {
  for (int s = first_step; s < first_step + steps; ++s) {
    const auto seed = static_cast<std::uint64_t>(s);
    const std::size_t n = opt.tensor_size(1);
    if (s % 2 == 0) {
      const auto g = normal(n, seed);
      opt.step(1, std::span<const float>(g));
    } else {
      const auto idx = sorted_indices<std::uint32_t>(n, n / 5, seed);
      const auto val = normal(idx.size(), seed + 1000);
      opt.step(1, view32{idx, val, n});
    }
    opt.step(0, std::span<const float>());
  }
}

template <class Optimizer>
void register_tensors(Optimizer& opt) {
  opt.add_tensor(std::vector<float>{});
  opt.add_tensor(normal(1001, 3));
}

template <class Optimizer>
std::vector<std::byte> save(const Optimizer& opt) {
  std::vector<std::byte> bytes(opt.state_size_bytes());
  REQUIRE(opt.save_state(bytes) == bytes.size());
  return bytes;
}

}  // namespace

TEMPLATE_TEST_CASE("a restored state continues bit-identically", "[optim][state]", sgd_optimizer,
                   adam_optimizer) {
  using options = std::remove_cvref_t<decltype(std::declval<TestType>().options())>;
  std::vector<options> cases;
  if constexpr (std::is_same_v<TestType, sgd_optimizer>) {
    cases = {{.lr = 0.1f, .momentum = 0.9f, .nesterov = true},
             {.lr = 0.1f, .momentum = 0.9f, .dampening = 0.2f, .step_mode = step_count::per_element},
             {.lr = 0.1f, .weight_decay = 0.1f}};
  } else {
    cases = {{.lr = 1e-2f},
             {.lr = 1e-2f, .weight_decay = 0.1f, .decay = weight_decay_mode::decoupled, .amsgrad = true},
             {.lr = 1e-2f, .amsgrad = true, .step_mode = step_count::per_element}};
  }
  for (const auto& o : cases) {
    TestType a(o);
    register_tensors(a);
    train(a, 0, 7);
    a.set_learning_rate(o.lr * 0.5f);  // a scheduler changed it: the state carries it
    const auto bytes = save(a);
    train(a, 7, 6);

    options fresh = o;  // constructed with the initial lr; load restores the saved one
    TestType b(fresh);
    register_tensors(b);
    b.load_state(bytes);
    CHECK(b.options().lr == o.lr * 0.5f);
    CHECK(b.step_count_of(1) == 7);
    train(b, 7, 6);
    for (std::size_t t = 0; t < 2; ++t) {
      CHECK(same_bits(a.params(t), b.params(t)));
      CHECK(a.step_count_of(t) == b.step_count_of(t));
      if constexpr (std::is_same_v<TestType, adam_optimizer>) {
        CHECK(same_bits(a.exp_avg(t), b.exp_avg(t)));
        CHECK(same_bits(a.exp_avg_sq(t), b.exp_avg_sq(t)));
        CHECK(same_bits(a.max_exp_avg_sq(t), b.max_exp_avg_sq(t)));
      } else {
        CHECK(same_bits(a.momentum_buffer(t), b.momentum_buffer(t)));
      }
      CHECK(std::equal(a.element_steps(t).begin(), a.element_steps(t).end(), b.element_steps(t).begin(),
                       b.element_steps(t).end()));
    }
    // Through streams as well.
    std::stringstream ss;
    a.save_state(ss);
    TestType c(fresh);
    register_tensors(c);
    c.load_state(ss);
    CHECK(same_bits(a.params(1), c.params(1)));
    CHECK(save(c) == save(a));
  }
}

TEST_CASE("the saved state follows the documented layout", "[optim][state]") {
  adam_optimizer a({.lr = 0.25f, .amsgrad = true});
  register_tensors(a);
  train(a, 0, 2);
  const auto bytes = save(a);
  // 64-byte header, per tensor a 32-byte record + 4 arrays of (4n + 4) bytes, 16-byte trailer.
  CHECK(bytes.size() == 64 + (32 + 4 * 4) + (32 + 4 * (4 * 1001 + 4)) + 16);
  CHECK(std::memcmp(bytes.data(), "STELLOPT", 8) == 0);
  std::uint32_t version, kind;
  float lr;
  std::memcpy(&version, bytes.data() + 8, 4);
  std::memcpy(&kind, bytes.data() + 16, 4);
  std::memcpy(&lr, bytes.data() + 24, 4);
  CHECK(version == 1);
  CHECK(kind == 2);
  CHECK(lr == 0.25f);
  const auto info = read_optimizer_state_info(bytes);
  CHECK(info.kind == optimizer_kind::adam);
  CHECK(info.flags == optimizer_state_flags::adam_amsgrad);
  REQUIRE(info.tensors.size() == 2);
  CHECK(info.tensors[1].size == 1001);
  CHECK(info.tensors[1].step == 2);
  CHECK(info.tensors[1].arrays == 0b1111u);
  // The first parameter of tensor 1 sits right after its record header.
  float p0;
  std::memcpy(&p0, bytes.data() + 64 + 48 + 32, 4);
  CHECK(p0 == a.params(1)[0]);
}

TEST_CASE("corrupted, truncated and foreign states are refused and change nothing", "[optim][state][errors]") {
  adam_optimizer a({.lr = 1e-2f, .amsgrad = true, .step_mode = step_count::per_element});
  register_tensors(a);
  train(a, 0, 3);
  const auto good = save(a);

  adam_optimizer b({.lr = 1e-2f, .amsgrad = true, .step_mode = step_count::per_element});
  register_tensors(b);
  train(b, 100, 2);
  const auto before = save(b);
  auto refused = [&](const std::vector<std::byte>& bytes, errc code) {
    const auto m = error_message([&] { b.load_state(bytes); }, code);
    CHECK(save(b) == before);  // nothing changed
    return m;
  };

  // A flipped bit anywhere: in the header, a record, every array, the trailer.
  const std::size_t t1 = 64 + (32 + 5 * 4);  // tensor 1 record
  const std::size_t array_bytes = 4 * 1001 + 4;
  struct flip {
    std::size_t at;
    errc code;
    const char* says;
  };
  const flip flips[] = {
      {30, errc::checksum_mismatch, "header checksum"},
      {t1 + 17, errc::checksum_mismatch, "tensor 1: record checksum"},
      {t1 + 32 + 5, errc::checksum_mismatch, "array params"},
      {t1 + 32 + array_bytes + 400, errc::checksum_mismatch, "array exp_avg:"},
      {t1 + 32 + 2 * array_bytes + 4000, errc::checksum_mismatch, "array exp_avg_sq:"},
      {t1 + 32 + 3 * array_bytes + 8, errc::checksum_mismatch, "array max_exp_avg_sq"},
      {t1 + 32 + 4 * array_bytes + 100, errc::checksum_mismatch, "array element_steps"},
      {t1 + 32 + 5 * array_bytes - 2, errc::checksum_mismatch, "array element_steps"},  // its CRC
      {good.size() - 12, errc::malformed_message, "trailer"},
      {2, errc::malformed_message, "magic"},
  };
  for (const auto& f : flips) {
    auto bad = good;
    bad[f.at] ^= std::byte{0x10};
    INFO("flipped byte " << f.at);
    CHECK(contains(refused(bad, f.code), f.says));
  }
  // Truncated anywhere.
  for (std::size_t keep : {std::size_t{0}, std::size_t{63}, t1 + 10, t1 + 32 + 999, good.size() - 1}) {
    INFO("truncated to " << keep);
    auto cut = std::vector<std::byte>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep));
    CHECK(contains(refused(cut, errc::malformed_message), "bytes end inside"));
  }
  // Trailing garbage.
  auto longer = good;
  longer.push_back(std::byte{0});
  refused(longer, errc::malformed_message);
  // Another format version (with a valid header checksum).
  auto v2 = good;
  const std::uint32_t two = 2;
  std::memcpy(v2.data() + 8, &two, 4);
  const std::uint32_t crc = crc32c(std::span<const std::byte>(v2.data(), 60));
  std::memcpy(v2.data() + 60, &crc, 4);
  CHECK(contains(refused(v2, errc::version_mismatch), "version 2"));
}

TEST_CASE("a state of another optimizer or shape is refused", "[optim][state][errors]") {
  adam_optimizer a({.lr = 1e-2f, .amsgrad = true});
  register_tensors(a);
  train(a, 0, 2);
  const auto bytes = save(a);

  {
    adam_optimizer b({.lr = 1e-2f});  // no amsgrad
    register_tensors(b);
    const auto m = error_message([&] { b.load_state(bytes); }, errc::invalid_argument);
    CHECK(contains(m, "saved with options [amsgrad]"));
    CHECK(contains(m, "this optimizer has [none]"));
  }
  {
    adam_optimizer b({.lr = 1e-2f, .decay = weight_decay_mode::decoupled, .amsgrad = true});
    register_tensors(b);
    CHECK(contains(error_message([&] { b.load_state(bytes); }, errc::invalid_argument), "decoupled"));
  }
  {
    sgd_optimizer s({.lr = 0.1f, .momentum = 0.9f});
    register_tensors(s);
    CHECK(contains(error_message([&] { s.load_state(bytes); }, errc::invalid_argument), "adam optimizer"));
  }
  {
    adam_optimizer b({.lr = 1e-2f, .amsgrad = true});
    b.add_tensor(std::vector<float>{});
    CHECK(contains(error_message([&] { b.load_state(bytes); }, errc::size_mismatch), "holds 2 tensors"));
  }
  {
    adam_optimizer b({.lr = 1e-2f, .amsgrad = true});
    b.add_tensor(std::vector<float>{});
    b.add_tensor(normal(1000, 3));
    const auto m = error_message([&] { b.load_state(bytes); }, errc::size_mismatch);
    CHECK(contains(m, "tensor 1 has 1001 elements"));
    for (float v : b.exp_avg(1)) REQUIRE(v == 0.0f);
  }
  {
    std::vector<std::byte> small(100);
    std::vector<std::byte> buffer(a.state_size_bytes() - 1);
    error_message([&] { (void)a.save_state(buffer); }, errc::size_mismatch);
  }
}
