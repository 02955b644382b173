# ampx_add_gtests(TARGET SHARDS n [NAME name] [FILTER gtest_filter]
#                 [ENVIRONMENT var=value...] [PROPERTIES prop value...])
#
# Registers a GoogleTest binary with ctest: its tests matching FILTER
# (GoogleTest's --gtest_filter; default all), under NAME (default TARGET),
# which a binary registered twice needs (e.g. once per environment).
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
  cmake_parse_arguments(ARG "" "SHARDS;NAME;FILTER" "ENVIRONMENT;PROPERTIES" ${ARGN})
  if(NOT ARG_SHARDS OR ARG_SHARDS LESS 1)
    message(FATAL_ERROR "ampx_add_gtests(${target}): SHARDS must be a positive count")
  endif()
  if(NOT ARG_NAME)
    set(ARG_NAME ${target})
  endif()
  set(filter_args)
  if(ARG_FILTER)
    set(filter_args --gtest_filter=${ARG_FILTER})
  endif()
  if(NOT AMPX_TEST_SHARDS)
    set(properties ${ARG_PROPERTIES})
    if(ARG_ENVIRONMENT)
      list(APPEND properties ENVIRONMENT "${ARG_ENVIRONMENT}")
    endif()
    set(discover_args)
    if(NOT ARG_NAME STREQUAL target)
      # (a second registration: its tests under their own prefix)
      if(CMAKE_VERSION VERSION_LESS 3.22)
        return()  # gtest_discover_tests has no TEST_FILTER before 3.22
      endif()
      list(APPEND discover_args TEST_PREFIX "${ARG_NAME}:")
    endif()
    if(ARG_FILTER)
      list(APPEND discover_args TEST_FILTER ${ARG_FILTER})
    endif()
    gtest_discover_tests(${target} DISCOVERY_TIMEOUT 60 ${discover_args} PROPERTIES ${properties})
    return()
  endif()
  math(EXPR last "${ARG_SHARDS} - 1")
  foreach(i RANGE ${last})
    set(name "${ARG_NAME}.shard${i}of${ARG_SHARDS}")
    add_test(NAME ${name}
      COMMAND ${target} ${filter_args} --gtest_output=xml:${AMPX_GTEST_XML_DIR}/${name}.xml)
    set(env GTEST_TOTAL_SHARDS=${ARG_SHARDS} GTEST_SHARD_INDEX=${i} ${ARG_ENVIRONMENT})
    # A shard runs many tests: a per-test TIMEOUT in PROPERTIES is replaced
    # by one for the whole shard (a hung test still fails it).
    set_tests_properties(${name} PROPERTIES ${ARG_PROPERTIES})
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${env}" TIMEOUT 3000)
  endforeach()
endfunction()
