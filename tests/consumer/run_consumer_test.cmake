# Installs the built ampx into a scratch prefix, then configures, builds and
# runs a user's project against it with find_package(ampx): the project is
# README.md's usage section as written (its find_package block and its
# training loop; readme_usage.cmake), so a stale README line fails here.
include(${CMAKE_CURRENT_LIST_DIR}/readme_usage.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/consumer_steps.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
ampx_install_into(${AMPX_BINARY_DIR} ${WORK_DIR}/prefix)
# Installed headers are the public API: a detail/ header is installed only
# where an installed header includes it.
file(GLOB_RECURSE installed_headers ${WORK_DIR}/prefix/include/ampx/*.h)
file(GLOB installed_details RELATIVE ${WORK_DIR}/prefix/include
  ${WORK_DIR}/prefix/include/ampx/detail/*.h)
foreach(detail IN LISTS installed_details)
  set(included_by "")
  foreach(header IN LISTS installed_headers)
    file(STRINGS ${header} lines REGEX "#include \"${detail}\"")
    if(lines)
      set(included_by ${header})
      break()
    endif()
  endforeach()
  if(NOT included_by)
    message(FATAL_ERROR "the package installs ${detail}, which no installed header includes")
  endif()
endforeach()
ampx_write_readme_project(${AMPX_SOURCE_DIR} 0 ${WORK_DIR}/src "")
# The consumer is built as ampx was: same compiler, build type and flags
# (sanitizer builds need the runtime their instrumented libampx.a calls).
# LibTorch is found as the README says, through CMAKE_PREFIX_PATH (the folder
# holding its Torch/ and Caffe2/ configs: torch.utils.cmake_prefix_path).
string(REPLACE "|" ";" torch_args "${CONSUMER_TORCH_ARGS}")
get_filename_component(torch_prefix "${Torch_DIR}/.." ABSOLUTE)
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/src -B ${WORK_DIR}/build
  "-DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix;${torch_prefix}" ${torch_args}
  -DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER} -DCMAKE_BUILD_TYPE=${CONSUMER_BUILD_TYPE}
  "-DCMAKE_CXX_FLAGS=${CONSUMER_CXX_FLAGS}" "-DCMAKE_EXE_LINKER_FLAGS=${CONSUMER_LINKER_FLAGS}"
  RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "configuring the consumer (README.md's usage section) failed: ${rc}")
endif()
execute_process(COMMAND ${CMAKE_COMMAND} --build ${WORK_DIR}/build RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "building the consumer (README.md's usage section) failed: ${rc}")
endif()
execute_process(COMMAND ${WORK_DIR}/build/app RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "the consumer failed: ${rc}")
endif()
