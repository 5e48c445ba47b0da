// SPDX-License-Identifier: Apache-2.0
// The code blocks of the README and the guides (docs/guide/) that no other example holds, each
// between two lines "// [name]" (the test docs.readme_snippets fails when a block differs from
// its region). The code around a region declares what its block takes as given; main runs
// every block and checks a little of what it did.
// [include]
#include <stellatrain/stellatrain.hpp>  // every CPU part; GPU parts: <stellatrain/cuda.cuh>
// [include]

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <stdexcept>
#include <vector>

namespace {

void require(bool ok, const char* what) {
  if (!ok) throw std::runtime_error(what);
}

// "CPU selection and compression"
void select_and_compress(stellatrain::thread_pool& pool,
                         const stellatrain::aligned_buffer<float>& grad) {
  const std::uint64_t k = grad.size() / 100;
  std::vector<std::uint32_t> idx(k);
  std::vector<float> val(k);
  // [selection]
  namespace st = stellatrain;

  st::exact_topk_selector<> topk;  // radix select, one pass in the common case
  topk.select(pool, std::span<const float>(grad), k, std::span(idx), std::span(val));

  st::threshold_selector<> sel;  // persistent bound, one SIMD pass per call
  st::threshold_state state;     // one per tensor, kept across steps
  sel.select(pool, state, std::span<const float>(grad), k, std::span(idx), std::span(val));

  st::error_feedback_compressor<st::threshold_selector<>, st::bf16> ef;  // over any selector
  ef.add_tensor(pool, /*id=*/0, grad.size(), /*max_k=*/k);
  st::sparse_buffer<st::bf16> out(grad.size(), k);
  // acc = g + r; send the top k of acc; r = acc - sent
  ef.compress(pool, 0, std::span<const float>(grad), k, out);
  auto saved = ef.save_state();  // residuals, bounds, steps: resume exactly
  // [selection]
  require(out.size() == k && !saved.empty(), "selection: k elements sent, the state saved");
}

// "Packing for the wire"
void pack_and_merge(stellatrain::thread_pool& pool, const stellatrain::aligned_buffer<float>& grad,
                    stellatrain::sparse_buffer<stellatrain::bf16>& selection) {
  const std::uint64_t step = 7;
  const std::vector<std::uint32_t> sent{3, 70, 9000};
  selection.resize(sent.size());
  for (std::size_t j = 0; j < sent.size(); ++j) {
    selection.indices()[j] = sent[j];
    selection.values()[j] = stellatrain::bf16{0.5f * static_cast<float>(j + 1)};
  }
  stellatrain::sparse_buffer<float> received(grad.size(), selection.size());
  // Two ranks' decoded selections, {70: 1, 9000: 2} and {70: 3}, to merge.
  stellatrain::sparse_buffer<float> first(grad.size(), 2), second(grad.size(), 1);
  first.resize(2);
  second.resize(1);
  first.indices()[0] = second.indices()[0] = 70;
  first.indices()[1] = 9000;
  first.values()[0] = 1.0f;
  first.values()[1] = 2.0f;
  second.values()[0] = 3.0f;
  const std::vector<stellatrain::sparse_view<const float, const std::uint32_t>> ranks{
      first.view(), second.view()};
  stellatrain::sparse_buffer<float> sum(grad.size(),
                                        stellatrain::merge_capacity<float, std::uint32_t>(ranks));
  // [packing]
  stellatrain::message_packer packer;  // keeps its memory between steps
  packer.clear(/*tag=*/step);
  packer.add(/*tensor=*/0, selection.view(), {.values = stellatrain::value_encoding::bf16});
  std::vector<std::byte> wire(packer.prepare(pool));  // exact size before writing
  packer.write(wire, pool);

  stellatrain::message_unpacker unpacker(std::vector<stellatrain::tensor_info>{{0, grad.size()}});
  const auto& msg = unpacker.parse(wire, pool);  // throws stellatrain::error on bad bytes
  unpacker.decode(0, received, pool);            // into a preallocated sparse_buffer

  stellatrain::sparse_merger merger;  // sum of W ranks, sorted
  merger.merge<float, std::uint32_t>(ranks, sum, stellatrain::reduction::mean, pool);
  // [packing]
  require(msg.tag == step && received.size() == sent.size() && received.values()[2] == 1.5f,
          "packing: the selection comes back");
  require(sum.size() == 2 && sum.values()[0] == 2.0f && sum.values()[1] == 1.0f,
          "packing: the mean of two ranks");
}

// "CPU optimizers"
float step_adamw() {
  // [optimizers]
  stellatrain::thread_pool pool{2};
  stellatrain::adam_optimizer adamw(stellatrain::adamw_defaults);  // decoupled weight decay 1e-2
  std::vector<float> weights(1 << 20, 0.5f), grad(1 << 20, 0.01f);
  auto t = adamw.add_tensor(weights, pool);           // copies; allocates the state
  adamw.step(t, std::span<const float>(grad), pool);  // dense: one fused SIMD pass

  std::vector<std::uint32_t> idx{3, 70, 70, 9000};  // sorted; 70 twice: summed
  std::vector<float> val{0.1f, -0.2f, 0.05f, 1.0f};
  std::vector<stellatrain::bf16> upload(idx.size());  // new values, for the GPU
  adamw.step(t,
             stellatrain::sparse_view<const float, const std::uint32_t>{idx, val, weights.size()},
             pool, stellatrain::param_copy<stellatrain::bf16>{upload});
  float w3 = adamw.params(t)[3];
  // [optimizers]
  require(w3 < 0.5f && static_cast<float>(upload[0]) != 0.0f, "optimizers: w[3] stepped twice");
  return w3;
}

// A model for the pipeline's block: three tensors, loss 1/2 |w - 1|^2.
class toy_model {
 public:
  struct tensor {
    std::uint32_t id;
    std::vector<float> initial_values;
  };

  toy_model() {
    for (std::uint32_t id = 0; const std::size_t n : {1000, 200'000, 10}) {
      tensors_.push_back({id++, std::vector<float>(n, 0.0f)});
      weights_.emplace_back(n);
      grads_.emplace_back(n);
    }
  }
  std::vector<tensor>& tensors() { return tensors_; }
  std::span<float> weights(std::size_t t) { return weights_[t]; }
  void forward() {}
  // Calls ready(t, gradient) for each tensor, the last one first, as a backward pass would.
  template <class Ready>
  void backward(Ready&& ready) {
    for (std::size_t t = tensors_.size(); t-- > 0;) {
      for (std::size_t i = 0; i < grads_[t].size(); ++i) grads_[t][i] = weights_[t][i] - 1.0f;
      ready(t, std::span<const float>(grads_[t]));
    }
  }

 private:
  std::vector<tensor> tensors_;
  std::vector<std::vector<float>> weights_, grads_;
};

// "The pipeline": the training loop, the same for a flat and a hierarchical pipeline.
template <class Pipeline>
void run_steps(Pipeline& p, toy_model& model, int steps) {
  // [loop]
  for (auto& t : model.tensors()) p.add_tensor(t.id, t.initial_values);  // forward order
  p.start();  // collective: rank 0's values to all
  for (int step = 0; step < steps; ++step) {
    for (std::size_t b = 0; b < p.bucket_count(); ++b) {  // before the forward pass
      p.wait_for_forward(b);
      const auto r = p.bucket(b);
      for (auto t = r.first_tensor; t < r.first_tensor + r.tensor_count; ++t) {
        p.copy_params(t, model.weights(t));
      }
    }
    model.forward();
    model.backward([&](std::size_t t, std::span<const float> grad) {  // as each gradient is ready
      p.push_gradient(t, grad);
    });
  }
  p.flush();
  // [loop]
  require(p.stats().steps_applied == static_cast<std::uint64_t>(steps), "pipeline: every step");
}

void train(stellatrain::in_process_transport& transport, toy_model& model, int steps) {
  // [pipeline]
  stellatrain::thread_pool pool{2};
  stellatrain::pipeline p(
      transport, pool,
      stellatrain::error_feedback_compressor<stellatrain::threshold_selector<>,
                                             stellatrain::bf16>(),
      stellatrain::adam_optimizer({.lr = 1e-3f}), {.bucket_bytes = 4 << 20, .staleness = 0},
      stellatrain::adaptive_density_controller({.min_density = 1e-4, .max_density = 0.05}));
  // [pipeline]
  run_steps(p, model, steps);
}

// "Across clusters": `lan` connects the ranks of this rank's cluster, `wan` every rank.
void train_in_clusters(stellatrain::in_process_transport& lan,
                       stellatrain::in_process_transport& wan, toy_model& model, int steps) {
  // [hierarchical]
  // Cluster sizes in rank order, the same on every rank (checked at start), here from
  // STELLATRAIN_CLUSTERS=2,2; without the variable every rank is a cluster of its own.
  const auto topology = stellatrain::cluster_topology::from_environment(wan.size());
  stellatrain::thread_pool pool{2};
  stellatrain::pipeline p(
      stellatrain::hierarchical_links<stellatrain::in_process_transport>{lan, wan, topology}, pool,
      stellatrain::error_feedback_compressor<stellatrain::threshold_selector<>,
                                             stellatrain::bf16>(),
      stellatrain::adam_optimizer({.lr = 1e-3f}), {.bucket_bytes = 4 << 20, .staleness = 0},
      stellatrain::adaptive_density_controller({.min_density = 1e-4, .max_density = 0.05}));
  // [hierarchical]
  run_steps(p, model, steps);
}

// "GPUs of different speeds": each rank takes its part of the global batch from the split that
// every rank agreed on, measured by its own compute time.
void split_steps(stellatrain::in_process_transport& transport, int steps) {
  const auto compute = [](std::span<const std::uint64_t> examples) {
    double sum = 0;  // stands for the forward and backward of these examples
    for (auto e : examples) sum += std::sqrt(static_cast<double>(e));
    return sum;
  };
  // [split]
  stellatrain::batch_split_agreement split(
      transport, {.global_batch = 256, .bounds = {.min_per_rank = 8, .max_per_rank = 256}});
  stellatrain::split_sampler sampler(/*examples=*/60'000, /*seed=*/1);
  std::vector<std::uint64_t> mine;
  for (int step = 0; step < steps; ++step) {
    sampler.next(split.split(), static_cast<std::size_t>(transport.rank()), mine);
    const auto t0 = std::chrono::steady_clock::now();
    compute(mine);  // then scale the gradient by split.my_weight() and hand it over
    const std::chrono::duration<double> took = std::chrono::steady_clock::now() - t0;
    split.end_step(took.count());  // in decision steps: one all-gather, the same split
  }
  // [split]
  require(split.decisions() == static_cast<std::uint64_t>(steps) / 10, "split: decisions");
}

}  // namespace

int main() {
  try {
    // [using]
    stellatrain::thread_pool pool{2};
    stellatrain::aligned_buffer<float> grad(25'000'000, {.prefault = true}, pool);
    stellatrain::sparse_buffer<stellatrain::bf16> selection(grad.size(), /*capacity=*/250'000);
    // [using]
    for (std::size_t i = 0; i < grad.size(); ++i) grad[i] = std::sin(static_cast<float>(i));
    select_and_compress(pool, grad);
    pack_and_merge(pool, grad, selection);
    const float w3 = step_adamw();
    stellatrain::run_in_process(2, [](stellatrain::in_process_transport& transport) {
      toy_model model;
      train(transport, model, /*steps=*/5);
    });
    stellatrain::run_in_process(2, [](stellatrain::in_process_transport& transport) {
      split_steps(transport, /*steps=*/20);
    });
    setenv("STELLATRAIN_CLUSTERS", "2,2", /*overwrite=*/1);
    stellatrain::run_in_process_clusters(
        stellatrain::cluster_topology::parse("2,2"),
        [](stellatrain::in_process_transport& lan, stellatrain::in_process_transport& wan) {
          toy_model model;
          train_in_clusters(lan, wan, model, /*steps=*/5);
        });
    std::printf("every documented block ran (adamw: w[3] = %.6f)\n", static_cast<double>(w3));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "readme: %s\n", e.what());
    return 1;
  }
}
