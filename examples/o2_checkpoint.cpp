// Apex's opt level O2 on a model of your own, with a checkpoint saved half
// way and resumed in a fresh process state, as Apex's documentation does it
// in Python (docs/examples.md shows both):
//
//   model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
//                                     cast_model_outputs=torch.float32)
//   torch.save({"model": ..., "optimizer": ..., "amp": amp.state_dict()}, path)
//
//   o2_checkpoint [--dir FOLDER] [--steps N]
//
// O2 keeps the model's weights in 16 bits (bfloat16 on the CPU, float16 on
// CUDA), its LayerNorm in float32, and float32 master weights in the
// optimizer. The program trains N steps straight, then N/2 steps, saves,
// builds everything anew, loads and trains the rest, and exits 1 unless both
// runs end with the same bits in every weight and master.

#include <ampx/ampx.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <string>

namespace {

// A model of one's own: an MLP block with a LayerNorm, which O2 keeps in float32.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", torch::nn::Linear(32, 128));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({128})));
    fc2 = register_module("fc2", torch::nn::Linear(128, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::gelu(norm(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Net);

// One training state: the model, its optimizer (holding the fp32 masters)
// and the opt level's session (its loss scalers), built from seed 0.
struct Run {
  explicit Run(const torch::Device& device) {
    torch::manual_seed(0);
    model = Net();
    model->to(device);
    optimizer =
        std::make_unique<ampx::optim::AdamW>(model->parameters(), ampx::optim::AdamWOptions(1e-2));
    // Apex: amp.initialize(model, optimizer, opt_level="O2", cast_model_outputs=torch.float32)
    amp = std::make_unique<ampx::AmpSession>(
        ampx::initialize(model.ptr(), {optimizer.get()},
                         ampx::AmpOptions(ampx::OptLevel::O2).cast_model_outputs(torch::kFloat)));
  }

  // Step `step` on its batch: a fixed function of the step, so that a resumed
  // run sees what the straight one saw.
  void train_step(int64_t step, const torch::Device& device) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
    const auto x = torch::randn({64, 32}, gen).to(device);
    const auto y = torch::sin(x.slice(1, 0, 8) * 2).to(device);
    optimizer->zero_grad();
    torch::Tensor loss;
    {
      auto forward = amp->forward_guard();
      loss = torch::mse_loss(amp->cast_output(model->forward(amp->cast_input(x))), y);
    }
    amp->scaler().scale(loss).backward();
    amp->scaler().step(*optimizer);
    amp->scaler().update();
  }

  void save(const std::filesystem::path& dir) const {
    std::filesystem::create_directories(dir);
    torch::serialize::OutputArchive archive, model_archive, optimizer_archive;
    model->save(model_archive);
    optimizer->save(optimizer_archive);
    archive.write("model", model_archive);
    archive.write("optimizer", optimizer_archive);
    ampx::save_archive(archive, (dir / "checkpoint.pt").string());
    for (const auto& [name, state] : amp->state_dict()) {
      ampx::save_state_dict(state,
                            (dir / ("amp-" + name + ".pt")).string());  // torch.load reads it
    }
  }

  void load(const std::filesystem::path& dir) {
    torch::serialize::InputArchive archive, model_archive, optimizer_archive;
    ampx::load_archive(archive, (dir / "checkpoint.pt").string());
    archive.read("model", model_archive);
    archive.read("optimizer", optimizer_archive);
    model->load(model_archive);
    optimizer->load(optimizer_archive);
    std::map<std::string, ampx::StateDict> amp_state;
    for (const auto& [name, state] : amp->state_dict()) {
      amp_state[name] = ampx::load_state_dict((dir / ("amp-" + name + ".pt")).string());
    }
    amp->load_state_dict(amp_state);
  }

  Net model{nullptr};
  std::unique_ptr<ampx::optim::AdamW> optimizer;
  std::unique_ptr<ampx::AmpSession> amp;
};

// Whether `a` and `b` hold the same bits in every weight and master weight
// (float32 parameters, LayerNorm's, have no master: they are their own).
bool same_bits(Run& a, Run& b) {
  const auto pa = a.model->parameters(), pb = b.model->parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    if (!torch::equal(pa[i], pb[i])) return false;
    const auto ma = a.optimizer->master(pa[i]), mb = b.optimizer->master(pb[i]);
    if (ma.defined() != mb.defined() || (ma.defined() && !torch::equal(ma, mb))) return false;
  }
  return true;
}

int usage(const std::string& why) {
  std::fprintf(stderr, "o2_checkpoint: %s\nusage: o2_checkpoint [--dir FOLDER] [--steps N]\n",
               why.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::filesystem::path dir = std::filesystem::temp_directory_path() / "ampx-o2-checkpoint";
  int64_t steps = 40;
  for (int i = 1; i < argc; i += 2) {
    const std::string arg = argv[i];
    if (i + 1 >= argc) return usage("missing value for " + arg);
    if (arg == "--dir") {
      dir = argv[i + 1];
    } else if (arg == "--steps") {
      steps = std::atoll(argv[i + 1]);
    } else {
      return usage("unknown argument " + arg);
    }
  }
  if (steps < 2) return usage("--steps must be at least 2");
  const torch::Device device(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);

  Run straight(device);
  for (int64_t step = 0; step < steps; ++step) straight.train_step(step, device);

  {
    Run first_half(device);
    for (int64_t step = 0; step < steps / 2; ++step) first_half.train_step(step, device);
    first_half.save(dir);
  }  // everything of the first half is gone
  Run resumed(device);
  resumed.load(dir);
  for (int64_t step = steps / 2; step < steps; ++step) resumed.train_step(step, device);

  const auto weight = straight.model->fc1->weight;
  const auto master = straight.optimizer->master(weight);
  const bool o2 = weight.scalar_type() != torch::kFloat &&
                  straight.model->norm->weight.scalar_type() == torch::kFloat && master.defined() &&
                  master.scalar_type() == torch::kFloat;
  const bool same = same_bits(straight, resumed);
  std::printf(
      "%s: O2 on %s, weights %s, LayerNorm %s, masters %s; %lld steps straight and "
      "%lld + %lld resumed from %s: %s\n",
      o2 && same ? "ok" : "FAILED", device.str().c_str(), c10::toString(weight.scalar_type()),
      c10::toString(straight.model->norm->weight.scalar_type()),
      master.defined() ? c10::toString(master.scalar_type()) : "none",
      static_cast<long long>(steps), static_cast<long long>(steps / 2),
      static_cast<long long>(steps - steps / 2), dir.string().c_str(),
      same ? "the same bits" : "DIFFERENT bits");
  return o2 && same ? 0 : 1;
}
