# SPDX-License-Identifier: Apache-2.0
# The selection, compression and bit-packing tests again, built for AVX2 (+FMA, F16C) and for
# AVX-512, so that their xsimd::default_arch is that instruction set and every SIMD path is
# checked against the scalar one whatever the build's own flags. Each runs as one ctest test that
# exits 77 (skipped) on a CPU without the instruction set. The compressors' saved-state tests
# run in the host build only: the format does not depend on the instruction set. STELLATRAIN_TEST_ISAS says which
# are built: "host" (default: those the building CPU runs, read from /proc/cpuinfo; all where
# that file is missing), "all", "none", or a list.
include(CheckCXXCompilerFlag)
set(_isas "${STELLATRAIN_TEST_ISAS}")
if(_isas STREQUAL "all")
  set(_isas avx2 avx512)
elseif(_isas STREQUAL "none")
  set(_isas "")
elseif(_isas STREQUAL "host")
  set(_isas avx2 avx512)
  if(EXISTS "/proc/cpuinfo")
    file(STRINGS "/proc/cpuinfo" _cpu_flags REGEX "^flags" LIMIT_COUNT 1)
    set(_isas "")
    if(_cpu_flags MATCHES " avx2( |$)" AND _cpu_flags MATCHES " fma( |$)" AND _cpu_flags MATCHES " f16c( |$)")
      list(APPEND _isas avx2)
    endif()
    if(_cpu_flags MATCHES " avx512f( |$)" AND _cpu_flags MATCHES " avx512cd( |$)" AND
       _cpu_flags MATCHES " avx512bw( |$)" AND _cpu_flags MATCHES " avx512dq( |$)" AND
       _cpu_flags MATCHES " avx512vl( |$)")
      list(APPEND _isas avx512)
    endif()
  endif()
endif()
list(SORT _isas)  # avx2 before avx512: see STELLATRAIN_TEST_AVX512_ONLY below
file(GLOB _isa_sources CONFIGURE_DEPENDS
  "${CMAKE_CURRENT_SOURCE_DIR}/select/test_*.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/compress/test_*.cpp"
  "${CMAKE_CURRENT_SOURCE_DIR}/pack/test_bit_packing.cpp")
list(FILTER _isa_sources EXCLUDE REGEX "/compress/test_compressor_state\\.cpp$")
set(_isa_avx2 "-mavx2;-mfma;-mf16c")
set(_isa_avx512 "-mavx512f;-mavx512cd;-mavx512bw;-mavx512dq;-mavx512vl;-mavx2;-mfma;-mf16c")
foreach(_isa IN LISTS _isas)
  string(REPLACE ";" " " _flags "${_isa_${_isa}}")
  check_cxx_compiler_flag("${_flags}" STELLATRAIN_CXX_HAS_${_isa})
  if(NOT STELLATRAIN_CXX_HAS_${_isa} OR NOT _isa_sources)
    continue()
  endif()
  set(_target test_select_${_isa})
  add_executable(${_target} ${_isa_sources} "${CMAKE_CURRENT_SOURCE_DIR}/select/isa_test_main.cpp")
  target_link_libraries(${_target} PRIVATE stellatrain::stellatrain Catch2::Catch2WithMain)
  target_include_directories(${_target} PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/support")
  target_compile_definitions(${_target} PRIVATE STELLATRAIN_TEST_ISA="${_isa}")
  if(_isa STREQUAL "avx512" AND TARGET test_select_avx2)
    # The AVX2 unit instantiates the architectures up to AVX2 already.
    target_compile_definitions(${_target} PRIVATE STELLATRAIN_TEST_AVX512_ONLY)
  endif()
  stellatrain_project_target(${_target})
  target_compile_options(${_target} PRIVATE ${_isa_${_isa}})
  add_test(NAME select.${_isa} COMMAND ${_target})
  set_tests_properties(select.${_isa} PROPERTIES SKIP_RETURN_CODE ${STELLATRAIN_SKIP_RETURN_CODE} LABELS isa)
endforeach()

# The instantiation test compiles every kernel for each of up to 13 architectures: optimised
# fully, that is minutes of compile time per unit. It checks that each kernel compiles and agrees
# with the scalar reference, which -Og does as well (-O0 does not do: GCC's AVX-512 intrinsics
# become macros that xsimd 8's calls do not compile with); the other tests check the optimised
# kernels of the unit's own architecture.
set_source_files_properties("${CMAKE_CURRENT_SOURCE_DIR}/select/test_arch_instantiation.cpp"
  PROPERTIES COMPILE_OPTIONS "-Og")
