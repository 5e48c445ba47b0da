# SPDX-License-Identifier: Apache-2.0
# cmake -DMPIRUN=<mpirun;args> -DPROGRAM=<test_transport_mpi> -DLIMIT=<s> [-DMODE=kill] -P run_mpi_fault.cmake
# Rank 2 kills itself during an exchange (MODE: kill, kill-allgather or kill-allreduce). Passes when the job ends with an error within LIMIT
# seconds (no hang), rank 2 did reach the kill, and no rank reported an exchange as completed
# after it (no partial result taken as whole).
cmake_minimum_required(VERSION 3.25)
if(NOT DEFINED MODE)
  set(MODE kill)
endif()
string(TIMESTAMP _t0 "%s")
execute_process(COMMAND ${MPIRUN} "${PROGRAM}" ${MODE}
  RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _err TIMEOUT ${LIMIT})
string(TIMESTAMP _t1 "%s")
math(EXPR _took "${_t1} - ${_t0}")
message(STATUS "mpirun ended with '${_rc}' after ${_took} s\n${_out}\n${_err}")
if(_rc MATCHES "timeout" OR _took GREATER_EQUAL LIMIT)
  message(FATAL_ERROR "the job did not end within ${LIMIT} s after a rank was killed")
endif()
if(_rc EQUAL 0)
  message(FATAL_ERROR "the job succeeded although a rank was killed")
endif()
if(NOT _out MATCHES "rank 2: killing itself")
  message(FATAL_ERROR "rank 2 never reached the point where it kills itself")
endif()
if(_out MATCHES "completed after the kill")
  message(FATAL_ERROR "a rank reported an exchange as completed after rank 2 was killed")
endif()
message(STATUS "a killed rank ended the job with an error in ${_took} s, and no rank took a partial exchange for a complete one")
