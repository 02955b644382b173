// ampx-train --export-weights: the trained weights as safetensors, under the
// model's names, with the fp32 masters where the mode keeps them; the Python
// twin of the gpt (bench/python/ampx_models.py) loads the file with
// safetensors.torch.load_model and computes the same fp32 logits as ampx's
// C++ model, bit for bit (tests/reference/export_weights_logits.py); a
// failing write stops the run naming the file.

#include "cli/config.h"
#include "run/checkpoint.h"
#include "run/trainer.h"
#include "run/workloads.h"
#include "test_support.h"

#include <ampx/safetensors.h>

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using ampx::train::Batch;
using ampx::train::checkpoint_path_for;
using ampx::train::load_checkpoint;
using ampx::train::make_workload;
using ampx::train::ModeSetUp;
using ampx::train::parse_command_line;
using ampx::train::parse_mode;
using ampx::train::read_checkpoint;
using ampx::train::read_checkpoint_bytes;
using ampx::train::resolve_defaults;
using ampx::train::set_up_mode;
using ampx::train::TrainConfig;
using ampx::train::test::contains;
using ampx::train::test::model_tensors;
using ampx::train::test::resolved_config;
using ampx::train::test::run_binary_in;
using ampx::train::test::TempDir;
using ampx::train::test::tiny_gpt;
using ampx::train::test::write_text_data;
#ifdef AMPX_TRAIN_BINARY
using ampx::train::test::BinaryRun;
using ampx::train::test::Exit;
using ampx::train::test::run_train;
#endif

class ExportWeightsTest : public testing::Test {
 protected:
  void SetUp() override { write_text_data(data_, "abcdefghijklmnopqrstuvwxyz .,;", 20000, 11); }

  /// tiny_gpt's flags, three steps, this test's data and output folders, and `more`.
  std::vector<std::string> flags(const std::vector<std::pair<std::string, std::string>>& more) {
    std::vector<std::pair<std::string, std::string>> all = {
        {"--steps", "3"},
        {"--data-dir", data_.string()},
        {"--out-dir", (dir_.path() / "out").string()}};
    all.insert(all.end(), more.begin(), more.end());
    return tiny_gpt(all);
  }

  TempDir dir_{"ampx-export-test"};
  fs::path data_ = dir_.path() / "data";
};

#ifdef AMPX_TRAIN_BINARY

/// The trained model's fp32 weights by name: mode `mode`'s checkpoint
/// restored by ampx-train's own resume code (set_up_mode, load_checkpoint),
/// then each parameter as the optimizer's fp32 master where it keeps one
/// (O2), else as it is, and the buffers. Independent of the export's code.
std::map<std::string, torch::Tensor> trained_weights(const TrainConfig& config,
                                                     const std::string& mode) {
  auto workload = make_workload(config);
  ModeSetUp setup = set_up_mode(config, *workload, parse_mode(mode, config), torch::kCPU);
  const fs::path checkpoint = checkpoint_path_for(config, mode);
  load_checkpoint(checkpoint, read_checkpoint_bytes(checkpoint),
                  read_checkpoint(checkpoint).meta.at("run"),
                  {*setup.model, *setup.optimizer, *setup.amp});
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : setup.model->named_parameters()) {
    const auto master =
        dynamic_cast<ampx::optim::MixedPrecisionOptimizer&>(*setup.optimizer).master(p.value());
    out[p.key()] = (master.defined() ? master : p.value()).detach().clone();
  }
  for (const auto& b : setup.model->named_buffers()) out[b.key()] = b.value().clone();
  return out;
}

// --compare: one file per mode. fp32 exports its weights, O2 its fp32
// masters. ampx's logits of one batch come from the trained model (restored
// from its checkpoint, not from the export) in ampx's C++ model; Python's
// from the export in bench/python's model: fp32, one thread, equal bit for
// bit where both run the same ops (explicit attention). A transposed or
// misnamed tensor in the export would change Python's logits only.
TEST_F(ExportWeightsTest, PythonLoadsTheExportAndComputesTheSameLogitsBitwise) {
  const fs::path weights = dir_.path() / "w.safetensors";
  const auto args = flags({{"--compare", "fp32,O2"},
                           {"--save-every", "3"},
                           {"--checkpoint-dir", (dir_.path() / "ck").string()},
                           {"--export-weights", weights.string()}});
  const Exit run = run_train(args, dir_.path() / "train.log");
  ASSERT_EQ(run.status, 0) << run.output;
  for (const std::string mode : {"fp32", "O2"}) {
    SCOPED_TRACE(mode);
    const fs::path file = dir_.path() / ("w-" + mode + ".safetensors");
    ASSERT_TRUE(fs::exists(file)) << run.output;
    EXPECT_TRUE(contains(run.output, {"[" + mode + "] weights (safetensors): " + file.string()}));
    std::map<std::string, std::string> meta;
    const auto tensors = ampx::read_safetensors(file.string(), &meta);
    EXPECT_EQ(meta["precision"], mode);
    EXPECT_EQ(meta["workload"], "gpt");
    for (const auto& [name, t] : tensors) {
      if (name != "blocks.0.attn.mask") {
        EXPECT_EQ(t.scalar_type(), torch::kFloat) << name;
      }
    }

    // ampx's logits: the trained weights in the workload's model as
    // ampx-train builds it, one batch, fp32, one thread (as Python runs).
    const auto trained = trained_weights(resolved_config(args), mode);
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    torch::NoGradGuard no_grad;
    std::map<std::string, torch::Tensor> logits;
    for (const std::string attention : {"explicit", "fused"}) {
      auto argv = args;
      argv.insert(argv.end(), {"--attention", attention});
      auto workload = make_workload(resolved_config(argv));
      torch::nn::AnyModule model = workload->build(torch::kCPU);
      for (const auto& p : model.ptr()->named_parameters()) p.value().copy_(trained.at(p.key()));
      for (const auto& b : model.ptr()->named_buffers()) b.value().copy_(trained.at(b.key()));
      model.ptr()->eval();
      const Batch batch = workload->batch(/*step=*/5, torch::kCPU);
      logits["input"] = batch.input;
      logits["logits_" + attention] = model.forward(batch.input);
    }
    at::set_num_threads(threads);
    const fs::path logits_file = dir_.path() / ("logits-" + mode + ".safetensors");
    ampx::save_safetensors(logits, logits_file.string());

    const BinaryRun py = run_binary_in(
        dir_.path(), AMPX_PYTHON, {AMPX_EXPORT_LOGITS_SCRIPT, file.string(), logits_file.string()});
    if (py.status == 77) GTEST_SKIP() << py.out;
    EXPECT_EQ(py.status, 0) << py.out << py.err;
    std::printf("%s", py.out.c_str());
  }
}

// O2 trains a bf16 model from fp32 masters: the file holds the masters, each
// rounding to the bf16 weight the checkpoint holds, under the same names.
TEST_F(ExportWeightsTest, O2ExportsTheFp32MastersUnderTheModelsNames) {
  const fs::path weights = dir_.path() / "o2.safetensors";
  const Exit run = run_train(flags({{"--precision", "O2"},
                                    {"--save-every", "3"},
                                    {"--checkpoint-dir", (dir_.path() / "ck").string()},
                                    {"--export-weights", weights.string()}}),
                             dir_.path() / "train.log");
  ASSERT_EQ(run.status, 0) << run.output;
  const auto exported = ampx::read_safetensors(weights.string());
  const auto model = model_tensors(dir_.path() / "ck" / "checkpoint.ampx");
  ASSERT_EQ(exported.size(), model.size());
  int64_t finer = 0;  // master values that bf16 does not hold
  for (const auto& [name, t] : model) {
    ASSERT_TRUE(exported.count(name)) << name;
    const auto& e = exported.at(name);
    if (t.scalar_type() == torch::kBFloat16) {
      EXPECT_EQ(e.scalar_type(), torch::kFloat) << name;
      EXPECT_TRUE(torch::equal(e.to(torch::kBFloat16), t)) << name;
      finer += e.ne(e.to(torch::kBFloat16).to(torch::kFloat)).sum().item<int64_t>();
    } else {
      EXPECT_TRUE(torch::equal(e, t)) << name;  // fp32 norms, the bool mask
    }
  }
  EXPECT_GT(finer, 0);
}

// fp8: the fp32 master weights and the model's own buffers; the FP8 layers'
// scaling state (amax histories, scales) is training state and stays out,
// so the file has exactly the fp32 model's names.
TEST_F(ExportWeightsTest, Fp8ExportsTheWeightsWithoutTheScalingState) {
  const fs::path fp32 = dir_.path() / "fp32.safetensors", fp8 = dir_.path() / "fp8.safetensors";
  ASSERT_EQ(run_train(flags({{"--precision", "fp32"}, {"--export-weights", fp32.string()}}),
                      dir_.path() / "fp32.log")
                .status,
            0);
  const Exit run = run_train(flags({{"--precision", "fp8"}, {"--export-weights", fp8.string()}}),
                             dir_.path() / "fp8.log");
  ASSERT_EQ(run.status, 0) << run.output;
  const auto a = ampx::read_safetensors(fp32.string()), b = ampx::read_safetensors(fp8.string());
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    EXPECT_EQ(b.at(name).scalar_type(), t.scalar_type()) << name;
    EXPECT_EQ(b.at(name).sizes(), t.sizes()) << name;
  }
}

// A missing folder is made; a path that cannot become the file (here a
// folder) stops the run with status 1 naming it, and leaves it as it was;
// a folder that cannot be made (under a file) is named with its error.
TEST_F(ExportWeightsTest, MakesItsFolderAndAFailingWriteStopsTheRunNamingTheFile) {
  const fs::path weights = dir_.path() / "new" / "folder" / "w.safetensors";
  const Exit ok =
      run_train(flags({{"--precision", "fp32"}, {"--export-weights", weights.string()}}),
                dir_.path() / "ok.log");
  ASSERT_EQ(ok.status, 0) << ok.output;
  EXPECT_EQ(ampx::read_safetensors(weights.string()).count("head.weight"), 1u);

  const fs::path taken = dir_.path() / "taken";
  fs::create_directories(taken);
  const Exit run = run_train(flags({{"--precision", "fp32"}, {"--export-weights", taken.string()}}),
                             dir_.path() / "train.log");
  EXPECT_EQ(run.status, 1) << run.output;
  EXPECT_TRUE(contains(
      run.output,
      {"ampx-train: --export-weights: save_safetensors: cannot write '" + taken.string() + "'"}));
  EXPECT_TRUE(fs::is_directory(taken) && fs::is_empty(taken));
  for (const auto& e : fs::directory_iterator(dir_.path())) {
    EXPECT_EQ(e.path().string().find(".tmp."), std::string::npos) << e.path();  // no temp file left
  }

  // A folder that cannot be made (under a file): the error says why.
  const fs::path file = dir_.path() / "a-file";
  std::ofstream(file) << "kept";
  const fs::path under = file / "sub" / "w.safetensors";
  const Exit no_folder =
      run_train(flags({{"--precision", "fp32"}, {"--export-weights", under.string()}}),
                dir_.path() / "no-folder.log");
  EXPECT_EQ(no_folder.status, 1) << no_folder.output;
  EXPECT_TRUE(contains(no_folder.output,
                       {"ampx-train: --export-weights: ",
                        "; its folder '" + (file / "sub").string() + "' could not be made: "}))
      << no_folder.output;
  EXPECT_TRUE(fs::is_regular_file(file) && fs::file_size(file) == 4);
}

#endif  // AMPX_TRAIN_BINARY

}  // namespace
