#pragma once

// One training step under LibTorch's profiler: a Chrome trace (open it in
// chrome://tracing or ui.perfetto.dev) and a by-op summary for the console.
//
//   { StepProfile p("runs/gpt/profile-O2.json"); train_step(); }  // trace written here
//   std::cout << summarize_trace("runs/gpt/profile-O2.json", 12);

#include <memory>
#include <string>

namespace ampx::train {

class StepProfile {
 public:
  explicit StepProfile(const std::string& path);
  ~StepProfile();  // stops recording and writes the trace
  StepProfile(const StepProfile&) = delete;
  StepProfile& operator=(const StepProfile&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// The `top` events with the most total time in a Chrome trace: name, calls,
/// total ms. Times are inclusive (an op's time contains the ops it calls).
std::string summarize_trace(const std::string& path, int top);

/// `path` with "-<mode>" before its extension: one trace per mode of --compare.
std::string profile_path_for(const std::string& path, const std::string& mode, bool per_mode);

}  // namespace ampx::train
