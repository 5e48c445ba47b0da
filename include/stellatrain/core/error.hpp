// SPDX-License-Identifier: Apache-2.0
// The library's exception type and error codes.
#pragma once

#include <stellatrain/config.hpp>

#include <source_location>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

namespace stellatrain {

/// What went wrong, as a `std::error_code` value in `stellatrain::error_category()`.
enum class errc : int {
  invalid_argument = 1,  ///< an argument is outside what the function accepts
  out_of_range,          ///< an index, size or offset lies outside its container
  size_mismatch,         ///< two sizes that must agree do not
  malformed_message,     ///< bytes from the wire or a file do not parse
  checksum_mismatch,     ///< bytes parse but their checksum does not match
  version_mismatch,      ///< a format or protocol version this build does not read
  not_finite,            ///< a NaN or infinity where finite values are required
  timeout,               ///< a bounded wait ran out
  peer_failure,          ///< another rank failed, disconnected or stopped answering
  io_error,              ///< a file or socket operation failed
  cuda_error,            ///< a CUDA runtime or kernel error
  unsupported,           ///< valid, but not supported by this build or backend
  resource_exhausted,    ///< an allocation or capacity limit was hit
};

namespace detail {

class error_category_impl final : public std::error_category {
 public:
  [[nodiscard]] const char* name() const noexcept override { return "stellatrain"; }

  [[nodiscard]] std::string message(int code) const override {
    switch (static_cast<errc>(code)) {
      case errc::invalid_argument:
        return "invalid argument";
      case errc::out_of_range:
        return "out of range";
      case errc::size_mismatch:
        return "size mismatch";
      case errc::malformed_message:
        return "malformed message";
      case errc::checksum_mismatch:
        return "checksum mismatch";
      case errc::version_mismatch:
        return "version mismatch";
      case errc::not_finite:
        return "non-finite value";
      case errc::timeout:
        return "timed out";
      case errc::peer_failure:
        return "peer failure";
      case errc::io_error:
        return "I/O error";
      case errc::cuda_error:
        return "CUDA error";
      case errc::unsupported:
        return "unsupported";
      case errc::resource_exhausted:
        return "resource exhausted";
    }
    return "unknown stellatrain error " + std::to_string(code);
  }
};

}  // namespace detail

/// The error category of `errc` values (one object per program).
[[nodiscard]] inline const std::error_category& error_category() noexcept {
  static const detail::error_category_impl category;
  return category;
}

/// Makes `errc` usable wherever a `std::error_code` is expected.
[[nodiscard]] inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), error_category()};
}

/// The exception every host-side failure of the library throws.
///
/// `code()` tells the kind of failure (compare with `errc` values); `what()` says what was
/// wrong and where, for example
/// "unpack: section 3 (tensor 17): index 70000 >= tensor size 65536: out of range".
///
/// Example:
/// \code
///   try { ... } catch (const stellatrain::error& e) {
///     if (e.code() == stellatrain::errc::checksum_mismatch) { /* ask for a resend */ }
///   }
/// \endcode
class error : public std::system_error {
 public:
  error(errc code, const std::string& what) : std::system_error(make_error_code(code), what) {}
  error(errc code, const char* what) : std::system_error(make_error_code(code), what) {}
};

/// Throws `error(code, what)`. Kept out of line from hot loops: callers test a condition and
/// call this on the cold path.
[[noreturn]] inline void throw_error(errc code, std::string_view what) {
  throw error(code, std::string(what));
}

/// Throws `error(code, "<function>: <what>")`, naming the calling function.
#if defined(__cpp_lib_source_location)
[[noreturn]] inline void throw_error_here(
    errc code, std::string_view what,
    std::source_location where = std::source_location::current()) {
  std::string message(where.function_name());
  message += ": ";
  message += what;
  throw error(code, message);
}
#else
// Standard libraries without std::source_location for this compiler (libstdc++ 12 with
// clang 14, which builds the fuzzers): the builtin both compilers have names the caller.
[[noreturn]] inline void throw_error_here(errc code, std::string_view what,
                                          const char* function = __builtin_FUNCTION()) {
  std::string message(function);
  message += ": ";
  message += what;
  throw error(code, message);
}
#endif

}  // namespace stellatrain

template <>
struct std::is_error_code_enum<stellatrain::errc> : std::true_type {};
