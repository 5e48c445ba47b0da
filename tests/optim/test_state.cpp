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
    cases = {
        {.lr = 0.1f, .momentum = 0.9f, .nesterov = true},
        {.lr = 0.1f, .momentum = 0.9f, .dampening = 0.2f, .step_mode = step_count::per_element},
        {.lr = 0.1f, .weight_decay = 0.1f}};
  } else {
    cases = {
        {.lr = 1e-2f},
        {.lr = 1e-2f, .weight_decay = 0.1f, .decay = weight_decay_mode::decoupled, .amsgrad = true},
        {.lr = 1e-2f, .amsgrad = true, .step_mode = step_count::per_element},
        {.lr = 1e-2f, .formula = adam_formula::sparse_adam}};
  }
  for (const auto& o : cases) {
    TestType a(o);
    register_tensors(a);
    train(a, 0, 7);
    a.set_lr(o.lr * 0.5f);  // a scheduler changed it: the state carries it
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
      CHECK(std::equal(a.element_steps(t).begin(), a.element_steps(t).end(),
                       b.element_steps(t).begin(), b.element_steps(t).end()));
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
  // Container header (32) and trailer (16); records of a 16-byte head, the payload and a CRC:
  // OPTM (44), per tensor TNSR (24) and 4 arrays of 4n bytes.
  CHECK(bytes.size() == 32 + (20 + 44) + (20 + 24 + 4 * 20) + (20 + 24 + 4 * (20 + 4 * 1001)) + 16);
  CHECK(std::memcmp(bytes.data(), "STELLOPT", 8) == 0);
  std::uint32_t container, layout, kind;
  float lr;
  std::memcpy(&container, bytes.data() + 8, 4);
  std::memcpy(&layout, bytes.data() + 12, 4);
  CHECK(std::memcmp(bytes.data() + 32, "OPTM", 4) == 0);
  std::memcpy(&kind, bytes.data() + 48, 4);
  std::memcpy(&lr, bytes.data() + 56, 4);
  CHECK(container == 1);
  CHECK(layout == 2);
  CHECK(kind == 2);
  CHECK(lr == 0.25f);
  const auto info = read_optimizer_state_info(bytes);
  CHECK(info.version == 2);
  CHECK(info.kind == optimizer_kind::adam);
  CHECK(info.flags == optimizer_state_flags::adam_amsgrad);
  REQUIRE(info.tensors.size() == 2);
  CHECK(info.tensors[1].size == 1001);
  CHECK(info.tensors[1].step == 2);
  CHECK(info.tensors[1].arrays == 0b1111u);
  // Tensor 1's record follows tensor 0's (TNSR and 4 empty arrays); its parameters are the
  // payload of the record after it.
  const std::size_t t1 = 96 + 44 + 4 * 20;
  CHECK(std::memcmp(bytes.data() + t1, "TNSR", 4) == 0);
  CHECK(std::memcmp(bytes.data() + t1 + 44, "PARM", 4) == 0);
  float p0;
  std::memcpy(&p0, bytes.data() + t1 + 44 + 16, 4);
  CHECK(p0 == a.params(1)[0]);
}

TEST_CASE("corrupted, truncated and foreign states are refused and change nothing",
          "[optim][state][errors]") {
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
  const std::size_t t1 = 96 + (44 + 5 * 20);  // tensor 1's TNSR record
  const std::size_t array_bytes = 20 + 4 * 1001;
  const std::size_t arrays = t1 + 44;
  struct flip {
    std::size_t at;
    errc code;
    const char* says;
  };
  const flip flips[] = {
      {30, errc::checksum_mismatch, "header's checksum"},
      {t1 + 17, errc::checksum_mismatch, "(TNSR) at byte 240: checksum"},
      {arrays + 16 + 5, errc::checksum_mismatch, "(PARM)"},
      {arrays + array_bytes + 400, errc::checksum_mismatch, "(MOM1)"},
      {arrays + 2 * array_bytes + 4000, errc::checksum_mismatch, "(MOM2)"},
      {arrays + 3 * array_bytes + 8, errc::checksum_mismatch, "(MAX2)"},  // its length
      {arrays + 4 * array_bytes + 100, errc::checksum_mismatch, "(ESTP)"},
      {arrays + 5 * array_bytes - 2, errc::checksum_mismatch, "(ESTP)"},  // its CRC
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
  for (std::size_t keep :
       {std::size_t{0}, std::size_t{31}, t1 + 10, t1 + 44 + 999, good.size() - 1}) {
    INFO("truncated to " << keep);
    auto cut =
        std::vector<std::byte>(good.begin(), good.begin() + static_cast<std::ptrdiff_t>(keep));
    const auto m = refused(cut, errc::malformed_message);
    CHECK((contains(m, "ends inside") || contains(m, "past the end of the input")));
  }
  // Trailing garbage.
  auto longer = good;
  longer.push_back(std::byte{0});
  refused(longer, errc::malformed_message);
  // Another layout version (with a valid header checksum).
  auto v3 = good;
  const std::uint32_t three = 3;
  std::memcpy(v3.data() + 12, &three, 4);
  const std::uint32_t crc = crc32c(std::span<const std::byte>(v3.data(), 28));
  std::memcpy(v3.data() + 28, &crc, 4);
  CHECK(contains(refused(v3, errc::version_mismatch), "layout version 3"));
  // A record in the wrong place: tensor 1's params tagged as its exp_avg (checksum fixed up).
  auto swapped = good;
  std::memcpy(swapped.data() + arrays, "MOM1", 4);
  const auto whole = std::span<const std::byte>(swapped).subspan(arrays, array_bytes - 4);
  const std::uint32_t record_crc = crc32c(whole);
  std::memcpy(swapped.data() + arrays + array_bytes - 4, &record_crc, 4);
  CHECK(contains(refused(swapped, errc::malformed_message), "is MOM1, expected PARM"));
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
    CHECK(
        contains(error_message([&] { b.load_state(bytes); }, errc::invalid_argument), "decoupled"));
  }
  {
    adam_optimizer b({.lr = 1e-2f, .amsgrad = true, .formula = adam_formula::sparse_adam});
    register_tensors(b);
    CHECK(contains(error_message([&] { b.load_state(bytes); }, errc::invalid_argument),
                   "this optimizer has [amsgrad, SparseAdam formula]"));
  }
  {
    sgd_optimizer s({.lr = 0.1f, .momentum = 0.9f});
    register_tensors(s);
    CHECK(contains(error_message([&] { s.load_state(bytes); }, errc::invalid_argument),
                   "adam optimizer"));
  }
  {
    adam_optimizer b({.lr = 1e-2f, .amsgrad = true});
    b.add_tensor(std::vector<float>{});
    CHECK(contains(error_message([&] { b.load_state(bytes); }, errc::size_mismatch),
                   "holds 2 tensors"));
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
