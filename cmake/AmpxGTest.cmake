# ampx_add_gtests(TARGET SHARDS n [ENVIRONMENT var=value...] [PROPERTIES prop value...])
#
# Registers a GoogleTest binary with ctest.
#
# AMPX_TEST_SHARDS OFF (the default): one ctest test per GoogleTest test
# (gtest_discover_tests), so that `ctest -R Suite.Test` selects one.
#
# AMPX_TEST_SHARDS ON (what `make test` builds): SHARDS ctest tests, each
# running the share of the binary's tests GoogleTest deals to it
# (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX: round-robin in declaration order)
# in one process. Each test process loads LibTorch and runs its static
# initializers, about 0.5 s on LibTorch 1.13 and more than 1 s on a CUDA
# build; over some 430 tests on 2 cores that was minutes of every leg. Each
# shard writes GoogleTest's XML report to <build>/gtest-xml/, where
# scripts/check-skips.py reads which tests ran and which skipped.
option(AMPX_TEST_SHARDS "Run each GoogleTest binary as a few ctest shards instead of one ctest test per test" OFF)
set(AMPX_GTEST_XML_DIR ${PROJECT_BINARY_DIR}/gtest-xml)

function(ampx_add_gtests target)
  cmake_parse_arguments(ARG "" "SHARDS" "ENVIRONMENT;PROPERTIES" ${ARGN})
  if(NOT ARG_SHARDS OR ARG_SHARDS LESS 1)
    message(FATAL_ERROR "ampx_add_gtests(${target}): SHARDS must be a positive count")
  endif()
  if(NOT AMPX_TEST_SHARDS)
    set(properties ${ARG_PROPERTIES})
    if(ARG_ENVIRONMENT)
      list(APPEND properties ENVIRONMENT "${ARG_ENVIRONMENT}")
    endif()
    gtest_discover_tests(${target} DISCOVERY_TIMEOUT 60 PROPERTIES ${properties})
    return()
  endif()
  math(EXPR last "${ARG_SHARDS} - 1")
  foreach(i RANGE ${last})
    set(name "${target}.shard${i}of${ARG_SHARDS}")
    add_test(NAME ${name}
      COMMAND ${target} --gtest_output=xml:${AMPX_GTEST_XML_DIR}/${name}.xml)
    set(env GTEST_TOTAL_SHARDS=${ARG_SHARDS} GTEST_SHARD_INDEX=${i} ${ARG_ENVIRONMENT})
    # A shard runs many tests: a per-test TIMEOUT in PROPERTIES is replaced
    # by one for the whole shard (a hung test still fails it).
    set_tests_properties(${name} PROPERTIES ${ARG_PROPERTIES})
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${env}" TIMEOUT 3000)
  endforeach()
endfunction()
