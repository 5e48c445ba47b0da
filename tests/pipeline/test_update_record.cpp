// SPDX-License-Identifier: Apache-2.0
// Keeping a copy of the parameters up to date with the changed elements only
// (`record_updates<T>` + `copy_changes`): the copy stays bit-identical to a whole copy, a copy two
// steps behind gets the union of both steps' changes, anything older, a dense update or a
// restore asks for a whole copy, and bad use is an error.
#include <stellatrain/compress/error_feedback.hpp>
#include <stellatrain/core/thread_pool.hpp>
#include <stellatrain/optim/adam.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/transport/in_process.hpp>

#include "catch.hpp"

#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <vector>

using namespace stellatrain;

namespace {

// 1 element: its aggregation is dense (a whole update every step); the others are sparse.
const std::vector<std::uint64_t> sizes{4000, 17, 1, 9000};

std::vector<float> gradient_of(std::uint64_t n, int rank, std::int64_t step, std::size_t t) {
  std::mt19937 rng(static_cast<std::uint32_t>(7919 * rank + 104729 * step + 31 * t));
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> g(n);
  for (auto& x : g) x = d(rng);
  return g;
}

template <class Pipeline>
void add_tensors(Pipeline& p) {
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    std::vector<float> init(sizes[i]);
    for (std::size_t j = 0; j < init.size(); ++j) init[j] = 0.001f * static_cast<float>(j % 97);
    p.add_tensor(static_cast<std::uint32_t>(i), init);
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

struct kind_counts {
  int none = 0, sparse = 0, merged = 0, whole = 0, compared = 0;
};

// Whether pipeline P offers copy_changes into values of type T.
template <class P, class T>
concept can_copy_changes_into = requires(P& p, std::span<typename P::index_type> indices,
                                         std::span<T> values) {
  p.copy_changes(std::size_t{0}, param_version{}, indices, values);
};

// Trains `steps` steps on every rank; rank 0 keeps a copy of every tensor in T through
// copy_changes, skipping the refresh of tensor 0 every 4th step (its copy falls two steps
// behind) and of tensor 3 for two steps every 6 (three behind), and checks it against a
// whole copy whenever no update landed in between.
template <class T>
kind_counts mirror_run(int staleness) {
  kind_counts counts;
  std::mutex m;
  run_in_process(2, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-2f}), {.bucket_bytes = 20000, .staleness = staleness},
               fixed_density{0.02}, record_updates<T>);
    add_tensors(p);
    p.start();
    std::vector<std::vector<T>> copy, whole;
    std::vector<param_version> held(sizes.size());
    for (auto n : sizes) {
      copy.emplace_back(n);
      whole.emplace_back(n);
    }
    std::vector<typename decltype(p)::index_type> idx(20000);
    std::vector<T> val(20000);
    kind_counts mine;
    for (std::int64_t s = 0; s < 30; ++s) {
      for (std::size_t b = 0; b < p.bucket_count(); ++b) p.wait_for_forward(b);
      for (std::size_t i = 0; i < sizes.size() && t.rank() == 0; ++i) {
        if ((i == 0 && s % 4 == 1) || (i == 3 && s % 6 >= 4)) continue;
        const param_changes c = p.copy_changes(i, held[i], std::span(idx), std::span(val));
        if (c.kind == param_changes_kind::none) {
          ++mine.none;
        } else if (c.kind == param_changes_kind::sparse) {
          ++(c.version.step - held[i].step == 2 ? mine.merged : mine.sparse);
          for (std::uint64_t j = 0; j < c.count; ++j) {
            if (j > 0) REQUIRE(idx[j] > idx[j - 1]);
            REQUIRE(idx[j] < sizes[i]);
            copy[i][idx[j]] = val[j];
          }
          held[i] = c.version;
        } else {
          ++mine.whole;
          held[i] = p.copy_params(i, std::span(copy[i]));
        }
        if (p.copy_params(i, std::span(whole[i])) == held[i]) {
          ++mine.compared;
          REQUIRE(same_bits(copy[i], whole[i]));
        }
      }
      for (std::size_t i = sizes.size(); i-- > 0;)
        p.push_gradient(i, gradient_of(sizes[i], t.rank(), s, i));
    }
    p.flush();
    if (t.rank() == 0) {
      std::lock_guard lock(m);
      counts = mine;
    }
  });
  return counts;
}

}  // namespace

TEST_CASE("copy_changes keeps a copy bit-identical to a whole copy", "[pipeline]") {
  const int staleness = GENERATE(0, 1);
  const bool bf16_copy = GENERATE(true, false);
  const kind_counts c = bf16_copy ? mirror_run<bf16>(staleness) : mirror_run<float>(staleness);
  INFO("staleness " << staleness << ": none " << c.none << ", sparse " << c.sparse << ", merged "
                    << c.merged << ", whole " << c.whole << ", compared " << c.compared);
  if (staleness == 0) {
    // Every forward sees exactly the previous step. Tensor 0: 22 refreshes, the first whole,
    // 7 two steps behind; tensor 1: 30, the first whole; tensor 2: whole every step; tensor 3:
    // 20, whole the first and after each double skip (4).
    CHECK(c.sparse == 14 + 29 + 15);
    CHECK(c.merged == 7);
    CHECK(c.whole == 30 + 3 + 4);
    CHECK(c.compared == 30 * 4 - 8 - 10);
  } else {
    // A forward sees the step before or the one before that (timing decides), so copies fall
    // one to three steps behind.
    CHECK(c.sparse + c.merged >= 20);
    CHECK(c.merged >= 1);
    CHECK(c.compared > 30);
  }
}

TEST_CASE("copy_params converts to fp16 and bf16 exactly", "[pipeline]") {
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-2f}), {.staleness = 0}, fixed_density{0.1});
    add_tensors(p);
    p.start();
    for (std::size_t i = 0; i < sizes.size(); ++i)
      p.push_gradient(i, gradient_of(sizes[i], 0, 0, i));
    p.flush();
    std::vector<float> f(sizes[0]);
    std::vector<bf16> b(sizes[0]);
    std::vector<fp16> h(sizes[0]);
    const param_version v = p.copy_params(0, std::span(f));
    CHECK(v.step == 0);
    CHECK(p.copy_params(0, std::span(b)) == v);
    CHECK(p.copy_params(0, std::span(h)) == v);
    for (std::size_t j = 0; j < f.size(); ++j) {
      REQUIRE(b[j].bits() == bf16(f[j]).bits());
      REQUIRE(h[j].bits() == fp16(f[j]).bits());
    }
  });
}

TEST_CASE("copy_changes asks for a whole copy when the changes are not kept, and rejects bad use",
          "[pipeline]") {
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-2f}), {.staleness = 0}, fixed_density{0.01},
               record_updates<bf16>);
    STATIC_REQUIRE(can_copy_changes_into<decltype(p), bf16>);
    STATIC_REQUIRE_FALSE(can_copy_changes_into<decltype(p), float>);  // another precision
    STATIC_REQUIRE_FALSE(can_copy_changes_into<decltype(p), fp16>);
    add_tensors(p);
    std::vector<std::uint32_t> idx(100);
    std::vector<bf16> val(100);
    std::vector<float> f32(100);
    CHECK_THROWS_AS(p.copy_changes(0, {}, std::span(idx), std::span(val)), error);  // not started
    p.start();
    std::vector<bf16> copy(sizes[0]);
    const param_version initial = p.copy_params(0, std::span(copy));
    CHECK(initial == param_version{.step = -1, .generation = 0});
    CHECK(p.copy_changes(0, initial, std::span(idx), std::span(val)).kind ==
          param_changes_kind::none);
    CHECK(p.copy_changes(0, {}, std::span(idx), std::span(val)).kind == param_changes_kind::whole);
    auto step = [&](std::int64_t s) {
      for (std::size_t i = 0; i < sizes.size(); ++i)
        p.push_gradient(i, gradient_of(sizes[i], 0, s, i));
      p.flush();
    };
    step(0);
    const param_changes one = p.copy_changes(0, initial, std::span(idx), std::span(val));
    CHECK(one.kind == param_changes_kind::sparse);
    CHECK(one.count == 40);  // 1% of 4000
    CHECK(one.version.step == 0);
    // Too little room: whole, with the count needed.
    const param_changes small =
        p.copy_changes(0, initial, std::span(idx).first(39), std::span(val));
    CHECK(small.kind == param_changes_kind::whole);
    CHECK(small.count == 40);
    // Errors.
    try {
      (void)p.copy_changes(9, initial, std::span(idx), std::span(val));
      FAIL("no error for an unknown tensor");
    } catch (const error& e) {
      CHECK(e.code() == errc::out_of_range);
    }
    CHECK_THROWS_AS(p.bucket_of(9), error);
    CHECK_THROWS_AS(p.copy_params(0, std::span(f32)), error);  // size
    // Two steps behind: the union; three: whole.
    step(1);
    const param_changes two = p.copy_changes(0, initial, std::span(idx), std::span(val));
    CHECK(two.kind == param_changes_kind::sparse);
    CHECK(two.count >= 40);
    CHECK(two.count <= 80);
    step(2);
    CHECK(p.copy_changes(0, initial, std::span(idx), std::span(val)).kind ==
          param_changes_kind::whole);
    CHECK(p.copy_changes(0, one.version, std::span(idx), std::span(val)).kind ==
          param_changes_kind::sparse);
    // A version from the future, or from before a restore: whole.
    CHECK(p.copy_changes(0, {.step = 7, .generation = 0}, std::span(idx), std::span(val)).kind ==
          param_changes_kind::whole);
    const param_version current = p.copy_params(0, std::span(copy));
    p.load_checkpoint(p.save_checkpoint());
    const param_changes after = p.copy_changes(0, current, std::span(idx), std::span(val));
    CHECK(after.kind == param_changes_kind::whole);
    CHECK(after.version == param_version{.step = 2, .generation = 1});
    step(3);  // the first update after the restore is kept again
    CHECK(p.copy_changes(0, after.version, std::span(idx), std::span(val)).kind ==
          param_changes_kind::sparse);
  });
  run_in_process(1, [&](in_process_transport& t) {
    thread_pool pool{1};
    pipeline p(t, pool, error_feedback_compressor<exact_topk_selector<>, bf16>(),
               adam_optimizer({.lr = 1e-2f}), {.staleness = 0}, fixed_density{0.01});
    add_tensors(p);
    p.start();
    STATIC_REQUIRE_FALSE(can_copy_changes_into<decltype(p), bf16>);  // records nothing
    STATIC_REQUIRE_FALSE(can_copy_changes_into<decltype(p), float>);
  });
}
