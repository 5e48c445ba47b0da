// SPDX-License-Identifier: Apache-2.0
// The compressors' per-tensor states, kept in a vector sorted by tensor id: the lookup by id
// that every compressor shares.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

#include <algorithm>
#include <cstdint>
#include <string>

namespace stellatrain::detail {

/// The first state of `states` (pointers to structs with an `id`, ascending) whose id is not
/// below `id`.
template <class States>
auto lower_bound_id(States& states, std::uint32_t id) {
  return std::lower_bound(states.begin(), states.end(), id,
                          [](const auto& t, std::uint32_t v) { return t->id < v; });
}

/// The state of tensor `id`; throws `errc::invalid_argument` naming `who` when it is not
/// registered.
template <class States>
auto& state_of(States& states, std::uint32_t id, const char* who) {
  const auto at = lower_bound_id(states, id);
  if (at == states.end() || (*at)->id != id) {
    throw_error(errc::invalid_argument,
                std::string(who) + ": tensor " + std::to_string(id) + " is not registered");
  }
  return **at;
}

}  // namespace stellatrain::detail
