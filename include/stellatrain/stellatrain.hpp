// SPDX-License-Identifier: Apache-2.0
// Umbrella header: every CPU (host) part of stellatrain. Never includes CUDA headers; for the
// GPU parts include <stellatrain/cuda.cuh>.
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
#include <stellatrain/core/sparse.hpp>
#include <stellatrain/core/thread_pool.hpp>

#include <stellatrain/pack/aggregate.hpp>
#include <stellatrain/pack/packer.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>
