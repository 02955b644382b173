// The plan-watch scenarios of ampx_dist_worker (dist_worker.cpp starts
// them): a PrecisionPlan's watch over ranks, with and without the group.

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/fp8/autocast.h>
#include <ampx/precision_plan.h>

#include <torch/torch.h>

#include <fstream>
#include <memory>
#include <string>
#include <tuple>

namespace dist_worker {

// plan-watch: one NVFP4 Linear (64 -> 32) on a noisy regression, checked by
// a PlanWatch with widen. Rank 0 sits at the least-squares solution (its
// gradient is NVFP4's noise: reported), rank 1 at zero weights (a large
// gradient: nothing to report), and with a threshold that never reports;
// no DDP, so the ranks' numbers differ, as they could in their last bits in
// real data-parallel training. With the
// group (plan-watch) every rank takes rank 0's numbers and decisions;
// plan-watch-alone leaves the group out. Writes each event and the
// layer's final format.
int run_plan_watch(const std::string& scenario, const std::string& out,
                   ampx::dist::ProcessGroup pg) {
  struct NetImpl : torch::nn::Module {
    NetImpl() : fc(register_module("fc", torch::nn::Linear(64, 32))) {}
    torch::nn::Linear fc;
  };
  auto net = std::make_shared<NetImpl>();
  torch::manual_seed(11);
  const auto x = torch::randn({256, 64});
  const auto y = x.mm(0.1 * torch::randn({32, 64}).t()) + torch::randn({256, 32});
  {
    torch::NoGradGuard no_grad;
    net->fc->weight.zero_();
    net->fc->bias.zero_();
    if (pg.rank() == 0) {  // least squares in float64, bias included
      const auto a = torch::cat({x, torch::ones({256, 1})}, 1).to(torch::kDouble);
      const auto sol = std::get<0>(torch::linalg_lstsq(a, y.to(torch::kDouble)));
      net->fc->weight.copy_(sol.narrow(0, 0, 64).t());
      net->fc->bias.copy_(sol[64]);
    }
  }
  ampx::plan::PrecisionPlan plan;
  plan.target = "b200";
  plan.loss_budget = 0.005;
  const auto nvfp4 = ampx::plan::LayerFormat::kNvfp4;
  plan.layers.push_back({"fc", nvfp4, ampx::plan::scale_rule_of(nvfp4), 0, 0, 1, "test"});
  ampx::plan::apply_plan(*net, plan, 3);
  auto options = ampx::plan::WatchOptions().widen(true);
  if (pg.rank() == 1) options.noise_ratio(1e-9);
  if (scenario == "plan-watch") options.group(&pg);
  ampx::plan::PlanWatch watch(*net, plan, options);
  const auto backward = [&] {
    ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16);
    torch::mse_loss(net->fc->forward(x).to(torch::kFloat), y).backward();
  };
  {
    ampx::fp8::Fp8AutocastGuard fp8;
    backward();
  }
  std::ofstream f(out);
  f.precision(17);
  for (const auto& e : watch.check(0, backward)) {
    f << e.module << " " << ampx::plan::to_string(e.finding) << " " << e.gradient_norm << " "
      << e.noise_norm << " " << ampx::plan::to_string(e.moved_to) << "\n";
  }
  f << "fc in " << ampx::plan::to_string(watch.plan().layers[0].format) << "\n";
  return 0;
}

}  // namespace dist_worker
