# PyTorch's pip wheels (and the LibTorch zips built the same way) export from
# libtorch_cpu.so the std::filesystem functions of the older libstdc++ they
# were linked against statically (pytorch/pytorch#133437). A program that
# lists libtorch before libstdc++ (every CMake program does: the compiler adds
# libstdc++ last) resolves its own std::filesystem calls to those and crashes
# in the first one, where the layouts differ (seen with LibTorch 2.11 and
# GCC 13: every test that made a temporary folder segfaulted). Two link
# items keep the program's calls off LibTorch's copy:
#   - a link option, before everything: a shared libstdc++ becomes the first
#     library the program needs, so its definitions win at run time, for the
#     program and for libtorch alike, whatever order the libraries come in;
#   - a link library, right after ampx and before LibTorch: where the
#     toolchain has libstdc++ only as a static archive (a link option before
#     the objects pulls nothing from it), the linker takes the functions into
#     the program before it meets libtorch_cpu.so's exports. (On the GPU
#     machine's GCC 13 the first item alone left the programs crashing.)
# tests/helpers/link_libstdcxx_first.sh checks the bindings themselves.
#
#   include(AmpxLibstdcxxFirst)
#   add_library(ampx ...)
#   ampx_libstdcxx_first(ampx)   # after find_package(Torch), before ampx links
#                                # LibTorch: INTERFACE, so every program
#                                # linking ampx (consumers' too)
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
    target_link_libraries(${target} INTERFACE "-Wl,--push-state,--no-as-needed" stdc++
                          "-Wl,--pop-state")
  endif()
endfunction()
