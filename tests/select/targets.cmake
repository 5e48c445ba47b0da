# SPDX-License-Identifier: Apache-2.0
# The selection and compression tests again, built for AVX2 (+FMA, F16C) and for AVX-512, so
# that their xsimd::default_arch is that instruction set and every SIMD path is checked
# against the scalar one whatever the build's own flags. Each runs as one ctest test that
# exits 77 (skipped) on a CPU without the instruction set.
include(CheckCXXCompilerFlag)
file(GLOB _isa_sources CONFIGURE_DEPENDS
  "${CMAKE_CURRENT_SOURCE_DIR}/select/test_*.cpp" "${CMAKE_CURRENT_SOURCE_DIR}/compress/test_*.cpp")
set(_isa_avx2 "-mavx2;-mfma;-mf16c")
set(_isa_avx512 "-mavx512f;-mavx512bw;-mavx512dq;-mavx512vl;-mavx2;-mfma;-mf16c")
foreach(_isa IN ITEMS avx2 avx512)
  string(REPLACE ";" " " _flags "${_isa_${_isa}}")
  check_cxx_compiler_flag("${_flags}" STELLATRAIN_CXX_HAS_${_isa})
  if(NOT STELLATRAIN_CXX_HAS_${_isa} OR NOT _isa_sources)
    continue()
  endif()
  set(_target test_select_${_isa})
  add_executable(${_target} ${_isa_sources} "${CMAKE_CURRENT_SOURCE_DIR}/select/isa_test_main.cpp")
  target_link_libraries(${_target} PRIVATE stellatrain::stellatrain Catch2::Catch2)
  target_include_directories(${_target} PRIVATE "${CMAKE_CURRENT_SOURCE_DIR}/support")
  target_compile_definitions(${_target} PRIVATE STELLATRAIN_TEST_ISA="${_isa}")
  stellatrain_project_target(${_target})
  target_compile_options(${_target} PRIVATE ${_isa_${_isa}})
  add_test(NAME select.${_isa} COMMAND ${_target})
  set_tests_properties(select.${_isa} PROPERTIES SKIP_RETURN_CODE ${STELLATRAIN_SKIP_RETURN_CODE} LABELS isa)
endforeach()
