// SPDX-License-Identifier: Apache-2.0
#include <stellatrain/stellatrain.hpp>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

int main() {
  if (std::strcmp(stellatrain::version_string, CONSUMER_EXPECTED_VERSION) != 0) {
    std::printf("version %s, expected %s\n", stellatrain::version_string,
                CONSUMER_EXPECTED_VERSION);
    return 1;
  }
  stellatrain::thread_pool pool{2};
  std::vector<float> x(1000);
  stellatrain::for_each_chunk(pool, x.size(), 100, [&](std::uint64_t b, std::uint64_t e) {
    for (auto i = b; i < e; ++i) x[i] = static_cast<float>(stellatrain::bf16{1.0f});
  });
  const float sum = std::accumulate(x.begin(), x.end(), 0.0f);
  std::printf("stellatrain %s: sum %g\n", stellatrain::version_string, static_cast<double>(sum));
  return sum == 1000.0f ? 0 : 1;
}
