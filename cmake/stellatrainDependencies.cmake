# SPDX-License-Identifier: Apache-2.0
# Finds what the core target needs (xsimd, threads). Used by the build and by the installed
# package config, so both resolve dependencies the same way.
include(CMakeFindDependencyMacro)

# Debian's xsimd 8.1 exports the target `xsimd` with INTERFACE_LINK_LIBRARIES "xtl" but its
# config never looks for xtl: without a target of that name every consumer links "-lxtl" and
# fails. Find xtl first; where it is absent, define an empty stand-in (xsimd reads xtl only
# under XSIMD_ENABLE_XTL_COMPLEX, which stellatrain never sets).
if(NOT TARGET xtl)
  find_package(xtl CONFIG QUIET)
endif()
if(NOT TARGET xsimd)
  find_dependency(xsimd CONFIG)
endif()
if(NOT TARGET xtl)
  get_target_property(_stellatrain_xsimd_links xsimd INTERFACE_LINK_LIBRARIES)
  if("xtl" IN_LIST _stellatrain_xsimd_links)
    add_library(xtl INTERFACE IMPORTED)
  endif()
  unset(_stellatrain_xsimd_links)
endif()

# -pthread rather than -lpthread; inside a function, so that the setting does not leak into
# the scope of a project that finds the package.
function(_stellatrain_find_threads)
  set(THREADS_PREFER_PTHREAD_FLAG ON)
  find_package(Threads QUIET)
endfunction()
if(NOT TARGET Threads::Threads)
  _stellatrain_find_threads()
endif()
if(NOT TARGET Threads::Threads)
  find_dependency(Threads)  # reports the failure the way find_package expects
endif()
