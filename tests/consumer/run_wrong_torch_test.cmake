# A consumer whose find_package(Torch) finds another LibTorch than the one
# ampx was built against must get ampx's message naming both, at configure
# time (not a link error or a crash later). The "other LibTorch" is a
# TorchConfig.cmake that reports version 0.1.0 and defines nothing else:
# ampx's config must stop before it imports anything. The consumer is the
# README's (readme_usage.cmake): find_package(Torch) first, then ampx.
include(${CMAKE_CURRENT_LIST_DIR}/readme_usage.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${AMPX_BINARY_DIR} --prefix ${WORK_DIR}/prefix
  OUTPUT_QUIET RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "cmake --install failed: ${rc}")
endif()
file(WRITE ${WORK_DIR}/other-torch/TorchConfig.cmake "set(TORCH_LIBRARIES \"\")\n")
file(WRITE ${WORK_DIR}/other-torch/TorchConfigVersion.cmake
  "set(PACKAGE_VERSION \"0.1.0\")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
ampx_write_readme_project(${AMPX_SOURCE_DIR} 0 ${WORK_DIR}/src "")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/src -B ${WORK_DIR}/build
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${WORK_DIR}/other-torch
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(want "this ampx was built against LibTorch ${TORCH_VERSION}, but find_package(Torch) found LibTorch 0.1.0")
string(REPLACE "\n" " " text "${out} ${err}")
string(REGEX REPLACE " +" " " text "${text}")
if(rc EQUAL 0)
  message(FATAL_ERROR "the consumer configured against LibTorch 0.1.0; expected ampx to refuse:\n${out}${err}")
endif()
string(FIND "${text}" "${want}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "configuring failed, but without ampx's message\n  \"${want}\"\n${out}${err}")
endif()
message(STATUS "ampx refused LibTorch 0.1.0, naming both versions")
