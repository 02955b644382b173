// GradScaler state: PyTorch-compatible state dicts, LibTorch archives, files
// exchanged with Python's torch, bitwise resume, and the update rule over long
// random overflow patterns against tests/reference/torch_reference.py.

#include "ampx/detail/compat.h"
#include "ampx/grad_scaler.h"
#include "ampx/serialize.h"

#include "../test_util.h"

#include <torch/torch.h>
#include <torch/version.h>

#include <cstdio>
#include <fstream>
#include <limits>

namespace {

using ampx::GradScaler;
using ampx::GradScalerOptions;
using ampx::StateDict;
using ampx::test::error_text;
using ::testing::HasSubstr;
using ::testing::StartsWith;

TEST(GradScalerStateTest, StateDictHasPyTorchsKeysAndTypes) {
  GradScaler s(GradScalerOptions().init_scale(512.0).growth_interval(11));
  const auto d = s.state_dict();
  EXPECT_EQ(d.at("scale").toDouble(), 512.0);
  EXPECT_EQ(d.at("growth_factor").toDouble(), 2.0);
  EXPECT_EQ(d.at("backoff_factor").toDouble(), 0.5);
  EXPECT_EQ(d.at("growth_interval").toInt(), 11);
  EXPECT_EQ(d.at("_growth_tracker").toInt(), 0);
  EXPECT_EQ(d.at("hysteresis").toInt(), 1);
  EXPECT_TRUE(d.at("min_scale").isNone());
  EXPECT_TRUE(d.at("max_scale").isNone());  // no ceiling, as PyTorch
  EXPECT_EQ(d.at("_ampx_state_version").toInt(), 1);
}

TEST(GradScalerStateTest, EmptyStateDictIsPyTorchsError) {
  GradScaler s;
  EXPECT_EQ(error_text([&] { s.load_state_dict(StateDict()); }),
            "The source state dict is empty, possibly because it was saved from a disabled "
            "instance of GradScaler.");
}

TEST(GradScalerStateTest, BadStateDictNamesTheKeyAndChangesNothing) {
  GradScaler s(GradScalerOptions().init_scale(256.0));
  auto d = GradScaler(GradScalerOptions().init_scale(8.0)).state_dict();
  d.erase("growth_interval");
  auto text = error_text([&] { s.load_state_dict(d); });
  EXPECT_THAT(text, HasSubstr("missing key 'growth_interval'"));
  d = GradScaler(GradScalerOptions().init_scale(8.0)).state_dict();
  d["growth_interval"] = c10::IValue(std::string("often"));
  text = error_text([&] { s.load_state_dict(d); });
  EXPECT_THAT(text, HasSubstr("'growth_interval' must be an int, got String"));
  d = GradScaler(GradScalerOptions().init_scale(8.0)).state_dict();
  d["scale"] = std::numeric_limits<double>::infinity();
  text = error_text([&] { s.load_state_dict(d); });
  EXPECT_THAT(text, HasSubstr("'scale' must be finite and > 0, got inf"));
  d = GradScaler(GradScalerOptions().init_scale(8.0)).state_dict();
  d["_ampx_state_version"] = int64_t(99);
  text = error_text([&] { s.load_state_dict(d); });
  EXPECT_THAT(text, HasSubstr("'_ampx_state_version' is 99"));
  EXPECT_EQ(s.get_scale(), 256.0) << "a rejected state dict must change nothing";
}

TEST(GradScalerStateTest, LoadsBeforeAndAfterTheScaleExists) {
  GradScaler src(GradScalerOptions().init_scale(64.0).growth_factor(4.0).hysteresis(3));
  GradScaler before_init, after_init;
  after_init.scale(torch::ones({}));
  before_init.load_state_dict(src.state_dict());
  after_init.load_state_dict(src.state_dict());
  for (auto* s : {&before_init, &after_init}) {
    EXPECT_EQ(s->get_scale(), 64.0);
    EXPECT_EQ(s->get_growth_factor(), 4.0);
    EXPECT_EQ(s->get_hysteresis(), 3);
    EXPECT_EQ(s->get_hysteresis_tracker(), 3);
  }
  EXPECT_EQ(before_init.scale(torch::ones({})).item<float>(), 64.f);
}

// ---- bitwise resume through a LibTorch archive

struct TrainingRun {
  torch::nn::Sequential net{torch::nn::Linear(6, 12), torch::nn::Tanh(), torch::nn::Linear(12, 1)};
  torch::optim::SGD opt{net->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9)};
  GradScaler scaler{GradScalerOptions().init_scale(1024.0).growth_interval(3).hysteresis(2)};
  std::vector<double> losses;

  void train(int from, int to) {
    for (int step = from; step < to; ++step) {
      auto g = at::detail::createCPUGenerator(100 + step);
      auto x = at::randn({16, 6}, g);
      auto y = x.cos().sum(1, true);
      opt.zero_grad();
      auto loss = torch::mse_loss(net->forward(x), y);
      losses.push_back(loss.item<double>());
      scaler.scale(loss).backward();
      if (step == 5 || step == 6 || step == 7 || step == 17) {  // overflows
        net->parameters()[0].mutable_grad().view(-1)[1] = std::numeric_limits<float>::infinity();
      }
      scaler.step(opt);
      scaler.update();
    }
  }
};

TEST(GradScalerStateTest, ArchiveRoundTripResumesBitwise) {
  torch::manual_seed(1);
  TrainingRun straight;
  torch::manual_seed(1);
  TrainingRun first;
  straight.train(0, 30);
  first.train(0, 14);
  const std::string path = ::testing::TempDir() + "ampx_resume.pt";
  {
    torch::serialize::OutputArchive archive;
    first.net->save(archive);
    first.opt.save(archive);
    archive << first.scaler;
    archive.save_to(path);
  }
  torch::manual_seed(999);  // a different init that the load must overwrite
  TrainingRun resumed;
  {
    torch::serialize::InputArchive archive;
    archive.load_from(path);
    resumed.net->load(archive);
    resumed.opt.load(archive);
    archive >> resumed.scaler;
  }
  EXPECT_EQ(resumed.scaler.get_scale(), first.scaler.get_scale());
  EXPECT_EQ(resumed.scaler.get_growth_tracker(), first.scaler.get_growth_tracker());
  EXPECT_EQ(resumed.scaler.get_hysteresis_tracker(), first.scaler.get_hysteresis_tracker());
  resumed.losses = first.losses;
  resumed.train(14, 30);
  EXPECT_EQ(resumed.losses, straight.losses);
  EXPECT_EQ(resumed.scaler.get_scale(), straight.scaler.get_scale());
  EXPECT_EQ(resumed.scaler.get_growth_tracker(), straight.scaler.get_growth_tracker());
  const auto a = straight.net->parameters(), b = resumed.net->parameters();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(torch::equal(a[i], b[i])) << "param " << i;
  std::remove(path.c_str());
}

TEST(GradScalerStateTest, ArchiveWithoutScalerStateIsAClearError) {
  const std::string path = ::testing::TempDir() + "ampx_noscaler.pt";
  torch::serialize::OutputArchive out;
  out.write("something", torch::ones({1}));
  out.save_to(path);
  torch::serialize::InputArchive in;
  in.load_from(path);
  GradScaler s;
  const auto text = error_text([&] { in >> s; });
  EXPECT_THAT(text, HasSubstr("holds no GradScaler state"));
  std::remove(path.c_str());
}

// ---- files exchanged with Python's torch

TEST(GradScalerStateTest, LoadsAStateDictSavedByPythonTorch) {
  const auto expected = ampx::test::load_reference("python_scaler_state.json");
  ASSERT_FALSE(expected.is_null());
  GradScaler s(GradScalerOptions().max_scale(1e6));
  s.load_state_dict(ampx::load_state_dict(ampx::test::reference_dir() + "/python_scaler_state.pt"));
  EXPECT_EQ(s.get_scale(), expected["scale"].get<double>());
  EXPECT_EQ(s.get_growth_factor(), expected["growth_factor"].get<double>());
  EXPECT_EQ(s.get_backoff_factor(), expected["backoff_factor"].get<double>());
  EXPECT_EQ(s.get_growth_interval(), expected["growth_interval"].get<int64_t>());
  EXPECT_EQ(s.get_growth_tracker(), expected["_growth_tracker"].get<int64_t>());
  // ampx's own keys were absent: ours are kept.
  EXPECT_EQ(s.get_hysteresis(), 1);
  EXPECT_EQ(s.get_max_scale().value(), 1e6);
}

TEST(GradScalerStateTest, SavedFileRoundTripsAndCorruptFilesAreRejected) {
  const std::string path = ::testing::TempDir() + "ampx_scaler_state.pt";
  GradScaler s(GradScalerOptions().init_scale(32.0).min_scale(2.0));
  ampx::save_state_dict(s.state_dict(), path);
  GradScaler t;
  t.load_state_dict(ampx::load_state_dict(path));
  EXPECT_EQ(t.get_scale(), 32.0);
  EXPECT_EQ(t.get_min_scale().value(), 2.0);

  // Truncate a copy: a clear error naming the file, the original untouched.
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string bad = ::testing::TempDir() + "ampx_truncated.pt";
  std::ofstream(bad, std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  auto text = error_text([&] { ampx::load_state_dict(bad); });
  EXPECT_THAT(text, HasSubstr("'" + bad + "' is not a readable torch.save file"));
  text = error_text([&] { ampx::load_state_dict(bad + ".missing"); });
  EXPECT_THAT(text, HasSubstr("cannot open"));
  std::remove(path.c_str());
  std::remove(bad.c_str());
}

// ---- the update rule over long random overflow patterns

// Rules torch.amp.GradScaler can run: PyTorch has no hysteresis and no bounds.
bool torch_expressible(const nlohmann::json& rule) {
  return rule["hysteresis"].get<int64_t>() == 1 && rule["min_scale"].is_null() &&
         rule["max_scale"].is_null();
}

// Where the reference script must have driven torch.amp.GradScaler itself:
// PyTorch runs it on the CPU from 2.3 on.
constexpr bool kTorchHasCpuScaler = AMPX_TORCH_AT_LEAST(2, 3);

// A rule PyTorch can express is built from PyTorch's four arguments alone, so
// ampx's defaults for the rest (hysteresis, bounds) are under test too.
GradScalerOptions options_for(const nlohmann::json& rule) {
  auto opts = GradScalerOptions()
                  .init_scale(rule["init_scale"].get<double>())
                  .growth_factor(rule["growth_factor"].get<double>())
                  .backoff_factor(rule["backoff_factor"].get<double>())
                  .growth_interval(rule["growth_interval"].get<int64_t>());
  if (torch_expressible(rule)) return opts;
  auto bound = [](const nlohmann::json& v) {
    return v.is_null() ? c10::nullopt : c10::optional<double>(v.get<double>());
  };
  return opts.hysteresis(rule["hysteresis"].get<int64_t>())
      .min_scale(bound(rule["min_scale"]))
      .max_scale(bound(rule["max_scale"]));
}

TEST(GradScalerStateTest, UpdateRuleMatchesReferenceOverLongRandomSequences) {
  const auto ref = ampx::test::load_reference("scaler_sequences.json");
  ASSERT_FALSE(ref.is_null());
  ASSERT_GE(ref["cases"].size(), 20u);
  // The reference must come from the torch that matches this LibTorch, and on
  // 2.3+ every case PyTorch can express must have been checked against it.
  const std::string version = ref["torch_version"].get<std::string>();
  const std::string expected_prefix =
      std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR) + ".";
  ASSERT_THAT(version, StartsWith(expected_prefix))
      << "reference made by torch " << version << " for LibTorch " << TORCH_VERSION;
  ASSERT_EQ(ref["torch_scaler_used"].get<bool>(), kTorchHasCpuScaler) << version;
  size_t long_default_cases = 0;
  for (const auto& c : ref["cases"]) {
    const auto& rule = c["rule"];
    const bool checked = c["checked_against_torch"].get<bool>();
    ASSERT_EQ(checked, kTorchHasCpuScaler && torch_expressible(rule))
        << "torch.amp.GradScaler check missing or unexpected for " << rule.dump();
    const auto& found = c["found_inf"];
    const auto& expected = c["expected"];
    if (torch_expressible(rule) && found.size() >= 10000) ++long_default_cases;

    GradScaler scaler(options_for(rule));
    auto p = torch::zeros({3}, torch::requires_grad());
    torch::optim::SGD opt({p}, 0.0);
    for (size_t step = 0; step < found.size(); ++step) {
      scaler.scale(torch::ones({}));
      p.mutable_grad() = torch::full({3}, found[step].get<int>() ? INFINITY : 1.0f);
      scaler.step(opt);
      scaler.update();
      ASSERT_EQ(scaler.get_scale(), expected[step][0].get<double>())
          << "step " << step << " of " << rule.dump();
      ASSERT_EQ(scaler.get_growth_tracker(), expected[step][1].get<int64_t>()) << step;
      ASSERT_EQ(scaler.get_hysteresis_tracker(), expected[step][2].get<int64_t>()) << step;
    }
  }
  // 10^4-step sequences that climb past 2^24 and 2^64 with default options.
  EXPECT_GE(long_default_cases, 5u);
}

}  // namespace
