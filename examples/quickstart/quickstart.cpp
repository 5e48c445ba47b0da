// SPDX-License-Identifier: Apache-2.0
// The core vocabulary in one page: a pre-faulted gradient buffer, work split over a thread
// pool, a sparse bf16 selection in an owning buffer, validation, and the library's errors.
#include <stellatrain/stellatrain.hpp>

#include <cmath>
#include <cstdio>

int main() {
  namespace st = stellatrain;
  st::thread_pool pool{2};

  // A 1M-element gradient, pre-faulted across the pool so that no later pass pays page faults.
  const std::size_t n = 1 << 20;
  st::aligned_buffer<float> grad(n, {.prefault = true}, pool);
  st::for_each_chunk(pool, n, st::balanced_grain(n, pool.concurrency(), 1 << 14, 16),
                     [&](std::uint64_t b, std::uint64_t e) {
                       for (auto i = b; i < e; ++i) grad[i] = std::sin(static_cast<float>(i) * 1e-3f);
                     });

  // Keep every element above 0.999 in magnitude, with bf16 values (half the bytes of fp32).
  st::sparse_buffer<st::bf16, std::uint32_t> selection(n, n);
  std::uint64_t k = 0;
  for (std::uint32_t i = 0; i < n; ++i) {
    if (std::fabs(grad[i]) > 0.999f) {
      selection.resize(k + 1);
      selection.indices()[k] = i;
      selection.values()[k] = st::bf16{grad[i]};
      ++k;
    }
  }
  st::validate_sparse(selection.view(), st::index_order::strictly_ascending, "selection");
  std::printf("stellatrain %s: kept %llu of %zu elements (density %.4f)\n", st::version_string,
              static_cast<unsigned long long>(selection.size()), n, selection.view().density());

  // Bad input is an error that says what and where, never a crash.
  try {
    selection.indices()[0] = static_cast<std::uint32_t>(n);
    st::validate_sparse(selection.view(), st::index_order::any, "selection");
  } catch (const st::error& e) {
    std::printf("caught as expected: %s\n", e.what());
    return 0;
  }
  return 1;
}
