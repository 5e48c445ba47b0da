// SPDX-License-Identifier: Apache-2.0
// The one reader of a bucket's message, for every tier of every exchange strategy: parse
// (which checks every byte), the step check, the step reports, and the tensors of the bucket.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/pack/unpacker.hpp>
#include <stellatrain/pack/wire_format.hpp>
#include <stellatrain/pipeline/exchange_strategy.hpp>

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

namespace stellatrain::detail {

// Throws `e` again with `context` in front of what it says ("<context>: <what>"), its code
// kept; the category's own suffix (": <code message>") is not repeated.
[[noreturn]] inline void rethrow_with_context(const error& e, std::string_view context) {
  std::string_view what = e.what();
  const std::string suffix = ": " + e.code().message();
  if (what.size() >= suffix.size() && what.substr(what.size() - suffix.size()) == suffix) {
    what.remove_suffix(suffix.size());
  }
  throw error(static_cast<errc>(e.code().value()), std::string(context) + ": " + std::string(what));
}

// Parses `m`, the message of global rank `from` for `step`, checks that it is of that step
// and hands its step reports to `sink`. `who()` names the sender in errors (built only on
// failure). The caller decodes the sections from the unpacker.
template <class Executor, class Who>
const message_info& read_bucket_message(message_unpacker& u, std::span<const std::byte> m,
                                        std::int64_t step, int from, Executor& ex, report_sink sink,
                                        Who&& who) {
  const message_info* parsed = nullptr;
  try {
    parsed = &u.parse(m, ex);
  } catch (const error& e) {
    rethrow_with_context(e, who());  // what the reader found, naming the sender
  }
  const message_info& info = *parsed;
  if (info.tag != static_cast<std::uint64_t>(step)) {
    throw_error(errc::malformed_message, who() + " sent step " + std::to_string(info.tag) +
                                             " at step " + std::to_string(step));
  }
  if (const std::size_t c = u.find_control(control_type::step_reports);
      c != message_unpacker::npos) {
    sink(from, step, info.controls[c].payload);
  }
  return info;
}

// The index of tensor `id` in the bucket, or `errc::malformed_message` naming `who()`.
template <class Who>
std::size_t tensor_in_bucket(std::span<const bucket_tensor> tensors, std::uint32_t id, Who&& who) {
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].id == id) return i;
  }
  throw_error(errc::malformed_message,
              who() + " sent tensor " + std::to_string(id) + ", which the bucket does not hold");
}

}  // namespace stellatrain::detail
