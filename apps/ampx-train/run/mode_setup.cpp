// A mode's set-up (model, optimizer, AMP session, FP8 or planned layers)
// and one training step on it; trainer.cpp runs the steps.
#include "trainer.h"

#include "distributed/sharding.h"
#include "optimizer_options.h"
#include "precision/auto_precision.h"
#include "precision/fp8_layers.h"
#include "reports/memory_origins.h"

#include <ampx/ampx.h>
#include <ampx/debug/nonfinite.h>
#include <ampx/debug/scope.h>
#include <ampx/precision_plan.h>

#include <torch/torch.h>

#include <algorithm>
#include <optional>
#include <utility>

namespace ampx::train {

torch::Tensor ModeSetUp::model_output(const torch::Tensor& input) {
  // TE's fp8_autocast around the model's forward: the amaxes of its casts
  // are reduced over the group by finish() (the backward's when that ends).
  std::optional<ampx::fp8::Fp8AutocastGuard> region;
  if (fp8) region.emplace(ampx::fp8::Fp8AutocastOptions().amax_reduction_group(fp8_group));
  // The root unit gathered around the whole forward (--shard full, grad).
  torch::Tensor output = ampx::dist::sharded_forward(net, amp->cast_input(input));
  if (region) region->finish();
  return output;
}

torch::Tensor ModeSetUp::forward(const torch::Tensor& input) {
  return amp->cast_output(model_output(input));
}

namespace {

/// --precision auto: the plan (--precision-plan, or the one measured for
/// this run) applied to setup.model; its watch decides over `group`'s ranks.
void set_up_plan(const TrainConfig& config, ModeSetUp& setup,
                 const ampx::dist::ProcessGroup* group) {
  TORCH_CHECK(!config.precision_plan.empty(),
              "ampx-train: --precision auto has no plan: measure one (plan_precision) or pass "
              "--precision-plan");
  setup.plan_text = read_plan_text(config.precision_plan);  // once: the text is the plan applied
  const auto& plan =
      setup.plan.emplace(ampx::plan::parse_plan(setup.plan_text, config.precision_plan));
  // A saved plan (--precision-plan, a checkpoint's) trains with its own tail.
  TORCH_CHECK(!config.plan_tail_given || parse_tail(config.plan_tail, "--plan-tail") == plan.tail,
              "ampx-train: --plan-tail ", config.plan_tail, ", but the plan '",
              config.precision_plan, "' has a tail of ", plan.tail,
              ", which it trains with; drop --plan-tail, or measure a plan with it");
  if (config.plan_ends_given) {  // the same floors, in any order
    const auto named = [](const std::vector<ampx::plan::Floor>& floors) {
      std::vector<std::pair<std::string, std::string>> out;
      for (const auto& f : floors) out.emplace_back(f.prefix, ampx::plan::to_string(f.format));
      std::sort(out.begin(), out.end());
      return out;
    };
    const auto asked = plan_end_floors(config, *setup.model);
    TORCH_CHECK(named(asked) == named(plan.floors), "ampx-train: --plan-ends ", config.plan_ends,
                " (floors: ", floors_text(asked), "), but the plan '", config.precision_plan,
                "' was solved with floors: ", floors_text(plan.floors),
                "; drop --plan-ends, or measure a plan with it");
  }
  setup.fp8_layers = ampx::plan::apply_plan(*setup.model, plan, config.seed);
  if (config.plan_watch > 0) {
    auto options = ampx::plan::WatchOptions()
                       .every(config.plan_watch)
                       .widen(config.plan_widen)
                       .noise_ratio(config.plan_noise_ratio);
    options.group(group);  // null: one process
    setup.watch = std::make_unique<ampx::plan::PlanWatch>(*setup.model, plan, options);
  }
  for (const auto& item : setup.model->named_modules("", /*include_self=*/false)) {
    if (!dynamic_cast<torch::nn::LinearImpl*>(item.value().get())) continue;
    const auto& f = setup.fp8_layers;
    if (std::find(f.begin(), f.end(), item.key()) == f.end())
      setup.bf16_layers.push_back(item.key());
  }
}

/// O1 plus FP8 (or FP4) Linears: every Linear FP8 tensor cores take
/// (dimensions multiples of 16), as torchao does, but those kept in bf16.
void convert_fp8_linears(const TrainConfig& config, Workload& workload, const Mode& mode,
                         ModeSetUp& setup) {
  setup.fp8 = true;
  setup.bf16_layers = bf16_layers_of(config, mode.name, *setup.model);
  const auto& keep = setup.bf16_layers;
  setup.fp8_layers = ampx::fp8::convert_linears(
      *setup.model,
      ampx::fp8::ConvertOptions()
          .recipe(fp8_recipe_of(config, mode.name))
          .filter([&keep](const std::string& path, const torch::nn::LinearImpl& linear) {
            const auto& o = linear.options;
            return o.in_features() % 16 == 0 && o.out_features() % 16 == 0 &&
                   std::find(keep.begin(), keep.end(), path) == keep.end();
          }));
  TORCH_CHECK(!setup.fp8_layers.empty(), "ampx-train: --precision ", mode.name, ", but ",
              workload.name(),
              " has no Linear layer whose dimensions are multiples of 16 outside --bf16-layers");
}

}  // namespace

ModeSetUp set_up_mode(const TrainConfig& config, Workload& workload, const Mode& mode,
                      const torch::Device& device, const ampx::dist::ProcessGroup* group) {
  ModeSetUp setup;
  torch::manual_seed(config.seed);
  setup.net = workload.build(device);
  setup.model = setup.net.ptr();
  setup.model_params = 0;
  for (const auto& p : setup.model->parameters()) setup.model_params += p.numel();
  auto options = ampx::optim::AdamWOptions(config.lr).weight_decay(config.weight_decay);
  ampx::AmpOptions amp_options(mode.level);
  if (mode.mixed()) amp_options.dtype(mode.dtype).cast_model_outputs(torch::kFloat);
  if (config.tf32) amp_options.allow_tf32(true);
  // O2: fp32 masters; O3 (pure low precision): none, bf16 keeping small
  // updates alive by rounding stochastically (fp16 has the mantissa to do
  // without); --masters and --optimizer-state as asked.
  apply_optimizer_options(config, mode, options, amp_options);
  // Before the sharding wrapper, which gathers the FP8 Linears' weights as codes.
  if (mode.fp8 && mode.name != "auto") convert_fp8_linears(config, workload, mode, setup);
  if (group && config.shard != "none") {
    set_up_sharded(config, workload, mode, *group, options, amp_options, setup);
  } else {
    setup.optimizer = std::make_unique<ampx::optim::AdamW>(setup.model->parameters(), options);
    setup.amp = std::make_unique<ampx::AmpSession>(
        ampx::initialize(setup.model, {setup.optimizer.get()}, amp_options));
  }
  apply_loss_scale_options(config, setup.amp->scaler());
  // Every submodule by its path, for the numerics diagnostics: ops that take
  // a parameter of "blocks.0.fc" run in that scope (after initialize(): the
  // parameters it cast are the ones the forward takes).
  ampx::debug::name_modules(*setup.model);
  if (mode.name == "auto") {
    // O1 plus each Linear in its plan's format (bf16: not converted, as
    // --bf16-layers keeps layers in bf16).
    setup.fp8 = true;
    set_up_plan(config, setup, group);
  }
  return setup;
}

void enter_tail(ModeSetUp& setup) {
  if (setup.in_tail) return;
  if (setup.plan) {
    ampx::plan::enter_tail(*setup.model, *setup.plan);
  } else {
    TORCH_CHECK(setup.fp8, "ampx-train: a tail is for --precision auto and the FP8 modes");
    setup.fp8 = false;  // model_output opens no FP8 region: plain Linears under autocast
  }
  setup.in_tail = true;
}

StepDiagnostics::Options diagnostics_options(const TrainConfig& config) {
  StepDiagnostics::Options options;
  if (config.detect_nonfinite == "throw") options.nonfinite = ampx::debug::NonFiniteAction::kThrow;
  if (config.detect_nonfinite == "warn") options.nonfinite = ampx::debug::NonFiniteAction::kWarn;
  options.range_stats = config.range_stats;
  return options;
}

namespace {

/// The plan's watch at a due step: the same batch again with every Linear
/// in bf16 (no FP8 region), its gradients compared with the step's: with
/// `ddp`, both averaged over the ranks.
void watch_step(ModeSetUp& setup, Workload& workload, const Batch& batch,
                ampx::dist::DistributedDataParallel* ddp, StepOutcome& out) {
  out.watched = true;
  out.watch_events = setup.watch->check(batch.step, [&] {
    const bool fp8 = std::exchange(setup.fp8, false);  // model_output opens no region
    try {
      torch::Tensor loss;
      {
        auto forward = setup.amp->forward_guard();
        loss = workload.loss(setup.forward(batch.input), batch.target);
      }
      setup.amp->scaler().scale(loss).backward();
      if (ddp) ddp->synchronize();
    } catch (...) {
      setup.fp8 = fp8;
      throw;
    }
    setup.fp8 = fp8;
  });
}

}  // namespace

StepOutcome train_step(ModeSetUp& setup, Workload& workload, const Batch& batch,
                       ampx::dist::DistributedDataParallel* ddp, StepDiagnostics* diagnostics) {
  setup.optimizer->zero_grad();
  StepOutcome out;
  const bool watching = setup.watch && !setup.in_tail;
  if (watching) setup.watch->begin_step(batch.step);
  auto& scaler = setup.amp->scaler();
  {
    std::optional<StepDiagnostics::Watch> watch;
    if (diagnostics) watch.emplace(diagnostics->active() ? diagnostics : nullptr, batch.step);
    torch::Tensor output;
    {
      auto forward = setup.amp->forward_guard();
      std::optional<ampx::CpuMemoryPhaseGuard> phase(std::in_place, kForwardPhase);
      output = setup.forward(batch.input);
      phase.emplace(kLossPhase);
      ampx::debug::NamedScopeGuard scope("loss");
      out.loss = workload.loss(output, batch.target);
      output.reset();  // as the temporary it was: freed before the backward
    }
    ampx::CpuMemoryPhaseGuard phase(kBackwardPhase);
    scaler.scale(out.loss).backward();
  }
  if (ddp) ddp->synchronize();  // averaged gradients: every rank steps (or skips) alike
  if (watching && setup.watch->due(batch.step)) watch_step(setup, workload, batch, ddp, out);
  ampx::CpuMemoryPhaseGuard phase(kOptimizerPhase);
  out.stepped = static_cast<bool>(scaler.step(*setup.optimizer));
  scaler.update();
  return out;
}

}  // namespace ampx::train
