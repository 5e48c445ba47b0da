# SPDX-License-Identifier: Apache-2.0
# Builds and runs consumer/main.cpp (and main_zmq.cpp, main_mpi.cpp where those modules are
# installed) with the compiler flags pkg-config gives for the install tree in PREFIX, as a
# build without CMake would.
cmake_minimum_required(VERSION 3.25)
include("${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake")
file(REMOVE_RECURSE "${BINARY_DIR}")
file(MAKE_DIRECTORY "${BINARY_DIR}")
set(ENV{PKG_CONFIG_PATH} "${PREFIX}/${DATADIR}/pkgconfig")

function(flags_of module out)
  execute_process(COMMAND "${PKG_CONFIG}" --cflags --libs ${module}
    RESULT_VARIABLE rc OUTPUT_VARIABLE flags ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config ${module} failed (${rc}): ${err}")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")
  set(${out} "${flags}" PARENT_SCOPE)
endfunction()

execute_process(COMMAND "${PKG_CONFIG}" --modversion stellatrain
  OUTPUT_VARIABLE version OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc)
if(NOT rc EQUAL 0 OR NOT version STREQUAL EXPECTED_VERSION)
  message(FATAL_ERROR "pkg-config --modversion stellatrain: '${version}', expected ${EXPECTED_VERSION}")
endif()

set(programs "stellatrain:main.cpp")
foreach(component zmq mpi)
  if(EXISTS "${PREFIX}/${DATADIR}/pkgconfig/stellatrain-${component}.pc")
    list(APPEND programs "stellatrain-${component}:main_${component}.cpp")
  endif()
endforeach()
foreach(entry IN LISTS programs)
  string(REPLACE ":" ";" entry "${entry}")
  list(GET entry 0 module)
  list(GET entry 1 source)
  flags_of(${module} flags)
  set(exe "${BINARY_DIR}/${module}")
  execute_process(COMMAND "${CXX_COMPILER}" -std=c++20 -O1 "${CONSUMER_DIR}/${source}"
      "-DCONSUMER_EXPECTED_VERSION=\"${EXPECTED_VERSION}\"" ${flags} -o "${exe}"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${source} with pkg-config ${module} (${flags}) did not build:\n${out}\n${err}")
  endif()
  stellatrain_run_checked("${exe}" "${module} (${flags})")
endforeach()
