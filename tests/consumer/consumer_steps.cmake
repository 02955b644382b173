# Steps the package.* tests share (run_*_test.cmake):
#
#   ampx_install_into(${AMPX_BINARY_DIR} ${WORK_DIR}/prefix)  # cmake --install, or fail
#   execute_process(... RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
#   ampx_expect_refusal("${rc}" "${out}" "${err}" "${want}" "what it configured against")

function(ampx_install_into binary_dir prefix)
  execute_process(COMMAND ${CMAKE_COMMAND} --install ${binary_dir} --prefix ${prefix}
    OUTPUT_QUIET RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "cmake --install failed: ${rc}")
  endif()
endfunction()

# Fails unless a configure failed (rc not 0) with `want` in its output, read
# with line breaks and runs of spaces as one space (CMake wraps messages).
function(ampx_expect_refusal rc out err want what)
  string(REPLACE "\n" " " text "${out} ${err}")
  string(REGEX REPLACE " +" " " text "${text}")
  if(rc EQUAL 0)
    message(FATAL_ERROR "the consumer configured ${what}; expected ampx to refuse:\n${out}${err}")
  endif()
  string(FIND "${text}" "${want}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "configuring failed, but without ampx's message\n  \"${want}\"\n${out}${err}")
  endif()
endfunction()
