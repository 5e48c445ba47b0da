// SPDX-License-Identifier: Apache-2.0
// The NCCL backend: ranks on GPUs, device buffers, work enqueued on a CUDA stream; the unique
// id is exchanged out of band through another transport. Needs NCCL (CMake target
// stellatrain::nccl); not part of <stellatrain/cuda.cuh>.
// stellatrain-component: nccl
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/cuda_check.cuh>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/broadcast.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/request_base.hpp>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace stellatrain {

/// Options of `nccl_transport`.
struct nccl_options {
  /// Bound on communicator creation (every rank must join) and on each enqueue.
  std::chrono::milliseconds init_timeout{60'000};
  /// Longest sleep between two polls of a wait.
  std::chrono::microseconds max_poll_sleep{100};
};

namespace detail {

inline std::string nccl_text(ncclResult_t r) { return std::string(ncclGetErrorString(r)); }

template <class V>
constexpr ncclDataType_t nccl_type_of() {
  if constexpr (std::is_same_v<V, float>)
    return ncclFloat32;
  else if constexpr (std::is_same_v<V, double>)
    return ncclFloat64;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 1)
    return ncclInt8;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 4)
    return ncclInt32;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 8)
    return ncclInt64;
  else if constexpr (std::is_integral_v<V> && !std::is_signed_v<V> && sizeof(V) == 1)
    return ncclUint8;
  else if constexpr (std::is_integral_v<V> && !std::is_signed_v<V> && sizeof(V) == 4)
    return ncclUint32;
  else if constexpr (std::is_integral_v<V> && !std::is_signed_v<V> && sizeof(V) == 8)
    return ncclUint64;
  else
    return ncclNumTypes;  // unsupported
}

// Shared by the transport and its requests: the communicator, and its failure.
struct nccl_state {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  int rank = 0;
  int size = 1;
  nccl_options options;
  bool failed = false;
  std::string failure;
  std::uint64_t* device_scratch = nullptr;  // size + 1 words: lengths, barrier token

  std::string who() const {
    return "nccl_transport (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
  }

  void fail(const std::string& why) noexcept {
    if (failed) return;
    failed = true;
    try {
      failure = why;
    } catch (...) {
    }
    if (comm != nullptr) (void)ncclCommAbort(comm);  // stops its kernels; the comm is dead now
    comm = nullptr;
  }

  void check_usable() const {
    if (failed) throw error(errc::peer_failure, failure);
  }

  // A non-blocking communicator may answer ncclInProgress: poll until the call is enqueued.
  void settle(ncclResult_t r, const char* what) {
    if (r == ncclInProgress) {
      const auto deadline = deadline_after(options.init_timeout);
      do {
        if (transport_clock::now() >= deadline) {
          fail(who() + ": " + what + " not enqueued within " +
               std::to_string(options.init_timeout.count()) + " ms");
          throw error(errc::timeout, failure);
        }
        std::this_thread::yield();
        if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
      } while (r == ncclInProgress);
    }
    if (r != ncclSuccess) {
      fail(who() + ": " + what + " failed: " + nccl_text(r));
      throw error(errc::peer_failure, failure);
    }
  }

  // Polls an event: true when the work before it is done; throws when the communicator
  // reports an asynchronous error (for example a peer that failed).
  bool poll(cudaEvent_t event) {
    const cudaError_t e = cudaEventQuery(event);
    if (e == cudaSuccess) return true;
    if (e != cudaErrorNotReady) check_cuda(e, "cudaEventQuery");
    check_usable();
    ncclResult_t async = ncclSuccess;
    if (comm != nullptr && ncclCommGetAsyncError(comm, &async) == ncclSuccess &&
        async != ncclSuccess && async != ncclInProgress) {
      fail(who() + ": asynchronous NCCL error: " + nccl_text(async));
      throw error(errc::peer_failure, failure);
    }
    return false;
  }
};

// The operation of an nccl_request: the event recorded after it; empty once the event has
// passed (or was dropped).
struct nccl_handle {
  nccl_state* state = nullptr;
  cudaEvent_t event = nullptr;

  bool empty() const noexcept { return event == nullptr; }

  bool test() {
    if (!state->poll(event)) return false;
    release();
    return true;
  }

  bool wait_until(transport_clock::time_point deadline) {
    auto sleep = std::chrono::microseconds(1);
    for (;;) {
      if (test()) return true;
      if (transport_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, state->options.max_poll_sleep);
    }
  }

  // Stream order is final: dropping a request only lets go of its event.
  void cancel() noexcept { release(); }

  void release() noexcept {
    if (event != nullptr) (void)cudaEventDestroy(event);  // freed once the work has passed it
    event = nullptr;
  }
};

}  // namespace detail

class nccl_transport;

/// The completion handle of `nccl_transport`: a CUDA event recorded on the transport's
/// stream after the operation. Completion means the GPU work is done. Dropping a pending
/// request does not cancel the GPU work (stream order is final): keep the device buffers
/// until the stream has passed it, or `abort` the transport.
class nccl_request : public detail::request_base<detail::nccl_handle> {
 public:
  nccl_request() = default;

 private:
  friend class nccl_transport;
  nccl_request(detail::nccl_state* s, cudaEvent_t e) noexcept : request_base({s, e}) {}
};

/// A rank of an NCCL communicator on the current CUDA device; models `transport` over
/// DEVICE memory (the spans given to isend/irecv point to GPU memory).
///
/// - Construction is collective: rank 0 creates the NCCL unique id and broadcasts it
///   through `bootstrap` (any host transport: MPI, ZeroMQ, in-process), then every rank
///   joins a non-blocking communicator, bounded by `init_timeout`.
/// - isend/irecv enqueue ncclSend/ncclRecv on `stream`. NCCL has no tags: messages between
///   two ranks match in the order they are enqueued, and a receive must have the exact size
///   of its send (the tag argument is only checked to be the same kind of stream as the
///   other backends'). Send/receive pairs that must run concurrently (a ring step) go
///   inside `group()`, as NCCL requires.
/// - Native collectives (device memory, on `stream`): `dense_allreduce` (ncclAllReduce),
///   the span `broadcast` (ncclBroadcast) and `barrier` are overridden, so the generic
///   functions work with this transport; `nccl_sparse_allgather` gathers byte messages of
///   different lengths. The generic point-to-point algorithms are not used with it (they
///   read lengths in host memory).
/// - Faults: a timeout or NCCL error aborts the communicator (ncclCommAbort) and fails the
///   transport; operations then throw `errc::peer_failure`.
///
/// \code
///   stellatrain::mpi_transport host;                         // bootstrap
///   cudaStream_t s;  cudaStreamCreate(&s);
///   stellatrain::nccl_transport t(host, s);
///   stellatrain::dense_allreduce(t, std::span<float>(device_grad, n), {.average = true});
/// \endcode
class nccl_transport {
 public:
  using request_type = nccl_request;
  /// The spans this transport moves are device memory.
  static constexpr bool device_memory = true;

  template <transport Bootstrap>
  nccl_transport(Bootstrap& bootstrap, cudaStream_t stream, nccl_options options = {})
      : state_(std::make_unique<detail::nccl_state>()) {
    detail::nccl_state& s = *state_;
    s.stream = stream;
    s.options = options;
    s.rank = bootstrap.rank();
    s.size = bootstrap.size();
    ncclUniqueId id{};
    if (s.rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess)
        throw error(errc::io_error, s.who() + ": ncclGetUniqueId failed: " + detail::nccl_text(r));
    }
    broadcast(bootstrap, 0, object_bytes(id), {.timeout = options.init_timeout});
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&s.comm, s.size, id, s.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      throw error(errc::io_error,
                  s.who() + ": ncclCommInitRankConfig failed: " + detail::nccl_text(r));
    }
    const auto deadline = deadline_after(options.init_timeout);
    while (r == ncclInProgress) {
      if (transport_clock::now() >= deadline) {
        s.fail(s.who() + ": not every rank joined the NCCL communicator within " +
               std::to_string(options.init_timeout.count()) + " ms");
        throw error(errc::timeout, s.failure);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (ncclCommGetAsyncError(s.comm, &r) != ncclSuccess) break;
    }
    if (r != ncclSuccess) {
      s.fail(s.who() + ": NCCL communicator creation failed: " + detail::nccl_text(r));
      throw error(errc::io_error, s.failure);
    }
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&s.device_scratch),
                          sizeof(std::uint64_t) * (static_cast<std::size_t>(s.size) + 1)),
               "cudaMalloc (nccl_transport scratch)");
  }

  nccl_transport(nccl_transport&&) noexcept = default;
  nccl_transport& operator=(nccl_transport&&) = delete;
  nccl_transport(const nccl_transport&) = delete;
  nccl_transport& operator=(const nccl_transport&) = delete;

  ~nccl_transport() {
    if (!state_) return;
    detail::nccl_state& s = *state_;
    if (s.comm != nullptr) {
      (void)cudaStreamSynchronize(s.stream);
      (void)ncclCommFinalize(s.comm);
      ncclResult_t r = ncclInProgress;
      while (r == ncclInProgress) {
        if (ncclCommGetAsyncError(s.comm, &r) != ncclSuccess) break;
      }
      (void)ncclCommDestroy(s.comm);
    }
    if (s.device_scratch != nullptr) (void)cudaFree(s.device_scratch);
  }

  [[nodiscard]] int rank() const noexcept { return state_->rank; }
  [[nodiscard]] int size() const noexcept { return state_->size; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_->stream; }
  [[nodiscard]] ncclComm_t communicator() const noexcept { return state_->comm; }

  /// Enqueues ncclSend of the device bytes to `dest`.
  request_type isend(int dest, tag_type, std::span<const std::byte> device_bytes) {
    detail::nccl_state& s = usable();
    s.settle(ncclSend(device_bytes.data(), device_bytes.size(), ncclUint8, dest, s.comm, s.stream),
             "ncclSend");
    return record();
  }

  /// Enqueues ncclRecv of exactly `device_bytes.size()` bytes from `source`.
  request_type irecv(int source, tag_type, std::span<std::byte> device_bytes) {
    detail::nccl_state& s = usable();
    s.settle(
        ncclRecv(device_bytes.data(), device_bytes.size(), ncclUint8, source, s.comm, s.stream),
        "ncclRecv");
    return record();
  }

  /// Runs `f()` between ncclGroupStart and ncclGroupEnd (sends and receives issued inside
  /// progress together, as a ring step needs).
  template <class F>
  void group(F&& f) {
    detail::nccl_state& s = usable();
    s.settle(ncclGroupStart(), "ncclGroupStart");
    try {
      f();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    s.settle(ncclGroupEnd(), "ncclGroupEnd");
  }

  /// Aborts the communicator; this and the other ranks' operations fail.
  void abort(std::string_view reason) noexcept {
    if (state_) state_->fail(state_->who() + ": aborted: " + std::string(reason));
  }

  // ---- native collectives (device memory), used by the generic functions

  template <class V>
  bool native_allreduce(std::span<V> device_data, const allreduce_options& opt) {
    constexpr ncclDataType_t type = detail::nccl_type_of<V>();
    if constexpr (type == ncclNumTypes) {
      throw_error(errc::unsupported, "nccl_transport: no NCCL type for this element type");
    } else {
      detail::nccl_state& s = usable();
      s.settle(ncclAllReduce(device_data.data(), device_data.data(), device_data.size(), type,
                             opt.average ? ncclAvg : ncclSum, s.comm, s.stream),
               "ncclAllReduce");
      wait(record(), opt.timeout, "dense_allreduce (ncclAllReduce)");
    }
    return true;
  }

  bool native_broadcast(int root, std::span<std::byte> device_data, const broadcast_options& opt) {
    detail::nccl_state& s = usable();
    s.settle(ncclBroadcast(device_data.data(), device_data.data(), device_data.size(), ncclUint8,
                           root, s.comm, s.stream),
             "ncclBroadcast");
    wait(record(), opt.timeout, "broadcast (ncclBroadcast)");
    return true;
  }

  bool native_barrier(const barrier_options& opt) {
    detail::nccl_state& s = usable();
    std::uint64_t* token = s.device_scratch + s.size;
    s.settle(ncclAllReduce(token, token, 1, ncclUint64, ncclSum, s.comm, s.stream),
             "ncclAllReduce (barrier)");
    wait(record(), opt.timeout, "barrier");
    return true;
  }

  /// All-gather of device byte messages of different lengths: rank i's `mine` lands at
  /// `out + i * capacity` on every rank and its length in `lengths[i]` (host memory, size()
  /// entries). One ncclAllGather of the lengths (and a wait for it: lengths are needed on
  /// the host), then one group of ncclBroadcast calls; returns the request of the latter.
  /// A length above `capacity` fails with `errc::size_mismatch` before any data moves.
  request_type sparse_allgather(std::span<const std::byte> mine, std::byte* out,
                                std::size_t capacity, std::span<std::uint64_t> lengths,
                                std::chrono::milliseconds timeout) {
    detail::nccl_state& s = usable();
    if (lengths.size() != static_cast<std::size_t>(s.size)) {
      throw_error(errc::invalid_argument,
                  s.who() + ": sparse_allgather needs " + std::to_string(s.size) + " length slots");
    }
    const std::uint64_t len = mine.size();
    check_cuda(cudaMemcpyAsync(s.device_scratch + s.rank, &len, sizeof len, cudaMemcpyHostToDevice,
                               s.stream),
               "cudaMemcpyAsync");
    s.settle(
        ncclAllGather(s.device_scratch + s.rank, s.device_scratch, 1, ncclUint64, s.comm, s.stream),
        "ncclAllGather (lengths)");
    check_cuda(
        cudaMemcpyAsync(lengths.data(), s.device_scratch, sizeof(std::uint64_t) * lengths.size(),
                        cudaMemcpyDeviceToHost, s.stream),
        "cudaMemcpyAsync");
    wait(record(), timeout, "sparse_allgather (lengths)");
    for (int r = 0; r < s.size; ++r) {
      if (lengths[static_cast<std::size_t>(r)] > capacity) {
        throw_error(errc::size_mismatch,
                    s.who() + ": rank " + std::to_string(r) + "'s message has " +
                        std::to_string(lengths[static_cast<std::size_t>(r)]) +
                        " bytes, the output holds " + std::to_string(capacity) + " per rank");
      }
    }
    group([&] {
      for (int r = 0; r < s.size; ++r) {
        std::byte* dst = out + static_cast<std::size_t>(r) * capacity;
        const void* src =
            r == s.rank ? static_cast<const void*>(mine.data()) : static_cast<const void*>(dst);
        s.settle(ncclBroadcast(src, dst, lengths[static_cast<std::size_t>(r)], ncclUint8, r, s.comm,
                               s.stream),
                 "ncclBroadcast");
      }
    });
    return record();
  }

 private:
  detail::nccl_state& usable() {
    state_->check_usable();
    return *state_;
  }

  request_type record() {
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t r = cudaEventRecord(e, state_->stream);
    if (r != cudaSuccess) {
      (void)cudaEventDestroy(e);
      check_cuda(r, "cudaEventRecord");
    }
    return {state_.get(), e};
  }

  void wait(request_type r, std::chrono::milliseconds timeout, const char* what) {
    if (!r.wait_until(deadline_after(timeout))) {
      state_->fail(state_->who() + ": " + what + " timed out after " +
                   std::to_string(timeout.count()) + " ms");
      throw error(errc::timeout, state_->failure);
    }
  }

  std::unique_ptr<detail::nccl_state> state_;
};

static_assert(transport_request<nccl_request>);
static_assert(transport<nccl_transport>);

}  // namespace stellatrain
