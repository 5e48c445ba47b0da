// SPDX-License-Identifier: Apache-2.0
// A trainer's unit as users build it: every public host header (the umbrella, and the
// transport components that are built) and the templates a trainer instantiates — the
// optimizers' dense and sparse steps with fp32, fp16 and bf16 gradients and parameter copies,
// every selector through the error-feedback compressor, packing and unpacking, and pipelines
// over them. tests/headers/CMakeLists.txt compiles it with only the users' usual flags
// (-O2 -Wall -Wextra -Werror) at the default ISA and at -march=x86-64-v4: a header that warns
// under them breaks the build. Compiled, not run.
#include <stellatrain/stellatrain.hpp>
#if defined(STELLATRAIN_USER_FLAGS_WITH_ZMQ)
#include <stellatrain/transport/zmq.hpp>
#endif
#if defined(STELLATRAIN_USER_FLAGS_WITH_MPI)
#include <stellatrain/transport/mpi.hpp>
#endif

#include <cstdint>
#include <span>
#include <vector>

namespace st = stellatrain;

namespace {

template <class Optimizer, class Grad, class Out>
void step_with(Optimizer& opt, std::size_t t, std::span<const Grad> g, std::span<Out> copy,
               st::thread_pool& pool) {
  opt.step(t, g, pool, st::param_copy<Out>{copy});
  const std::vector<std::uint32_t> idx = {1, 5, 9};
  const std::vector<Grad> val(3, g[0]);
  const st::sparse_view<const Grad, const std::uint32_t> sparse(idx, val, g.size());
  opt.step(t, sparse, pool, st::param_copy<Out>{copy.first(idx.size())});
}

template <class Optimizer>
void every_type(Optimizer opt, st::thread_pool& pool) {
  std::vector<float> w(4096, 0.5f);
  const std::size_t t = opt.add_tensor(std::span<const float>(w), pool);
  const std::vector<float> g32(w.size(), 0.01f);
  const std::vector<st::fp16> g16(w.size(), st::fp16(0.01f));
  const std::vector<st::bf16> gb16(w.size(), st::bf16(0.01f));
  std::vector<float> c32(w.size());
  std::vector<st::fp16> c16(w.size());
  std::vector<st::bf16> cb16(w.size());
  step_with(opt, t, std::span<const float>(g32), std::span<st::bf16>(cb16), pool);
  step_with(opt, t, std::span<const st::fp16>(g16), std::span<st::fp16>(c16), pool);
  step_with(opt, t, std::span<const st::bf16>(gb16), std::span<float>(c32), pool);
}

template <class Compressor>
void train() {
  st::run_in_process(2, [&](st::in_process_transport& t) {
    st::thread_pool pool{1};
    st::pipeline p(t, pool, Compressor(), st::adam_optimizer(st::adamw_defaults), {.staleness = 0},
                   st::adaptive_density_controller(st::density_controller_options{}));
    p.add_tensor(0, std::vector<float>(1 << 12, 0.0f));
    p.start();
    std::vector<float> w(1 << 12), g(1 << 12, 0.01f);
    p.wait_for_forward(0);
    p.copy_params(0, w);
    p.push_gradient(0, g);
    p.flush();
  });
}

}  // namespace

int stellatrain_user_flags_unit() {
  st::thread_pool pool{2};
  every_type(st::adam_optimizer(st::adam_options{}), pool);
  every_type(st::adam_optimizer(st::adamw_defaults), pool);
  every_type(st::adam_optimizer({.amsgrad = true}), pool);
  every_type(st::sgd_optimizer({.momentum = 0.9f, .nesterov = true}), pool);
  train<st::error_feedback_compressor<st::threshold_selector<>, st::bf16>>();
  train<st::error_feedback_compressor<st::exact_topk_selector<>, st::fp16>>();
  train<st::error_feedback_compressor<st::block_topk_selector<>, float>>();
  train<st::error_feedback_compressor<st::random_k_selector<>, st::bf16>>();
  train<st::error_feedback_compressor<st::sampled_threshold_selector<>, st::bf16>>();
  return 0;
}
