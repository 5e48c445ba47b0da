// SPDX-License-Identifier: Apache-2.0
// Internals of the MPI backend: the MPI C API, the check of its return codes, and the MPI
// datatype of an element type.
// stellatrain-component: mpi
#pragma once

#include <stellatrain/config.hpp>
#include <stellatrain/core/error.hpp>

// The C API only: never the deprecated C++ bindings (their headers warn and need linking).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstddef>
#include <string>
#include <type_traits>

namespace stellatrain {

namespace detail {

inline void mpi_check(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, text, &len) != MPI_SUCCESS) len = 0;
  throw error(errc::io_error, std::string("mpi_transport: ") + what +
                                  " failed: " + std::string(text, static_cast<std::size_t>(len)));
}

template <class V>
MPI_Datatype mpi_type_of() {
  if constexpr (std::is_same_v<V, float>)
    return MPI_FLOAT;
  else if constexpr (std::is_same_v<V, double>)
    return MPI_DOUBLE;
  else if constexpr (std::is_same_v<V, long double>)
    return MPI_LONG_DOUBLE;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 1)
    return MPI_INT8_T;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 2)
    return MPI_INT16_T;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 4)
    return MPI_INT32_T;
  else if constexpr (std::is_integral_v<V> && std::is_signed_v<V> && sizeof(V) == 8)
    return MPI_INT64_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 1)
    return MPI_UINT8_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 2)
    return MPI_UINT16_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 4)
    return MPI_UINT32_T;
  else if constexpr (std::is_integral_v<V> && sizeof(V) == 8)
    return MPI_UINT64_T;
  else
    return MPI_DATATYPE_NULL;
}

}  // namespace detail

}  // namespace stellatrain
