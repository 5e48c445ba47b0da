# SPDX-License-Identifier: Apache-2.0
# cmake -DINCLUDE_ROOT=<dir> -DLAYERS_FILE=<docs/design.md> -P check_layers.cmake
# Fails when a header includes a stellatrain header that is not of its own part or of a lower
# layer, or when a .hpp includes a .cuh. The layers are read from the one line of LAYERS_FILE
# that starts with "layers:", for example
#   layers: config.hpp < core < select pack optim transport < compress < pipeline < stellatrain.hpp
# (lowest first; the parts of one layer must not include each other). A part is the first path
# element below stellatrain/ (its detail/ folder belongs to it), or the file name of a header
# directly in stellatrain/.
cmake_minimum_required(VERSION 3.25)

file(STRINGS "${LAYERS_FILE}" _line REGEX "^ *layers: ")
list(LENGTH _line _lines)
if(NOT _lines EQUAL 1)
  message(FATAL_ERROR "${LAYERS_FILE}: expected one line starting with 'layers:', found ${_lines}")
endif()
string(REGEX REPLACE "^ *layers: *" "" _line "${_line}")
string(REPLACE "<" ";" _layers "${_line}")
set(_rank 0)
set(_known "")
foreach(_layer IN LISTS _layers)
  string(STRIP "${_layer}" _layer)
  string(REGEX REPLACE " +" ";" _parts "${_layer}")
  foreach(_part IN LISTS _parts)
    set(_rank_of_${_part} ${_rank})
    list(APPEND _known "${_part}")
  endforeach()
  math(EXPR _rank "${_rank} + 1")
endforeach()

function(part_of path out)
  string(REGEX REPLACE "^stellatrain/" "" _rest "${path}")
  string(REGEX REPLACE "/.*$" "" _part "${_rest}")
  set(${out} "${_part}" PARENT_SCOPE)
endfunction()

file(GLOB_RECURSE _headers RELATIVE "${INCLUDE_ROOT}" "${INCLUDE_ROOT}/stellatrain/*.hpp"
     "${INCLUDE_ROOT}/stellatrain/*.cuh" "${INCLUDE_ROOT}/stellatrain/*.hpp.in")
set(_violations "")
set(_edges 0)
foreach(_header IN LISTS _headers)
  string(REGEX REPLACE "\\.in$" "" _name "${_header}")
  part_of("${_name}" _from)
  if(NOT DEFINED _rank_of_${_from})
    list(APPEND _violations "${_header}: part '${_from}' is in no layer")
    continue()
  endif()
  file(STRINGS "${INCLUDE_ROOT}/${_header}" _includes REGEX "^[ \t]*#[ \t]*include[ \t]*<stellatrain/")
  foreach(_include IN LISTS _includes)
    string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*<([^>]+)>.*$" "\\1" _target "${_include}")
    math(EXPR _edges "${_edges} + 1")
    part_of("${_target}" _to)
    if(_name MATCHES "\\.hpp$" AND _target MATCHES "\\.cuh$")
      list(APPEND _violations "${_header} includes ${_target}: a .hpp never includes a .cuh")
    endif()
    if(_to STREQUAL _from)
      continue()
    endif()
    if(NOT DEFINED _rank_of_${_to})
      list(APPEND _violations "${_header} includes ${_target}: part '${_to}' is in no layer")
    elseif(NOT _rank_of_${_to} LESS _rank_of_${_from})
      list(APPEND _violations
           "${_header} includes ${_target}: '${_to}' is not below '${_from}' (layers: ${_line})")
    endif()
  endforeach()
endforeach()

if(_violations)
  list(JOIN _violations "\n  " _text)
  message(FATAL_ERROR "include order violated:\n  ${_text}")
endif()
list(LENGTH _headers _n)
message(STATUS "layers: ${_n} headers, ${_edges} includes, all downward (${_line})")
