// SPDX-License-Identifier: Apache-2.0
// The MPI transport (`mpi_transport`): a duplicated communicator, sends, receives, abort
// notices and the native collectives.
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/frame.hpp>
#include <stellatrain/transport/message_buffer.hpp>
#include <stellatrain/transport/mpi/api.hpp>
#include <stellatrain/transport/mpi/engine.hpp>
#include <stellatrain/transport/mpi/options.hpp>
#include <stellatrain/transport/mpi/request.hpp>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace stellatrain {

/// A rank of an MPI communicator (models `message_transport`).
///
/// - Construction duplicates the communicator (collective: every rank constructs together),
///   so its messages never mix with the application's, and sets MPI_ERRORS_RETURN on it.
///   MPI must be initialised (see `mpi_environment`); all MPI calls of the transport are
///   serialised by one mutex, so it is safe from several threads whatever thread level MPI
///   granted, as long as the application's other MPI calls respect that level.
/// - Each message is one MPI message: the 32-byte frame header (detail/frame.hpp) followed
///   by the payload, sent with an hindexed datatype straight from the caller's memory
///   (blocks of at most `max_block_bytes`, so sizes are 64-bit). A receive matches its
///   message with MPI_Improbe (in posting order per source and tag), sizes the buffer from
///   the probed length, receives with MPI_Imrecv and then verifies the header.
/// - Tags must be below MPI_TAG_UB (the largest tag, reserved for abort notices);
///   `abort(reason)` sends one to every rank, whose operations then fail.
/// - Faults: a rank that dies is handled by the MPI runtime (Open MPI's mpirun ends the job
///   with an error); a rank that stalls makes the others' waits time out.
/// - Destruction frees the duplicated communicator (when MPI is not finalised yet).
///
/// \code
///   stellatrain::mpi_environment env(argc, argv);
///   stellatrain::mpi_transport t;
///   std::vector<stellatrain::message_buffer> got(t.size());
///   stellatrain::sparse_allgather(t, mine, got);
/// \endcode
class mpi_transport {
 public:
  using request_type = mpi_request;

  explicit mpi_transport(MPI_Comm comm = MPI_COMM_WORLD, mpi_options options = {})
      : state_(std::make_unique<detail::mpi_state>()) {
    int initialized = 0;
    detail::mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (initialized == 0)
      throw_error(errc::invalid_argument,
                  "mpi_transport: MPI is not initialised (see mpi_environment)");
    if (options.max_block_bytes == 0 ||
        options.max_block_bytes > static_cast<std::size_t>(INT_MAX)) {
      throw_error(errc::invalid_argument,
                  "mpi_transport: max_block_bytes must be 1.." + std::to_string(INT_MAX));
    }
    detail::mpi_state& s = *state_;
    s.options = options;
    detail::mpi_check(MPI_Comm_dup(comm, &s.comm), "MPI_Comm_dup");
    detail::mpi_check(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN),
                      "MPI_Comm_set_errhandler");
    detail::mpi_check(MPI_Comm_rank(s.comm, &s.rank), "MPI_Comm_rank");
    detail::mpi_check(MPI_Comm_size(s.comm, &s.size), "MPI_Comm_size");
    int* tag_ub = nullptr;
    int found = 0;
    detail::mpi_check(MPI_Comm_get_attr(s.comm, MPI_TAG_UB, &tag_ub, &found), "MPI_Comm_get_attr");
    s.control_tag = found != 0 && tag_ub != nullptr ? *tag_ub : 32767;
  }

  mpi_transport(mpi_transport&&) noexcept = default;
  mpi_transport& operator=(mpi_transport&&) = delete;
  mpi_transport(const mpi_transport&) = delete;
  mpi_transport& operator=(const mpi_transport&) = delete;

  ~mpi_transport() {
    if (!state_) return;
    int finalized = 0;
    (void)MPI_Finalized(&finalized);
    if (finalized != 0) return;
    std::lock_guard lock(state_->mutex);
    for (auto& op : state_->orphans) {
      if (op->request != MPI_REQUEST_NULL) (void)MPI_Request_free(&op->request);
    }
    for (MPI_Request& r : state_->notice_requests) {
      if (r != MPI_REQUEST_NULL) (void)MPI_Request_free(&r);
    }
    (void)MPI_Comm_free(&state_->comm);
  }

  [[nodiscard]] int rank() const noexcept { return state_ ? state_->rank : 0; }
  [[nodiscard]] int size() const noexcept { return state_ ? state_->size : 0; }

  /// `mpi_options::chunk_bytes` (see `auto_chunk_bytes`).
  [[nodiscard]] std::size_t preferred_chunk_bytes() const noexcept {
    return state_->options.chunk_bytes;
  }

  /// The duplicated communicator (for the application's own MPI calls on the same ranks).
  [[nodiscard]] MPI_Comm communicator() const noexcept { return state_->comm; }

  request_type isend(int dest, tag_type tag, std::span<const std::byte> bytes) {
    detail::mpi_state& s = *state_;
    check(dest, tag, "isend");
    auto op = std::make_shared<detail::mpi_op>();
    op->kind = detail::mpi_op_kind::send;
    op->peer = dest;
    op->tag = tag;
    op->data =
        const_cast<std::byte*>(bytes.data());  // only read: MPI's API is not const-typed here
    op->size = bytes.size();
    detail::encode_frame(detail::data_frame(static_cast<std::uint32_t>(s.rank), tag, bytes,
                                            s.options.payload_checksum),
                         op->header);
    std::lock_guard lock(s.mutex);
    s.check_usable();
    MPI_Datatype t =
        detail::mpi_frame_type(op->header, op->data, op->size, s.options.max_block_bytes);
    const int rc = MPI_Isend(MPI_BOTTOM, 1, t, dest, static_cast<int>(tag), s.comm, &op->request);
    (void)MPI_Type_free(&t);
    detail::mpi_check(rc, "MPI_Isend");
    op->state = detail::mpi_active;
    return {state_.get(), std::move(op)};
  }

  request_type irecv(int source, tag_type tag, std::span<std::byte> into) {
    return post_recv(source, tag, detail::mpi_op_kind::recv_span, into.data(), into.size(),
                     nullptr);
  }

  request_type irecv(int source, tag_type tag, message_buffer& into) {
    return post_recv(source, tag, detail::mpi_op_kind::recv_buffer, nullptr, 0, &into);
  }

  /// Fails this transport and sends an abort notice with `reason` to every other rank.
  void abort(std::string_view reason) noexcept {
    if (!state_) return;
    detail::mpi_state& s = *state_;
    try {
      std::lock_guard lock(s.mutex);
      if (s.failed) return;
      s.fail_locked(s.who() + ": aborted: " + std::string(reason));
      s.notices.reserve(static_cast<std::size_t>(s.size));
      for (int p = 0; p < s.size; ++p) {
        if (p == s.rank) continue;
        s.notices.emplace_back(reason.substr(0, 4000));
        MPI_Request r = MPI_REQUEST_NULL;
        if (MPI_Isend(s.notices.back().data(), static_cast<int>(s.notices.back().size()), MPI_CHAR,
                      p, s.control_tag, s.comm, &r) == MPI_SUCCESS) {
          s.notice_requests.push_back(r);
        }
      }
    } catch (...) {
    }
  }

  // ---- native collectives (used by the generic functions when enabled in the options)

  /// MPI_Iallgather of the lengths, then MPI_Iallgatherv through a staging buffer. Returns
  /// false (use the generic algorithm) when disabled or when the total exceeds an int.
  bool native_sparse_allgather(std::span<const std::byte> mine, std::span<message_buffer> out,
                               const allgather_options& opt) {
    detail::mpi_state& s = *state_;
    if (!s.options.native_collectives && opt.algorithm != allgather_algorithm::native) return false;
    const auto deadline = deadline_after(opt.timeout);
    std::vector<std::uint64_t> lengths(static_cast<std::size_t>(s.size));
    std::uint64_t len = mine.size();
    collective(deadline, "sparse_allgather (native) lengths", [&](MPI_Request* r) {
      return MPI_Iallgather(&len, 1, MPI_UINT64_T, lengths.data(), 1, MPI_UINT64_T, s.comm, r);
    });
    std::uint64_t total = 0;
    for (auto l : lengths) {
      if (l > opt.max_message_bytes)
        throw_error(errc::malformed_message,
                    s.who() + ": native all-gather length above the limit");
      total += l;
    }
    if (total > static_cast<std::uint64_t>(INT_MAX)) {
      if (opt.algorithm == allgather_algorithm::native) {
        throw_error(errc::unsupported, s.who() + ": native all-gather of " + std::to_string(total) +
                                           " bytes exceeds an int");
      }
      return false;  // every rank computed the same total: all fall back together
    }
    std::vector<int> counts(static_cast<std::size_t>(s.size));
    std::vector<int> displs(static_cast<std::size_t>(s.size));
    int at = 0;
    for (int p = 0; p < s.size; ++p) {
      counts[static_cast<std::size_t>(p)] = static_cast<int>(lengths[static_cast<std::size_t>(p)]);
      displs[static_cast<std::size_t>(p)] = at;
      at += counts[static_cast<std::size_t>(p)];
    }
    s.staging.resize_for_overwrite(static_cast<std::size_t>(std::max<std::uint64_t>(total, 1)));
    collective(deadline, "sparse_allgather (native)", [&](MPI_Request* r) {
      return MPI_Iallgatherv(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, s.staging.data(),
                             counts.data(), displs.data(), MPI_BYTE, s.comm, r);
    });
    for (int p = 0; p < s.size; ++p) {
      out[static_cast<std::size_t>(p)].assign(std::span<const std::byte>(
          s.staging.data() + displs[static_cast<std::size_t>(p)],
          static_cast<std::size_t>(counts[static_cast<std::size_t>(p)])));
    }
    return true;
  }

  /// MPI_Iallreduce (MPI_SUM) in pieces of at most INT_MAX elements.
  template <class V>
  bool native_allreduce(std::span<V> data, const allreduce_options& opt) {
    detail::mpi_state& s = *state_;
    if (!s.options.native_collectives && opt.algorithm != allreduce_algorithm::native) return false;
    const MPI_Datatype type = detail::mpi_type_of<V>();
    if (type == MPI_DATATYPE_NULL) return false;
    const auto deadline = deadline_after(opt.timeout);
    for (std::size_t at = 0; at < data.size(); at += static_cast<std::size_t>(INT_MAX)) {
      const int n = static_cast<int>(std::min<std::size_t>(data.size() - at, INT_MAX));
      collective(deadline, "dense_allreduce (native)", [&](MPI_Request* r) {
        return MPI_Iallreduce(MPI_IN_PLACE, data.data() + at, n, type, MPI_SUM, s.comm, r);
      });
    }
    if constexpr (std::is_floating_point_v<V>) {
      if (opt.average && s.size > 1) {
        const V inv = static_cast<V>(1) / static_cast<V>(s.size);
        for (V& x : data) x *= inv;
      }
    }
    return true;
  }

  /// MPI_Ibarrier.
  bool native_barrier(const barrier_options& opt) {
    detail::mpi_state& s = *state_;
    if (!s.options.native_collectives) return false;
    collective(deadline_after(opt.timeout), "barrier (native)",
               [&](MPI_Request* r) { return MPI_Ibarrier(s.comm, r); });
    return true;
  }

 private:
  void check(int peer, tag_type tag, const char* what) const {
    const detail::mpi_state& s = *state_;
    if (peer < 0 || peer >= s.size) {
      throw_error(errc::invalid_argument,
                  s.who() + ": " + what + " with peer " + std::to_string(peer));
    }
    if (tag >= static_cast<tag_type>(s.control_tag)) {
      throw_error(errc::invalid_argument,
                  s.who() + ": tag " + std::to_string(tag) +
                      " is not below MPI_TAG_UB = " + std::to_string(s.control_tag));
    }
  }

  request_type post_recv(int source, tag_type tag, detail::mpi_op_kind kind, std::byte* data,
                         std::size_t size, message_buffer* buffer) {
    detail::mpi_state& s = *state_;
    check(source, tag, "irecv");
    auto op = std::make_shared<detail::mpi_op>();
    op->kind = kind;
    op->peer = source;
    op->tag = tag;
    op->data = data;
    op->size = size;
    op->buffer = buffer;
    std::lock_guard lock(s.mutex);
    s.check_usable();
    s.queued.push_back(op);
    s.advance();
    return {state_.get(), std::move(op)};
  }

  // Starts a non-blocking collective and polls it until done or `deadline` (then the
  // transport fails: an MPI collective cannot be cancelled).
  template <class Start>
  void collective(transport_clock::time_point deadline, const char* what, Start&& start) {
    detail::mpi_state& s = *state_;
    MPI_Request r = MPI_REQUEST_NULL;
    {
      std::lock_guard lock(s.mutex);
      s.check_usable();
      detail::mpi_check(start(&r), what);
    }
    auto sleep = std::chrono::microseconds(1);
    for (;;) {
      {
        std::lock_guard lock(s.mutex);
        int flag = 0;
        detail::mpi_check(MPI_Test(&r, &flag, MPI_STATUS_IGNORE), what);
        if (flag != 0) return;
        s.advance();
        if (s.failed) {
          (void)MPI_Request_free(&r);
          throw error(errc::peer_failure, s.failure);
        }
        if (transport_clock::now() >= deadline) {
          s.fail_locked(s.who() + ": " + what + " timed out");
          (void)MPI_Request_free(&r);
          throw error(errc::timeout,
                      s.who() + ": " + what + " timed out; the transport is unusable now");
        }
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, s.options.max_poll_sleep);
    }
  }

  std::unique_ptr<detail::mpi_state> state_;
};

static_assert(message_transport<mpi_transport>);

}  // namespace stellatrain
