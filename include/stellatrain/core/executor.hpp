// SPDX-License-Identifier: Apache-2.0
// The `executor` concept the CPU kernels split their work through, the trivial executor that
// runs everything on the calling thread, and helpers to cut a range into chunks.
#pragma once

#include <stellatrain/config.hpp>

#include <algorithm>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <utility>

namespace stellatrain {

namespace detail {
// Stands for "some callable taking an index" when the concept checks `bulk`.
struct bulk_function_archetype {
  void operator()(std::size_t) const {}
};
}  // namespace detail

/// Something that runs a bulk of independent calls, possibly in parallel.
///
/// Requirements, for `E& ex`, `std::size_t n` and a callable `f` with `f(std::size_t)`:
/// - `ex.concurrency()` (noexcept): how many calls may run at the same time, at least 1;
///   kernels use it to decide how finely to split their work.
/// - `ex.bulk(n, f)`: calls `f(i)` exactly once for every `i` in `[0, n)`, in any order and
///   possibly concurrently, and returns when every call has returned. If calls throw, the
///   remaining calls may be skipped and `bulk` rethrows the first exception on the calling
///   thread. `bulk` may run some calls on the calling thread, and must not deadlock when
///   called from inside another `bulk` call on the same executor.
///
/// A minimal conforming executor:
/// \code
///   struct serial {
///     std::size_t concurrency() const noexcept { return 1; }
///     template <class F> void bulk(std::size_t n, F&& f) { for (std::size_t i = 0; i < n; ++i)
///     f(i); }
///   };
///   static_assert(stellatrain::executor<serial>);
/// \endcode
template <class E>
concept executor = requires(E& ex, std::size_t n, const detail::bulk_function_archetype& f) {
  { ex.concurrency() }
  noexcept->std::convertible_to<std::size_t>;
  ex.bulk(n, f);
};

namespace detail {
struct no_awake_guard {};
}  // namespace detail

/// For a kernel that makes several bulk calls in a row: keeps the threads of `ex` polling for
/// work between them until the returned guard is destroyed, where `ex` offers that as
/// `ex.stay_awake()` (as `thread_pool` does); otherwise returns an empty guard. Optional for
/// executors: waking sleeping threads costs tens of microseconds per bulk call, so a pool that
/// puts its threads to sleep at once gains from offering it.
template <executor Executor>
[[nodiscard]] auto stay_awake(Executor& ex) {
  if constexpr (requires { ex.stay_awake(); }) {
    return ex.stay_awake();
  } else {
    return detail::no_awake_guard{};
  }
}

/// An `executor` that also runs independent tasks: `ex.submit(f)` runs `f()` (a callable
/// taking nothing) at some later time or at once, on some thread; what it returns is ignored
/// by the library. The pipeline runs its stages through it.
template <class E>
concept task_executor = executor<E> && requires(E& ex, void (*f)()) {
  ex.submit(f);
};

/// Runs every call of a bulk on the calling thread, in index order; `submit` runs the task at
/// once on the calling thread.
class inline_executor {
 public:
  [[nodiscard]] std::size_t concurrency() const noexcept { return 1; }

  template <class F>
  void bulk(std::size_t n, F&& f) {
    for (std::size_t i = 0; i < n; ++i) f(i);
  }

  template <class F>
  void submit(F&& f) {
    f();
  }
};

static_assert(task_executor<inline_executor>);

/// Calls `fn(begin, end)` for consecutive chunks `[begin, end)` of `[0, total)`, each `grain`
/// long except possibly the last, through `ex.bulk`. A single chunk runs inline, without the
/// executor. `grain` 0 is taken as 1.
template <executor Executor, class Fn>
void for_each_chunk(Executor& ex, std::uint64_t total, std::uint64_t grain, Fn&& fn) {
  if (total == 0) return;
  grain = std::max<std::uint64_t>(grain, 1);
  const std::uint64_t chunks = (total - 1) / grain + 1;
  if (chunks == 1) {
    fn(std::uint64_t{0}, total);
    return;
  }
  ex.bulk(static_cast<std::size_t>(chunks), [&](std::size_t i) {
    const std::uint64_t begin = static_cast<std::uint64_t>(i) * grain;
    fn(begin, std::min(total, begin + grain));
  });
}

/// A chunk length for splitting `total` elements across `concurrency` threads: about
/// `chunks_per_thread` chunks per thread (to even out uneven progress), never shorter than
/// `min_grain` (so that small inputs stay on one thread), and a multiple of `align` (so that
/// chunks start on SIMD or cache-line boundaries). `align` must be at least 1.
[[nodiscard]] constexpr std::uint64_t balanced_grain(std::uint64_t total, std::size_t concurrency,
                                                     std::uint64_t min_grain,
                                                     std::uint64_t align = 1,
                                                     std::uint64_t chunks_per_thread = 4) noexcept {
  const std::uint64_t parts = std::max<std::uint64_t>(1, concurrency * chunks_per_thread);
  std::uint64_t grain = std::max<std::uint64_t>({(total + parts - 1) / parts, min_grain, 1});
  align = std::max<std::uint64_t>(align, 1);
  return (grain + align - 1) / align * align;
}

}  // namespace stellatrain
