// SPDX-License-Identifier: Apache-2.0
// GPU umbrella header: everything in <stellatrain/stellatrain.hpp> plus the CUDA parts.
// Include it from .cu files compiled by nvcc.
#pragma once

#include <stellatrain/stellatrain.hpp>

#include <stellatrain/core/cuda_check.cuh>

#include <stellatrain/compress/error_feedback_cuda.cuh>
#include <stellatrain/pipeline/cuda_bridge.cuh>
#include <stellatrain/select/selection_scatter.cuh>
#include <stellatrain/select/topk_cuda.cuh>
