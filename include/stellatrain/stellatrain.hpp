// SPDX-License-Identifier: Apache-2.0
// Umbrella header: every CPU (host) part of stellatrain. Never includes CUDA headers; for the
// GPU parts include <stellatrain/cuda.cuh>.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/version.hpp>

#include <stellatrain/core/aligned_buffer.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/executor.hpp>
#include <stellatrain/core/float16.hpp>
#include <stellatrain/core/philox.hpp>
#include <stellatrain/core/random_indices.hpp>
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include <stellatrain/select/block_topk.hpp>
#include <stellatrain/select/exact_topk.hpp>
#include <stellatrain/select/partitioned.hpp>
#include <stellatrain/select/random_k.hpp>
#include <stellatrain/select/sampled_threshold.hpp>
#include <stellatrain/select/selection.hpp>
#include <stellatrain/select/threshold.hpp>

#include <stellatrain/compress/compressor.hpp>
#include <stellatrain/compress/error_feedback.hpp>
