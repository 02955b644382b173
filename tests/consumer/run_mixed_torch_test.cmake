# A consumer on a machine with two LibTorches (a pip wheel's, and Debian's
# libtorch-dev in the system folders) that points Torch_DIR at the wheel's
# config and nothing else: LibTorch's config then takes Debian's Caffe2
# targets, and the program would compile against the wheel's headers and link
# Debian's libtorch.so (undefined at::_ops::... references). ampx's config
# must refuse at configure time, saying what to put in CMAKE_PREFIX_PATH
# (cmake/AmpxOneTorch.cmake). Registered only where both exist.
include(${CMAKE_CURRENT_LIST_DIR}/readme_usage.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/consumer_steps.cmake)
file(REMOVE_RECURSE ${WORK_DIR})
ampx_install_into(${AMPX_BINARY_DIR} ${WORK_DIR}/prefix)
ampx_write_readme_project(${AMPX_SOURCE_DIR} 0 ${WORK_DIR}/src "")
string(REPLACE "|" ";" torch_args "${CONSUMER_TORCH_ARGS}")
execute_process(COMMAND ${CMAKE_COMMAND} -S ${WORK_DIR}/src -B ${WORK_DIR}/build
  -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DTorch_DIR=${Torch_DIR} ${torch_args}
  -DCMAKE_CXX_COMPILER=${CONSUMER_CXX_COMPILER}
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
get_filename_component(torch_prefix "${Torch_DIR}/.." ABSOLUTE)
set(want "another LibTorch is installed in a system folder, and a program would compile against one and link the other. Put ${torch_prefix} in CMAKE_PREFIX_PATH")
ampx_expect_refusal("${rc}" "${out}" "${err}" "${want}"
  "with the wheel's headers and the system's LibTorch")
message(STATUS "ampx refused the mixed LibTorch, naming the fix")
