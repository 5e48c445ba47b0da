# SPDX-License-Identifier: Apache-2.0
# MPI as the mpi component uses it: the C API, called from C++.
#
# stellatrain_find_mpi_c_api(<found_var>)
#   Finds MPI and defines the (global) imported target stellatrain::mpi_c_api: MPI's include
#   directories, flags and libraries without the deprecated C++ bindings library (libmpi_cxx)
#   that FindMPI's CXX component links. FindMPI's C component would avoid that library but
#   needs the C language enabled in the caller's project. The headers keep the bindings out
#   (transport/mpi/api.hpp defines OMPI_SKIP_MPICXX and MPICH_SKIP_MPICXX). A function, so
#   that the settings of the find (MPI_CXX_SKIP_MPICXX, MPI_* results) do not leak into the
#   caller's scope; sets STELLATRAIN_MPI_VERSION there. Used by the build and by the package
#   config.
function(stellatrain_find_mpi_c_api found_var)
  if(NOT TARGET stellatrain::mpi_c_api)
    set(MPI_CXX_SKIP_MPICXX TRUE)
    find_package(MPI QUIET COMPONENTS CXX)
    if(NOT MPI_CXX_FOUND OR NOT TARGET MPI::MPI_CXX)
      set(${found_var} FALSE PARENT_SCOPE)
      return()
    endif()
    add_library(stellatrain::mpi_c_api INTERFACE IMPORTED GLOBAL)
    foreach(property INTERFACE_INCLUDE_DIRECTORIES INTERFACE_COMPILE_OPTIONS
                     INTERFACE_COMPILE_DEFINITIONS INTERFACE_LINK_OPTIONS)
      get_target_property(value MPI::MPI_CXX ${property})
      if(value)
        set_property(TARGET stellatrain::mpi_c_api PROPERTY ${property} "${value}")
      endif()
    endforeach()
    get_target_property(libraries MPI::MPI_CXX INTERFACE_LINK_LIBRARIES)
    set(c_libraries "")
    foreach(library IN LISTS libraries)
      get_filename_component(file "${library}" NAME)
      if(NOT file MATCHES "^(lib)?(mpi_cxx|mpicxx|mpichcxx)([.]|$)")
        list(APPEND c_libraries "${library}")
      endif()
    endforeach()
    set_property(TARGET stellatrain::mpi_c_api PROPERTY INTERFACE_LINK_LIBRARIES "${c_libraries}")
    set(STELLATRAIN_MPI_VERSION "${MPI_CXX_VERSION}" PARENT_SCOPE)
  endif()
  set(${found_var} TRUE PARENT_SCOPE)
endfunction()
