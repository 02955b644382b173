# Run by ctest when it starts (CMakeLists.txt's TEST_INCLUDE_FILES), with
# `fuzz` the ampx_fuzz program and `fuzz_dir` this folder: two tests per
# target that `ampx_fuzz list` names (targets.cpp), over its corpus/ folder.
if(NOT EXISTS "${fuzz}")
  # Not built: one test that says so (ctest: "Not Run", no such program).
  add_test(fuzz.targets "${fuzz}" list)
  return()
endif()
execute_process(COMMAND "${fuzz}" list OUTPUT_VARIABLE listing RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  add_test(fuzz.targets "${fuzz}" list)  # fails as the listing did
  return()
endif()
string(REPLACE "\n" ";" lines "${listing}")
foreach(line IN LISTS lines)
  if(line STREQUAL "")
    continue()
  endif()
  string(REPLACE " " ";" fields "${line}")
  list(GET fields 0 target)
  list(GET fields 1 corpus)
  # The seeds are valid files: the checks refuse none of them.
  add_test(fuzz.seeds_accepted.${target} "${fuzz}" accept ${target} "${fuzz_dir}/corpus/${corpus}")
  # Every finding, kept as a regression input, is refused cleanly now.
  add_test(fuzz.regressions.${target} "${fuzz}" replay ${target} "${fuzz_dir}/corpus/${corpus}"
    "${fuzz_dir}/regressions/${target}")
  set_tests_properties(fuzz.seeds_accepted.${target} fuzz.regressions.${target}
    PROPERTIES TIMEOUT 300)
endforeach()
