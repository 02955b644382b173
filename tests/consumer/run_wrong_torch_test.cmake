# A consumer whose find_package(Torch) finds another LibTorch than the one
# ampx was built against must get ampx's message naming both, at configure
# time (not a link error or a crash later). The "other LibTorch" is a
# TorchConfig.cmake that reports version 0.1.0 and defines nothing else:
# ampx's config must stop before it imports anything. The consumer is the
# README's (readme_usage.cmake): find_package(Torch) first, then ampx.
include(${CMAKE_CURRENT_LIST_DIR}/readme_usage.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/consumer_steps.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
ampx_install_into(${AMPX_BINARY_DIR} ${WORK_DIR}/prefix)
file(WRITE ${WORK_DIR}/other-torch/TorchConfig.cmake "set(TORCH_LIBRARIES \"\")\n")
file(WRITE ${WORK_DIR}/other-torch/TorchConfigVersion.cmake
  "set(PACKAGE_VERSION \"0.1.0\")\nset(PACKAGE_VERSION_COMPATIBLE TRUE)\n")
ampx_write_readme_project(${AMPX_SOURCE_DIR} 0 ${WORK_DIR}/src "")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/src -B ${WORK_DIR}/build
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${WORK_DIR}/other-torch
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(want "this ampx was built against LibTorch ${TORCH_VERSION}, but find_package(Torch) found LibTorch 0.1.0")
ampx_expect_refusal("${rc}" "${out}" "${err}" "${want}" "against LibTorch 0.1.0")
message(STATUS "ampx refused LibTorch 0.1.0, naming both versions")
