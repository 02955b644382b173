# What package.subproject checks once README.md's subproject block
# (add_subdirectory(third_party/ampx)) has run in a user's project
# (run_subproject_test.cmake): only the library is defined, nothing is
# installed, and ampx::ampx is there to link, carrying C++20. Configured, not
# built (a build is the library's own, which make test already does).
if(NOT TARGET ampx::ampx)
  message(FATAL_ERROR "ampx as a subproject: no ampx::ampx target")
endif()
foreach(t ampx_tests ampx_train_tests ampx-train ampx_gemm_peak amp_recipe)
  if(TARGET ${t})
    message(FATAL_ERROR "ampx as a subproject defines ${t}: only the library was asked for")
  endif()
endforeach()
if(AMPX_INSTALL)
  message(FATAL_ERROR "ampx as a subproject would install itself (AMPX_INSTALL is on)")
endif()
get_target_property(features ampx INTERFACE_COMPILE_FEATURES)
if(NOT "cxx_std_20" IN_LIST features)
  message(FATAL_ERROR "ampx::ampx does not carry cxx_std_20 to its users (${features})")
endif()
message(STATUS "ampx_subproject_consumer: ampx::ampx defined, library only")
