#!/usr/bin/env bash
# Builds ampx's tests with sanitizers and runs them: `make sanitize` (host,
# LibTorch 1.13), `make sanitize-forky` (in the Debian testing chroot, LibTorch 2.14),
# `make tsan` (host). See README (tests) and docs/reliability.md (Sanitizers).
#
#   scripts/sanitize.sh asan BUILD_DIR [CTEST_ARGS...]   AddressSanitizer + UndefinedBehaviorSanitizer:
#                                          the whole suite (ctest's JUnit file in BUILD_DIR)
#   scripts/sanitize.sh tsan BUILD_DIR [CTEST_ARGS...]   ThreadSanitizer: the GradScaler and
#                                          data-parallel (Gloo, DDP, ZeRO-1) tests
# CTEST_ARGS narrow the run further, e.g. -R '^KernelsTest\.'.
#
# Only ampx's code is instrumented (the library, ampx-train, the tests);
# LibTorch, Gloo, OpenMP and the C++ runtime are the distribution's builds.
# Every sanitized process of the run, the test binaries and what they start
# (ampx-train and its ranks, the data-parallel workers, the package
# consumer), writes its reports to BUILD_DIR/sanitizer-logs/<tool>.<program>.<pid>
# and exits with status 86 on one. A test may not look at a child's status,
# or may expect it to fail anyway, so the run fails on any report in that
# folder too (scripts/check-sanitizer-logs.py), besides failing tests.
# Suppressions, each naming its cause outside ampx: tests/sanitizers/*.supp.
# Parallelism: CMAKE_BUILD_PARALLEL_LEVEL and CTEST_PARALLEL_LEVEL.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
usage() { sed -n '2,10p' "$0" >&2; exit 2; }
[ $# -ge 2 ] || usage
tool=$1
build=$2
shift 2
case "$build" in /*) ;; *) build=$root/$build ;; esac
case "$tool" in
  asan)
    sanitize=address,undefined
    # Every program ctest runs: the default target, which builds each test
    # program where its test is defined (tests/, tests/train, tests/fuzz,
    # bench/python, and ampx-train), so none can be left off a list here.
    # The benchmarks and examples are configured off (below): not built, and
    # the examples' tests not registered.
    targets=()
    select=()
    ;;
  tsan)
    sanitize=thread
    targets=(ampx_tests ampx_dist_worker ampx_fsdp_worker)
    select=(-R '^(GradScaler[A-Za-z]*Test|Dist[A-Za-z]*Test|Fsdp[A-Za-z]*Test|World/(DistWorld|Zero|FsdpWorld)Test)\.')
    ;;
  *) usage ;;
esac
logs=$build/sanitizer-logs
supp=$root/tests/sanitizers
start=$SECONDS

# The file API's code model: scripts/check-test-programs.py reads the build's
# executables from it.
mkdir -p "$build/.cmake/api/v1/query"
touch "$build/.cmake/api/v1/query/codemodel-v2"
# -O1 -g1: reports with source lines, stack traces close to the source, and
# a shorter build than the usual -O3.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DAMPX_SANITIZE="$sanitize" \
  -DAMPX_BUILD_EXAMPLES=OFF -DAMPX_BUILD_BENCHMARKS=OFF \
  >"$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }

# The options hold for the build too: gtest_discover_tests runs the
# instrumented test binaries to list their tests.
rm -rf "$logs"
mkdir -p "$logs"
common="log_path=$logs/$tool:log_exe_name=1:exitcode=86"
if [ "$tool" = asan ]; then
  # allocator_may_return_null: an impossible size throws std::bad_alloc, as
  # with glibc's malloc, instead of ending the process.
  export ASAN_OPTIONS="$common:allocator_may_return_null=1:check_initialization_order=1"
  export LSAN_OPTIONS="suppressions=$supp/lsan.supp:print_suppressions=1"
  export UBSAN_OPTIONS="$common:print_stacktrace=1:halt_on_error=1"
else
  # ignore_noninstrumented_modules: ThreadSanitizer does not check what
  # LibTorch's own code does (it sees none of LibTorch's atomics, so a Work
  # freed by Gloo's thread after ampx dropped its reference would read as a
  # race); ampx's code, and its synchronization with LibTorch's threads
  # through mutexes and condition variables, is checked. docs/reliability.md.
  export TSAN_OPTIONS="$common:suppressions=$supp/tsan.supp:second_deadlock_stack=1:ignore_noninstrumented_modules=1"
fi

cmake --build "$build" ${targets[@]:+--target "${targets[@]}"}
built=$SECONDS
# A test whose program the build left out fails now, by name, instead of
# ending "Not Run" after the whole run.
python3 scripts/check-test-programs.py "$build" "${select[@]}" "$@"
rm -f "$build/ctest-junit.xml"
rc=0
(cd "$build" && ctest --output-on-failure --timeout 1800 "${select[@]}" "$@" \
   --output-junit "$build/ctest-junit.xml") || rc=$?
python3 scripts/check-sanitizer-logs.py "$logs" || rc=1
echo "sanitize.sh $tool: build $(((built - start) / 60)) min $(((built - start) % 60)) s," \
     "tests $(((SECONDS - built) / 60)) min $(((SECONDS - built) % 60)) s, status $rc"
exit "$rc"
