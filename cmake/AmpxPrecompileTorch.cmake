# AMPX_PRECOMPILE_TORCH (make test's legs turn it on): LibTorch's
# <torch/torch.h> parsed once per build instead of once per C++ file. Nearly
# every file of ampx includes it, and an empty file including it compiles in
# 12.5 s on LibTorch 1.13, 11.7 s on 2.14 and 15.7 s on the 2.15 wheel; with
# the precompiled header in 4.4, 5.1 and 5.5 s.
#
# GCC takes a precompiled header only where the file is compiled with the
# flags it was made with (-fPIC against none, -fopenmp's _OPENMP), so there
# are two, each made by a target of its own that compiles nothing else:
#   - ampx_pch_pic: -fPIC and OpenMP, as the library and its object libraries
#     (POSITION_INDEPENDENT_CODE) are built;
#   - ampx_pch: neither, as the programs and ampx-train's static libraries.
# Every C++ target of the project takes the one of its kind (REUSE_FROM), but
# those that set DISABLE_PRECOMPILE_HEADERS (the per-ISA kernels: their -m
# flags differ, and they include no <torch/torch.h>). CMake compiles with
# -Winvalid-pch, so with AMPX_WARNINGS_AS_ERRORS a target whose flags stop
# matching its header fails to build instead of quietly parsing it again.
#
# A file still includes what it uses: the header only saves the parse. The
# installed package's consumers (package.consumer, package.subproject) build
# without it.
#
#   include(AmpxPrecompileTorch)
#   ampx_precompile_torch()   # at the end of the top CMakeLists.txt
function(ampx_precompile_torch)
  if(NOT AMPX_PRECOMPILE_TORCH)
    return()
  endif()
  set(source ${CMAKE_CURRENT_BINARY_DIR}/ampx_pch.cpp)
  # (written only when it changes: a new time stamp would recompile it)
  file(CONFIGURE OUTPUT ${source} CONTENT
       "// The targets that make the precompiled <torch/torch.h> (cmake/AmpxPrecompileTorch.cmake)\n")
  foreach(host ampx_pch ampx_pch_pic)
    add_library(${host} OBJECT ${source})
    target_link_libraries(${host} PRIVATE ${TORCH_LIBRARIES})
    target_precompile_headers(${host} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:<torch/torch.h$<ANGLE-R>>)
  endforeach()
  target_link_libraries(ampx_pch_pic PRIVATE OpenMP::OpenMP_CXX)
  set_target_properties(ampx_pch_pic PROPERTIES POSITION_INDEPENDENT_CODE ON)
  ampx_reuse_torch_pch()
endfunction()

# Every target of the project reuses the header of its kind: ampx's own, not
# the two hosts, nor a GoogleTest built from its sources
# (AMPX_GTEST_SOURCE_DIR, outside the project). (ampx_all_targets: the top
# CMakeLists.txt.)
function(ampx_reuse_torch_pch)
  ampx_all_targets(targets ${PROJECT_SOURCE_DIR})
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    get_target_property(disabled ${t} DISABLE_PRECOMPILE_HEADERS)
    get_target_property(source_dir ${t} SOURCE_DIR)
    string(FIND "${source_dir}/" "${PROJECT_SOURCE_DIR}/" at)
    if(t MATCHES "^ampx_pch(_pic)?$" OR disabled OR NOT at EQUAL 0
       OR NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY)$")
      continue()
    endif()
    get_target_property(pic ${t} POSITION_INDEPENDENT_CODE)
    if(pic)
      target_precompile_headers(${t} REUSE_FROM ampx_pch_pic)
    else()
      target_precompile_headers(${t} REUSE_FROM ampx_pch)
    endif()
  endforeach()
endfunction()
