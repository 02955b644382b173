#!/usr/bin/env bash
# ctest link.libstdcxx_first: against a LibTorch whose libtorch_cpu.so exports
# std::filesystem (pip wheels; cmake/AmpxLibstdcxxFirst.cmake), no
# std::filesystem function that PROGRAM calls may bind to LibTorch's copy:
# the dynamic linker, with every symbol bound at start-up, must take each one
# from libstdc++ (shared) or from the program itself (a toolchain that links
# libstdc++ statically). On failure: the bindings, the program's libraries in
# order, and which libstdc++ the compiler links.
#   tests/helpers/link_libstdcxx_first.sh PROGRAM CXX_COMPILER
set -uo pipefail
program=$1 cxx=$2
bindings=$(LD_BIND_NOW=1 LD_DEBUG=bindings "$program" --gtest_list_tests \
  2>&1 >/dev/null | grep -E "binding file ([^ ]*/)?$(basename "$program") \[.* to [^ ]*libtorch_cpu\.so[^ ]* .*St10filesystem")
if [ -z "$bindings" ]; then
  exit 0
fi
echo "link.libstdcxx_first: $(echo "$bindings" | wc -l) std::filesystem symbols of $program bind to LibTorch's copy:"
echo "$bindings" | head -n 5
echo "the program's libraries, in order:"
readelf -d "$program" | grep NEEDED | head -n 6
echo "the compiler's libstdc++: $("$cxx" -print-file-name=libstdc++.so) $("$cxx" -print-file-name=libstdc++.a)"
exit 1
