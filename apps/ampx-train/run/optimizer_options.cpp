#include "optimizer_options.h"

#include <ampx/zero.h>

#include <c10/util/Exception.h>

#include <sstream>
#include <vector>

namespace ampx::train {

namespace {

/// Whether --init-scale or --growth-interval was given.
bool sets_loss_scaler(const TrainConfig& c) {
  return c.init_scale > 0 || c.growth_interval > 0;
}

}  // namespace

void add_optimizer_options(CLI::App& app, TrainConfig& c) {
  const ampx::GradScalerOptions scaler_defaults;
  app.add_option("--masters", c.masters,
                 "what keeps the lost low bits of 16-bit weights (O2, O3): fp32 (an fp32 master "
                 "copy, O2's default), kahan (a 16-bit compensation, 2 bytes a parameter), "
                 "stochastic (none: bf16 rounded stochastically, O3's default) [default: the "
                 "mode's]")
      ->check(CLI::IsMember({"fp32", "kahan", "stochastic"}));
  app.add_option("--optimizer-state", c.optimizer_state,
                 "AdamW's moments: fp32, bf16 (rounded stochastically), fp8 (E4M3, a scale per "
                 "256) or 8bit (dynamic tree codes, a scale per 256); parameters under 4096 "
                 "elements keep fp32")
      ->check(CLI::IsMember({"fp32", "bf16", "fp8", "8bit"}))
      ->capture_default_str();
  app.add_option("--init-scale", c.init_scale,
                 "fp16's loss scaler: its first scale (torch.amp.GradScaler's init_scale)")
      ->check(CLI::PositiveNumber)
      ->default_str(std::to_string(static_cast<int64_t>(scaler_defaults.init_scale())));
  app.add_option("--growth-interval", c.growth_interval,
                 "fp16's loss scaler: steps without inf/NaN gradients before the scale doubles "
                 "(torch.amp.GradScaler's growth_interval)")
      ->check(CLI::PositiveNumber)
      ->default_str(std::to_string(scaler_defaults.growth_interval()));
}

void check_optimizer_config(const TrainConfig& c) {
  std::vector<Mode> modes;
  for (const auto& name : modes_of(c)) modes.push_back(parse_mode(name, c));
  for (const auto& mode : modes) {
    // Each mode's masters, and who asked for them: the mode's name or the flag.
    const std::string masters = mode.masters.empty() ? c.masters : mode.masters;
    const std::string who =
        mode.masters.empty() ? "--masters " + masters : "mode " + mode.name + "'s " + masters;
    if (!masters.empty() && masters != "fp32") {
      TORCH_CHECK(c.shard == "none", "ampx-train: ", who, " with --shard ", c.shard,
                  ": sharded training keeps fp32 masters in the ranks' shards; drop ",
                  mode.masters.empty() ? "--masters" : "the part", " or --shard");
    }
    TORCH_CHECK(!(masters == "stochastic" && c.dtype == "fp16"), "ampx-train: ", who,
                " rounds bf16 weights; with --dtype fp16 use ",
                mode.masters.empty() ? "fp32 or kahan" : "+kahan, or no masters part");
  }
  TORCH_CHECK(!sets_loss_scaler(c) || c.dtype == "fp16",
              "ampx-train: ", c.init_scale > 0 ? "--init-scale" : "--growth-interval",
              " sets fp16's loss scaler; --dtype ", c.dtype,
              " trains without loss scaling: add --dtype fp16 or drop the flag");
  for (const auto& mode : modes) {  // (a "+" part of O3 is its own masters, never fp32)
    TORCH_CHECK(!(mode.masters.empty() && c.masters == "fp32" && mode.level == ampx::OptLevel::O3),
                "ampx-train: --masters fp32 with --precision O3: O3 trains without masters; use "
                "O2 for fp32 masters, or --masters kahan or stochastic");
  }
}

std::string masters_of(const TrainConfig& c, const Mode& mode) {
  const bool weights16 = mode.level == ampx::OptLevel::O2 || mode.level == ampx::OptLevel::O3;
  if (!weights16) return "";
  if (!mode.masters.empty()) return mode.masters;
  if (!c.masters.empty()) return c.masters;
  if (mode.level == ampx::OptLevel::O2) return "fp32";
  return mode.dtype == c10::kBFloat16 ? "stochastic" : "nearest";
}

std::string optimizer_state_of(const TrainConfig& c, const Mode& mode) {
  return mode.optimizer_state.empty() ? c.optimizer_state : mode.optimizer_state;
}

void apply_optimizer_options(const TrainConfig& c, const Mode& mode,
                             ampx::optim::AdamWOptions& options, ampx::AmpOptions& amp_options) {
  const auto masters = masters_of(c, mode);
  if (!masters.empty() && masters != "fp32") {
    options.master_weights(false)
        .stochastic_rounding(masters == "stochastic")
        .kahan_summation(masters == "kahan")
        .seed(c.seed);
    // O2 with --masters kahan or stochastic: the 16-bit weights' lost bits
    // live in the optimizer's compensation or its rounding, not in masters.
    if (mode.level == ampx::OptLevel::O2) amp_options.master_weights(false);
  }
  options.state_format(ampx::optim::state_format_from_name(optimizer_state_of(c, mode)));
}

void apply_loss_scale_options(const TrainConfig& c, ampx::GradScaler& scaler) {
  if (!scaler.is_enabled() || !sets_loss_scaler(c)) return;
  auto state = scaler.state_dict();  // the session's bounds and factors, kept
  if (c.init_scale > 0) state["scale"] = c.init_scale;
  if (c.growth_interval > 0) state["growth_interval"] = c.growth_interval;
  scaler.load_state_dict(state);
}

std::string optimizer_description(const TrainConfig& c) {
  std::ostringstream s;
  std::string per_mode, moments;
  bool own_moments = false;  // some mode's name sets its optimizer state
  for (const auto& name : modes_of(c)) {
    const Mode mode = parse_mode(name, c);
    own_moments = own_moments || !mode.optimizer_state.empty();
    moments += (moments.empty() ? "" : ", ") + name + " " + optimizer_state_of(c, mode);
    const auto masters = masters_of(c, mode);
    if (masters.empty()) continue;
    per_mode += (per_mode.empty() ? "" : ", ") + name + " " + masters;
  }
  s << "moments " << (own_moments ? moments : c.optimizer_state);
  if (!per_mode.empty()) s << "; 16-bit weights' lost bits: " << per_mode;
  if (sets_loss_scaler(c)) {
    const ampx::GradScalerOptions defaults;
    s << "; fp16 loss scale from " << (c.init_scale > 0 ? c.init_scale : defaults.init_scale())
      << ", doubled after "
      << (c.growth_interval > 0 ? c.growth_interval : defaults.growth_interval()) << " clean steps";
  }
  return s.str();
}

int64_t optimizer_state_bytes(torch::optim::Optimizer& optimizer) {
  if (auto* mixed = dynamic_cast<ampx::optim::MixedPrecisionOptimizer*>(&optimizer)) {
    return mixed->state_bytes();
  }
  if (auto* zero = dynamic_cast<ampx::dist::ZeroRedundancyOptimizer*>(&optimizer)) {
    return zero->state_bytes();
  }
  return 0;
}

int64_t weight_and_grad_bytes(const torch::nn::Module& model) {
  int64_t total = 0;
  for (const auto& p : model.parameters()) {
    total += p.numel() * static_cast<int64_t>(p.element_size());
    const auto& g = p.grad();
    if (g.defined()) total += g.numel() * static_cast<int64_t>(g.element_size());
  }
  return total;
}

}  // namespace ampx::train
