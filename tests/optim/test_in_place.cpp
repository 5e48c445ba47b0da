// SPDX-License-Identifier: Apache-2.0
// Tensors registered in place (the caller holds the parameters): the same steps as a tensor
// with a master copy, bit for bit, on the caller's array; rebinding; checkpoints; errors; and
// where the optimizer places its own arrays.
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/sgd.hpp>

#include "catch.hpp"
#include "optim_test_support.hpp"

#include <cstdint>
#include <vector>

using namespace stellatrain;
using namespace optim_test;

namespace {

using view32 = sparse_view<const float, const std::uint32_t>;

// Dense and sparse steps on tensor `t` of both optimizers, on 2 threads.
template <class Optimizer>
void train(Optimizer& a, Optimizer& b, std::size_t t, int steps) {
  thread_pool pool{2};
  const std::size_t n = a.tensor_size(t);
  for (int s = 0; s < steps; ++s) {
    const auto seed = static_cast<std::uint64_t>(s + 1);
    if (s % 3 == 2) {
      const auto idx = sorted_indices<std::uint32_t>(n, n / 4, seed);
      const auto val = normal(idx.size(), seed + 100);
      a.step(t, view32{idx, val, n}, pool);
      b.step(t, view32{idx, val, n}, pool);
    } else {
      const auto g = normal(n, seed);
      a.step(t, std::span<const float>(g), pool);
      b.step(t, std::span<const float>(g), pool);
    }
  }
}

template <class Optimizer>
std::vector<std::byte> save(const Optimizer& opt) {
  std::vector<std::byte> bytes(opt.state_size_bytes());
  REQUIRE(opt.save_state(bytes) == bytes.size());
  return bytes;
}

bool refused_with(errc code, auto&& f) {
  try {
    f();
  } catch (const error& e) {
    return e.code() == code;
  }
  return false;
}

}  // namespace

TEST_CASE("a tensor registered in place steps as a master copy does, on the caller's array",
          "[optim][in_place]") {
  const std::vector<adam_options> adam_cases = {
      {.lr = 1e-2f, .weight_decay = 0.1f},
      {.lr = 1e-2f, .weight_decay = 0.1f, .decay = weight_decay_mode::decoupled, .amsgrad = true},
      {.lr = 1e-2f, .step_mode = step_count::per_element}};
  for (std::size_t n : dense_sizes()) {
    for (const auto& o : adam_cases) {
      adam_optimizer owned(o), held(o);
      auto caller = normal(n, 5);
      owned.add_tensor(caller);
      REQUIRE(held.add_tensor_in_place(caller) == 0);
      if (n > 0) CHECK(held.params(0).data() == caller.data());
      train(owned, held, 0, 7);
      CHECK(same_bits(caller, owned.params(0)));
      CHECK(same_bits(held.exp_avg(0), owned.exp_avg(0)));
      CHECK(same_bits(held.exp_avg_sq(0), owned.exp_avg_sq(0)));
      CHECK(save(held) == save(owned));
    }
    sgd_optimizer owned({.lr = 0.1f, .momentum = 0.9f, .nesterov = true});
    sgd_optimizer held(owned.options());
    auto caller = normal(n, 6);
    owned.add_tensor(caller);
    held.add_tensor_in_place(caller);
    train(owned, held, 0, 5);
    CHECK(same_bits(caller, owned.params(0)));
    CHECK(same_bits(held.momentum_buffer(0), owned.momentum_buffer(0)));
  }
}

TEST_CASE("rebinding moves a tensor to another array", "[optim][in_place]") {
  adam_optimizer owned({.lr = 1e-2f}), held({.lr = 1e-2f});
  auto first = normal(1003, 7);
  owned.add_tensor(first);
  held.add_tensor_in_place(first);
  train(owned, held, 0, 2);
  auto second = first;  // what `p.data = p.data.clone()` does in torch
  const auto left = first;
  held.rebind_params(0, second);
  CHECK(held.params(0).data() == second.data());
  train(owned, held, 0, 3);
  CHECK(same_bits(second, owned.params(0)));
  CHECK(same_bits(first, left));  // the old array is no longer touched
}

TEST_CASE("in-place registration and rebinding refuse bad arrays", "[optim][in_place][errors]") {
  adam_optimizer opt({.lr = 1e-2f});
  std::vector<float> owned_init(10, 1.0f), held(10, 1.0f), other(11, 1.0f);
  opt.add_tensor(owned_init);
  opt.add_tensor_in_place(held);
  CHECK(refused_with(errc::invalid_argument, [&] { opt.rebind_params(0, held); }));
  CHECK(refused_with(errc::size_mismatch, [&] { opt.rebind_params(1, other); }));
  CHECK(refused_with(errc::invalid_argument, [&] {
    opt.rebind_params(1, std::span<float>(static_cast<float*>(nullptr), 10));
  }));
  CHECK(refused_with(errc::out_of_range, [&] { opt.rebind_params(2, held); }));
  CHECK(refused_with(errc::invalid_argument, [&] {
    opt.add_tensor_in_place(std::span<float>(static_cast<float*>(nullptr), 3));
  }));
  CHECK(opt.tensor_count() == 2);
  CHECK(opt.add_tensor_in_place(std::span<float>()) == 2);  // an empty tensor is fine
  CHECK(opt.params(2).empty());
}

TEST_CASE("checkpoints move between in-place and owned tensors", "[optim][in_place][state]") {
  const adam_options o{.lr = 1e-2f, .amsgrad = true};
  adam_optimizer a(o), b(o);
  auto held = normal(1001, 8);
  a.add_tensor(held);
  b.add_tensor_in_place(held);
  train(a, b, 0, 4);
  const auto from_owned = save(a);
  CHECK(save(b) == from_owned);

  // Into an in-place tensor: the saved parameters land in the caller's array.
  std::vector<float> target(1001, 0.0f);
  adam_optimizer c(o);
  c.add_tensor_in_place(target);
  c.load_state(from_owned);
  CHECK(same_bits(target, a.params(0)));
  adam_optimizer d(o);
  d.add_tensor(std::vector<float>(1001, 0.0f));
  d.load_state(from_owned);
  train(c, d, 0, 3);
  train(a, b, 0, 3);
  CHECK(same_bits(target, d.params(0)));
  CHECK(same_bits(held, a.params(0)));
}

TEST_CASE("an optimizer's own arrays do not start at the same offset", "[optim][placement]") {
  // Above 2 MiB the arrays are aligned to huge pages: the stagger is what tells them apart.
  const std::size_t n = (std::size_t{3} << 20) / sizeof(float);
  adam_optimizer opt({.amsgrad = true});
  opt.add_tensor(std::vector<float>(n, 0.0f));
  const auto offset = [](std::span<const float> s) {
    return reinterpret_cast<std::uintptr_t>(s.data()) % huge_page_bytes;
  };
  const auto p = offset(opt.params(0));
  const auto m = offset(opt.exp_avg(0));
  const auto v = offset(opt.exp_avg_sq(0));
  const auto vmax = offset(opt.max_exp_avg_sq(0));
  CHECK(p != m);
  CHECK(p != v);
  CHECK(p != vmax);
  CHECK(m != v);
  CHECK(m != vmax);
  CHECK(v != vmax);
  CHECK(p != 0);  // nor where a 2 MiB-aligned gradient starts
}
