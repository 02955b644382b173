#pragma once

// What plan_mode_test.cpp and plan_mode_watch_test.cpp share: the small gpt
// their runs plan, the error its flags give, and a plan file to apply.

#include "test_support.h"

#include <ampx/precision_plan.h>

#include <string>
#include <utility>
#include <vector>

namespace plan_mode_test {

/// A gpt of 2 blocks of d 32 on 4 x 16 tokens (NVFP4 takes multiples of 16);
/// its head (vocabulary 9) takes bf16 only.
inline std::vector<std::string> plan_gpt(const ampx::train::test::TempDir& tmp,
                                         std::vector<std::pair<std::string, std::string>> flags) {
  flags.insert(flags.begin(), {{"--layers", "2"},
                               {"--d-model", "32"},
                               {"--block-size", "16"},
                               {"--data-dir", (tmp.path() / "data").string()},
                               {"--out-dir", (tmp.path() / "out").string()},
                               {"--steps", "2"},
                               {"--plan-steps", "2"}});
  return ampx::train::test::tiny_gpt(flags);
}

/// The error resolving plan_gpt(tmp, flags) and then `switches` (flags
/// without a value) gives.
inline std::string config_error_of(const ampx::train::test::TempDir& tmp,
                                   const std::vector<std::pair<std::string, std::string>>& flags,
                                   const std::vector<std::string>& switches = {}) {
  auto args = plan_gpt(tmp, flags);
  args.insert(args.end(), switches.begin(), switches.end());
  return ampx::train::test::error_text([&] { (void)ampx::train::test::resolved_config(args); });
}

/// A plan file (in tmp) with blocks.0.fc in NVFP4, the other Linears in bf16,
/// and the last `tail` of a run's steps in bf16.
inline std::string nvfp4_fc_plan(const ampx::train::test::TempDir& tmp, double tail = 0) {
  ampx::plan::PrecisionPlan plan;
  plan.target = "b200";
  plan.loss_budget = 0.005;
  plan.tail = tail;
  plan.layers.push_back({"blocks.0.fc", ampx::plan::LayerFormat::kNvfp4,
                         ampx::plan::scale_rule_of(ampx::plan::LayerFormat::kNvfp4), 0, 0, 0,
                         "test"});
  const auto file = (tmp.path() / (tail > 0 ? "tail-plan.json" : "plan.json")).string();
  ampx::plan::save_plan(plan, file);
  return file;
}

}  // namespace plan_mode_test
