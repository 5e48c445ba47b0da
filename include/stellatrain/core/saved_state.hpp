// SPDX-License-Identifier: Apache-2.0
// The one binary format of saved state (optimizer, compressor and pipeline checkpoints): fixed
// byte order, a magic word and a layout version per kind of object, sized records with CRC-32C
// checksums; a reader that verifies everything before anything is loaded.
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/crc32c.hpp>
#include <stellatrain/core/error.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <istream>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// Container, version 1. Every integer and float is little-endian, whatever the host.
//
//   header (32 bytes)
//     0  char[8]  magic: the kind of object ("STELLOPT" optimizer, "STELLEFC" error-feedback
//                 compressor, "STELLPIP" pipeline checkpoint)
//     8  u32      container version (1)
//    12  u32      layout version of that kind of object
//    16  u64      record count
//    24  u32      0
//    28  u32      CRC-32C of bytes 0..27
//   records, each
//     0  char[4]  tag: what the record holds (the object's layout names them)
//     4  u32      0
//     8  u64      payload length L
//    16  L bytes  payload: the object's fields in its layout's order, each little-endian
//    16+L u32     CRC-32C of bytes 0..16+L-1 of the record (its head and payload)
//   trailer (16 bytes)
//     0  char[8]  "STELLEND"
//     8  u64      total size in bytes, trailer included
//
// `state_reader` refuses, with a `stellatrain::error` that says what and where: another magic,
// a bad record head, a length past the end, a missing trailer or bytes after it
// (errc::malformed_message); another container or layout version (errc::version_mismatch); a
// checksum that does not match (errc::checksum_mismatch). An object then checks its fields
// against its own configuration and throws before it changes anything: a load that throws
// leaves the object as it was.

namespace stellatrain {

/// The kind of a saved state: its magic (8 characters) and the layout version of its records.
struct state_kind {
  std::array<char, 8> magic{};
  std::uint32_t version = 0;

  /// Throws `errc::invalid_argument` unless `magic` has exactly 8 characters.
  static constexpr state_kind of(std::string_view magic, std::uint32_t version) {
    if (magic.size() != 8) {
      throw_error(errc::invalid_argument,
                  "state_kind: magic \"" + std::string(magic) + "\" is not 8 characters");
    }
    state_kind k;
    std::copy(magic.begin(), magic.end(), k.magic.begin());
    k.version = version;
    return k;
  }
  [[nodiscard]] std::string_view name() const noexcept { return {magic.data(), magic.size()}; }
};

/// A type `state_writer::put` and `state_reader::get` handle: integers, floats and enums.
template <class T>
concept state_field = std::is_arithmetic_v<T> || std::is_enum_v<T>;

namespace detail {

inline constexpr std::uint32_t saved_state_container_version = 1;
inline constexpr std::size_t saved_state_header_bytes = 32;
inline constexpr std::size_t saved_state_record_head_bytes = 16;
inline constexpr std::size_t saved_state_trailer_bytes = 16;
inline constexpr char saved_state_end[8] = {'S', 'T', 'E', 'L', 'L', 'E', 'N', 'D'};

// Copies `count` values of `size` bytes each from `src` to `dst`, reversing each value's bytes
// on a big-endian host (the format is little-endian).
inline void copy_little_endian(std::byte* dst, const std::byte* src, std::size_t count,
                               std::size_t size) noexcept {
  if constexpr (std::endian::native == std::endian::little) {
    if (count != 0) std::memcpy(dst, src, count * size);
  } else {
    for (std::size_t i = 0; i < count; ++i) {
      for (std::size_t b = 0; b < size; ++b) dst[i * size + b] = src[i * size + size - 1 - b];
    }
  }
}

inline void put_le32(std::byte* at, std::uint32_t v) noexcept {
  copy_little_endian(at, reinterpret_cast<const std::byte*>(&v), 1, 4);
}
inline void put_le64(std::byte* at, std::uint64_t v) noexcept {
  copy_little_endian(at, reinterpret_cast<const std::byte*>(&v), 1, 8);
}
[[nodiscard]] inline std::uint32_t get_le32(const std::byte* at) noexcept {
  std::uint32_t v;
  copy_little_endian(reinterpret_cast<std::byte*>(&v), at, 1, 4);
  return v;
}
[[nodiscard]] inline std::uint64_t get_le64(const std::byte* at) noexcept {
  std::uint64_t v;
  copy_little_endian(reinterpret_cast<std::byte*>(&v), at, 1, 8);
  return v;
}

[[nodiscard]] inline std::string printable_tag(const std::byte* tag, std::size_t n) {
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    const auto c = static_cast<unsigned char>(tag[i]);
    s += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
  }
  return s;
}

// Where the writer's bytes go: counted only (the sizing pass), or handed to a sink.
struct byte_sink {
  void (*write)(void* ctx, const std::byte* data, std::size_t n) = nullptr;
  void* ctx = nullptr;
};

}  // namespace detail

/// Writes the fields of one record (see `state_writer::record`).
class state_record_writer {
 public:
  /// Appends one field, little-endian.
  template <state_field T>
  void put(T v) {
    std::byte b[sizeof(T)];
    detail::copy_little_endian(b, reinterpret_cast<const std::byte*>(&v), 1, sizeof(T));
    write(b, sizeof(T));
  }
  /// Appends the values of `v` (no length: the layout or an earlier field gives it).
  template <class T, std::size_t Extent>
  requires state_field<std::remove_const_t<T>>
  void put_array(std::span<T, Extent> v) {
    if constexpr (std::endian::native == std::endian::little || sizeof(T) == 1) {
      write(reinterpret_cast<const std::byte*>(v.data()), v.size_bytes());
    } else {
      for (const T& x : v) put(x);
    }
  }
  /// Appends raw bytes (a nested saved state, say).
  void put_bytes(std::span<const std::byte> v) { write(v.data(), v.size()); }

  /// Bytes of payload written so far.
  [[nodiscard]] std::uint64_t size() const noexcept { return size_; }

 private:
  friend class state_writer;
  explicit state_record_writer(const detail::byte_sink* sink) : sink_(sink) {}

  void write(const std::byte* data, std::size_t n) {
    size_ += n;
    if (sink_ == nullptr || n == 0) return;
    crc_ = crc32c(std::span<const std::byte>(data, n), crc_);
    sink_->write(sink_->ctx, data, n);
  }

  const detail::byte_sink* sink_;
  std::uint64_t size_ = 0;
  std::uint32_t crc_ = 0;
};

namespace detail {
struct saved_state_access;
}  // namespace detail

/// Writes a saved state record by record. An object's save function is written once, as a
/// function of a `state_writer&`, and `save_state_bytes` / `save_state_into` / `save_state_to`
/// run it twice: once to size every record, once to write it (so a stream needs no buffer of
/// the whole state).
///
/// \code
///   auto bytes = stellatrain::save_state_bytes(kind, [&](stellatrain::state_writer& w) {
///     w.record("CONF", [&](auto& r) { r.put(options.momentum); r.put(std::uint64_t{count}); });
///     for (const auto& t : tensors) w.record("TNSR", [&](auto& r) { r.put(t.id);
///     r.put_array(t.values()); });
///   });
/// \endcode
class state_writer {
 public:
  /// Writes one record tagged `tag` (4 characters) whose fields `fields(state_record_writer&)`
  /// writes. The function must write the same bytes in both passes.
  template <class Fields>
  void record(std::string_view tag, Fields&& fields) {
    if (tag.size() != 4) {
      throw_error(errc::invalid_argument,
                  "state_writer::record: tag \"" + std::string(tag) + "\" is not 4 characters");
    }
    if (sink_ == nullptr) {
      state_record_writer r(nullptr);
      fields(r);
      sizes_.push_back(r.size());
      return;
    }
    if (next_ >= sizes_.size())
      throw_error(errc::invalid_argument, "state_writer: more records than when sized");
    const std::uint64_t declared = sizes_[next_++];
    std::byte head[detail::saved_state_record_head_bytes] = {};
    std::memcpy(head, tag.data(), 4);
    detail::put_le64(head + 8, declared);
    sink_->write(sink_->ctx, head, sizeof head);
    state_record_writer r(sink_);
    r.crc_ = crc32c(std::span<const std::byte>(head, sizeof head));
    fields(r);
    if (r.size() != declared) {
      throw_error(errc::invalid_argument, "state_writer::record: record " + std::string(tag) +
                                              " wrote " + std::to_string(r.size()) + " bytes, " +
                                              std::to_string(declared) + " when sized");
    }
    std::byte crc[4];
    detail::put_le32(crc, r.crc_);
    sink_->write(sink_->ctx, crc, 4);
  }

 private:
  friend struct detail::saved_state_access;

  std::vector<std::uint64_t> sizes_;
  std::size_t next_ = 0;
  const detail::byte_sink* sink_ = nullptr;
};

namespace detail {

struct saved_state_access {
  // Sizes the records of `write`; returns the total size of the state.
  template <class Write>
  static std::uint64_t size(state_writer& w, Write& write) {
    write(w);
    std::uint64_t total = saved_state_header_bytes + saved_state_trailer_bytes;
    for (const std::uint64_t s : w.sizes_) total += saved_state_record_head_bytes + s + 4;
    return total;
  }

  // Writes the state that `write` describes into `sink`.
  template <class Write>
  static void write(const state_kind& kind, Write& write, byte_sink sink) {
    state_writer w;
    const std::uint64_t total = size(w, write);
    std::byte header[saved_state_header_bytes] = {};
    std::memcpy(header, kind.magic.data(), 8);
    put_le32(header + 8, saved_state_container_version);
    put_le32(header + 12, kind.version);
    put_le64(header + 16, w.sizes_.size());
    put_le32(header + 28, crc32c(std::span<const std::byte>(header, 28)));
    sink.write(sink.ctx, header, sizeof header);
    w.sink_ = &sink;
    write(w);
    if (w.next_ != w.sizes_.size())
      throw_error(errc::invalid_argument, "state_writer: fewer records than when sized");
    std::byte trailer[saved_state_trailer_bytes];
    std::memcpy(trailer, saved_state_end, 8);
    put_le64(trailer + 8, total);
    sink.write(sink.ctx, trailer, sizeof trailer);
  }
};

}  // namespace detail

/// Bytes of the saved state that `write(state_writer&)` describes (runs the sizing pass only).
template <class Write>
[[nodiscard]] std::uint64_t saved_state_size(Write&& write) {
  state_writer w;
  return detail::saved_state_access::size(w, write);
}

/// The saved state of `kind` that `write(state_writer&)` describes, as bytes.
template <class Write>
[[nodiscard]] std::vector<std::byte> save_state_bytes(const state_kind& kind, Write&& write) {
  std::vector<std::byte> out;
  auto append = [](void* ctx, const std::byte* data, std::size_t n) {
    auto& v = *static_cast<std::vector<std::byte>*>(ctx);
    v.insert(v.end(), data, data + n);
  };
  detail::saved_state_access::write(kind, write, {append, &out});
  return out;
}

/// Writes the saved state into `out`, which must hold `saved_state_size(write)` bytes
/// (`errc::size_mismatch` otherwise, nothing written); returns the bytes written.
template <class Write>
std::size_t save_state_into(std::span<std::byte> out, const state_kind& kind, Write&& write) {
  const std::uint64_t need = saved_state_size(write);
  if (out.size() < need) {
    throw_error(errc::size_mismatch, std::string(kind.name()) + " state: buffer of " +
                                         std::to_string(out.size()) + " bytes, the state needs " +
                                         std::to_string(need));
  }
  struct cursor {
    std::byte* at;
  } c{out.data()};
  auto copy = [](void* ctx, const std::byte* data, std::size_t n) {
    auto& cur = *static_cast<cursor*>(ctx);
    std::memcpy(cur.at, data, n);
    cur.at += n;
  };
  detail::saved_state_access::write(kind, write, {copy, &c});
  return static_cast<std::size_t>(c.at - out.data());
}

/// Writes the saved state of `kind` to `os`; throws `errc::io_error` when the stream fails.
template <class Write>
void save_state_to(std::ostream& os, const state_kind& kind, Write&& write) {
  auto put = [](void* ctx, const std::byte* data, std::size_t n) {
    static_cast<std::ostream*>(ctx)->write(reinterpret_cast<const char*>(data),
                                           static_cast<std::streamsize>(n));
  };
  detail::saved_state_access::write(kind, write, {put, &os});
  os.flush();
  if (!os)
    throw_error(errc::io_error, std::string(kind.name()) + " state: writing to the stream failed");
}

/// Reads the fields of one verified record, in the order they were written.
class state_record_reader {
 public:
  template <state_field T>
  [[nodiscard]] T get() {
    T v;
    detail::copy_little_endian(reinterpret_cast<std::byte*>(&v), take(sizeof(T), "a field"), 1,
                               sizeof(T));
    return v;
  }
  /// Fills `out` with the next out.size() values.
  template <state_field T>
  void get_array(std::span<T> out) {
    const std::byte* p = take(out.size_bytes(), "an array");
    detail::copy_little_endian(reinterpret_cast<std::byte*>(out.data()), p, out.size(), sizeof(T));
  }
  /// The next `n` raw bytes (a nested saved state, say), without copying.
  [[nodiscard]] std::span<const std::byte> get_bytes(std::uint64_t n) {
    return {take(n, "bytes"), static_cast<std::size_t>(n)};
  }
  /// Whether `count` more values of `T` fit the rest of the record (check an untrusted length
  /// before allocating for it).
  template <state_field T>
  [[nodiscard]] bool holds(std::uint64_t count) const noexcept {
    return count <= remaining() / sizeof(T);
  }
  [[nodiscard]] std::uint64_t remaining() const noexcept { return payload_.size() - pos_; }
  /// Throws `errc::malformed_message` unless every byte of the record was read.
  void finish() const {
    if (remaining() != 0) fail(std::to_string(remaining()) + " bytes left over at the end");
  }
  /// Throws `errc::malformed_message` with `what` and where the record is.
  [[noreturn]] void fail(const std::string& what) const {
    throw_error(errc::malformed_message, std::string(who_) + ": record " + std::to_string(index_) +
                                             " (" + tag_ + "): " + what);
  }

 private:
  friend class state_reader;
  state_record_reader(std::span<const std::byte> payload, std::string_view who, std::uint64_t index,
                      std::string tag)
      : payload_(payload), who_(who), index_(index), tag_(std::move(tag)) {}

  const std::byte* take(std::uint64_t n, const char* what) {
    if (n > remaining()) {
      fail(std::string("ends inside ") + what + " at payload byte " + std::to_string(pos_) + " (" +
           std::to_string(n) + " bytes needed, " + std::to_string(remaining()) + " left)");
    }
    const std::byte* p = payload_.data() + pos_;
    pos_ += n;
    return p;
  }

  std::span<const std::byte> payload_;
  std::string_view who_;
  std::uint64_t index_;
  std::string tag_;
  std::uint64_t pos_ = 0;
};

/// Verifies a whole saved state on construction (header, every record's length and checksum,
/// trailer; linear time, one CRC-32C pass) and then hands out its records in order.
///
/// \code
///   stellatrain::state_reader rd(bytes, kind, "error_feedback_compressor::load_state");
///   auto conf = rd.next("CONF");
///   const auto momentum = conf.get<float>();
///   conf.finish();
///   ...
///   rd.finish();
/// \endcode
class state_reader {
 public:
  /// Throws (see the format above) unless `bytes` is a complete, intact saved state of `kind`.
  /// `who` names the loading function in every message; it must outlive the reader.
  state_reader(std::span<const std::byte> bytes, const state_kind& kind, std::string_view who)
      : bytes_(bytes), who_(who) {
    using namespace detail;
    const std::uint64_t size = bytes.size();
    const std::byte* p = bytes.data();
    if (size < saved_state_header_bytes) truncated(0, saved_state_header_bytes, "the header");
    if (std::memcmp(p, kind.magic.data(), 8) != 0) {
      malformed("not a saved " + std::string(kind.name()) + " state (its magic is \"" +
                printable_tag(p, 8) + "\")");
    }
    const std::uint32_t container = get_le32(p + 8);
    if (container != saved_state_container_version) {
      throw_error(errc::version_mismatch, std::string(who_) + ": container version " +
                                              std::to_string(container) + ", this build reads " +
                                              std::to_string(saved_state_container_version));
    }
    const std::uint32_t header_crc = crc32c(bytes.first(28));
    if (get_le32(p + 28) != header_crc || get_le32(p + 24) != 0) {
      throw_error(errc::checksum_mismatch,
                  std::string(who_) + ": the header's checksum does not match");
    }
    const std::uint32_t layout = get_le32(p + 12);
    if (layout != kind.version) {
      throw_error(errc::version_mismatch, std::string(who_) + ": " + std::string(kind.name()) +
                                              " layout version " + std::to_string(layout) +
                                              ", this build reads " + std::to_string(kind.version));
    }
    const std::uint64_t count = get_le64(p + 16);
    if (count > (size - saved_state_header_bytes) / (saved_state_record_head_bytes + 4)) {
      malformed("input of " + std::to_string(size) + " bytes ends inside the " +
                std::to_string(count) + " records its header announces");
    }
    std::uint64_t at = saved_state_header_bytes;
    records_.reserve(static_cast<std::size_t>(count));
    for (std::uint64_t j = 0; j < count; ++j) {
      if (size - at < saved_state_record_head_bytes + 4)
        truncated(at, saved_state_record_head_bytes + 4, "a record head");
      const std::byte* r = p + at;
      const std::string tag = printable_tag(r, 4);
      const std::uint64_t length = get_le64(r + 8);
      if (get_le32(r + 4) != 0 || length > size - at - saved_state_record_head_bytes - 4) {
        malformed("record " + std::to_string(j) + " (" + tag + ") at byte " + std::to_string(at) +
                  " claims " + std::to_string(length) + " bytes, past the end of the input");
      }
      const auto whole = static_cast<std::size_t>(saved_state_record_head_bytes + length);
      const std::uint32_t actual = crc32c(bytes.subspan(static_cast<std::size_t>(at), whole));
      if (get_le32(r + whole) != actual) {
        throw_error(errc::checksum_mismatch, std::string(who_) + ": record " + std::to_string(j) +
                                                 " (" + tag + ") at byte " + std::to_string(at) +
                                                 ": checksum does not match");
      }
      records_.push_back({at, length});
      at += whole + 4;
    }
    if (size - at < saved_state_trailer_bytes)
      truncated(at, saved_state_trailer_bytes, "the trailer");
    if (std::memcmp(p + at, saved_state_end, 8) != 0 ||
        get_le64(p + at + 8) != at + saved_state_trailer_bytes) {
      malformed("no valid trailer at byte " + std::to_string(at));
    }
    if (at + saved_state_trailer_bytes != size) {
      malformed(std::to_string(size - at - saved_state_trailer_bytes) + " bytes after the trailer");
    }
  }

  /// Records in the state.
  [[nodiscard]] std::uint64_t records() const noexcept { return records_.size(); }
  /// Records not handed out yet.
  [[nodiscard]] std::uint64_t remaining() const noexcept { return records_.size() - next_; }
  /// The tag of the next record ("" when none is left).
  [[nodiscard]] std::string next_tag() const {
    if (next_ >= records_.size()) return {};
    return detail::printable_tag(bytes_.data() + records_[next_].offset, 4);
  }

  /// The next record; throws `errc::malformed_message` when none is left or its tag is not
  /// `tag`.
  [[nodiscard]] state_record_reader next(std::string_view tag) {
    if (next_ >= records_.size()) malformed("ends before the expected record " + std::string(tag));
    const record& rec = records_[next_];
    const std::byte* r = bytes_.data() + rec.offset;
    if (tag.size() != 4 || std::memcmp(r, tag.data(), 4) != 0) {
      malformed("record " + std::to_string(next_) + " is " + detail::printable_tag(r, 4) +
                ", expected " + std::string(tag));
    }
    state_record_reader out(
        bytes_.subspan(static_cast<std::size_t>(rec.offset + detail::saved_state_record_head_bytes),
                       static_cast<std::size_t>(rec.length)),
        who_, next_, std::string(tag));
    ++next_;
    return out;
  }

  /// Throws `errc::malformed_message` unless every record was read.
  void finish() const {
    if (remaining() != 0)
      malformed(std::to_string(remaining()) + " records left over after the last expected one");
  }

  /// Throws `errc::malformed_message` with `what`, naming the loading function.
  [[noreturn]] void malformed(const std::string& what) const {
    throw_error(errc::malformed_message, std::string(who_) + ": " + what);
  }

 private:
  struct record {
    std::uint64_t offset;
    std::uint64_t length;
  };

  [[noreturn]] void truncated(std::uint64_t at, std::uint64_t need, const char* what) const {
    malformed("input of " + std::to_string(bytes_.size()) + " bytes ends inside " + what + " (" +
              std::to_string(need) + " bytes at byte " + std::to_string(at) + ")");
  }

  std::span<const std::byte> bytes_;
  std::string_view who_;
  std::vector<record> records_;
  std::uint64_t next_ = 0;
};

/// Reads a stream to its end (a whole saved state) into memory; `errc::io_error` when the
/// stream fails.
[[nodiscard]] inline std::vector<std::byte> read_state_stream(std::istream& is) {
  std::vector<std::byte> bytes;
  char chunk[1 << 16];
  while (is) {
    is.read(chunk, sizeof chunk);
    const auto got = static_cast<std::size_t>(is.gcount());
    const auto* b = reinterpret_cast<const std::byte*>(chunk);
    bytes.insert(bytes.end(), b, b + got);
  }
  if (is.bad()) throw_error(errc::io_error, "saved state: reading from the stream failed");
  return bytes;
}

}  // namespace stellatrain
