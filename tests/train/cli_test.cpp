// ampx-train's command line: parse_command_line and resolve_defaults in
// process (defaults per workload, mode lists, every usage error and the
// checks CLI11 cannot do), then the real binary (exit status and stderr of
// bad flags, missing data, --resume without a checkpoint, a fresh run that
// would overwrite one, and a help text that lists every flag).

#include "cli/config.h"

#include <ampx/kernels.h>
#include <ampx/version.h>

#include <c10/util/Exception.h>
#include "test_support.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <CLI/CLI.hpp>

#include <sys/wait.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

namespace {

namespace fs = std::filesystem;
using ampx::train::modes_of;
using ampx::train::parse_command_line;
using ampx::train::resolve_defaults;
using ampx::train::TrainConfig;
using namespace ampx::train::test;

/// What parse_command_line made of `args` (program name added in front).
struct Parsed {
  std::optional<int> code;  // nullopt: the program would run
  TrainConfig config;
  std::string out, err;  // what it printed
};

Parsed parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ampx-train");
  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  Parsed p;
  testing::internal::CaptureStdout();
  testing::internal::CaptureStderr();
  p.code = parse_command_line(static_cast<int>(argv.size()), argv.data(), p.config);
  p.err = testing::internal::GetCapturedStderr();
  p.out = testing::internal::GetCapturedStdout();
  return p;
}

std::string join(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += (s.empty() ? "" : " ") + a;
  return s;
}

/// Flags of a gpt run small enough to take a moment.
const std::vector<std::string> kTinyGpt = ampx::train::test::tiny_gpt({{"--steps", "2"}});

class TrainCliTest : public testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/ampx-cli-test-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  /// An empty folder <dir_>/<name>.
  fs::path folder(const std::string& name) {
    const fs::path p = dir_ / name;
    fs::create_directories(p);
    return p;
  }

  /// <data>/moby-dick/data.txt: 20000 seeded random letters and spaces.
  fs::path text_data() {
    const fs::path data = folder("text-data");
    write_text_data(data, "abcdefghijklmnopqrstuvwxyz     ", 20000, 7);
    return data;
  }

#ifdef AMPX_TRAIN_BINARY
  /// Runs the ampx-train binary with `args`, stdout and stderr kept apart.
  BinaryRun run_binary(const std::vector<std::string>& args) {
    return run_binary_in(dir_, AMPX_TRAIN_BINARY, args);
  }
#endif

  fs::path dir_;
};

// ---------------------------------------------------------------- in process

TEST_F(TrainCliTest, FillsGptDefaults) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  TrainConfig& c = p.config;
  resolve_defaults(c);
  EXPECT_EQ(c.workload, "gpt");
  EXPECT_EQ(c.precision, "O2");
  EXPECT_EQ(c.batch_size, 32);
  EXPECT_EQ(c.steps, 200);
  EXPECT_EQ(c.epochs, 0);
  EXPECT_EQ(c.lr, 1e-3);
  EXPECT_EQ(c.device, "cpu");
  EXPECT_EQ(c.dtype, "bf16");
  EXPECT_EQ(c.threads, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  EXPECT_EQ(c.eval_batches, 32);
  EXPECT_EQ(c.out_dir, "runs/gpt");
  EXPECT_EQ(c.checkpoint_dir, "runs/gpt/checkpoints");
  EXPECT_EQ(c.data_dir, dir_.string());
  EXPECT_EQ(modes_of(c), std::vector<std::string>{"O2"});
}

TEST_F(TrainCliTest, FillsImageWorkloadDefaults) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed mnist = parse({"--workload", "mnist-cnn"});
  ASSERT_FALSE(mnist.code.has_value()) << mnist.err;
  resolve_defaults(mnist.config);
  EXPECT_EQ(mnist.config.batch_size, 128);
  EXPECT_EQ(mnist.config.steps, 0);
  EXPECT_EQ(mnist.config.epochs, 1);
  EXPECT_EQ(mnist.config.out_dir, "runs/mnist-cnn");
  EXPECT_EQ(mnist.config.checkpoint_dir, "runs/mnist-cnn/checkpoints");

  Parsed fashion = parse({"--workload", "fashion-mlp"});
  ASSERT_FALSE(fashion.code.has_value()) << fashion.err;
  resolve_defaults(fashion.config);
  EXPECT_EQ(fashion.config.batch_size, 256);
  EXPECT_EQ(fashion.config.steps, 0);
  EXPECT_EQ(fashion.config.epochs, 3);
}

TEST_F(TrainCliTest, KeepsGivenValuesOverDefaults) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--workload", "mnist-cnn", "--steps", "7", "--batch-size", "5", "--lr", "0.5",
                    "--threads", "3", "--out-dir", "o", "--data-dir", "d"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  resolve_defaults(p.config);
  EXPECT_EQ(p.config.steps, 7);
  EXPECT_EQ(p.config.epochs, 0);
  EXPECT_EQ(p.config.batch_size, 5);
  EXPECT_EQ(p.config.lr, 0.5);
  EXPECT_EQ(p.config.threads, 3);
  EXPECT_EQ(p.config.out_dir, "o");
  EXPECT_EQ(p.config.checkpoint_dir, "o/checkpoints");
  EXPECT_EQ(p.config.data_dir, "d");
}

TEST_F(TrainCliTest, CompareListsModesInOrder) {
  Parsed p = parse({"--compare", "fp32,O1,O2"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_EQ(modes_of(p.config), (std::vector<std::string>{"fp32", "O1", "O2"}));
}

TEST_F(TrainCliTest, CompareDropsRepeatedModes) {
  Parsed p = parse({"--compare", "O2,fp32,O2,O1,fp32"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_EQ(modes_of(p.config), (std::vector<std::string>{"O2", "fp32", "O1"}));
}

TEST_F(TrainCliTest, PrecisionGivesOneMode) {
  Parsed p = parse({"--precision", "O3"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_EQ(modes_of(p.config), std::vector<std::string>{"O3"});
}

TEST_F(TrainCliTest, HelpReturnsZero) {
  Parsed p = parse({"--help"});
  ASSERT_TRUE(p.code.has_value());
  EXPECT_EQ(*p.code, 0);
  EXPECT_TRUE(contains(p.out, {"ampx-train", "--workload", "--compare"}));
}

struct UsageError {
  std::vector<std::string> args;
  CLI::ExitCodes code;
  std::vector<std::string> message;  // parts of what CLI11 prints
};

TEST_F(TrainCliTest, RejectsBadFlagsWithUsageErrors) {
  // CLI11's own wording (2.1): "--opt: value not in {...}", "--a excludes --b".
  const std::vector<UsageError> cases = {
      {{"--precision", "O5"}, CLI::ExitCodes::ValidationError, {"--precision: O5 not in"}},
      {{"--dtype", "fp8"}, CLI::ExitCodes::ValidationError, {"--dtype: fp8 not in"}},
      {{"--workload", "imagenet"},
       CLI::ExitCodes::ValidationError,
       {"--workload: imagenet not in"}},
      {{"--steps", "0"}, CLI::ExitCodes::ValidationError, {"--steps: ", " 0 "}},
      {{"--steps", "5", "--epochs", "1"},
       CLI::ExitCodes::ExcludesError,
       {"--steps", " excludes ", "--epochs"}},
      {{"--precision", "O1", "--compare", "fp32"},
       CLI::ExitCodes::ExcludesError,
       {"--precision", " excludes ", "--compare"}},
      {{"--compare", "fp32,O9"},
       CLI::ExitCodes::ValidationError,
       {"--compare: ampx-train: unknown precision mode 'O9'"}},
      {{"--compare", "O2,O1+kahan"},
       CLI::ExitCodes::ValidationError,
       {"--compare: ampx-train: mode 'O1+kahan': kahan keeps the lost bits"}},
      {{"--bogus"}, CLI::ExitCodes::ExtrasError, {"not expected: --bogus"}},
      {{"--gpt-shape", "gpt3"}, CLI::ExitCodes::ValidationError, {"--gpt-shape: gpt3 not in"}},
      {{"--gpt-shape", "gpt2-small", "--layers", "2"},
       CLI::ExitCodes::ExcludesError,
       {"--gpt-shape", " excludes ", "--layers"}},
      {{"--diagnose", "--export-weights", "w.safetensors"},
       CLI::ExitCodes::ExcludesError,
       {"--diagnose", " excludes ", "--export-weights"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(join(c.args));
    const Parsed p = parse(c.args);
    ASSERT_TRUE(p.code.has_value());
    EXPECT_NE(*p.code, 0);
    EXPECT_EQ(*p.code, static_cast<int>(c.code));
    for (const auto& part : c.message) EXPECT_TRUE(contains(p.err, {part}));
  }
}

TEST_F(TrainCliTest, Gpt2SmallShapeIsGpt2Smalls) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--gpt-shape", "gpt2-small"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  resolve_defaults(p.config);
  EXPECT_EQ(p.config.layers, 12);
  EXPECT_EQ(p.config.d_model, 768);
  EXPECT_EQ(p.config.heads, 12);
  EXPECT_EQ(p.config.block_size, 1024);
}

TEST_F(TrainCliTest, RejectsHeadsThatDoNotDivideTheWidth) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--d-model", "100", "--heads", "3"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_EQ(error_text([&] { resolve_defaults(p.config); }),
            "ampx-train: --d-model 100 is not a multiple of --heads 3");
}

TEST_F(TrainCliTest, IgnoresTheGptShapeForImageWorkloads) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--workload", "mnist-cnn", "--d-model", "100", "--heads", "3"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_NO_THROW(resolve_defaults(p.config));
}

TEST_F(TrainCliTest, RejectsCudaWithoutADevice) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA is available";
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--device", "cuda"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_EQ(error_text([&] { resolve_defaults(p.config); }),
            std::string("ampx-train: --device cuda, but this LibTorch (") + ampx::torch_version() +
                ") sees no CUDA device");
}

TEST_F(TrainCliTest, RejectsTf32OnTheCpu) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--tf32"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_TRUE(p.config.tf32);
  EXPECT_EQ(error_text([&] { resolve_defaults(p.config); }),
            "ampx-train: --tf32 is for --device cuda (TF32 is a tensor-core format of NVIDIA "
            "GPUs); on the CPU fp32 products stay fp32");
}

TEST_F(TrainCliTest, RejectsMemoryOriginsOffTheCpu) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--memory-origins", "2", "--device", "cuda"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_EQ(p.config.memory_origins, 2);
  EXPECT_EQ(error_text([&] { resolve_defaults(p.config); }),
            "ampx-train: --memory-origins 2 is for --device cpu (ampx's tracking allocator)");
  EXPECT_TRUE(parse({"--memory-origins", "-1"}).code.has_value()) << "a negative count";
}

TEST_F(TrainCliTest, RejectsRecomputeWhereItCannotRun) {
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  EXPECT_TRUE(parse({"--recompute", "attention"}).code.has_value()) << "not a choice";
  auto refused = [&](std::vector<std::string> args) {
    Parsed p = parse(std::move(args));
    EXPECT_FALSE(p.code.has_value()) << p.err;
    return error_text([&] { resolve_defaults(p.config); });
  };
  EXPECT_EQ(refused({"--workload", "mnist-cnn", "--recompute", "blocks"}),
            "ampx-train: --recompute blocks is for the gpt workloads (gpt, gpt-nn), not "
            "--workload mnist-cnn");
  for (const std::string shard : {"grad", "full"}) {
    EXPECT_EQ(refused({"--recompute", "mlp", "--nproc", "2", "--shard", shard}),
              "ampx-train: --recompute mlp with --shard " + shard +
                  ": the sharded units gather their weights as their forward starts, and a "
                  "forward run again in backward is not one they can follow yet; use --shard "
                  "none or optimizer");
  }
  EXPECT_EQ(refused({"--recompute", "blocks", "--nproc", "2", "--shard", "optimizer"}), "");
  EXPECT_EQ(refused({"--recompute", "blocks", "--compare", "O2,fp8"}),
            "ampx-train: --recompute blocks with --precision fp8: running an FP8 layer again in "
            "backward would record its amax twice; recompute fp32, O0, O1, O2 or O3");
  EXPECT_EQ(refused({"--recompute", "none", "--workload", "mnist-cnn"}), "");
}

TEST_F(TrainCliTest, RejectsFp16OnCpuWithLibTorch1) {
  if (std::string(ampx::torch_version()).rfind("1.", 0) != 0) {
    GTEST_SKIP() << "LibTorch " << ampx::torch_version() << " has fp16 on CPU";
  }
  EnvGuard data("AMPX_DATA_DIR", dir_.c_str());
  Parsed p = parse({"--dtype", "fp16", "--compare", "fp32,O1"});
  ASSERT_FALSE(p.code.has_value()) << p.err;
  EXPECT_EQ(error_text([&] { resolve_defaults(p.config); }),
            std::string("ampx-train: --dtype fp16 on --device cpu needs LibTorch 2.x; this is ") +
                ampx::torch_version() +
                ", which has no fp16 CPU autocast or fp16 CPU matrix products. Use --dtype bf16.");
  // fp32 alone never uses the 16-bit type.
  Parsed fp32 = parse({"--dtype", "fp16", "--precision", "fp32"});
  ASSERT_FALSE(fp32.code.has_value()) << fp32.err;
  EXPECT_NO_THROW(resolve_defaults(fp32.config));
}

// ---------------------------------------------------------------- the binary

#ifdef AMPX_TRAIN_BINARY
#define AMPX_REQUIRE_BINARY()
#else
#define AMPX_REQUIRE_BINARY() GTEST_SKIP() << "the ampx-train binary was not built"
#endif

TEST_F(TrainCliTest, BinaryRejectsAnUnknownPrecision) {
  AMPX_REQUIRE_BINARY();
#ifdef AMPX_TRAIN_BINARY
  const BinaryRun r = run_binary({"--precision", "O5"});
  EXPECT_EQ(r.status, static_cast<int>(CLI::ExitCodes::ValidationError)) << r.err;
  EXPECT_TRUE(
      contains(r.err, {"--precision: O5 not in {fp32,O1,O2,O3,fp8,mxfp8,nvfp4,fp8-block,auto}"}));
#endif
}

TEST_F(TrainCliTest, BinaryNamesMissingDataAndHowToInstallIt) {
  AMPX_REQUIRE_BINARY();
#ifdef AMPX_TRAIN_BINARY
  const fs::path data = folder("empty-data");
  const std::string hint = "; install the data with: scripts/install-data.sh " + data.string();
  struct Case {
    std::string workload, file;
  };
  const std::vector<Case> cases = {
      {"mnist-cnn", "MNIST file '" + (data / "mnist" / "train-images-idx3-ubyte").string()},
      {"fashion-mlp",
       "Fashion-MNIST file '" + (data / "fashion-mnist" / "train-images-idx3-ubyte.gz").string()},
      {"gpt", "Moby Dick file '" + (data / "moby-dick" / "data.txt").string()},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.workload);
    const BinaryRun r =
        run_binary({"--data-dir", data.string(), "--workload", c.workload, "--steps", "1",
                    "--threads", "1", "--out-dir", (dir_ / "out").string()});
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_TRUE(contains(r.err, {"ampx-train: " + c.file + "' not found" + hint}));
  }
#endif
}

TEST_F(TrainCliTest, BinaryRefusesToResumeWithoutACheckpoint) {
  AMPX_REQUIRE_BINARY();
#ifdef AMPX_TRAIN_BINARY
  const fs::path data = text_data(), ckpt = folder("no-checkpoint");
  std::vector<std::string> args = kTinyGpt;
  args.insert(args.end(), {"--data-dir", data.string(), "--out-dir", (dir_ / "out").string(),
                           "--checkpoint-dir", ckpt.string(), "--resume"});
  const BinaryRun r = run_binary(args);
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_TRUE(contains(
      r.err, {"ampx-train: --resume, but there is no checkpoint at '" +
              (ckpt / "checkpoint.ampx").string() + "' (--checkpoint-dir " + ckpt.string() + ")"}));
  EXPECT_TRUE(fs::is_empty(ckpt));
#endif
}

TEST_F(TrainCliTest, BinaryRefusesToOverwriteACheckpoint) {
  AMPX_REQUIRE_BINARY();
#ifdef AMPX_TRAIN_BINARY
  const fs::path data = text_data(), ckpt = dir_ / "checkpoints";
  const fs::path file = ckpt / "checkpoint.ampx";
  std::vector<std::string> args = kTinyGpt;
  args.insert(args.end(), {"--data-dir", data.string(), "--out-dir", (dir_ / "out").string(),
                           "--checkpoint-dir", ckpt.string(), "--save-every", "1"});
  const BinaryRun first = run_binary(args);
  ASSERT_EQ(first.status, 0) << first.out << first.err;
  ASSERT_TRUE(fs::exists(file)) << first.out;
  const std::string before = read_bytes(file);
  ASSERT_FALSE(before.empty());

  // Another seed: had it written, the file's bytes would differ (the same
  // seed reproduces the same checkpoint byte for byte).
  args.insert(args.end(), {"--seed", "2"});
  const BinaryRun second = run_binary(args);
  EXPECT_EQ(second.status, 1) << second.err;
  EXPECT_TRUE(contains(second.err, {"ampx-train: '" + file.string() +
                                    "' already holds a checkpoint; pass --resume to continue "
                                    "it, or choose another --checkpoint-dir"}));
  EXPECT_TRUE(read_bytes(file) == before) << "the refused run changed " << file;
#endif
}

// --compare's modes multiply their 16-bit CPU products as the parent chose
// to (AMPX_CPU_PRODUCTS unset: the parent timed them once and handed its
// choice on), not each after timing them anew, which on a loaded machine
// could choose otherwise (other sums, other speeds in one table).
TEST_F(TrainCliTest, BinaryComparisonsModesMultiplyAsTheParentChose) {
  AMPX_REQUIRE_BINARY();
#ifdef AMPX_TRAIN_BINARY
  if (!ampx::cpu_has_native_products(c10::kBFloat16)) {  // nothing is timed: always wide
    GTEST_SKIP() << "no bf16 products in LibTorch on this CPU to time";
  }
  EnvGuard unset("AMPX_CPU_PRODUCTS", nullptr);
  const fs::path data = text_data(), out = dir_ / "out";
  std::vector<std::string> args = kTinyGpt;
  args.insert(args.end(), {"--data-dir", data.string(), "--out-dir", out.string(), "--compare",
                           "fp32,O2,O1"});
  const BinaryRun r = run_binary(args);
  ASSERT_EQ(r.status, 0) << r.out << r.err;
  const auto report = nlohmann::json::parse(read_bytes(out / "compare.json"));
  const std::string parent = report.at("settings").at("cpu_products");
  ASSERT_TRUE(parent == "wide" || parent == "native") << parent;
  ASSERT_EQ(report.at("modes").size(), 3u);
  for (const auto& m : report.at("modes")) {
    const std::string used = m.at("cpu_products");
    EXPECT_EQ(used, m.at("mode") == "fp32" ? "" : parent) << m.at("mode");  // not "(timed)"
  }
#endif
}

TEST_F(TrainCliTest, BinaryHelpListsEveryFlag) {
  AMPX_REQUIRE_BINARY();
#ifdef AMPX_TRAIN_BINARY
  const BinaryRun r = run_binary({"--help"});
  EXPECT_EQ(r.status, 0) << r.err;
  for (const char* flag :
       {"--workload",       "--precision",   "--compare",          "--dtype",
        "--device",         "--threads",     "--batch-size",       "--steps",
        "--epochs",         "--lr",          "--weight-decay",     "--seed",
        "--block-size",     "--layers",      "--d-model",          "--heads",
        "--data-dir",       "--out-dir",     "--checkpoint-dir",   "--save-every",
        "--resume",         "--eval-every",  "--eval-batches",     "--log-every",
        "--metrics-format", "--progress",    "--detect-nonfinite", "--diagnose",
        "--diagnose-steps", "--range-stats", "--recompute"}) {
    EXPECT_TRUE(contains(r.out, {std::string(flag) + " "})) << flag;
  }
#endif
}

}  // namespace
