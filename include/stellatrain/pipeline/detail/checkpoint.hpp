// SPDX-License-Identifier: Apache-2.0
// The layout of a pipeline checkpoint in the checked saved-state format of
// core/saved_state.hpp (kind "STELLPIP"): the step and the tensors (PIPE), the density
// policy's fields (POLI), and the compressor's and the optimizer's own saved states (COMP,
// OPTM), nested as bytes.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/saved_state.hpp>
#include <stellatrain/pipeline/detail/tensor_table.hpp>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace stellatrain::detail {

inline constexpr state_kind pipeline_checkpoint_kind = state_kind::of("STELLPIP", 2);

// The checkpoint of a pipeline after `steps` steps.
template <class Policy, class Compressor, class Optimizer>
std::vector<std::byte> write_pipeline_checkpoint(std::uint64_t steps,
                                                 std::span<const tensor_shape> tensors,
                                                 const Policy& policy, const Compressor& c,
                                                 const Optimizer& o) {
  const std::vector<std::byte> compressor = c.save_state();
  std::vector<std::byte> optimizer(static_cast<std::size_t>(o.state_size_bytes()));
  o.save_state(std::span<std::byte>(optimizer));
  return save_state_bytes(pipeline_checkpoint_kind, [&](state_writer& w) {
    w.record("PIPE", [&](state_record_writer& r) {
      r.put(steps);
      r.put(static_cast<std::uint64_t>(tensors.size()));
      for (const auto& t : tensors) {
        r.put(t.id);
        r.put(t.size);
      }
    });
    w.record("POLI", [&](state_record_writer& r) {
      if constexpr (requires { policy.save(r); }) policy.save(r);
    });
    w.record("COMP", [&](state_record_writer& r) { r.put_bytes(compressor); });
    w.record("OPTM", [&](state_record_writer& r) { r.put_bytes(optimizer); });
  });
}

// A verified checkpoint: the nested states point into the blob.
template <class Policy>
struct pipeline_checkpoint {
  std::uint64_t steps = 0;
  std::optional<Policy> policy;  // read into a copy of the current one, when it has `load`
  std::span<const std::byte> compressor;
  std::span<const std::byte> optimizer;
};

// Verifies `blob` whole (checksums, layout, the tensors against `tensors`) and reads it; the
// policy's fields go into a copy of `current`, so that it changes with the rest or not at all.
// Throws (`checksum_mismatch`, `malformed_message`; `invalid_argument` for another
// configuration) before anything outside the result changed.
template <class Policy>
pipeline_checkpoint<Policy> read_pipeline_checkpoint(std::span<const std::byte> blob,
                                                     std::span<const tensor_shape> tensors,
                                                     const Policy& current) {
  constexpr const char* who = "pipeline checkpoint";
  state_reader rd(blob, pipeline_checkpoint_kind, who);
  pipeline_checkpoint<Policy> out;
  auto head = rd.next("PIPE");
  out.steps = head.get<std::uint64_t>();
  const auto count = head.get<std::uint64_t>();
  if (count != tensors.size()) {
    throw_error(errc::invalid_argument, std::string(who) + ": " + std::to_string(count) +
                                            " tensors, the pipeline has " +
                                            std::to_string(tensors.size()));
  }
  for (const auto& t : tensors) {
    const auto id = head.get<std::uint32_t>();
    const auto size = head.get<std::uint64_t>();
    if (id != t.id || size != t.size) {
      throw_error(errc::invalid_argument,
                  std::string(who) + ": tensor " + std::to_string(id) + " of " +
                      std::to_string(size) + " elements where the pipeline has tensor " +
                      std::to_string(t.id) + " of " + std::to_string(t.size));
    }
  }
  head.finish();
  auto policy = rd.next("POLI");
  if constexpr (requires { out.policy->load(policy); }) {
    out.policy.emplace(current);
    out.policy->load(policy);
  }
  policy.finish();
  auto c_record = rd.next("COMP");
  out.compressor = c_record.get_bytes(c_record.remaining());
  auto o_record = rd.next("OPTM");
  out.optimizer = o_record.get_bytes(o_record.remaining());
  rd.finish();
  return out;
}

// Loads the compressor's and the optimizer's states of `saved`. Each checks its state before
// it changes anything, and the compressor's earlier state is put back when the optimizer
// refuses its own: both change, or neither.
template <class Policy, class Compressor, class Optimizer, class Executor>
void restore_states(const pipeline_checkpoint<Policy>& saved, Compressor& c, Optimizer& o,
                    Executor& ex) {
  const auto compressor_before = c.save_state();
  c.load_state(ex, saved.compressor);
  try {
    o.load_state(saved.optimizer);
  } catch (...) {
    c.load_state(ex, compressor_before);
    throw;
  }
}

}  // namespace stellatrain::detail
