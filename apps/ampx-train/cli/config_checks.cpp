// ampx-train's checks of flag combinations (config_checks.h).

#include "config_checks.h"

#include "distributed/sharding.h"
#include "models.h"
#include "precision/auto_precision.h"
#include "run/optimizer_options.h"

#include <ampx/detail/compat.h>
#include <ampx/dist.h>
#include <ampx/version.h>

#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

namespace ampx::train {
namespace {

/// What the device, the model's shape and this LibTorch allow.
void check_device(const TrainConfig& c) {
  TORCH_CHECK(!is_gpt_workload(c.workload) || c.d_model % c.heads == 0, "ampx-train: --d-model ",
              c.d_model, " is not a multiple of --heads ", c.heads);
  TORCH_CHECK(c.memory_origins == 0 || c.device == "cpu", "ampx-train: --memory-origins ",
              c.memory_origins, " is for --device cpu (ampx's tracking allocator)");
  TORCH_CHECK(c.device != "cuda" || torch::cuda::is_available(),
              "ampx-train: --device cuda, but this LibTorch (", ampx::torch_version(),
              ") sees no CUDA device");
  TORCH_CHECK(!c.tf32 || c.on_cuda(),
              "ampx-train: --tf32 is for --device cuda (TF32 is a tensor-core format of NVIDIA "
              "GPUs); on the CPU fp32 products stay fp32");
  const auto modes = modes_of(c);
  const bool mixed =
      std::any_of(modes.begin(), modes.end(), [](auto& m) { return precision_of(m) != "fp32"; });
  TORCH_CHECK(!(mixed && c.dtype == "fp16" && c.device == "cpu" &&
                !ampx::detail::compat::cpu_autocast_supports_half()),
              "ampx-train: --dtype fp16 on --device cpu needs LibTorch 2.x; this is ",
              ampx::torch_version(),
              ", which has no fp16 CPU autocast or fp16 CPU matrix "
              "products. Use --dtype bf16.");
}

/// The modes the command line lists: --compare's list, not this process's
/// --only-mode (every child gets the flags), or --precision's one.
std::vector<std::string> listed_modes(const TrainConfig& c) {
  return c.compare.empty() ? std::vector<std::string>{c.precision} : c.compare;
}

/// The precision plan's flags (--precision auto) and the FP8 modes' tail.
void check_plan_flags(TrainConfig& c) {
  const auto modes = modes_of(c);
  const auto listed = listed_modes(c);
  const bool plan_mode = std::find(listed.begin(), listed.end(), "auto") != listed.end();
  TORCH_CHECK(c.precision_plan.empty() || plan_mode, "ampx-train: --precision-plan '",
              c.precision_plan, "' is for --precision auto");
  // --nproc measures before it starts its ranks and hands them the plan, and
  // ranks an outside launcher started with --precision auto measure on rank
  // 0 and hand it on; a --compare on such ranks has no process to measure in
  // once for all. (This process's modes: --compare's children of other
  // modes get no plan.)
  const bool trains_auto = std::find(modes.begin(), modes.end(), "auto") != modes.end();
  TORCH_CHECK(!trains_auto || modes.size() == 1 || !c.precision_plan.empty() ||
                  !ampx::dist::launched_as_rank(),
              "ampx-train: --compare with auto on ranks a launcher started has no process to "
              "measure the plan in once for all; measure first (ampx-train --precision auto, "
              "alone or with --nproc N or a launcher), then give every rank the plan it writes "
              "as --precision-plan");
  TORCH_CHECK(!plan_mode || c.precision_plan.empty() || std::filesystem::exists(c.precision_plan),
              "ampx-train: --precision-plan '", c.precision_plan, "': no such file");
  if (plan_mode) (void)parse_loss_budget(c.loss_budget);  // its error names the flag
  if (plan_mode) (void)parse_tail(c.plan_tail, "--plan-tail");
  // A share of 0 is no tail, whatever the modes.
  const auto no_tail = [](const std::string& text) {
    try {
      return parse_tail(text, "") == 0;
    } catch (const c10::Error&) {
      return false;
    }
  };
  TORCH_CHECK(c.plan_tail == TrainConfig().plan_tail || plan_mode || no_tail(c.plan_tail),
              "ampx-train: --plan-tail ", c.plan_tail, " is for --precision auto");
  const bool fp8_modes = std::any_of(listed.begin(), listed.end(), [](const std::string& m) {
    return is_fp8_mode(m) && m != "auto";
  });
  if (fp8_modes) (void)parse_tail(c.fp8_tail, "--fp8-tail");
  TORCH_CHECK(fp8_modes || no_tail(c.fp8_tail), "ampx-train: --fp8-tail ", c.fp8_tail,
              " is for the FP8 modes (fp8, mxfp8, nvfp4, fp8-block; --precision auto "
              "has --plan-tail)");
  TORCH_CHECK(c.plan_watch <= 0 || plan_mode, "ampx-train: --plan-watch ", c.plan_watch,
              " is for --precision auto");
  TORCH_CHECK(!c.plan_widen || plan_mode, "ampx-train: --plan-widen is for --precision auto");
  TORCH_CHECK(c.plan_reference == "bf16" || plan_mode, "ampx-train: --plan-reference ",
              c.plan_reference, " is for --precision auto");
  TORCH_CHECK(c.plan_ends == TrainConfig().plan_ends || plan_mode, "ampx-train: --plan-ends ",
              c.plan_ends, " is for --precision auto");
  if (c.plan_watch < 0) c.plan_watch = plan_mode ? 50 : 0;
  TORCH_CHECK(std::isfinite(c.plan_noise_ratio) && c.plan_noise_ratio > 0,
              "ampx-train: --plan-noise-ratio ", c.plan_noise_ratio, " is not a number > 0");
  TORCH_CHECK(c.plan_noise_ratio == TrainConfig().plan_noise_ratio || c.plan_watch > 0,
              "ampx-train: --plan-noise-ratio ", c.plan_noise_ratio,
              " sets the plan watch's threshold; the watch is off (--plan-watch 0, or not "
              "--precision auto)");
  TORCH_CHECK(!c.plan_widen || c.plan_watch > 0,
              "ampx-train: --plan-widen moves the layers the watch reports; --plan-watch is 0");
}

/// --recompute: the gpt workloads, without FP8 layers, in one process or
/// under DDP or ZeRO-1 (whose gradient hooks see the recompute's backward as
/// any other); the wrapper's units (--shard grad, full) gather their weights
/// in their forward, which a recompute in backward would run out of order.
void check_recompute(const TrainConfig& c) {
  if (c.recompute == "none") return;
  TORCH_CHECK(is_gpt_workload(c.workload), "ampx-train: --recompute ", c.recompute,
              " is for the gpt workloads (gpt, gpt-nn), not --workload ", c.workload);
  TORCH_CHECK(c.shard == "none" || c.shard == "optimizer", "ampx-train: --recompute ", c.recompute,
              " with --shard ", c.shard,
              ": the sharded units gather their weights as their forward starts, and a forward "
              "run again in backward is not one they can follow yet; use --shard none or "
              "optimizer");
  for (const auto& m : listed_modes(c)) {
    TORCH_CHECK(!is_fp8_mode(m), "ampx-train: --recompute ", c.recompute, " with --precision ", m,
                ": running an FP8 layer again in backward would record its amax twice; "
                "recompute fp32, O0, O1, O2 or O3");
  }
}

}  // namespace

void check_combinations(TrainConfig& c) {
  check_device(c);
  check_plan_flags(c);
  TORCH_CHECK(!c.diagnose || c.nproc == 1,
              "ampx-train: --diagnose runs in one process; drop "
              "--nproc ",
              c.nproc);
  check_shard_config(c);
  check_optimizer_config(c);
  check_recompute(c);
}

}  // namespace ampx::train
