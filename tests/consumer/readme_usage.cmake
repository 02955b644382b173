# The README's usage section ("### In your own CMake project, ..."), as a
# user copies it: its ```cmake blocks and its ```cpp loop, written into a
# project that package.consumer and package.subproject configure (and the
# consumer builds and runs), so that a stale line in the README fails a test.
#
#   include(readme_usage.cmake)
#   ampx_write_readme_project(${AMPX_SOURCE_DIR} 0 ${WORK_DIR}/src "")   # find_package(ampx)
#   ampx_write_readme_project(${AMPX_SOURCE_DIR} 1 ${WORK_DIR}/src checks.cmake)  # subproject

cmake_policy(VERSION 3.18)  # -P scripts start with old policies: while(TRUE) needs CMP0012

function(ampx_readme_usage readme out_cmake out_cpp)
  file(READ "${readme}" text)
  set(heading "### In your own CMake project")
  string(FIND "${text}" "${heading}" start)
  if(start LESS 0)
    message(FATAL_ERROR "README: no section starting '${heading}' (${readme})")
  endif()
  string(SUBSTRING "${text}" ${start} -1 section)
  string(LENGTH "${heading}" skip)
  string(SUBSTRING "${section}" ${skip} -1 rest)
  string(FIND "${rest}" "\n## " end_major)
  string(FIND "${rest}" "\n### " end_minor)
  set(end ${end_minor})
  if(end LESS 0 OR (end_major GREATER_EQUAL 0 AND end_major LESS end))
    set(end ${end_major})
  endif()
  string(SUBSTRING "${rest}" 0 ${end} section)

  set(cmake_blocks "")
  set(cpp_block "")
  while(TRUE)
    string(FIND "${section}" "```" open)
    if(open LESS 0)
      break()
    endif()
    string(SUBSTRING "${section}" ${open} -1 section)
    string(FIND "${section}" "\n" eol)
    string(SUBSTRING "${section}" 3 ${eol} info)
    math(EXPR info_length "${eol} - 3")
    string(SUBSTRING "${section}" 3 ${info_length} info)
    math(EXPR body_start "${eol} + 1")
    string(SUBSTRING "${section}" ${body_start} -1 section)
    string(FIND "${section}" "```" close)
    if(close LESS 0)
      message(FATAL_ERROR "README: a ``` block of '${heading}' is not closed")
    endif()
    string(SUBSTRING "${section}" 0 ${close} body)
    math(EXPR after "${close} + 3")
    string(SUBSTRING "${section}" ${after} -1 section)
    if(info STREQUAL "cmake")
      if(cmake_blocks STREQUAL "")
        set(cmake_blocks "${body}")
      else()
        string(APPEND cmake_blocks "\n@@BLOCK@@\n${body}")
      endif()
    elseif(info STREQUAL "cpp")
      set(cpp_block "${body}")
    endif()
  endwhile()
  if(cmake_blocks STREQUAL "" OR cpp_block STREQUAL "")
    message(FATAL_ERROR "README: '${heading}' lost its ```cmake or ```cpp block")
  endif()
  set(${out_cmake} "${cmake_blocks}" PARENT_SCOPE)
  set(${out_cpp} "${cpp_block}" PARENT_SCOPE)
endfunction()

# The n-th (0-based) of the joined ```cmake blocks.
function(ampx_readme_block blocks n out)
  set(rest "${blocks}")
  foreach(i RANGE ${n})
    string(FIND "${rest}" "\n@@BLOCK@@\n" cut)
    if(i EQUAL n)
      if(cut GREATER_EQUAL 0)
        string(SUBSTRING "${rest}" 0 ${cut} rest)
      endif()
      set(${out} "${rest}" PARENT_SCOPE)
      return()
    endif()
    if(cut LESS 0)
      message(FATAL_ERROR "README: fewer than ${n}+1 ```cmake blocks in its usage section")
    endif()
    math(EXPR next "${cut} + 11")
    string(SUBSTRING "${rest}" ${next} -1 rest)
  endforeach()
endfunction()

# Writes the README's loop as a function the consumer's main calls:
# `bool readme_loop_trains()` runs it as written (its #include lines first),
# on a small classification problem it can learn in one pass, and says
# whether the loss fell and the scaler kept a finite scale.
function(ampx_write_readme_loop cpp_block path)
  set(includes "")
  set(statements "")
  # Semicolons inside the C++ would split lines here: protect them first.
  string(REPLACE ";" "@SEMI@" protected "${cpp_block}")
  string(REPLACE "\n" ";" lines "${protected}")
  foreach(line IN LISTS lines)
    string(REPLACE "@SEMI@" ";" line "${line}")
    if(line MATCHES "^#include")
      string(APPEND includes "${line}\n")
    else()
      string(APPEND statements "  ${line}\n")
    endif()
  endforeach()
  file(WRITE "${path}" "// Generated from README.md's usage section by tests/consumer/readme_usage.cmake.
${includes}#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <vector>

bool readme_loop_trains() {
  torch::manual_seed(0);
  // What the README's loop assumes: a model, an optimizer, and a loader of
  // batches with .data and .target. The class is which of the first four
  // inputs is largest.
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::ReLU(), torch::nn::Linear(32, 4));
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.2).momentum(0.9));
  std::vector<torch::data::Example<>> loader;
  for (int i = 0; i < 60; ++i) {
    const auto x = torch::randn({64, 8});
    loader.emplace_back(x, x.slice(1, 0, 4).argmax(1));
  }
  const auto mean_loss = [&] {
    torch::NoGradGuard no_grad;
    double sum = 0;
    for (const auto& b : loader) {
      sum += torch::nn::functional::cross_entropy(model->forward(b.data), b.target).item<double>();
    }
    return sum / static_cast<double>(loader.size());
  };
  const double before = mean_loss();
  // ---- README.md, as written ----
${statements}  // ---- end of README.md ----
  const double after = mean_loss();
  const double scale = scaler.get_scale();
  std::printf(\"README loop: mean loss %.4f before, %.4f after one pass; scale %g\\n\", before, after, scale);
  return std::isfinite(scale) && scale > 0 && after < 0.5 * before;
}
")
endfunction()

# Writes a user's project into `dir`: CMakeLists.txt with the app target
# (tests/consumer/main.cpp and the README's loop) followed by the README's
# `n`-th ```cmake block as written, then `include(${extra})` if given. The
# subproject block's `add_subdirectory(third_party/ampx)` finds ampx through a
# link `dir`/third_party/ampx to `source_dir`.
function(ampx_write_readme_project source_dir n dir extra)
  ampx_readme_usage("${source_dir}/README.md" blocks cpp)
  ampx_readme_block("${blocks}" ${n} block)
  file(REMOVE_RECURSE "${dir}")
  file(MAKE_DIRECTORY "${dir}/third_party")
  file(CREATE_LINK "${source_dir}" "${dir}/third_party/ampx" SYMBOLIC)
  ampx_write_readme_loop("${cpp}" "${dir}/readme_loop.cpp")
  set(tail "")
  if(extra)
    set(tail "include(\"${extra}\")\n")
  endif()
  file(WRITE "${dir}/CMakeLists.txt" "# Generated by tests/consumer/readme_usage.cmake: a user's project made of
# README.md's usage section (### In your own CMake project), ```cmake block ${n}.
cmake_minimum_required(VERSION 3.18)
project(ampx_readme_consumer LANGUAGES CXX)
add_executable(app \"${source_dir}/tests/consumer/main.cpp\" readme_loop.cpp)
# ---- README.md, as written ----
${block}# ---- end of README.md ----
${tail}")
endfunction()
