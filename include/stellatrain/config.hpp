// SPDX-License-Identifier: Apache-2.0
// Configuration macros shared by every header. Each macro can be defined by the user before
// the first stellatrain include to override the default.
#pragma once

#include <stellatrain/version.hpp>

#include <cstdio>
#include <cstdlib>

// STELLATRAIN_HOST_DEVICE marks a function usable from host and device code. Under nvcc it
// expands to `__host__ __device__ inline`; under a plain C++ compiler to `inline`, so the same
// header serves both without an #ifdef in user code.
#ifndef STELLATRAIN_HOST_DEVICE
#if defined(__CUDACC__) || defined(__HIPCC__)
#define STELLATRAIN_HOST_DEVICE __host__ __device__ inline
#else
#define STELLATRAIN_HOST_DEVICE inline
#endif
#endif

// True while compiling device code (the device pass of nvcc).
#if defined(__CUDA_ARCH__)
#define STELLATRAIN_DEVICE_PASS 1
#else
#define STELLATRAIN_DEVICE_PASS 0
#endif

#ifndef STELLATRAIN_RESTRICT
#define STELLATRAIN_RESTRICT __restrict__
#endif

#ifndef STELLATRAIN_FORCE_INLINE
#define STELLATRAIN_FORCE_INLINE inline __attribute__((always_inline))
#endif

// STELLATRAIN_ENABLE_ASSERTS: 1 checks preconditions with STELLATRAIN_ASSERT, 0 compiles the
// checks out. Defaults to on unless NDEBUG is defined.
#ifndef STELLATRAIN_ENABLE_ASSERTS
#ifdef NDEBUG
#define STELLATRAIN_ENABLE_ASSERTS 0
#else
#define STELLATRAIN_ENABLE_ASSERTS 1
#endif
#endif

namespace stellatrain::detail {

/// Called by the default STELLATRAIN_ASSERT when a precondition does not hold: prints the
/// failed condition and where to stderr, then aborts. Precondition violations are programming
/// errors; conditions that depend on input data throw `stellatrain::error` instead.
[[noreturn]] inline void assert_failed(const char* condition, const char* message, const char* file,
                                       int line) noexcept {
  std::fprintf(stderr, "%s:%d: stellatrain precondition failed: %s (%s)\n", file, line, condition,
               message);
  std::abort();
}

}  // namespace stellatrain::detail

// STELLATRAIN_ASSERT(condition, message): precondition check on host code paths. Define it
// before including stellatrain to route failures elsewhere (a test framework, a logger).
#ifndef STELLATRAIN_ASSERT
#if STELLATRAIN_ENABLE_ASSERTS
#define STELLATRAIN_ASSERT(condition, message) \
  ((condition) ? static_cast<void>(0)          \
               : ::stellatrain::detail::assert_failed(#condition, message, __FILE__, __LINE__))
#else
#define STELLATRAIN_ASSERT(condition, message) static_cast<void>(0)
#endif
#endif
