// The fuzz target of ampx::optim's own state files (targets.h): an AdamW
// with bf16 weights, Kahan compensations and 8-bit moments in blocks of 32
// (codes, scales, compensations: every kind of tensor the format holds)
// loads the fuzzed archive. A refused file must leave the optimizer as it
// was; an accepted one must save and load back to the same state, and step.

#include "targets.h"

#include <ampx/optim.h>
#include <ampx/serialize.h>

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <vector>

namespace ampx::fuzz {
namespace {

// The optimizer's model: Linear(8, 40) in bf16 (a weight of 10 blocks).
struct LowBitOptimizer {
  torch::nn::Linear model{nullptr};
  std::unique_ptr<ampx::optim::AdamW> opt;
  LowBitOptimizer() {
    torch::manual_seed(0);
    model = torch::nn::Linear(8, 40);
    opt = std::make_unique<ampx::optim::AdamW>(model->parameters(),
                                               ampx::optim::AdamWOptions(1e-3)
                                                   .master_weights(false)
                                                   .kahan_summation(true)
                                                   .state_format(ampx::optim::StateFormat::kInt8)
                                                   .state_block(32)
                                                   .state_min_numel(0));
    for (auto& p : model->parameters()) p.set_data(p.detach().to(torch::kBFloat16));
  }
  void step() {
    opt->zero_grad();
    model->forward(torch::ones({2, 8}, torch::kBFloat16)).to(torch::kFloat).sum().backward();
    opt->step();
  }
  // What load() may change: moments (decoded), compensations, step counts.
  std::vector<torch::Tensor> state() const {
    std::vector<torch::Tensor> out;
    for (const auto& p : model->parameters()) {
      for (const auto& t : {opt->exp_avg(p), opt->exp_avg_sq(p), opt->compensation(p)}) {
        out.push_back(t.defined() ? t.clone() : t);
      }
      out.push_back(torch::tensor(opt->step_count(p)));
    }
    return out;
  }
  std::string saved() const {
    torch::serialize::OutputArchive archive;
    opt->save(archive);
    std::ostringstream s;
    archive.save_to(s);
    return s.str();
  }
};

bool same_state(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() &&
        !(a[i].sizes() == b[i].sizes() && a[i].scalar_type() == b[i].scalar_type() &&
          torch::equal(a[i].isnan(), b[i].isnan()) &&
          torch::equal(a[i].nan_to_num(), b[i].nan_to_num()))) {
      return false;
    }
  }
  return true;
}

void optim_finding(const char* what) {
  std::fprintf(stderr, "fuzz: optim_state: %s\n", what);
  std::abort();
}

}  // namespace

void optim_state(const uint8_t* data, size_t size) {
  const std::string path = scratch_file("optim.pt");
  write_file(path, data, size);
  torch::serialize::InputArchive archive;
  ampx::load_archive(archive, path);
  LowBitOptimizer target;
  target.step();
  const auto before = target.state();
  try {
    target.opt->load(archive);
  } catch (const c10::Error&) {
    if (!same_state(before, target.state())) optim_finding("a refused state changed the optimizer");
    throw;
  }
  // Accepted: it saves and loads back to the same state, and steps.
  LowBitOptimizer again;
  {
    std::istringstream s(target.saved());
    torch::serialize::InputArchive reread;
    reread.load_from(s);
    again.opt->load(reread);
  }
  if (!same_state(target.state(), again.state()))
    optim_finding("an accepted state does not round-trip");
  target.step();
}

std::vector<Seed> optim_seeds() {
  LowBitOptimizer seed;
  seed.step();
  seed.step();
  torch::serialize::OutputArchive archive;
  seed.opt->save(archive);
  const std::string path = scratch_file("seed-optim.pt");
  ampx::save_archive(archive, path);
  return {{"optim_state", "seed-1.pt", read_whole(path)}};
}

}  // namespace ampx::fuzz
