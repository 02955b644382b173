# PyTorch's pip wheels (and the LibTorch zips built the same way) export from
# libtorch_cpu.so the std::filesystem functions of the older libstdc++ they
# were linked against statically (pytorch/pytorch#133437). A program that
# lists libtorch before libstdc++ (every CMake program does: the compiler adds
# libstdc++ last) resolves its own std::filesystem calls to those and crashes
# in the first one, where the layouts differ (seen with LibTorch 2.11 and
# GCC 13: every test that made a temporary folder segfaulted). Naming
# libstdc++ first among the libraries a program needs makes the system's
# definitions win, for the program and for libtorch alike.
#
#   include(AmpxLibstdcxxFirst)
#   ampx_libstdcxx_first(ampx)   # after find_package(Torch): INTERFACE, so
#                                # every program linking ampx (consumers' too)
#
# Only where the LibTorch found exports such symbols (never Debian's), with
# GCC on Linux, and not under sanitizers (whose runtime must come first).
function(ampx_libstdcxx_first target)
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR NOT CMAKE_CXX_COMPILER_ID STREQUAL "GNU"
     OR AMPX_SANITIZE OR NOT TARGET torch_cpu OR NOT CMAKE_NM)
    return()
  endif()
  get_target_property(torch_cpu_library torch_cpu LOCATION)
  if(NOT DEFINED CACHE{AMPX_TORCH_EXPORTS_FILESYSTEM})
    execute_process(COMMAND ${CMAKE_NM} -D --defined-only "${torch_cpu_library}"
                    COMMAND grep -m 1 -E " [TWtw] _ZN(K)?St10filesystem"
                    OUTPUT_VARIABLE hit ERROR_QUIET)
    if(hit)
      set(exports ON)
    else()
      set(exports OFF)
    endif()
    set(AMPX_TORCH_EXPORTS_FILESYSTEM ${exports} CACHE BOOL
        "libtorch_cpu.so exports std::filesystem functions (link libstdc++ first)")
  endif()
  if(AMPX_TORCH_EXPORTS_FILESYSTEM)
    message(STATUS "ampx: ${torch_cpu_library} exports std::filesystem; programs link "
                   "libstdc++ first (pytorch/pytorch#133437)")
    target_link_options(${target} INTERFACE
                        "SHELL:-Wl,--push-state,--no-as-needed -lstdc++ -Wl,--pop-state")
  endif()
endfunction()
