# NCCL for ampx::dist's CUDA tensors: c10d's ProcessGroupNCCL, in LibTorch
# builds with CUDA (PyTorch's pip wheels have NCCL; Debian's LibTorch has no
# CUDA). Its header declares the class only under USE_C10D_NCCL, which
# LibTorch's CMake config does not pass on, so ampx defines it itself.
#
#   include(AmpxNccl)                    # after find_package(Torch)
#   ampx_detect_nccl(AMPX_WITH_NCCL)     # ON or OFF
#
# The cache variable AMPX_NCCL chooses: AUTO (default) is ON when LibTorch has
# CUDA, c10d's NCCL header and nccl.h are found; OFF for a CUDA LibTorch built
# without NCCL (the link would miss ProcessGroupNCCL); ON insists, and stops
# the configuration naming whatever is missing. Sets AMPX_NCCL_INCLUDE_DIR
# (the folder of nccl.h) and AMPX_C10D_NCCL_HEADER in the cache.

set(AMPX_NCCL AUTO CACHE STRING "NCCL in ampx::dist: AUTO, ON or OFF")

function(ampx_detect_nccl out_var)
  find_file(AMPX_C10D_NCCL_HEADER NAMES torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp
            torch/csrc/distributed/c10d/ProcessGroupNCCL.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
  # nccl.h is not among LibTorch's headers: a CUDA toolkit's, or pip's
  # nvidia-nccl package next to a wheel's torch.
  set(hints ${TORCH_INCLUDE_DIRS} $ENV{CUDA_HOME}/include /usr/local/cuda/include)
  if(NOT AMPX_NCCL STREQUAL "OFF" AND AMPX_PYTHON)
    execute_process(COMMAND ${AMPX_PYTHON} -c
      "import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], 'include'))"
      OUTPUT_VARIABLE nccl_py OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    list(APPEND hints ${nccl_py})
  endif()
  find_path(AMPX_NCCL_INCLUDE_DIR nccl.h HINTS ${hints})
  set(torch_cuda OFF)
  if(TORCH_CUDA_LIBRARIES OR TARGET torch_cuda)
    set(torch_cuda ON)
  endif()
  if(AMPX_NCCL STREQUAL "AUTO")
    if(AMPX_C10D_NCCL_HEADER AND AMPX_NCCL_INCLUDE_DIR AND torch_cuda)
      set(with_nccl ON)
    else()
      set(with_nccl OFF)
    endif()
  else()
    set(with_nccl ${AMPX_NCCL})
  endif()
  if(with_nccl)
    if(NOT AMPX_C10D_NCCL_HEADER OR NOT AMPX_NCCL_INCLUDE_DIR OR NOT torch_cuda)
      message(FATAL_ERROR "ampx: AMPX_NCCL=ON needs a LibTorch with CUDA (found: "
        "${torch_cuda}), c10d's ProcessGroupNCCL header (${AMPX_C10D_NCCL_HEADER}) and "
        "nccl.h (${AMPX_NCCL_INCLUDE_DIR}; set CUDA_HOME)")
    endif()
  endif()
  set(${out_var} ${with_nccl} PARENT_SCOPE)
endfunction()
