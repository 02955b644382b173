# AMPX_PRECOMPILE_TORCH (make test's legs turn it on): LibTorch's
# <torch/torch.h> parsed once per build instead of once per C++ file. Nearly
# every file of ampx includes it, and an empty file including it compiles in
# 12.5 s on LibTorch 1.13, 11.7 s on 2.14 and 15.7 s on the 2.15 wheel; with
# the precompiled header in 4.4, 5.1 and 5.5 s.
#
# GCC takes a precompiled header only where the file is compiled with the
# flags it was made with (-fPIC against none, -fopenmp's _OPENMP), so there
# are two, each made (where some target needs it) by a target of its own
# that compiles nothing else:
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
  ampx_all_targets(targets ${PROJECT_SOURCE_DIR})  # (the top CMakeLists.txt)
  foreach(t IN LISTS targets)
    get_target_property(type ${t} TYPE)
    get_target_property(disabled ${t} DISABLE_PRECOMPILE_HEADERS)
    get_target_property(source_dir ${t} SOURCE_DIR)
    # ampx's own targets only, not a GoogleTest built from its sources
    # (AMPX_GTEST_SOURCE_DIR, outside the project)
    string(FIND "${source_dir}/" "${PROJECT_SOURCE_DIR}/" at)
    if(disabled OR NOT at EQUAL 0
       OR NOT type MATCHES "^(EXECUTABLE|STATIC_LIBRARY|SHARED_LIBRARY|OBJECT_LIBRARY)$")
      continue()
    endif()
    get_target_property(pic ${t} POSITION_INDEPENDENT_CODE)
    if(pic)
      set(host ampx_pch_pic)
    else()
      set(host ampx_pch)
    endif()
    if(NOT TARGET ${host})
      ampx_torch_pch_host(${host} "${pic}")
    endif()
    target_precompile_headers(${t} REUSE_FROM ${host})
  endforeach()
endfunction()

# The target that makes the precompiled header of one kind (PIC: with -fPIC
# and OpenMP) and compiles nothing else.
function(ampx_torch_pch_host name pic)
  set(source ${CMAKE_CURRENT_BINARY_DIR}/ampx_pch.cpp)
  # (written only when it changes: a new time stamp would recompile it)
  file(CONFIGURE OUTPUT ${source} CONTENT
       "// The targets that make the precompiled <torch/torch.h> (cmake/AmpxPrecompileTorch.cmake)\n")
  add_library(${name} OBJECT ${source})
  target_link_libraries(${name} PRIVATE ${TORCH_LIBRARIES})
  target_precompile_headers(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:<torch/torch.h$<ANGLE-R>>)
  if(pic)
    target_link_libraries(${name} PRIVATE OpenMP::OpenMP_CXX)
    set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  endif()
endfunction()
