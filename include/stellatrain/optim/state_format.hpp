// SPDX-License-Identifier: Apache-2.0
// The file format of the CPU optimizers' saved state (parameters, moments, momentum buffers,
// step counts): documented, versioned, checksummed with CRC-32C. The optimizers' save_state /
// load_state use it; `read_optimizer_state_info` verifies a saved state without loading it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/optim/detail/tensor_state.hpp>

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <vector>

// Format, version 1. Every integer and float is little-endian; offsets in bytes.
//
//   file header (64 bytes)
//     0  char[8]  magic "STELLOPT"
//     8  u32      format version (1)
//    12  u32      header size (64)
//    16  u32      optimizer kind: 1 = SGD, 2 = Adam (Adam, AdamW, AMSGrad)
//    20  u32      algorithm flags (see optimizer_state_flags): must match the loading optimizer
//    24  f32[8]   hyper-parameters, restored on load
//                 SGD:  lr, momentum, dampening, weight_decay, 0, 0, 0, 0
//                 Adam: lr, beta1, beta2, eps, weight_decay, 0, 0, 0
//    56  u32      tensor count
//    60  u32      CRC-32C of bytes 0..59
//   per tensor, in registration order:
//     record header (32 bytes)
//     0  char[4]  "TNSR"
//     4  u32      arrays present, bit k = array k: 0 params, 1..3 state arrays (SGD: 1 momentum
//                 buffer; Adam: 1 exp_avg, 2 exp_avg_sq, 3 max_exp_avg_sq), 4 per-element steps
//     8  u64      element count n
//    16  u64      step count of the tensor
//    24  u32      tensor index
//    28  u32      CRC-32C of bytes 0..27
//     then, for each present array in bit order: n x 4 bytes (f32, or u32 for the steps),
//     followed by the u32 CRC-32C of those bytes
//   trailer (16 bytes)
//     0  char[8]  "STELLEND"
//     8  u64      total size of the file in bytes, trailer included
//
// A reader refuses (stellatrain::error): a wrong magic, record tag or size
// (errc::malformed_message); another format version (errc::version_mismatch); a checksum
// that does not match (errc::checksum_mismatch); another optimizer kind or algorithm flags
// (errc::invalid_argument); another tensor count or tensor size (errc::size_mismatch).

namespace stellatrain {

/// Optimizer kinds of the state format.
enum class optimizer_kind : std::uint32_t { sgd = 1, adam = 2 };

/// Algorithm flags of the state format: options that decide which arrays exist or how the
/// state is to be read, so a state only loads into an optimizer with the same flags.
namespace optimizer_state_flags {
inline constexpr std::uint32_t maximize = 1u << 0;
inline constexpr std::uint32_t per_element_steps = 1u << 1;
inline constexpr std::uint32_t sgd_momentum = 1u << 8;   ///< momentum != 0
inline constexpr std::uint32_t sgd_nesterov = 1u << 9;
inline constexpr std::uint32_t adam_amsgrad = 1u << 8;
inline constexpr std::uint32_t adam_decoupled = 1u << 9;  ///< AdamW weight decay
}  // namespace optimizer_state_flags

/// What a saved state holds, as read and verified by `read_optimizer_state_info`.
struct optimizer_state_info {
  std::uint32_t version = 0;
  optimizer_kind kind = optimizer_kind::sgd;
  std::uint32_t flags = 0;
  std::array<float, 8> hyper_parameters{};
  struct tensor {
    std::uint64_t size = 0;
    std::uint64_t step = 0;
    std::uint32_t arrays = 0;
  };
  std::vector<tensor> tensors;
  std::uint64_t bytes = 0;
};

namespace detail {

inline constexpr char state_magic[8] = {'S', 'T', 'E', 'L', 'L', 'O', 'P', 'T'};
inline constexpr char state_end_magic[8] = {'S', 'T', 'E', 'L', 'L', 'E', 'N', 'D'};
inline constexpr char state_record_magic[4] = {'T', 'N', 'S', 'R'};
inline constexpr std::uint32_t state_version = 1;
inline constexpr std::size_t state_header_bytes = 64;
inline constexpr std::size_t state_record_bytes = 32;
inline constexpr std::size_t state_trailer_bytes = 16;
inline constexpr std::size_t state_array_count = 5;  // params, 3 state arrays, element steps

inline void require_little_endian() {
  if constexpr (std::endian::native != std::endian::little) {
    throw_error(errc::unsupported, "optimizer state: only little-endian hosts read and write it");
  }
}

inline std::string_view state_kind_name(optimizer_kind k) {
  return k == optimizer_kind::sgd ? "sgd" : k == optimizer_kind::adam ? "adam" : "unknown";
}

inline std::string_view state_array_name(optimizer_kind k, std::size_t a) {
  static constexpr std::string_view sgd[] = {"params", "momentum_buffer", "state2", "state3",
                                             "element_steps"};
  static constexpr std::string_view adam[] = {"params", "exp_avg", "exp_avg_sq", "max_exp_avg_sq",
                                              "element_steps"};
  return k == optimizer_kind::adam ? adam[a] : sgd[a];
}

inline std::string describe_state_flags(optimizer_kind k, std::uint32_t f) {
  namespace fl = optimizer_state_flags;
  std::string s;
  auto add = [&](bool on, const char* name) {
    if (!on) return;
    if (!s.empty()) s += ", ";
    s += name;
  };
  add(f & fl::maximize, "maximize");
  add(f & fl::per_element_steps, "per-element steps");
  if (k == optimizer_kind::sgd) {
    add(f & fl::sgd_momentum, "momentum");
    add(f & fl::sgd_nesterov, "nesterov");
  } else {
    add(f & fl::adam_amsgrad, "amsgrad");
    add(f & fl::adam_decoupled, "decoupled weight decay");
  }
  return s.empty() ? std::string("none") : s;
}

template <class T>
void put(std::byte* at, T v) noexcept {
  std::memcpy(at, &v, sizeof(T));
}
template <class T>
T get(const std::byte* at) noexcept {
  T v;
  std::memcpy(&v, at, sizeof(T));
  return v;
}

inline const std::byte* array_bytes(const tensor_state& t, std::size_t a) noexcept {
  if (a == 0) return reinterpret_cast<const std::byte*>(t.params.data());
  if (a == 4) return reinterpret_cast<const std::byte*>(t.element_steps.data());
  return reinterpret_cast<const std::byte*>(t.state[a - 1].data());
}

// Header fields the optimizer supplies.
struct state_identity {
  optimizer_kind kind;
  std::uint32_t flags;
  std::array<float, 8> hyper;
};

// Bytes of the saved state of `reg`, whose tensors all keep the arrays in `mask` (given by the
// optimizer's options: a 0-element tensor has no buffers to look at).
inline std::uint64_t state_size_bytes(const tensor_registry& reg,
                                      std::uint32_t mask) noexcept {
  std::uint64_t bytes = state_header_bytes + state_trailer_bytes;
  const auto arrays = static_cast<std::uint64_t>(std::popcount(mask));
  for (const auto& t : reg.tensors()) bytes += state_record_bytes + arrays * (t.size * 4 + 4);
  return bytes;
}

// Writes the state through `sink(const std::byte*, std::size_t)`, in order.
template <class Sink>
void write_state(const state_identity& id, const tensor_registry& reg, std::uint32_t mask,
                 Sink&& sink) {
  require_little_endian();
  std::byte header[state_header_bytes] = {};
  std::memcpy(header, state_magic, 8);
  put<std::uint32_t>(header + 8, state_version);
  put<std::uint32_t>(header + 12, static_cast<std::uint32_t>(state_header_bytes));
  put<std::uint32_t>(header + 16, static_cast<std::uint32_t>(id.kind));
  put<std::uint32_t>(header + 20, id.flags);
  for (std::size_t k = 0; k < 8; ++k) put<float>(header + 24 + 4 * k, id.hyper[k]);
  put<std::uint32_t>(header + 56, static_cast<std::uint32_t>(reg.tensor_count()));
  put<std::uint32_t>(header + 60, crc32c(std::span<const std::byte>(header, 60)));
  sink(header, sizeof header);
  std::uint64_t total = sizeof header;
  for (std::size_t ti = 0; ti < reg.tensor_count(); ++ti) {
    const tensor_state& t = reg.tensors()[ti];
    std::byte record[state_record_bytes] = {};
    std::memcpy(record, state_record_magic, 4);
    put<std::uint32_t>(record + 4, mask);
    put<std::uint64_t>(record + 8, t.size);
    put<std::uint64_t>(record + 16, t.step);
    put<std::uint32_t>(record + 24, static_cast<std::uint32_t>(ti));
    put<std::uint32_t>(record + 28, crc32c(std::span<const std::byte>(record, 28)));
    sink(record, sizeof record);
    total += sizeof record;
    for (std::size_t a = 0; a < state_array_count; ++a) {
      if ((mask & (1u << a)) == 0) continue;
      const auto bytes = static_cast<std::size_t>(t.size * 4);
      const std::byte* data = array_bytes(t, a);
      std::byte crc[4];
      put<std::uint32_t>(crc, bytes == 0 ? crc32c({}) : crc32c(std::span<const std::byte>(data, bytes)));
      if (bytes != 0) sink(data, bytes);
      sink(crc, 4);
      total += bytes + 4;
    }
  }
  std::byte trailer[state_trailer_bytes];
  std::memcpy(trailer, state_end_magic, 8);
  put<std::uint64_t>(trailer + 8, total + state_trailer_bytes);
  sink(trailer, sizeof trailer);
}

[[noreturn]] inline void state_truncated(std::uint64_t have, std::uint64_t need,
                                         const std::string& where) {
  throw_error(errc::malformed_message, "optimizer state: " + std::to_string(have) +
                                           " bytes end inside " + where + " (needs " +
                                           std::to_string(need) + ")");
}

inline std::string hex32(std::uint32_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "0x00000000";
  for (int k = 0; k < 8; ++k) s[static_cast<std::size_t>(9 - k)] = digits[(v >> (4 * k)) & 0xf];
  return s;
}

}  // namespace detail

/// Reads and verifies a saved optimizer state without loading it: the header, every tensor
/// record and every array checksum, and the trailer. Throws `stellatrain::error` (see the
/// format description above for which code) naming what is wrong and where. Linear time in
/// the size of `bytes` (one CRC-32C pass); allocates only the returned tensor list.
///
/// \code
///   auto info = stellatrain::read_optimizer_state_info(bytes);
///   // info.kind, info.tensors[i].size, info.tensors[i].step ...
/// \endcode
[[nodiscard]] inline optimizer_state_info read_optimizer_state_info(std::span<const std::byte> bytes) {
  using namespace detail;
  require_little_endian();
  const std::byte* p = bytes.data();
  const std::uint64_t size = bytes.size();
  if (size < state_header_bytes) state_truncated(size, state_header_bytes, "the file header");
  if (std::memcmp(p, state_magic, 8) != 0) {
    throw_error(errc::malformed_message,
                "optimizer state: not a stellatrain optimizer state (magic is not \"STELLOPT\")");
  }
  optimizer_state_info info;
  info.version = get<std::uint32_t>(p + 8);
  if (info.version != state_version) {
    throw_error(errc::version_mismatch, "optimizer state: format version " +
                                            std::to_string(info.version) + "; this build reads version " +
                                            std::to_string(state_version));
  }
  const auto header_crc = get<std::uint32_t>(p + 60);
  const auto header_actual = crc32c(bytes.first(60));
  if (header_crc != header_actual) {
    throw_error(errc::checksum_mismatch, "optimizer state: header checksum " + hex32(header_actual) +
                                             " does not match the stored " + hex32(header_crc));
  }
  if (get<std::uint32_t>(p + 12) != state_header_bytes) {
    throw_error(errc::malformed_message, "optimizer state: header size " +
                                             std::to_string(get<std::uint32_t>(p + 12)) +
                                             ", expected 64");
  }
  const auto kind = get<std::uint32_t>(p + 16);
  if (kind != static_cast<std::uint32_t>(optimizer_kind::sgd) &&
      kind != static_cast<std::uint32_t>(optimizer_kind::adam)) {
    throw_error(errc::malformed_message, "optimizer state: unknown optimizer kind " + std::to_string(kind));
  }
  info.kind = static_cast<optimizer_kind>(kind);
  info.flags = get<std::uint32_t>(p + 20);
  for (std::size_t k = 0; k < 8; ++k) info.hyper_parameters[k] = get<float>(p + 24 + 4 * k);
  const auto count = get<std::uint32_t>(p + 56);
  std::uint64_t at = state_header_bytes;
  info.tensors.reserve(count);
  for (std::uint32_t ti = 0; ti < count; ++ti) {
    const std::string where = "tensor " + std::to_string(ti);
    if (size - at < state_record_bytes) state_truncated(size, at + state_record_bytes, where + " header");
    const std::byte* r = p + at;
    if (std::memcmp(r, state_record_magic, 4) != 0 || get<std::uint32_t>(r + 24) != ti) {
      throw_error(errc::malformed_message, "optimizer state: " + where + ": no record header at byte " +
                                               std::to_string(at));
    }
    const auto record_crc = get<std::uint32_t>(r + 28);
    const auto record_actual = crc32c(std::span<const std::byte>(r, 28));
    if (record_crc != record_actual) {
      throw_error(errc::checksum_mismatch, "optimizer state: " + where + ": record checksum " +
                                               hex32(record_actual) + " does not match the stored " +
                                               hex32(record_crc));
    }
    optimizer_state_info::tensor t;
    t.arrays = get<std::uint32_t>(r + 4);
    t.size = get<std::uint64_t>(r + 8);
    t.step = get<std::uint64_t>(r + 16);
    if ((t.arrays & 1u) == 0 || (t.arrays >> state_array_count) != 0) {
      throw_error(errc::malformed_message, "optimizer state: " + where + ": invalid array set " +
                                               hex32(t.arrays));
    }
    at += state_record_bytes;
    if (t.size > (size - at) / 4) state_truncated(size, at + t.size * 4, where + " arrays");
    for (std::size_t a = 0; a < state_array_count; ++a) {
      if ((t.arrays & (1u << a)) == 0) continue;
      const std::uint64_t n = t.size * 4;
      const std::string array = where + ", array " + std::string(state_array_name(info.kind, a));
      if (size - at < n + 4) state_truncated(size, at + n + 4, array);
      const auto stored = get<std::uint32_t>(p + at + n);
      const auto actual = crc32c(bytes.subspan(static_cast<std::size_t>(at), static_cast<std::size_t>(n)));
      if (stored != actual) {
        throw_error(errc::checksum_mismatch, "optimizer state: " + array + ": checksum " +
                                                 hex32(actual) + " does not match the stored " +
                                                 hex32(stored) + " (corrupted)");
      }
      at += n + 4;
    }
    info.tensors.push_back(t);
  }
  if (size - at < state_trailer_bytes) state_truncated(size, at + state_trailer_bytes, "the trailer");
  if (std::memcmp(p + at, state_end_magic, 8) != 0 ||
      get<std::uint64_t>(p + at + 8) != at + state_trailer_bytes) {
    throw_error(errc::malformed_message, "optimizer state: no valid trailer at byte " + std::to_string(at));
  }
  at += state_trailer_bytes;
  if (at != size) {
    throw_error(errc::malformed_message, "optimizer state: " + std::to_string(size - at) +
                                             " unexpected bytes after the trailer");
  }
  info.bytes = size;
  return info;
}

namespace detail {

// Verifies `bytes` completely, checks it against the optimizer (kind, flags, tensor count and
// sizes, arrays), calls `accept(hyper_parameters)` (which throws to refuse them), then copies
// every array into the registry. Nothing changes unless all checks pass.
template <class Accept>
void load_state(std::span<const std::byte> bytes, const state_identity& id, tensor_registry& reg,
                std::uint32_t mask, Accept&& accept) {
  const optimizer_state_info info = read_optimizer_state_info(bytes);
  const std::string who = "optimizer state";
  if (info.kind != id.kind) {
    throw_error(errc::invalid_argument, who + ": saved by an " + std::string(state_kind_name(info.kind)) +
                                            " optimizer, loaded into " +
                                            std::string(state_kind_name(id.kind)));
  }
  if (info.flags != id.flags) {
    throw_error(errc::invalid_argument, who + ": saved with options [" +
                                            describe_state_flags(info.kind, info.flags) +
                                            "], this optimizer has [" +
                                            describe_state_flags(id.kind, id.flags) + "]");
  }
  if (info.tensors.size() != reg.tensor_count()) {
    throw_error(errc::size_mismatch, who + ": holds " + std::to_string(info.tensors.size()) +
                                         " tensors, the optimizer has " +
                                         std::to_string(reg.tensor_count()) + " registered");
  }
  for (std::size_t ti = 0; ti < info.tensors.size(); ++ti) {
    const auto& t = info.tensors[ti];
    if (t.size != reg.tensors()[ti].size) {
      throw_error(errc::size_mismatch, who + ": tensor " + std::to_string(ti) + " has " +
                                           std::to_string(t.size) + " elements, the registered tensor " +
                                           std::to_string(reg.tensors()[ti].size));
    }
    if (t.arrays != mask) {
      throw_error(errc::invalid_argument, who + ": tensor " + std::to_string(ti) + " holds arrays " +
                                              hex32(t.arrays) + ", the optimizer keeps " + hex32(mask));
    }
  }
  accept(info.hyper_parameters);
  // Everything checked: copy.
  std::uint64_t at = state_header_bytes;
  for (std::size_t ti = 0; ti < info.tensors.size(); ++ti) {
    tensor_state& t = reg.tensors()[ti];
    t.step = info.tensors[ti].step;
    at += state_record_bytes;
    const auto n = static_cast<std::size_t>(t.size * 4);
    for (std::size_t a = 0; a < state_array_count; ++a) {
      if ((mask & (1u << a)) == 0) continue;
      auto* dst = const_cast<std::byte*>(array_bytes(t, a));
      if (n != 0) std::memcpy(dst, bytes.data() + at, n);
      at += n + 4;
    }
  }
}

// Writes the state to a stream; errc::io_error when the stream fails.
inline void write_state_to(std::ostream& os, const state_identity& id, const tensor_registry& reg,
                           std::uint32_t mask) {
  write_state(id, reg, mask, [&](const std::byte* data, std::size_t n) {
    os.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n));
  });
  os.flush();
  if (!os) throw_error(errc::io_error, "optimizer state: writing to the stream failed");
}

// Writes the state into `out`, which must hold at least `state_size_bytes` bytes; returns the
// bytes written.
inline std::size_t write_state_to(std::span<std::byte> out, const state_identity& id,
                                  const tensor_registry& reg, std::uint32_t mask) {
  const std::uint64_t need = state_size_bytes(reg, mask);
  if (out.size() < need) {
    throw_error(errc::size_mismatch, "optimizer state: buffer of " + std::to_string(out.size()) +
                                         " bytes, the state needs " + std::to_string(need));
  }
  std::size_t at = 0;
  write_state(id, reg, mask, [&](const std::byte* data, std::size_t n) {
    std::memcpy(out.data() + at, data, n);
    at += n;
  });
  return at;
}

// Reads a stream to its end (a whole saved state) into memory.
inline std::vector<std::byte> read_all(std::istream& is) {
  std::vector<std::byte> bytes;
  char chunk[1 << 16];
  while (is) {
    is.read(chunk, sizeof chunk);
    const auto got = static_cast<std::size_t>(is.gcount());
    const auto* b = reinterpret_cast<const std::byte*>(chunk);
    bytes.insert(bytes.end(), b, b + got);
  }
  if (is.bad()) throw_error(errc::io_error, "optimizer state: reading from the stream failed");
  return bytes;
}

}  // namespace detail
}  // namespace stellatrain
