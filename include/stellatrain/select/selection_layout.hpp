// SPDX-License-Identifier: Apache-2.0
// The host-bound layout of one selection: a 64-byte header, the indices, then the values, so
// that one device-to-host copy moves a whole selection and the host reads it in place.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/dtype.hpp>
#include <stellatrain/core/error.hpp>
#include <stellatrain/core/sparse.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>

namespace stellatrain {

/// First four bytes of a selection buffer ("STSL" read as a little-endian u32).
inline constexpr std::uint32_t selection_magic = 0x4c535453u;
/// Layout version written by this build and the only one it reads.
inline constexpr std::uint16_t selection_version = 1;
/// Alignment, in bytes, of the header, the index array and the value array (a cache line).
inline constexpr std::size_t selection_alignment = 64;

/// What the producer of a selection found wrong while making it (`selection_header::status`).
/// A GPU selector cannot throw from the device; it records a broken internal invariant here and
/// `read_selection` turns it into an `error`.
enum class selection_status : std::uint32_t {
  ok = 0,
  inconsistent_counts = 1,  ///< a radix pass counted a different number of candidates than the last
  buffer_overflow = 2,      ///< more candidates were appended than a buffer holds
  wrong_total = 4,  ///< the compaction found a number of selected elements other than `count`
};

/// Bits of `selection_header::flags`: facts about how a selection was made (never errors).
inline constexpr std::uint32_t selection_flag_threshold_fallback =
    1u;  ///< threshold mispredicted: exact path ran
inline constexpr std::uint32_t selection_flag_threshold_used =
    2u;  ///< the candidates came from a threshold scan

/// The header at offset 0 of a selection buffer. Native byte order: this is the layout of a
/// device-to-host (or host-to-device) copy on one machine, not a wire format (see pack/).
struct selection_header {
  std::uint32_t magic;         ///< `selection_magic`
  std::uint16_t version;       ///< `selection_version`
  std::uint8_t index_dtype;    ///< `dtype::u32` or `dtype::u64`
  std::uint8_t value_dtype;    ///< `dtype::f32`, `dtype::f16` or `dtype::bf16`
  std::uint32_t status;        ///< `selection_status` bits; 0 when the selection is sound
  std::uint32_t flags;         ///< `selection_flag_*` bits
  std::uint64_t count;         ///< number of (index, value) pairs
  std::uint64_t dense_size;    ///< elements of the dense tensor the indices point into
  std::uint64_t index_offset;  ///< bytes from the start of the buffer to the index array
  std::uint64_t value_offset;  ///< bytes from the start of the buffer to the value array
  std::uint32_t kth_key;       ///< a lower bound of the magnitude keys of the selected elements
  std::uint32_t reserved0;     ///< zero
  std::uint64_t reserved1;     ///< zero
};
static_assert(sizeof(selection_header) == 64 && std::is_trivially_copyable_v<selection_header>,
              "selection_header must be 64 trivially copyable bytes");

/// Byte offset of the index array: right after the header.
[[nodiscard]] constexpr std::size_t selection_index_offset() noexcept {
  return sizeof(selection_header);
}

/// Byte offset of the value array of a selection of `count` pairs with `index` indices.
[[nodiscard]] constexpr std::size_t selection_value_offset(std::uint64_t count,
                                                           dtype index) noexcept {
  const std::size_t end =
      selection_index_offset() + static_cast<std::size_t>(count) * size_of(index);
  return (end + selection_alignment - 1) / selection_alignment * selection_alignment;
}

/// Total bytes of a selection of `count` pairs (a multiple of `selection_alignment`).
///
/// \code
///   // 250'000 u32 indices and bf16 values: 64 + 1'000'000 (+pad) + 500'000 (+pad) bytes
///   auto bytes = stellatrain::selection_bytes(250'000, stellatrain::dtype::u32,
///   stellatrain::dtype::bf16);
/// \endcode
[[nodiscard]] constexpr std::size_t selection_bytes(std::uint64_t count, dtype index,
                                                    dtype value) noexcept {
  const std::size_t end =
      selection_value_offset(count, index) + static_cast<std::size_t>(count) * size_of(value);
  return (end + selection_alignment - 1) / selection_alignment * selection_alignment;
}

/// `selection_bytes` for C++ element types.
template <value_type Value, index_type Index>
[[nodiscard]] constexpr std::size_t selection_bytes(std::uint64_t count) noexcept {
  return selection_bytes(count, dtype_of<Index>, dtype_of<Value>);
}

/// The header of a sound selection of `count` pairs into a tensor of `dense_size` elements.
template <value_type Value, index_type Index>
[[nodiscard]] constexpr selection_header make_selection_header(std::uint64_t count,
                                                               std::uint64_t dense_size) noexcept {
  selection_header h{};
  h.magic = selection_magic;
  h.version = selection_version;
  h.index_dtype = static_cast<std::uint8_t>(dtype_of<Index>);
  h.value_dtype = static_cast<std::uint8_t>(dtype_of<Value>);
  h.count = count;
  h.dense_size = dense_size;
  h.index_offset = selection_index_offset();
  h.value_offset = selection_value_offset(count, dtype_of<Index>);
  return h;
}

/// Reads and checks the header at the start of `bytes`: magic, version, known dtypes, offsets
/// that match `count` and a buffer large enough for them, `count <= dense_size`. The status is
/// returned as found (see `read_selection` for a check of it). Throws `error`
/// (`errc::malformed_message` or `errc::version_mismatch`) naming `what` and the field.
[[nodiscard]] inline selection_header read_selection_header(std::span<const std::byte> bytes,
                                                            std::string_view what = "selection") {
  auto fail = [&](errc code, const std::string& why) {
    throw_error(code, std::string(what) + ": " + why);
  };
  if (bytes.size() < sizeof(selection_header)) {
    fail(errc::malformed_message,
         "buffer of " + std::to_string(bytes.size()) + " bytes is shorter than the 64-byte header");
  }
  selection_header h;
  std::memcpy(&h, bytes.data(), sizeof h);
  if (h.magic != selection_magic)
    fail(errc::malformed_message, "bad magic " + std::to_string(h.magic));
  if (h.version != selection_version) {
    fail(errc::version_mismatch, "layout version " + std::to_string(h.version) +
                                     ", this build reads " + std::to_string(selection_version));
  }
  const auto index = static_cast<dtype>(h.index_dtype);
  const auto value = static_cast<dtype>(h.value_dtype);
  if (index != dtype::u32 && index != dtype::u64) {
    fail(errc::malformed_message,
         "index dtype " + std::to_string(h.index_dtype) + " is not u32 or u64");
  }
  if (value != dtype::f32 && value != dtype::f16 && value != dtype::bf16) {
    fail(errc::malformed_message,
         "value dtype " + std::to_string(h.value_dtype) + " is not f32, f16 or bf16");
  }
  if (h.count > h.dense_size) {
    fail(errc::malformed_message, "count " + std::to_string(h.count) + " exceeds the dense size " +
                                      std::to_string(h.dense_size));
  }
  // Bounds before arithmetic: a count this large could not be laid out in any buffer.
  if (h.count > bytes.size()) {
    fail(errc::malformed_message, "count " + std::to_string(h.count) + " does not fit in " +
                                      std::to_string(bytes.size()) + " bytes");
  }
  if (h.index_offset != selection_index_offset() ||
      h.value_offset != selection_value_offset(h.count, index)) {
    fail(errc::malformed_message, "offsets " + std::to_string(h.index_offset) + "/" +
                                      std::to_string(h.value_offset) + " do not match count " +
                                      std::to_string(h.count));
  }
  const std::size_t need = selection_bytes(h.count, index, value);
  if (bytes.size() < need) {
    fail(errc::malformed_message, "needs " + std::to_string(need) + " bytes for " +
                                      std::to_string(h.count) + " pairs, has " +
                                      std::to_string(bytes.size()));
  }
  return h;
}

/// A view of the selection in `bytes` (for example what one device-to-host copy of a GPU
/// selection brought). Checks the header (`read_selection_header`), that it holds `Index`
/// indices and `Value` values, that its status is `ok` (a nonzero status names what the producer
/// found wrong: `errc::malformed_message`), and that `bytes.data()` is aligned to
/// `selection_alignment`. Does not look at the indices (use `validate_sparse` for that). O(1).
///
/// \code
///   std::vector<std::byte> host(bytes);   // better: pinned memory, allocated once
///   cudaMemcpyAsync(host.data(), device_out, bytes, cudaMemcpyDeviceToHost, stream);
///   cudaStreamSynchronize(stream);
///   auto sel = stellatrain::read_selection<float, std::uint32_t>(std::as_bytes(std::span(host)));
/// \endcode
template <value_type Value, index_type Index>
[[nodiscard]] sparse_view<const Value, const Index> read_selection(
    std::span<const std::byte> bytes, std::string_view what = "selection") {
  const selection_header h = read_selection_header(bytes, what);
  auto fail = [&](const std::string& why) {
    throw_error(errc::malformed_message, std::string(what) + ": " + why);
  };
  if (h.index_dtype != static_cast<std::uint8_t>(dtype_of<Index>) ||
      h.value_dtype != static_cast<std::uint8_t>(dtype_of<Value>)) {
    fail(std::string("holds ") + std::string(name_of(static_cast<dtype>(h.index_dtype))) +
         " indices and " + std::string(name_of(static_cast<dtype>(h.value_dtype))) +
         " values, expected " + std::string(name_of(dtype_of<Index>)) + " and " +
         std::string(name_of(dtype_of<Value>)));
  }
  if (h.status != 0) {
    std::string why = "producer reported status " + std::to_string(h.status) + ":";
    if (h.status & static_cast<std::uint32_t>(selection_status::inconsistent_counts))
      why += " inconsistent counts";
    if (h.status & static_cast<std::uint32_t>(selection_status::buffer_overflow))
      why += " buffer overflow";
    if (h.status & static_cast<std::uint32_t>(selection_status::wrong_total)) why += " wrong total";
    fail(why);
  }
  if (reinterpret_cast<std::uintptr_t>(bytes.data()) % selection_alignment != 0) {
    fail("buffer is not aligned to " + std::to_string(selection_alignment) + " bytes");
  }
  const auto* base = bytes.data();
  const auto count = static_cast<std::size_t>(h.count);
  const auto* indices = reinterpret_cast<const Index*>(base + h.index_offset);
  const auto* values = reinterpret_cast<const Value*>(base + h.value_offset);
  return {std::span<const Index>(indices, count), std::span<const Value>(values, count),
          h.dense_size};
}

/// The index array of a selection buffer being filled on the host (for example, updated values
/// to send back to the device with `scatter_selection`). Precondition: `bytes` holds at least
/// `selection_bytes<Value, Index>(count)` bytes aligned to `selection_alignment`.
template <index_type Index>
[[nodiscard]] std::span<Index> selection_indices(std::span<std::byte> bytes,
                                                 std::uint64_t count) noexcept {
  STELLATRAIN_ASSERT(bytes.size() >= selection_index_offset() + count * sizeof(Index),
                     "selection buffer too small");
  return {reinterpret_cast<Index*>(bytes.data() + selection_index_offset()),
          static_cast<std::size_t>(count)};
}

/// The value array of a selection buffer being filled on the host; see `selection_indices`.
template <value_type Value, index_type Index>
[[nodiscard]] std::span<Value> selection_values(std::span<std::byte> bytes,
                                                std::uint64_t count) noexcept {
  const std::size_t offset = selection_value_offset(count, dtype_of<Index>);
  STELLATRAIN_ASSERT(bytes.size() >= offset + count * sizeof(Value), "selection buffer too small");
  return {reinterpret_cast<Value*>(bytes.data() + offset), static_cast<std::size_t>(count)};
}

/// Writes the header of a sound selection of `count` pairs to the start of `bytes`.
template <value_type Value, index_type Index>
void write_selection_header(std::span<std::byte> bytes, std::uint64_t count,
                            std::uint64_t dense_size) noexcept {
  STELLATRAIN_ASSERT(bytes.size() >= sizeof(selection_header), "selection buffer too small");
  const selection_header h = make_selection_header<Value, Index>(count, dense_size);
  std::memcpy(bytes.data(), &h, sizeof h);
}

}  // namespace stellatrain
