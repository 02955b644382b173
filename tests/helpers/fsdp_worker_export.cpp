// fsdp_worker's export scenario (tests/dist/fsdp_test.cpp): a model of three
// units and a root holding a LayerNorm, a Linear and two buffers, sharded
// in bf16. Rank 0 writes ampx::save_safetensors() of full_state_dict() to
// <out>.whole and of it with the parameters in bf16 to <out>.whole-bf16;
// every rank then streams the same through save_full_safetensors() to
// <out>.streamed and <out>.streamed-bf16, and tries what must be refused
// on every rank, printing "refused <case>: <error>" for each:
//   missing-folder  a path in a folder that does not exist (fails at the start)
//   over-folder     a path that is a folder (fails at the end, at the rename)
//   dtype           Int parameters
//   not-utf8        metadata that is not UTF-8 (refused before any gather)
//   visit           for_each_full_parameter whose visit throws on rank 0
// then streams <out>.after (the gathers still line up after the refusals).

#include "fsdp_worker.h"

#include <ampx/dist.h>
#include <ampx/fsdp.h>
#include <ampx/safetensors.h>

#include <torch/torch.h>

#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>

namespace fsdp_worker {
namespace {

struct ExportNetImpl : torch::nn::Module {
  ExportNetImpl()
      : in(register_module("in", torch::nn::Linear(8, 48))),
        mid(register_module("mid", torch::nn::Linear(48, 40))),
        out(register_module("out", torch::nn::Linear(40, 4))),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({4})))),
        root(register_module("root", torch::nn::Linear(4, 3))) {
    register_buffer("calls", torch::arange(5, torch::kLong));
    register_buffer("running", torch::linspace(-1, 1, 6));
  }
  torch::nn::Linear in, mid, out;
  torch::nn::LayerNorm norm;
  torch::nn::Linear root;
};
TORCH_MODULE(ExportNet);

/// Runs `save` and prints what it threw ("refused <what>: <error>"), or
/// "accepted <what>".
template <typename F>
void expect_refused(const std::string& what, F&& save) {
  try {
    save();
    std::cout << "accepted " << what << std::endl;
  } catch (const c10::Error& e) {
    std::cout << "refused " << what << ": " << e.what_without_backtrace() << std::endl;
  }
}

}  // namespace

int run_export(const std::string& out, ampx::dist::ProcessGroup& pg) {
  torch::manual_seed(3 + pg.rank());  // rank 0's weights are broadcast
  ExportNet model;
  ampx::dist::FullyShardedDataParallel fsdp(
      model.ptr(), pg, {model->in.ptr(), model->mid.ptr(), model->out.ptr()},
      ampx::dist::FullyShardedDataParallelOptions().param_dtype(torch::kBFloat16));
  const std::map<std::string, std::string> metadata = {{"format", "pt"}, {"run", "export"}};

  const auto state = fsdp.full_state_dict();
  if (pg.rank() == 0) {
    std::map<std::string, torch::Tensor> whole, bf16;
    for (const auto& item : state) {
      whole[item.key()] = item.value();
      const bool param = model->named_parameters().contains(item.key());
      bf16[item.key()] = param ? item.value().to(torch::kBFloat16) : item.value();
    }
    ampx::save_safetensors(whole, out + ".whole", metadata);
    ampx::save_safetensors(bf16, out + ".whole-bf16", metadata);
  }
  fsdp.save_full_safetensors(out + ".streamed", metadata);
  fsdp.save_full_safetensors(out + ".streamed-bf16", metadata, torch::kBFloat16);

  const auto folder = std::filesystem::path(out).parent_path();
  expect_refused("missing-folder", [&] {
    fsdp.save_full_safetensors((folder / "missing" / "w.safetensors").string(), metadata);
  });
  const auto taken = folder / "taken.safetensors";
  if (pg.rank() == 0) std::filesystem::create_directories(taken / "kept");
  pg.barrier();
  expect_refused("over-folder", [&] { fsdp.save_full_safetensors(taken.string(), metadata); });
  expect_refused("dtype", [&] { fsdp.save_full_safetensors(out + ".int", {}, torch::kInt); });
  expect_refused("not-utf8", [&] {  // "w\xE9": "wé" in Latin-1
    fsdp.save_full_safetensors(out + ".latin1", {{"note", "w\xE9"}});
  });
  int64_t visited = 0;
  expect_refused("visit", [&] {
    fsdp.for_each_full_parameter([&](const std::string& name, const torch::Tensor&) {
      if (++visited == 2) throw std::runtime_error("cannot take " + name);
    });
  });
  fsdp.save_full_safetensors(out + ".after", metadata);
  std::cout << "visited " << visited << std::endl;
  return 0;
}

}  // namespace fsdp_worker
