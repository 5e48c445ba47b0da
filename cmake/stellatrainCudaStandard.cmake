# SPDX-License-Identifier: Apache-2.0
# C++20 for CUDA sources. CMake 3.25 does not know that nvcc 12+ accepts -std=c++20: the
# compile feature cuda_std_20 is "not known to CUDA compiler NVIDIA" there. Where CMake knows
# the feature it is used; otherwise -std=c++20 is added to CUDA compile lines directly.
#
# stellatrain_require_cuda_cxx20(<target> [BUILD_INTERFACE])
#   Adds the requirement to the INTERFACE of <target>. With BUILD_INTERFACE the flag is wrapped
#   so that it does not leak into an exported target (the installed config decides again, for
#   the consumer's CMake).
function(stellatrain_require_cuda_cxx20 target)
  set(_wrap_begin "")
  set(_wrap_end "")
  if(ARGN STREQUAL "BUILD_INTERFACE")
    set(_wrap_begin "$<BUILD_INTERFACE:")
    set(_wrap_end ">")
  endif()
  if("cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES)
    target_compile_features(${target} INTERFACE ${_wrap_begin}cuda_std_20${_wrap_end})
  else()
    target_compile_options(${target} INTERFACE
      "${_wrap_begin}$<$<COMPILE_LANGUAGE:CUDA>:-std=c++20>${_wrap_end}")
  endif()
endfunction()
