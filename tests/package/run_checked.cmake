# SPDX-License-Identifier: Apache-2.0
# stellatrain_run_checked(PROGRAM LABEL): runs PROGRAM; fails with its output unless it exits
# with 0, else prints that output under LABEL. Included by the package test scripts.
function(stellatrain_run_checked program label)
  execute_process(COMMAND "${program}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${label} exited with ${rc}:\n${out}\n${err}")
  endif()
  message(STATUS "${label}: ${out}")
endfunction()
