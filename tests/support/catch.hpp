// SPDX-License-Identifier: Apache-2.0
// Catch2 shim: the tests build against Debian's Catch2 2.13 and against Catch2 v3.
#pragma once

#if __has_include(<catch2/catch_all.hpp>)
#include <catch2/catch_all.hpp>
#define STELLATRAIN_CATCH_MAJOR 3
#else
#include <catch2/catch.hpp>
#define STELLATRAIN_CATCH_MAJOR 2
#endif
