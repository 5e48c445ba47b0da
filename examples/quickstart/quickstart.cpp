// SPDX-License-Identifier: Apache-2.0
// The main path in one page: two data-parallel ranks (threads of this process) fit a model.
// Each step the pipeline selects 10% of every gradient with error feedback (bf16 values),
// packs it, all-gathers it over the in-process transport, averages and steps Adam; both
// ranks end every step with bit-identical parameters. The README shows the "quickstart" region.
#include <stellatrain/stellatrain.hpp>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

int main() {
  // [quickstart]
  namespace st = stellatrain;
  constexpr std::size_t n = 1 << 16;
  std::vector<std::vector<float>> result(2);
  st::run_in_process(2, [&](st::in_process_transport& transport) {
    const int rank = transport.rank();
    st::thread_pool pool{1};
    st::pipeline p(transport, pool,
                   st::error_feedback_compressor<st::threshold_selector<>, st::bf16>(),
                   st::adam_optimizer({.lr = 0.01f}), {.staleness = 0}, st::fixed_density{0.1});
    p.add_tensor(/*id=*/0, std::vector<float>(n, 0.0f));
    p.start();  // collective: every rank starts from rank 0's values

    std::vector<float> w(n), grad(n);
    for (int step = 0; step <= 300; ++step) {
      p.wait_for_forward(0);  // the updates of the previous step are applied
      p.copy_params(0, w);
      // Each rank's loss: 1/2 |w - target|^2, its target off by +-0.1 from the common one.
      double loss = 0;
      for (std::size_t i = 0; i < n; ++i) {
        grad[i] = w[i] - (std::sin(0.001f * static_cast<float>(i)) + (rank == 0 ? 0.1f : -0.1f));
        loss += 0.5 * grad[i] * grad[i] / n;
      }
      if (rank == 0 && step % 50 == 0) std::printf("step %3d  loss %.5f\n", step, loss);
      p.push_gradient(0, grad);  // the bucket goes down the pipeline
    }
    p.flush();
    p.copy_params(0, w);
    result[static_cast<std::size_t>(rank)] = w;
  });
  // [quickstart]
  const bool same = std::memcmp(result[0].data(), result[1].data(), n * sizeof(float)) == 0;
  std::printf("the ranks hold bit-identical parameters: %s\n", same ? "yes" : "NO");
  return same ? 0 : 1;
}
