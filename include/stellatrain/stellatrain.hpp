// SPDX-License-Identifier: Apache-2.0
// Umbrella header: every CPU (host) part of stellatrain. Never includes CUDA headers; for the
// GPU parts include <stellatrain/cuda.cuh>. Backends with their own dependencies (MPI, ZeroMQ)
// have their own headers and CMake components and are not included here.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/version.hpp>

#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/core/random_indices.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include <stellatrain/select/block_topk.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/runtime_selector.hpp>
#include <stellatrain/select/sampled_threshold.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/selection_layout.hpp>
#include <stellatrain/select/selection_source.hpp>
#include <stellatrain/select/threshold.hpp>
#include <stellatrain/select/topk_cuda_options.hpp>
#include <stellatrain/select/topk_threshold_state.hpp>

#include <stellatrain/compress/chunked_codec.hpp>
#include <stellatrain/compress/chunked_compressor.hpp>
#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/compress/error_feedback.hpp>

#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>

#include <stellatrain/optim/adam.hpp>
#include <stellatrain/optim/optimizer_concepts.hpp>
#include <stellatrain/optim/optimizer_types.hpp>
#include <stellatrain/optim/sgd.hpp>
#include <stellatrain/optim/state_format.hpp>

#include <stellatrain/transport/allgather.hpp>
#include <stellatrain/transport/allreduce.hpp>
#include <stellatrain/transport/any_transport.hpp>
#include <stellatrain/transport/barrier.hpp>
#include <stellatrain/transport/broadcast.hpp>
#include <stellatrain/transport/cluster_topology.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/collective_workspace.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/group.hpp>
#include <stellatrain/transport/in_process.hpp>
#include <stellatrain/transport/in_process_transport.hpp>
#include <stellatrain/transport/in_process_world.hpp>
#include <stellatrain/transport/latency_probe.hpp>
#include <stellatrain/transport/message_buffer.hpp>
#include <stellatrain/transport/metering.hpp>
#include <stellatrain/transport/rate_schedule.hpp>
#include <stellatrain/transport/run_in_process.hpp>
#include <stellatrain/transport/shaping.hpp>

#include <stellatrain/batch/batch_split.hpp>
#include <stellatrain/batch/batch_split_agreement.hpp>
#include <stellatrain/batch/split_sampler.hpp>

#include <stellatrain/pipeline/bucket_plan.hpp>
#include <stellatrain/pipeline/density_controller.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>
#include <stellatrain/pipeline/flat_exchange.hpp>
#include <stellatrain/pipeline/hierarchical_exchange.hpp>
#include <stellatrain/pipeline/local_steps.hpp>
#include <stellatrain/pipeline/pipeline.hpp>
#include <stellatrain/pipeline/pipeline_options.hpp>
#include <stellatrain/pipeline/runtime_exchange.hpp>
#include <stellatrain/pipeline/step_reports.hpp>
#include <stellatrain/pipeline/streaming_local_steps.hpp>
#include <stellatrain/pipeline/update_record.hpp>
