// SPDX-License-Identifier: Apache-2.0
// Internals of the MPI backend: the operations of one transport and their progress (matched
// probes, frame datatypes, verification), all under the transport's mutex.
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/transport/concept.hpp>
#include <stellatrain/transport/detail/frame.hpp>
#include <stellatrain/transport/message_buffer.hpp>
#include <stellatrain/transport/mpi/api.hpp>
#include <stellatrain/transport/mpi/options.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace stellatrain {

namespace detail {

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

}  // namespace stellatrain
