# ampx as a subproject of a user's project: README.md's subproject block as
# written (readme_usage.cmake; `add_subdirectory(third_party/ampx)`, the
# folder a link to this source tree), configured from scratch, then
# subproject_checks.cmake.
include(${CMAKE_CURRENT_LIST_DIR}/readme_usage.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
ampx_write_readme_project(${AMPX_SOURCE_DIR} 1 ${WORK_DIR}/src
  ${CMAKE_CURRENT_LIST_DIR}/subproject_checks.cmake)
string(REPLACE "|" ";" torch_args "${CONSUMER_TORCH_ARGS}")
get_filename_component(torch_prefix "${Torch_DIR}/.." ABSOLUTE)
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/src -B ${WORK_DIR}/build
  -DCMAKE_PREFIX_PATH=${torch_prefix} ${torch_args} -DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}
  -DCMAKE_BUILD_TYPE=${CONSUMER_BUILD_TYPE} RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring ampx as a subproject (README.md's usage section) failed: ${rc}")
endif()
message(STATUS "package.subproject: configured")
