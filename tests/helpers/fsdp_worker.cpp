// One rank of the fully sharded tests (tests/dist/fsdp_test.cpp starts 2 or 3 of
// them on loopback with torchrun's variables).
//
//   ampx_fsdp_worker <scenario> <out-file>
//   scenarios: fp32 | bf16 | bf16-grad | bf16-noprefetch | overflow | clip
//              | mismatch-units | O2 | lamb | lamb-pieces | ckpt-save
//              | ckpt-resume-from-<N> | ckpt-resume-from-zero-<N> | zero-ckpt-save
//              | zero-ckpt-resume-from-<N> | zero-ckpt-resume-from-fsdp-<N> | export
//              | zero-pieces | fp8-gather | block-gather
//
// Trains a small residual MLP (input layer, two blocks with a LayerNorm,
// a final LayerNorm in the root, a head) twice from rank 0's weights on
// this rank's shard of one global batch: with DistributedDataParallel, then
// with FullyShardedDataParallel, each unit a unit. Writes <out>.ddp and
// <out>.fsdp: one "loss <step> <loss> <scale> <stepped>" line a step, then
// on rank 0 every parameter as "param <value>" (%a), and prints the
// sharded state's sizes.
//
// ckpt-save trains only sharded (fp32, with a loss scaler) and, before step 4, saves
// each rank's shard (with AdamW's state) to <dir>/ckpt-<world>/shard-<rank>.pt
// and the loss scaler's state; ckpt-resume-from-<N> builds the model from
// other weights on this world's ranks, loads the N shards and trains steps
// 4-7. Both write <out>.at4 (rank 0: the full state at step 4, "param"
// lines) and <out>.fsdp; a load that fails prints its error and whether the
// model's state is unchanged ("unchanged 1"), and exits 1.
// ckpt-resume-from-zero-<N> loads the shards zero-ckpt-save wrote with N
// ranks. The zero-* scenarios do the same with ZeroRedundancyOptimizer
// (ZeRO-1: the model whole on every rank) in <dir>/zckpt-<world>;
// zero-ckpt-resume-from-fsdp-<N> loads the shards ckpt-save wrote.
// In the ckpt-* and zero-ckpt-* scenarios, AMPX_FSDP_WORKER_STATE names
// AdamW's state_format (default fp32; coded moments from 256 elements in
// blocks of 64, so that the pieces of 1, 2 and 3 ranks code theirs in
// blocks that differ), and AMPX_FSDP_WORKER_FAIL_RANK a rank whose reading
// of the shards fails. export: fsdp_worker_export.cpp; zero-pieces:
// fsdp_worker_zero_pieces.cpp; fp8-gather: fsdp_worker_fp8.cpp; block-gather:
// fsdp_worker_block.cpp.

#include "fsdp_worker.h"

#include <ampx/ampx.h>
#include <ampx/dist.h>
#include <ampx/fsdp.h>
#include <ampx/serialize.h>
#include <ampx/zero.h>

#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fsdp_worker {

std::string hex(double v) {
  char text[64];
  std::snprintf(text, sizeof(text), "%a", v);
  return text;
}

void log_grads(std::ostream& log, const std::string& tag,
               const ampx::dist::FullyShardedDataParallel& fsdp) {
  for (const auto& piece : fsdp.parameters()) {
    const auto g = piece.grad().contiguous();
    for (int64_t i = 0; i < g.numel(); ++i)
      log << tag << " " << hex(g.data_ptr<float>()[i]) << "\n";
  }
}

void log_params(std::ostream& log, const torch::nn::Module& model,
                ampx::dist::FullyShardedDataParallel& fsdp, const ampx::dist::ProcessGroup& pg) {
  const auto state = fsdp.full_state_dict();
  if (pg.rank() != 0) return;
  for (const auto& p : model.named_parameters()) {
    const auto c = state[p.key()].to(torch::kFloat).contiguous();
    for (int64_t i = 0; i < c.numel(); ++i) log << "param " << hex(c.data_ptr<float>()[i]) << "\n";
  }
}

}  // namespace fsdp_worker

namespace {

using fsdp_worker::hex;

constexpr int64_t kGlobalBatch = 12;
constexpr int kSteps = 8;

/// The norms' inputs in float32 (autocast), or as they come (O2: its
/// forward guard takes a bf16 input to the fp32 norm and back).
bool g_norms_fed_fp32 = true;

torch::Tensor norm_input(const torch::Tensor& x) {
  return g_norms_fed_fp32 ? x.to(torch::kFloat) : x;
}

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    // (LibTorch 1.13's CPU layer_norm takes no bfloat16 input with fp32
    // weights, nor does its autocast cast it: float32 in, as Python 1.13 needs.)
    return x + down(torch::gelu(up(norm(norm_input(x)))));
  }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl()
      : in(register_module("in", torch::nn::Linear(8, 32))),
        block0(register_module("block0", Block(32))),
        block1(register_module("block1", Block(32))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})))),
        head(register_module("head", torch::nn::Linear(32, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = ampx::dist::sharded_forward(in, x);
    h = ampx::dist::sharded_forward(block0, h);
    h = ampx::dist::sharded_forward(block1, h);
    return ampx::dist::sharded_forward(head, norm(norm_input(h)));
  }
  torch::nn::Linear in;
  Block block0, block1;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

std::pair<torch::Tensor, torch::Tensor> batch_shard(int64_t rank, int64_t world) {
  torch::manual_seed(7);
  const auto x = torch::randn({kGlobalBatch, 8}), y = torch::randn({kGlobalBatch, 4});
  const int64_t shard = kGlobalBatch / world;
  return {x.slice(0, rank * shard, (rank + 1) * shard),
          y.slice(0, rank * shard, (rank + 1) * shard)};
}

/// The sharded run's wrapper, each unit a unit (mismatch-units: the last rank
/// leaves the head out); O2 sums in bf16 where Gloo can. Prints its reduce_dtype.
std::unique_ptr<ampx::dist::FullyShardedDataParallel> shard_model(const std::string& scenario,
                                                                  Net& model,
                                                                  ampx::dist::ProcessGroup& pg,
                                                                  bool mixed, bool o2) {
  auto options = ampx::dist::FullyShardedDataParallelOptions()
                     .param_dtype(mixed ? torch::kBFloat16 : torch::kFloat)
                     .reduce_dtype(o2 ? torch::kBFloat16 : torch::kFloat)
                     .reshard_after_forward(scenario != "bf16-grad")
                     .prefetch(scenario != "bf16-noprefetch");
  std::vector<std::shared_ptr<torch::nn::Module>> units{model->in.ptr(), model->block0.ptr(),
                                                        model->block1.ptr(), model->head.ptr()};
  if (scenario == "mismatch-units" && pg.rank() == pg.world_size() - 1) units.pop_back();
  std::unique_ptr<ampx::dist::FullyShardedDataParallel> fsdp;
  try {
    fsdp = std::make_unique<ampx::dist::FullyShardedDataParallel>(model.ptr(), pg, units, options);
  } catch (const c10::Error& e) {
    // O2 sums in bf16, as DDP does, where Gloo can (LibTorch 2.x); else in fp32.
    if (!o2 || std::string(e.what()).find("cannot sum") == std::string::npos) throw;
    options.reduce_dtype(torch::kFloat);
    fsdp = std::make_unique<ampx::dist::FullyShardedDataParallel>(model.ptr(), pg, units, options);
  }
  std::cout << "reduce_dtype " << options.reduce_dtype() << std::endl;
  return fsdp;
}

/// LAMB (lamb: its trust ratios from whole parameters' norms, through fsdp's
/// piece sums where sharded) or AdamW, over `params`.
std::unique_ptr<ampx::optim::MixedPrecisionOptimizer> make_optimizer(
    bool lamb, const std::string& scenario, const std::vector<torch::Tensor>& params,
    ampx::dist::FullyShardedDataParallel* fsdp) {
  if (!lamb) {
    return std::make_unique<ampx::optim::AdamW>(params,
                                                ampx::optim::AdamWOptions(1e-2).weight_decay(0.01));
  }
  auto optimizer = std::make_unique<ampx::optim::LAMB>(
      params, ampx::optim::LAMBOptions(1e-2).weight_decay(0.01));
  if (fsdp && scenario == "lamb") optimizer->set_piece_sums(fsdp->piece_sums());
  return optimizer;
}

/// Prints what the sharded state holds, gathers and sends, and the model's own parameters' size.
void print_sharded_sizes(const ampx::dist::FullyShardedDataParallel& fsdp, Net& model) {
  std::cout << "sharded_bytes " << fsdp.sharded_bytes() << "\npeak_gathered_bytes "
            << fsdp.peak_gathered_bytes() << "\nbytes_communicated " << fsdp.bytes_communicated()
            << std::endl;
  int64_t full = 0;
  for (const auto& p : model->parameters()) full += p.numel();
  std::cout << "unsharded_parameters " << full << std::endl;  // the model's: placeholders
}

int train(const std::string& scenario, bool sharded, const std::string& out,
          ampx::dist::ProcessGroup& pg) {
  const int64_t rank = pg.rank(), world = pg.world_size();
  torch::manual_seed(100 + rank);  // different on each rank: both broadcast rank 0's
  Net model;
  // lamb: LAMB in fp32, its trust ratios from whole parameters' norms
  // (set_piece_sums); lamb-pieces: from each rank's pieces (what the
  // sharded LAMB must not do, so the test can tell).
  const bool lamb = scenario == "lamb" || scenario == "lamb-pieces";
  const bool mixed = scenario != "fp32" && !lamb;
  const bool o2 = scenario == "O2";  // ampx::initialize's O2 (sharded: on the wrapper)
  g_norms_fed_fp32 = !o2;
  std::unique_ptr<ampx::dist::DistributedDataParallel> ddp;
  std::unique_ptr<ampx::dist::FullyShardedDataParallel> fsdp;
  std::vector<torch::Tensor> params;
  if (sharded) {
    fsdp = shard_model(scenario, model, pg, mixed, o2);
    params = fsdp->parameters();
  } else {
    ddp = std::make_unique<ampx::dist::DistributedDataParallel>(model.ptr(), pg);
    params = model->parameters();
  }
  const auto optimizer = make_optimizer(lamb, scenario, params, fsdp.get());
  auto& opt = *optimizer;
  std::optional<ampx::AmpSession> amp;
  if (o2 && sharded) {
    amp.emplace(ampx::initialize(*fsdp, ampx::AmpOptions(ampx::OptLevel::O2)));
  } else if (o2) {
    ddp.reset();  // DDP after the cast: its buckets see the bf16 gradients
    amp.emplace(ampx::initialize(model.ptr(), {&opt}, ampx::AmpOptions(ampx::OptLevel::O2)));
    ddp = std::make_unique<ampx::dist::DistributedDataParallel>(model.ptr(), pg);
  }
  ampx::GradScaler own_scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  ampx::GradScaler& scaler = amp ? amp->scaler() : own_scaler;
  if (sharded) ampx::dist::synchronize_found_inf(scaler, pg);
  const auto [x, y] = batch_shard(rank, world);
  std::ofstream log(out + (sharded ? ".fsdp" : ".ddp"));
  for (int step = 0; step < kSteps; ++step) {
    opt.zero_grad();
    torch::Tensor loss;
    if (amp) {
      auto forward = amp->forward_guard();
      loss = torch::mse_loss(
          ampx::dist::sharded_forward(model, amp->cast_input(x)).to(torch::kFloat), y);
    } else {
      ampx::AutocastGuard autocast(torch::kCPU, torch::kBFloat16, mixed);
      loss = torch::mse_loss(ampx::dist::sharded_forward(model, x), y);
    }
    if (scenario == "overflow" && rank == 1 && step == 3) loss = loss * INFINITY;
    scaler.scale(loss).backward();
    if (ddp) ddp->synchronize();
    if (scenario == "clip") {
      scaler.unscale_(opt);
      const double norm =
          sharded ? fsdp->clip_grad_norm_(0.05) : torch::nn::utils::clip_grad_norm_(params, 0.05);
      log << "norm " << hex(norm) << "\n";
    }
    const bool stepped = static_cast<bool>(scaler.step(opt));
    scaler.update();
    log << "loss " << step << " " << hex(loss.item<double>()) << " " << hex(scaler.get_scale())
        << " " << stepped << "\n";
  }
  if (sharded) {
    print_sharded_sizes(*fsdp, model);
    fsdp_worker::log_params(log, *model, *fsdp, pg);
  } else if (rank == 0) {
    for (const auto& p : model->parameters()) {  // O2: the masters, as the shards hold them
      const auto master = opt.master(p);
      auto c = (master.defined() ? master : p).detach().to(torch::kFloat).contiguous();
      for (int64_t i = 0; i < c.numel(); ++i)
        log << "param " << hex(c.data_ptr<float>()[i]) << "\n";
    }
  }
  return 0;
}

/// Rank 0 writes every parameter of `state` (full_state_dict()) to `path`.
void write_params(const torch::OrderedDict<std::string, torch::Tensor>& state, Net& model,
                  const std::string& path) {
  if (state.is_empty()) return;
  std::ofstream out(path);
  for (const auto& p : model->named_parameters()) {
    auto c = state[p.key()].to(torch::kFloat).contiguous();
    for (int64_t i = 0; i < c.numel(); ++i) out << "param " << hex(c.data_ptr<float>()[i]) << "\n";
  }
}

/// What a checkpoint scenario saves, loads, reads back and trains.
struct Checkpointed {
  std::function<void(torch::serialize::OutputArchive&)> save;
  std::function<void(int64_t saved_world,
                     const ampx::dist::FullyShardedDataParallel::ShardReader&)>
      load;
  std::function<std::vector<torch::Tensor>()> state;    // rank 0: the full weights
  std::function<void(const std::string&)> write_params;  // rank 0: them, as "param" lines
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

/// ckpt-* and zero-ckpt-*: from `dir`'s shards (unless `save`: trains 8
/// steps and saves before step 4), then steps 4-7; see the top of this file.
int checkpoint_scenario(bool save, int64_t saved_world, const std::filesystem::path& dir,
                        const Checkpointed& c, torch::optim::Optimizer& opt,
                        const std::string& out, ampx::dist::ProcessGroup& pg) {
  namespace fs = std::filesystem;
  const int64_t rank = pg.rank(), world = pg.world_size();
  const auto shard_file = [&](int64_t r) {
    return (dir / ("shard-" + std::to_string(r) + ".pt")).string();
  };
  ampx::GradScaler scaler(ampx::GradScalerOptions().init_scale(1024.0).growth_interval(2));
  ampx::dist::synchronize_found_inf(scaler, pg);
  int first = 0;
  if (!save) {
    const auto before = c.state();
    const char* fail = std::getenv("AMPX_FSDP_WORKER_FAIL_RANK");
    try {
      c.load(saved_world, [&](int64_t r, torch::serialize::InputArchive& archive) {
        TORCH_CHECK(!(fail && std::to_string(rank) == fail), "this rank cannot read shard ", r,
                    " (AMPX_FSDP_WORKER_FAIL_RANK)");
        ampx::load_archive(archive, shard_file(r));
      });
    } catch (const c10::Error& e) {
      std::cout << "load failed: " << e.what_without_backtrace() << std::endl;
      const auto after = c.state();
      bool same = before.size() == after.size();
      for (size_t i = 0; same && i < after.size(); ++i) same = torch::equal(before[i], after[i]);
      std::cout << "unchanged " << same << std::endl;
      return 1;
    }
    scaler.load_state_dict(ampx::load_state_dict((dir / "scaler.pt").string()));
    c.write_params(out + ".at4");
    first = 4;
  }
  const auto [x, y] = batch_shard(rank, world);
  std::ofstream log(out + ".fsdp");
  for (int step = first; step < kSteps; ++step) {
    if (save && step == 4) {
      fs::create_directories(dir);
      torch::serialize::OutputArchive archive;
      c.save(archive);
      ampx::save_archive(archive, shard_file(rank));
      if (rank == 0) ampx::save_state_dict(scaler.state_dict(), (dir / "scaler.pt").string());
      c.write_params(out + ".at4");
    }
    opt.zero_grad();
    const auto loss = torch::mse_loss(c.forward(x), y);
    scaler.scale(loss).backward();
    const bool stepped = static_cast<bool>(scaler.step(opt));
    scaler.update();
    log << "loss " << step << " " << hex(loss.item<double>()) << " " << hex(scaler.get_scale())
        << " " << stepped << "\n";
  }
  log.close();
  c.write_params(out + ".final");
  return 0;
}

/// A ckpt-* or zero-ckpt-* scenario's saved world (its own when saving)
/// and shard folder: <dir>/ckpt-<N> (FSDP's) or <dir>/zckpt-<N> (ZeRO-1's).
std::pair<int64_t, std::filesystem::path> saved_shards(const std::string& scenario, bool save,
                                                       const std::string& out, int64_t world) {
  const bool zero_run = scenario.rfind("zero-", 0) == 0;
  const std::string from = zero_run ? "zero-ckpt-resume-from-" : "ckpt-resume-from-";
  const std::string other = zero_run ? "fsdp-" : "zero-";  // the other kind's shards
  const bool from_other = !save && scenario.rfind(from + other, 0) == 0;
  const int64_t saved_world =
      save ? world : std::stoll(scenario.substr(from.size() + (from_other ? other.size() : 0)));
  const bool zero_files = zero_run != from_other;
  return {saved_world, std::filesystem::path(out).parent_path() /
                           ((zero_files ? "zckpt-" : "ckpt-") + std::to_string(saved_world))};
}

/// The checkpoint scenarios' AdamW (AMPX_FSDP_WORKER_STATE: see the top).
ampx::optim::AdamWOptions checkpoint_adamw() {
  auto options = ampx::optim::AdamWOptions(1e-2).weight_decay(0.01);
  if (const char* format = std::getenv("AMPX_FSDP_WORKER_STATE")) {
    options.state_format(ampx::optim::state_format_from_name(format))
        .state_block(64)
        .state_min_numel(256);
  }
  return options;
}

int checkpoint_run(const std::string& scenario, const std::string& out,
                   ampx::dist::ProcessGroup& pg) {
  const bool save = scenario == "ckpt-save";
  const auto [saved_world, dir] = saved_shards(scenario, save, out, pg.world_size());
  torch::manual_seed(save ? 100 : 555 + pg.rank());  // resumed: other weights, replaced
  Net model;
  ampx::dist::FullyShardedDataParallel fsdp(
      model.ptr(), pg,
      {model->in.ptr(), model->block0.ptr(), model->block1.ptr(), model->head.ptr()},
      ampx::dist::FullyShardedDataParallelOptions());
  ampx::optim::AdamW opt(fsdp.parameters(), checkpoint_adamw());
  Checkpointed c;
  c.save = [&](torch::serialize::OutputArchive& a) { fsdp.save_shard(a, &opt); };
  c.load = [&](int64_t w, const ampx::dist::FullyShardedDataParallel::ShardReader& read) {
    fsdp.load_shards(w, read, &opt);
  };
  c.state = [&] {
    std::vector<torch::Tensor> values;
    for (const auto& item : fsdp.full_state_dict()) values.push_back(item.value());
    return values;
  };
  c.write_params = [&](const std::string& path) {
    write_params(fsdp.full_state_dict(), model, path);
  };
  c.forward = [&](const torch::Tensor& x) { return ampx::dist::sharded_forward(model, x); };
  return checkpoint_scenario(save, saved_world, dir, c, opt, out, pg);
}

/// Rank 0 writes every parameter of `model` (whole on every rank) to `path`.
void write_model_params(Net& model, int64_t rank, const std::string& path) {
  if (rank != 0) return;
  std::ofstream out(path);
  for (const auto& p : model->parameters()) {
    auto c = p.detach().to(torch::kFloat).contiguous();
    for (int64_t i = 0; i < c.numel(); ++i) out << "param " << hex(c.data_ptr<float>()[i]) << "\n";
  }
}

int zero_checkpoint_run(const std::string& scenario, const std::string& out,
                        ampx::dist::ProcessGroup& pg) {
  const bool save = scenario == "zero-ckpt-save";
  const auto [saved_world, dir] = saved_shards(scenario, save, out, pg.world_size());
  torch::manual_seed(save ? 100 : 555 + pg.rank());  // resumed: other weights, replaced
  Net model;
  ampx::dist::ZeroRedundancyOptimizer opt(
      model->parameters(), pg, [](std::vector<torch::Tensor> s) {
        return std::make_unique<ampx::optim::AdamW>(std::move(s), checkpoint_adamw());
      });
  Checkpointed c;
  c.save = [&](torch::serialize::OutputArchive& a) { opt.save_shard(a, *model); };
  c.load = [&](int64_t w, const ampx::dist::FullyShardedDataParallel::ShardReader& read) {
    opt.load_shards(w, read, *model);
  };
  c.state = [&] {
    std::vector<torch::Tensor> values;
    for (const auto& p : model->parameters()) values.push_back(p.detach().clone());
    return values;
  };
  c.write_params = [&](const std::string& path) { write_model_params(model, pg.rank(), path); };
  c.forward = [&](const torch::Tensor& x) { return model->forward(x); };
  return checkpoint_scenario(save, saved_world, dir, c, opt, out, pg);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: ampx_fsdp_worker <scenario> <out-file>\n");
    return 2;
  }
  try {
    auto pg =
        ampx::dist::init_process_group(ampx::dist::InitOptions().timeout(std::chrono::seconds(60)));
    const std::string scenario = argv[1];
    if (scenario == "export") return fsdp_worker::run_export(argv[2], pg);
    if (scenario == "zero-pieces") return fsdp_worker::run_zero_pieces(argv[2], pg);
    if (scenario == "fp8-gather") return fsdp_worker::run_fp8_gather(argv[2], pg);
    if (scenario == "block-gather") return fsdp_worker::run_block_gather(argv[2], pg);
    if (scenario.rfind("ckpt-", 0) == 0) return checkpoint_run(scenario, argv[2], pg);
    if (scenario.rfind("zero-ckpt-", 0) == 0) return zero_checkpoint_run(scenario, argv[2], pg);
    if (scenario != "mismatch-units" && train(scenario, false, argv[2], pg) != 0) return 1;
    return train(scenario, true, argv[2], pg);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "%s\n", e.what_without_backtrace());
  }
  return 1;
}
