# SPDX-License-Identifier: Apache-2.0
# Configures, builds and runs tests/package/consumer in one mode (see CMakeLists.txt beside).
cmake_minimum_required(VERSION 3.25)
include("${CMAKE_CURRENT_LIST_DIR}/run_checked.cmake")
file(REMOVE_RECURSE "${BINARY_DIR}")
set(_args -S "${CONSUMER_DIR}" -B "${BINARY_DIR}" -G "${GENERATOR}"
  -DCMAKE_CXX_COMPILER=${CXX_COMPILER}
  -DCMAKE_BUILD_TYPE=Release
  -DCONSUMER_MODE=${MODE}
  -DCONSUMER_WITH_CUDA=${WITH_CUDA}
  -DCONSUMER_WITH_MPI=${WITH_MPI}
  -DCONSUMER_WITH_ZMQ=${WITH_ZMQ}
  -DCONSUMER_EXTRA_COMPONENT=${EXTRA_COMPONENT}
  -DCONSUMER_EXPECTED_VERSION=${EXPECTED_VERSION}
  -DSTELLATRAIN_SOURCE_DIR=${STELLATRAIN_SOURCE_DIR}
  -DCMAKE_PREFIX_PATH=${PREFIX})
if(WITH_CUDA)
  list(APPEND _args -DCMAKE_CUDA_COMPILER=${CUDA_COMPILER} -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCHITECTURES})
endif()

execute_process(COMMAND "${CMAKE_COMMAND}" ${_args} RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(EXPECT_CONFIGURE_FAILURE)
  if(_rc EQUAL 0)
    message(FATAL_ERROR "configure succeeded but was expected to fail:\n${_out}\n${_err}")
  endif()
  if(NOT _err MATCHES "stellatrain")
    message(FATAL_ERROR "configure failed without naming stellatrain:\n${_err}")
  endif()
  message(STATUS "configure failed as expected:\n${_err}")
  return()
endif()
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "configure failed (${_rc}):\n${_out}\n${_err}")
endif()

execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BINARY_DIR}" RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err)
if(NOT _rc EQUAL 0)
  message(FATAL_ERROR "build failed (${_rc}):\n${_out}\n${_err}")
endif()

set(_programs trainer)
if(WITH_CUDA)
  list(APPEND _programs trainer_gpu)
endif()
if(WITH_MPI)
  list(APPEND _programs consumer_mpi)
endif()
if(WITH_ZMQ)
  list(APPEND _programs consumer_zmq)
endif()
foreach(program IN LISTS _programs)
  stellatrain_run_checked("${BINARY_DIR}/${program}" "${program}")
endforeach()
