// SPDX-License-Identifier: Apache-2.0
// The MPI backend (MPI-3 C API, e.g. Open MPI): ranks launched by mpirun, variable-length
// receives by matched probe, optional native collectives. Needs MPI (CMake target
// stellatrain::mpi); not part of <stellatrain/stellatrain.hpp>.
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/collective_options.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/frame.hpp>
#include <stellatrain/transport/message_buffer.hpp>

// The C API only: never the deprecated C++ bindings (their headers warn and need linking).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
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

/// Options of `mpi_transport`.
struct mpi_options {
  /// Use MPI's own collectives where `sparse_allgather`, `dense_allreduce` and `barrier` are
  /// called with the `automatic` (or `native`) algorithm: MPI_Iallgather + MPI_Iallgatherv
  /// (through a staging buffer, when the total fits in an int), MPI_Iallreduce,
  /// MPI_Ibarrier. Off: the generic algorithms run over point-to-point messages.
  bool native_collectives = false;
  /// Also protect every payload with a CRC32C (headers always have one).
  bool payload_checksum = false;
  /// Messages announcing more bytes are refused.
  std::uint64_t max_message_bytes = std::uint64_t{1} << 40;
  /// The collectives' default pipelining chunk on this transport (`auto_chunk_bytes`).
  /// Below Open MPI's TCP eager limit (64 KiB with headers) every chunk is sent eagerly: a
  /// larger one waits for a rendezvous handshake, one round trip each on a WAN (measured
  /// under wan-emu, 100 Mbit/s, 20 ms RTT: 256 KiB chunks gave 76%, 32 kB 88% of the link).
  std::size_t chunk_bytes = 32000;
  /// Messages are sent as blocks of at most this many bytes (MPI counts are int).
  std::size_t max_block_bytes = std::size_t{1} << 30;
  /// Waits poll MPI (which also drives its progress); between polls they sleep, starting
  /// at 1 us and doubling up to this.
  std::chrono::microseconds max_poll_sleep{200};
};

namespace detail {

inline void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw error(errc::io_error, std::string("mpi_transport: ") + what +
                                  " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

template <class V>
MPI_Datatype mpi_type_of() {
  if constexpr (std::is_same_v<V, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<V, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<V, long double>)
    return MPI_LONG_DOUBLE;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 1)
    return MPI_INT8_T;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 2)
    return MPI_INT16_T;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 4)
    return MPI_INT32_T;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 8)
    return MPI_INT64_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 1)
    return MPI_UINT8_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 2)
    return MPI_UINT16_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 4)
    return MPI_UINT32_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 8)
    return MPI_UINT64_T;
  else
    return MPI_DATATYPE_NULL;
}

enum class mpi_op_kind : std::uint8_t { send, recv_span, recv_buffer };
enum mpi_op_state : int { mpi_queued = 0, mpi_active = 1, mpi_done = 2, mpi_failed = 3 };

struct mpi_op {
  mpi_op_kind kind = mpi_op_kind::send;
  int state = mpi_queued;  // guarded by the transport's mutex
  int peer = 0;
  tag_type tag = 0;
  MPI_Request request = MPI_REQUEST_NULL;
  frame_bytes header{};
  std::byte* data = nullptr;  // send: the bytes; receive: where they go
  std::size_t size = 0;
  message_buffer* buffer = nullptr;
  errc code = errc::peer_failure;
  std::string message;
};

// A datatype covering `header` and `payload` at absolute addresses (used with MPI_BOTTOM),
// the payload in blocks of at most `block` bytes. Committed; free it after the call.
inline MPI_Datatype mpi_frame_type(frame_bytes& header, std::byte* payload, std::size_t n,
                                   std::size_t block) {
  const std::size_t blocks = n == 0 ? 0 : (n - 1) / block + 1;
  std::vector<int> lengths(blocks + 1);
  std::vector<MPI_Aint> at(blocks + 1);
  lengths[0] = static_cast<int>(frame_header_bytes);
  mpi_check(MPI_Get_address(header.data(), &at[0]), "MPI_Get_address");
  for (std::size_t b = 0; b < blocks; ++b) {
    const std::size_t off = b * block;
    lengths[b + 1] = static_cast<int>(std::min(block, n - off));
    mpi_check(MPI_Get_address(payload + off, &at[b + 1]), "MPI_Get_address");
  }
  MPI_Datatype t = MPI_DATATYPE_NULL;
  mpi_check(MPI_Type_create_hindexed(static_cast<int>(blocks + 1), lengths.data(), at.data(),
                                     MPI_BYTE, &t),
            "MPI_Type_create_hindexed");
  mpi_check(MPI_Type_commit(&t), "MPI_Type_commit");
  return t;
}

struct mpi_state {
  std::mutex mutex;  // every MPI call of the transport, and the queue
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0;
  int size = 1;
  int control_tag = 0;  // MPI_TAG_UB: abort notices; user tags must stay below
  mpi_options options;
  std::vector<std::shared_ptr<mpi_op>> queued;   // receives waiting for their message
  std::vector<std::shared_ptr<mpi_op>> orphans;  // dropped while MPI still owned them
  std::vector<std::string> notices;              // abort texts being sent
  std::vector<MPI_Request> notice_requests;
  bool failed = false;
  std::string failure;
  message_buffer staging;  // native all-gather

  std::string who() const {
    return "mpi_transport (rank " + std::to_string(rank) + " of " + std::to_string(size) + ")";
  }

  void fail_locked(const std::string& why) {
    if (failed) return;
    failed = true;
    failure = why;
  }

  void check_usable() const {
    if (failed) throw error(errc::peer_failure, failure);
  }

  void finish(mpi_op& op, int state, errc code = errc::peer_failure, std::string message = {}) {
    op.state = state;
    if (state == mpi_failed) {
      op.code = code;
      op.message = std::move(message);
    }
  }

  // Receives a message matched by a probe that will not be used, discarding it.
  void discard(MPI_Message& m) {
    std::byte sink[frame_header_bytes];
    MPI_Status st;
    (void)MPI_Mrecv(sink, static_cast<int>(sizeof sink), MPI_BYTE, &m, &st);  // truncation expected
  }

  // Looks for abort notices and matches queued receives, in posting order per (source,
  // tag). With `mutex` held.
  void advance() {
    for (;;) {  // abort notices from any rank
      int flag = 0;
      MPI_Status st;
      if (MPI_Iprobe(MPI_ANY_SOURCE, control_tag, comm, &flag, &st) != MPI_SUCCESS || flag == 0)
        break;
      int count = 0;
      (void)MPI_Get_count(&st, MPI_CHAR, &count);
      std::string text(static_cast<std::size_t>(std::max(0, std::min(count, 4096))), '\0');
      std::vector<char> sink(static_cast<std::size_t>(std::max(count, 1)));
      (void)MPI_Recv(sink.data(), std::max(count, 1), MPI_CHAR, st.MPI_SOURCE, control_tag, comm,
                     MPI_STATUS_IGNORE);
      std::memcpy(text.data(), sink.data(), text.size());
      fail_locked(who() + ": rank " + std::to_string(st.MPI_SOURCE) + " aborted: " + text);
    }
    if (queued.empty()) return;
    std::vector<std::pair<int, tag_type>> blocked;
    for (auto it = queued.begin(); it != queued.end();) {
      mpi_op& op = **it;
      const std::pair<int, tag_type> key{op.peer, op.tag};
      if (std::find(blocked.begin(), blocked.end(), key) != blocked.end()) {
        ++it;
        continue;
      }
      int flag = 0;
      MPI_Message m = MPI_MESSAGE_NULL;
      MPI_Status st;
      mpi_check(MPI_Improbe(op.peer, static_cast<int>(op.tag), comm, &flag, &m, &st),
                "MPI_Improbe");
      if (flag == 0) {
        blocked.push_back(key);
        ++it;
        continue;
      }
      MPI_Count total = 0;
      mpi_check(MPI_Get_elements_x(&st, MPI_BYTE, &total), "MPI_Get_elements_x");
      const auto bytes = static_cast<std::uint64_t>(total);
      if (total < static_cast<MPI_Count>(frame_header_bytes) ||
          bytes - frame_header_bytes > options.max_message_bytes) {
        discard(m);
        finish(op, mpi_failed, errc::malformed_message,
               who() + ": message of " + std::to_string(bytes) + " bytes from rank " +
                   std::to_string(op.peer) + " (tag " + std::to_string(op.tag) +
                   ") is not a frame of at most " + std::to_string(options.max_message_bytes) +
                   " bytes");
        it = queued.erase(it);
        continue;
      }
      const std::size_t n = static_cast<std::size_t>(bytes - frame_header_bytes);
      if (op.kind == mpi_op_kind::recv_span && n != op.size) {
        discard(m);
        finish(op, mpi_failed, errc::size_mismatch,
               who() + ": posted a receive of " + std::to_string(op.size) + " bytes from rank " +
                   std::to_string(op.peer) + " (tag " + std::to_string(op.tag) +
                   "), the message has " + std::to_string(n) + " bytes");
        it = queued.erase(it);
        continue;
      }
      if (op.kind == mpi_op_kind::recv_buffer) {
        try {
          op.buffer->resize_for_overwrite(n);
        } catch (const std::exception& e) {
          discard(m);
          finish(op, mpi_failed, errc::resource_exhausted, e.what());
          it = queued.erase(it);
          continue;
        }
        op.data = op.buffer->data();
      }
      op.size = n;
      MPI_Datatype t = mpi_frame_type(op.header, op.data, n, options.max_block_bytes);
      const int rc = MPI_Imrecv(MPI_BOTTOM, 1, t, &m, &op.request);
      (void)MPI_Type_free(&t);
      mpi_check(rc, "MPI_Imrecv");
      op.state = mpi_active;
      it = queued.erase(it);
    }
  }

  // Verifies the frame of a completed receive.
  void verify(mpi_op& op) {
    try {
      const frame_header h = decode_frame(op.header, static_cast<std::uint32_t>(op.peer),
                                          options.max_message_bytes, who());
      if (h.tag != op.tag || h.kind != frame_kind::data) {
        throw error(errc::malformed_message,
                    who() + ": frame from rank " + std::to_string(op.peer) + " names tag " +
                        std::to_string(h.tag) + ", received on tag " + std::to_string(op.tag));
      }
      verify_payload(h, std::span<const std::byte>(op.data, op.size), who());
      finish(op, mpi_done);
    } catch (const error& e) {
      finish(op, mpi_failed, static_cast<errc>(e.code().value()), e.what());
    }
  }

  // One poll of `op`: true when it has reached a final state. With `mutex` held.
  bool poll(mpi_op& op) {
    if (op.state >= mpi_done) return true;
    advance();
    if (op.state >= mpi_done) return true;
    if (op.state == mpi_queued) return false;
    int flag = 0;
    MPI_Status st;
    const int rc = MPI_Test(&op.request, &flag, &st);
    if (rc != MPI_SUCCESS) {
      finish(op, mpi_failed, errc::peer_failure,
             who() + ": MPI_Test failed on a message with rank " + std::to_string(op.peer));
      return true;
    }
    if (flag == 0) return false;
    if (op.kind == mpi_op_kind::send) {
      finish(op, mpi_done);
    } else {
      verify(op);
    }
    return true;
  }
};

}  // namespace detail

class mpi_transport;

/// The completion handle of `mpi_transport`. Waits poll MPI (driving its progress) with a
/// short, growing sleep. Dropping a pending receive that has not matched a message withdraws
/// it; dropping one that has, or a pending send (MPI cannot take sends back), fails the
/// transport, and MPI keeps the request: its buffer must then stay valid until the process
/// ends (after a failure, end it; `MPI_Abort` is the usual way).
class mpi_request {
 public:
  mpi_request() = default;
  mpi_request(mpi_request&&) noexcept = default;
  mpi_request& operator=(mpi_request&& other) noexcept {
    if (this != &other) {
      cancel();
      state_ = std::exchange(other.state_, nullptr);
      op_ = std::move(other.op_);
    }
    return *this;
  }
  mpi_request(const mpi_request&) = delete;
  mpi_request& operator=(const mpi_request&) = delete;
  ~mpi_request() { cancel(); }

  bool test() {
    if (!op_) return true;
    std::lock_guard lock(state_->mutex);
    return check(state_->poll(*op_));
  }

  bool wait_until(transport_clock::time_point deadline) {
    if (!op_) return true;
    auto sleep = std::chrono::microseconds(1);
    for (;;) {
      {
        std::lock_guard lock(state_->mutex);
        if (check(state_->poll(*op_))) return true;
      }
      if (transport_clock::now() >= deadline) return false;
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, state_->options.max_poll_sleep);
    }
  }

 private:
  friend class mpi_transport;
  mpi_request(detail::mpi_state* s, std::shared_ptr<detail::mpi_op> op)
      : state_(s), op_(std::move(op)) {}

  bool check(bool final) {
    if (final && op_->state == detail::mpi_done) {
      op_.reset();
      return true;
    }
    if (state_->failed) throw error(errc::peer_failure, state_->failure);
    if (final) throw error(op_->code, op_->message);
    return false;
  }

  void cancel() noexcept {
    if (!op_) return;
    try {
      std::lock_guard lock(state_->mutex);
      if (op_->state == detail::mpi_queued) {
        const auto it = std::find(state_->queued.begin(), state_->queued.end(), op_);
        if (it != state_->queued.end()) state_->queued.erase(it);
      } else if (op_->state == detail::mpi_active && !state_->poll(*op_)) {
        state_->fail_locked(
            state_->who() + ": a " +
            std::string(op_->kind == detail::mpi_op_kind::send ? "send to" : "receive from") +
            " rank " + std::to_string(op_->peer) + " was dropped before it completed");
        state_->orphans.push_back(op_);
      }
    } catch (...) {
    }
    op_.reset();
  }

  detail::mpi_state* state_ = nullptr;
  std::shared_ptr<detail::mpi_op> op_;
};

/// Initialises MPI with `MPI_THREAD_MULTIPLE` unless it is initialised already, and
/// finalises it at destruction when it initialised it. One per process, in `main`.
///
/// \code
///   int main(int argc, char** argv) {
///     stellatrain::mpi_environment env(argc, argv);
///     stellatrain::mpi_transport t;          // MPI_COMM_WORLD
///     ...
///   }
/// \endcode
class mpi_environment {
 public:
  mpi_environment(int& argc, char**& argv) { init(&argc, &argv); }
  mpi_environment() { init(nullptr, nullptr); }
  mpi_environment(const mpi_environment&) = delete;
  mpi_environment& operator=(const mpi_environment&) = delete;
  ~mpi_environment() {
    int finalized = 0;
    (void)MPI_Finalized(&finalized);
    if (owner_ && finalized == 0) (void)MPI_Finalize();
  }

  /// The thread support MPI granted (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
  [[nodiscard]] int thread_level() const noexcept { return provided_; }

 private:
  void init(int* argc, char*** argv) {
    int initialized = 0;
    detail::mpi_check(MPI_Initialized(&initialized), "MPI_Initialized");
    if (initialized == 0) {
      detail::mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided_),
                        "MPI_Init_thread");
      owner_ = true;
    } else {
      detail::mpi_check(MPI_Query_thread(&provided_), "MPI_Query_thread");
    }
  }

  bool owner_ = false;
  int provided_ = MPI_THREAD_SINGLE;
};

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

static_assert(transport_request<mpi_request>);
static_assert(message_transport<mpi_transport>);

}  // namespace stellatrain
