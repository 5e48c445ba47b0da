# SPDX-License-Identifier: Apache-2.0
# Settings for the project's own tests, benchmarks and examples (never for consumers).

# stellatrain_project_target(<target>): warnings, sanitizers and -march=native as configured.
function(stellatrain_project_target target)
  set(_warnings -Wall -Wextra -Wpedantic -Wshadow -Wconversion -Wnon-virtual-dtor)
  if(STELLATRAIN_WARNINGS_AS_ERRORS)
    list(APPEND _warnings -Werror)
  endif()
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:${_warnings}>")
  # Host-side warnings of CUDA sources (nvcc's own front end stays at its defaults).
  string(REPLACE ";" "," _host_warnings "-Wall;-Wextra")
  if(STELLATRAIN_WARNINGS_AS_ERRORS)
    string(APPEND _host_warnings ",-Werror")
  endif()
  target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${_host_warnings}>")
  if(STELLATRAIN_MARCH_NATIVE)
    target_compile_options(${target} PRIVATE "$<$<COMPILE_LANGUAGE:CXX>:-march=native>"
                                             "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-march=native>")
  endif()
  if(STELLATRAIN_SANITIZE)
    target_compile_options(${target} PRIVATE
      "$<$<COMPILE_LANGUAGE:CXX>:-fsanitize=${STELLATRAIN_SANITIZE};-fno-omit-frame-pointer;-fno-sanitize-recover=all>")
    target_link_options(${target} PRIVATE "-fsanitize=${STELLATRAIN_SANITIZE}")
  endif()
endfunction()
