// SPDX-License-Identifier: Apache-2.0
// The layout of the CPU optimizers' saved state (parameters, moments, momentum buffers, step
// counts) in the checked container of core/saved_state.hpp. The optimizers' save_state /
// load_state use it; `read_optimizer_state_info` verifies a saved state without loading it.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/optim/detail/tensor_state.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

// Layout version 2 of the kind "STELLOPT", in the container of core/saved_state.hpp (which
// gives the byte order, the record heads, the CRC-32C of every record and the trailer):
//
//   record OPTM (44 bytes)
//     0  u32      optimizer kind: 1 = SGD, 2 = Adam (Adam, AdamW, AMSGrad)
//     4  u32      algorithm flags (see optimizer_state_flags): must match the loading optimizer
//     8  f32[8]   hyper-parameters, restored on load
//                 SGD:  lr, momentum, dampening, weight_decay, 0, 0, 0, 0
//                 Adam: lr, beta1, beta2, eps, weight_decay, 0, 0, 0
//    40  u32      tensor count
//   per tensor, in registration order:
//     record TNSR (24 bytes)
//     0  u32      tensor index
//     4  u32      arrays present, bit k = array k: 0 params, 1..3 state arrays (SGD: 1 momentum
//                 buffer; Adam: 1 exp_avg, 2 exp_avg_sq, 3 max_exp_avg_sq), 4 per-element steps
//     8  u64      element count n
//    16  u64      step count of the tensor
//     then one record per present array, in bit order, of n x 4 bytes (f32, or u32 for the
//     steps), tagged PARM, MOM1, MOM2, MAX2, ESTP (array 0 to 4)
//
// A reader refuses (stellatrain::error): what the container refuses (core/saved_state.hpp); a
// record out of place or of the wrong size (errc::malformed_message); another optimizer kind
// or algorithm flags (errc::invalid_argument); another tensor count or tensor size
// (errc::size_mismatch).

namespace stellatrain {

/// Optimizer kinds of the state format.
enum class optimizer_kind : std::uint32_t { sgd = 1, adam = 2 };

/// Algorithm flags of the state format: options that decide which arrays exist or how the
/// state is to be read, so a state only loads into an optimizer with the same flags.
namespace optimizer_state_flags {
inline constexpr std::uint32_t maximize = 1u << 0;
inline constexpr std::uint32_t per_element_steps = 1u << 1;
inline constexpr std::uint32_t sgd_momentum = 1u << 8;  ///< momentum != 0
inline constexpr std::uint32_t sgd_nesterov = 1u << 9;
inline constexpr std::uint32_t adam_amsgrad = 1u << 8;
inline constexpr std::uint32_t adam_decoupled = 1u << 9;        ///< AdamW weight decay
inline constexpr std::uint32_t adam_sparse_formula = 1u << 10;  ///< adam_formula::sparse_adam
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

inline constexpr state_kind optimizer_state_kind = state_kind::of("STELLOPT", 2);
inline constexpr std::size_t state_array_count = 5;  // params, 3 state arrays, element steps
inline constexpr std::string_view state_array_tags[state_array_count] = {"PARM", "MOM1", "MOM2",
                                                                         "MAX2", "ESTP"};

inline std::string_view state_kind_name(optimizer_kind k) {
  return k == optimizer_kind::sgd ? "sgd" : k == optimizer_kind::adam ? "adam" : "unknown";
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
    add(f & fl::adam_sparse_formula, "SparseAdam formula");
  }
  return s.empty() ? std::string("none") : s;
}

inline std::string hex32(std::uint32_t v) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s = "0x00000000";
  for (int k = 0; k < 8; ++k) s[static_cast<std::size_t>(9 - k)] = digits[(v >> (4 * k)) & 0xf];
  return s;
}

// Header fields the optimizer supplies.
struct state_identity {
  optimizer_kind kind;
  std::uint32_t flags;
  std::array<float, 8> hyper;
};

// The records of `reg`, whose tensors all keep the arrays in `mask` (given by the optimizer's
// options: a 0-element tensor has no buffers to look at).
inline auto state_records(state_identity id, const tensor_registry& reg, std::uint32_t mask) {
  return [id, &reg, mask](state_writer& w) {
    w.record("OPTM", [&](state_record_writer& r) {
      r.put(static_cast<std::uint32_t>(id.kind));
      r.put(id.flags);
      r.put_array(std::span<const float>(id.hyper));
      r.put(static_cast<std::uint32_t>(reg.tensor_count()));
    });
    for (std::size_t ti = 0; ti < reg.tensor_count(); ++ti) {
      const tensor_state& t = reg.tensors()[ti];
      w.record("TNSR", [&](state_record_writer& r) {
        r.put(static_cast<std::uint32_t>(ti));
        r.put(mask);
        r.put(t.size);
        r.put(t.step);
      });
      for (std::size_t a = 0; a < state_array_count; ++a) {
        if ((mask & (1u << a)) == 0) continue;
        const auto n = static_cast<std::size_t>(t.size);
        w.record(state_array_tags[a], [&](state_record_writer& r) {
          if (a == 4) {
            r.put_array(std::span<const std::uint32_t>(t.element_steps.data(), n));
          } else {
            r.put_array(std::span<const float>(a == 0 ? t.params : t.state[a - 1].data(), n));
          }
        });
      }
    }
  };
}

// A verified state: its info and, per tensor and array, the bytes of the array.
struct parsed_state {
  optimizer_state_info info;
  std::vector<std::array<std::span<const std::byte>, state_array_count>> arrays;
};

inline parsed_state parse_state(std::span<const std::byte> bytes) {
  state_reader rd(bytes, optimizer_state_kind, "optimizer state");
  parsed_state out;
  optimizer_state_info& info = out.info;
  info.version = optimizer_state_kind.version;
  auto head = rd.next("OPTM");
  const auto kind = head.get<std::uint32_t>();
  if (kind != static_cast<std::uint32_t>(optimizer_kind::sgd) &&
      kind != static_cast<std::uint32_t>(optimizer_kind::adam)) {
    head.fail("unknown optimizer kind " + std::to_string(kind));
  }
  info.kind = static_cast<optimizer_kind>(kind);
  info.flags = head.get<std::uint32_t>();
  head.get_array(std::span<float>(info.hyper_parameters));
  const auto count = head.get<std::uint32_t>();
  head.finish();
  if (count > rd.remaining()) {
    rd.malformed("claims " + std::to_string(count) + " tensors, " + std::to_string(rd.remaining()) +
                 " records follow");
  }
  info.tensors.reserve(count);
  out.arrays.resize(count);
  for (std::uint32_t ti = 0; ti < count; ++ti) {
    auto rec = rd.next("TNSR");
    if (rec.get<std::uint32_t>() != ti) rec.fail("not the record of tensor " + std::to_string(ti));
    optimizer_state_info::tensor t;
    t.arrays = rec.get<std::uint32_t>();
    t.size = rec.get<std::uint64_t>();
    t.step = rec.get<std::uint64_t>();
    rec.finish();
    if ((t.arrays & 1u) == 0 || (t.arrays >> state_array_count) != 0) {
      rec.fail("tensor " + std::to_string(ti) + ": invalid array set " + hex32(t.arrays));
    }
    for (std::size_t a = 0; a < state_array_count; ++a) {
      if ((t.arrays & (1u << a)) == 0) continue;
      auto arr = rd.next(state_array_tags[a]);
      if (!arr.holds<float>(t.size) || arr.remaining() != t.size * 4) {
        arr.fail("tensor " + std::to_string(ti) + " has " + std::to_string(t.size) +
                 " elements, the array " + std::to_string(arr.remaining()) + " bytes");
      }
      out.arrays[ti][a] = arr.get_bytes(t.size * 4);
    }
    info.tensors.push_back(t);
  }
  rd.finish();
  info.bytes = bytes.size();
  return out;
}

}  // namespace detail

/// Reads and verifies a saved optimizer state without loading it: the container (every
/// checksum), the header record, every tensor record and the size of every array. Throws
/// `stellatrain::error` (see the format description above for which code) naming what is
/// wrong and where. Linear time in the size of `bytes` (one CRC-32C pass); allocates only the
/// returned tensor list and a list of the records.
///
/// \code
///   auto info = stellatrain::read_optimizer_state_info(bytes);
///   // info.kind, info.tensors[i].size, info.tensors[i].step ...
/// \endcode
[[nodiscard]] inline optimizer_state_info read_optimizer_state_info(
    std::span<const std::byte> bytes) {
  return detail::parse_state(bytes).info;
}

namespace detail {

// Verifies `bytes` completely, checks it against the optimizer (kind, flags, tensor count and
// sizes, arrays), calls `accept(hyper_parameters)` (which throws to refuse them), then copies
// every array into the registry. Nothing changes unless all checks pass.
template <class Accept>
void load_state(std::span<const std::byte> bytes, const state_identity& id, tensor_registry& reg,
                std::uint32_t mask, Accept&& accept) {
  const parsed_state parsed = parse_state(bytes);
  const optimizer_state_info& info = parsed.info;
  const std::string who = "optimizer state";
  if (info.kind != id.kind) {
    throw_error(errc::invalid_argument,
                who + ": saved by an " + std::string(state_kind_name(info.kind)) +
                    " optimizer, loaded into " + std::string(state_kind_name(id.kind)));
  }
  if (info.flags != id.flags) {
    throw_error(errc::invalid_argument,
                who + ": saved with options [" + describe_state_flags(info.kind, info.flags) +
                    "], this optimizer has [" + describe_state_flags(id.kind, id.flags) + "]");
  }
  if (info.tensors.size() != reg.tensor_count()) {
    throw_error(errc::size_mismatch, who + ": holds " + std::to_string(info.tensors.size()) +
                                         " tensors, the optimizer has " +
                                         std::to_string(reg.tensor_count()) + " registered");
  }
  for (std::size_t ti = 0; ti < info.tensors.size(); ++ti) {
    const auto& t = info.tensors[ti];
    if (t.size != reg.tensors()[ti].size) {
      throw_error(errc::size_mismatch,
                  who + ": tensor " + std::to_string(ti) + " has " + std::to_string(t.size) +
                      " elements, the registered tensor " + std::to_string(reg.tensors()[ti].size));
    }
    if (t.arrays != mask) {
      throw_error(errc::invalid_argument, who + ": tensor " + std::to_string(ti) +
                                              " holds arrays " + hex32(t.arrays) +
                                              ", the optimizer keeps " + hex32(mask));
    }
  }
  accept(info.hyper_parameters);
  // Everything checked: copy.
  for (std::size_t ti = 0; ti < info.tensors.size(); ++ti) {
    tensor_state& t = reg.tensors()[ti];
    t.step = info.tensors[ti].step;
    for (std::size_t a = 0; a < state_array_count; ++a) {
      if ((mask & (1u << a)) == 0) continue;
      const auto src = parsed.arrays[ti][a];
      void* dst = a == 4 ? static_cast<void*>(t.element_steps.data())
                         : static_cast<void*>(a == 0 ? t.params : t.state[a - 1].data());
      copy_little_endian(static_cast<std::byte*>(dst), src.data(), static_cast<std::size_t>(t.size),
                         4);
    }
  }
}

}  // namespace detail
}  // namespace stellatrain
