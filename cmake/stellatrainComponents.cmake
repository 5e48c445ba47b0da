# SPDX-License-Identifier: Apache-2.0
# Finding the dependency of an optional component (mpi, zmq) the same way for every one.
#
# stellatrain_find_component_dependency(<name> <enable_var> <result_var> "<find call>" <found_var>)
#   <enable_var> is AUTO, ON or OFF. AUTO and ON run <find call> (a find_package line);
#   <result_var> becomes ON when <found_var> is true afterwards. ON without the dependency is
#   a configure error naming the component; AUTO without it says it is skipped. A macro, so
#   that the variables of the find call stay visible to the caller.
macro(stellatrain_find_component_dependency name enable_var result_var find_call found_var)
  set(${result_var} OFF)
  if(NOT "${${enable_var}}" STREQUAL "OFF")
    cmake_language(EVAL CODE "${find_call}")
    if(${found_var})
      set(${result_var} ON)
    elseif("${${enable_var}}" STREQUAL "ON")
      message(FATAL_ERROR "stellatrain: ${enable_var}=ON but ${name} was not found")
    else()
      message(STATUS "stellatrain: ${name} not found; its component is not built")
    endif()
  endif()
endmacro()
