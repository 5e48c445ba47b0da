// SPDX-License-Identifier: Apache-2.0
// The library's version. CMake reads the three macros below as the project version, so this
// header is the single place where the version is written.
#pragma once

#define STELLATRAIN_VERSION_MAJOR 0
#define STELLATRAIN_VERSION_MINOR 1
#define STELLATRAIN_VERSION_PATCH 0

/// One integer that orders versions: major * 10000 + minor * 100 + patch.
#define STELLATRAIN_VERSION \
  (STELLATRAIN_VERSION_MAJOR * 10000 + STELLATRAIN_VERSION_MINOR * 100 + STELLATRAIN_VERSION_PATCH)

#define STELLATRAIN_DETAIL_STR2(x) #x
#define STELLATRAIN_DETAIL_STR(x) STELLATRAIN_DETAIL_STR2(x)

/// "MAJOR.MINOR.PATCH" as a string literal.
#define STELLATRAIN_VERSION_STRING                                                  \
  STELLATRAIN_DETAIL_STR(STELLATRAIN_VERSION_MAJOR)                                 \
  "." STELLATRAIN_DETAIL_STR(STELLATRAIN_VERSION_MINOR) "." STELLATRAIN_DETAIL_STR( \
      STELLATRAIN_VERSION_PATCH)

namespace stellatrain {

/// The version this header belongs to, as "MAJOR.MINOR.PATCH".
inline constexpr const char* version_string = STELLATRAIN_VERSION_STRING;

}  // namespace stellatrain
