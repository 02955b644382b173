// The optimizer's state as a safetensors file (ampx/optim/state_file.h):
// ampx's own round trip in every masters / moments combination, the
// refusals, and torchao's AdamW8bit / AdamWFp8 states loaded and stepped
// (tests/reference/optim_state_interop.py, the wheel leg).

#include "ampx/optim.h"
#include "ampx/optim/state_file.h"
#include "ampx/safetensors.h"

#include "../test_util.h"

#include <torch/torch.h>

#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace {
namespace state_file_test {  // (unity builds: apart from the other tests' helpers)

namespace aopt = ampx::optim;
namespace fs = std::filesystem;

/// Parameters by name, as a model holds them.
struct NamedImpl : torch::nn::Module {
  NamedImpl(const std::map<std::string, torch::Tensor>& values) {
    for (const auto& [name, v] : values) register_parameter(name, v.clone());
  }
};
TORCH_MODULE(Named);

/// A bf16 model of a 64 x 128 weight (coded moments) and a 64 bias (fp32
/// moments), its optimizer as `options` says, stepped `steps` times on
/// seeded gradients (the step count seeds them).
struct Trained {
  Named model;
  std::unique_ptr<aopt::AdamW> opt;
  Trained(const aopt::AdamWOptions& options, int steps, torch::ScalarType dtype)
      : model([&] {
          torch::manual_seed(1);
          return Named(
              std::map<std::string, torch::Tensor>{{"w", (torch::randn({64, 128}) * 0.1).to(dtype)},
                                                   {"b", (torch::randn({64}) * 0.1).to(dtype)}});
        }()),
        opt(std::make_unique<aopt::AdamW>(model->parameters(), options)) {
    for (int t = 0; t < steps; ++t) step(t);
  }
  void step(int t) {
    torch::manual_seed(100 + t);
    for (auto& p : model->parameters()) p.mutable_grad() = torch::randn_like(p);
    opt->step();
  }
};

std::string temp_path(const std::string& name) {
  return (fs::temp_directory_path() / ("ampx_state_file_" + name + ".safetensors")).string();
}

/// Every entry of `a` equals `b`'s of the same name, bit for bit.
void expect_same(const aopt::OptimizerStateTensors& a, const aopt::OptimizerStateTensors& b) {
  EXPECT_EQ(a.metadata, b.metadata);
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (const auto& [name, t] : a.tensors) {
    ASSERT_EQ(b.tensors.count(name), 1u) << name;
    const auto& u = b.tensors.at(name);
    EXPECT_EQ(t.scalar_type(), u.scalar_type()) << name;
    const auto bytes = [](const torch::Tensor& x) { return x.reshape({-1}).view(torch::kByte); };
    EXPECT_TRUE(t.sizes() == u.sizes() && torch::equal(bytes(t), bytes(u))) << name;
  }
}

// Saved after three steps and loaded into a new optimizer over the same
// weights, every combination of masters and moments takes the next two
// steps to the same weights and state bit for bit (stochastic rounding
// continues its stream from the saved seed). The file holds the moments as
// kept: 8-bit codes of the weight's shape with a scale per 256, the bias's
// (64 elements) in float32, the maps beside them.
TEST(OptimStateFileTest, EveryMastersAndMomentsCombinationResumesBitForBit) {
  struct Case {
    const char* name;
    bool masters, kahan, stochastic;
  };
  for (const Case c : {Case{"fp32 masters", true, false, false}, Case{"kahan", false, true, false},
                       Case{"stochastic", false, false, true}}) {
    for (const auto format : {aopt::StateFormat::kFp32, aopt::StateFormat::kBf16,
                              aopt::StateFormat::kFp8, aopt::StateFormat::kInt8}) {
      SCOPED_TRACE(std::string(c.name) + ", " + aopt::state_format_name(format));
      const auto options = aopt::AdamWOptions(1e-2)
                               .weight_decay(0.01)
                               .master_weights(c.masters)
                               .kahan_summation(c.kahan)
                               .stochastic_rounding(c.stochastic)
                               .seed(7)
                               .state_format(format);
      Trained a(options, 3, torch::kBFloat16);
      const auto path = temp_path("resume");
      aopt::save_optimizer_safetensors(*a.opt, *a.model, path);
      Trained b(aopt::AdamWOptions(options).seed(99), 0, torch::kBFloat16);
      {
        torch::NoGradGuard no_grad;
        for (const auto& item : a.model->named_parameters()) {
          b.model->named_parameters()[item.key()].copy_(item.value());
        }
      }
      aopt::load_optimizer_safetensors(*b.opt, *b.model, path);
      fs::remove(path);
      expect_same(b.opt->state_tensors(aopt::param_names(*b.opt, *b.model)),
                  a.opt->state_tensors(aopt::param_names(*a.opt, *a.model)));
      for (int t = 3; t < 5; ++t) {
        a.step(t);
        b.step(t);
      }
      for (const auto& item : a.model->named_parameters()) {
        EXPECT_TRUE(torch::equal(item.value(), b.model->named_parameters()[item.key()]))
            << item.key();
      }
      expect_same(b.opt->state_tensors(aopt::param_names(*b.opt, *b.model)),
                  a.opt->state_tensors(aopt::param_names(*a.opt, *a.model)));
    }
  }
  Trained a(aopt::AdamWOptions(1e-2).state_format(aopt::StateFormat::kInt8), 2, torch::kBFloat16);
  const auto s = a.opt->state_tensors(aopt::param_names(*a.opt, *a.model));
  EXPECT_EQ(s.metadata.at("state_format"), "8bit");
  EXPECT_EQ(s.tensors.at("w.step").item<int64_t>(), 2);
  EXPECT_EQ(s.tensors.at("w.exp_avg").scalar_type(), torch::kByte);
  EXPECT_EQ(s.tensors.at("w.exp_avg").sizes(), torch::IntArrayRef({64, 128}));
  EXPECT_EQ(s.tensors.at("w.exp_avg_sq.scale").sizes(), torch::IntArrayRef({32}));
  EXPECT_EQ(s.tensors.at("w.master").scalar_type(), torch::kFloat);
  EXPECT_EQ(s.tensors.at("b.exp_avg").scalar_type(), torch::kFloat);
  EXPECT_EQ(s.tensors.at("ampx.map_signed").sizes(), torch::IntArrayRef({256}));
  EXPECT_EQ(s.tensors.count("b.exp_avg.scale"), 0u);
}

// A file that is not this optimizer's is refused, naming what differs, and
// the optimizer keeps its state: another optimizer, codes of another
// state_format or state_block, an entry of no param, a moment without its
// step, a negative scale, a wrong shape.
TEST(OptimStateFileTest, AFileNotThisOptimizersIsRefusedNamingItAndChangesNothing) {
  Trained a(aopt::AdamWOptions(1e-2).state_format(aopt::StateFormat::kInt8), 2, torch::kBFloat16);
  const auto names = aopt::param_names(*a.opt, *a.model);
  const auto good = a.opt->state_tensors(names);
  Trained fp8(aopt::AdamWOptions(1e-2).state_format(aopt::StateFormat::kFp8), 1, torch::kBFloat16);
  const auto fp8_before = fp8.opt->state_tensors(names);
  const auto refused = [&](aopt::AdamW& opt, const aopt::OptimizerStateTensors& s) {
    const auto before = opt.state_tensors(names);
    const std::string error = ampx::test::error_text([&] { opt.load_state_tensors(s, names); });
    expect_same(opt.state_tensors(names), before);
    return error;
  };
  using testing::HasSubstr;
  EXPECT_THAT(refused(*fp8.opt, good),
              HasSubstr("w.exp_avg is codes of state_format 8bit, this optimizer has "
                        "state_format fp8"));
  Trained block128(aopt::AdamWOptions(1e-2).state_format(aopt::StateFormat::kInt8).state_block(128),
                   1, torch::kBFloat16);
  EXPECT_THAT(refused(*block128.opt, good),
              HasSubstr("is codes of state_block 256, this optimizer has state_block 128"));
  auto other = good;
  other.metadata["optimizer"] = "SGD";
  EXPECT_THAT(refused(*a.opt, other), HasSubstr("the state is of SGD, this optimizer is AdamW"));
  other = good;
  other.tensors["x.exp_avg"] = other.tensors.at("b.exp_avg");
  EXPECT_THAT(refused(*a.opt, other), HasSubstr("entry 'x.exp_avg' is of no param"));
  other = good;
  other.tensors.erase("w.step");
  EXPECT_THAT(refused(*a.opt, other), HasSubstr("w has state but no 'w.step'"));
  other = good;
  other.tensors["w.exp_avg.scale"] = -other.tensors.at("w.exp_avg.scale");
  EXPECT_THAT(refused(*a.opt, other), HasSubstr("w.exp_avg.scale has a negative or non-finite"));
  other = good;
  other.tensors["b.exp_avg"] = torch::zeros({65});
  EXPECT_THAT(refused(*a.opt, other), HasSubstr("b.exp_avg has shape [65], expected [64]"));
  other = good;
  other.metadata["format"] = "something else";
  EXPECT_THAT(refused(*a.opt, other), HasSubstr("format 'something else' is not"));
  // The file's path leads the message of a load from a file.
  const auto path = temp_path("refused");
  ampx::save_safetensors(good.tensors, path, good.metadata);
  EXPECT_THAT(
      ampx::test::error_text([&] { aopt::load_optimizer_safetensors(*fp8.opt, *fp8.model, path); }),
      HasSubstr(path + ": ampx::optim::AdamW::load_state_tensors"));
  fs::remove(path);
  expect_same(fp8.opt->state_tensors(names), fp8_before);
}

// torchao's AdamW8bit and AdamWFp8 states after three steps, written by
// tools/optim_state_torchao.py (tests/reference/optim_state_interop.py),
// load into ampx's AdamW of the same format over the same float32
// weights: the quantized weight's codes and scales as they were (ampx's
// own file of them holds the same bytes), its moments torchao's within the
// maps' 2 ulps; the 4100-element parameter, whose moments torchao keeps in
// float32, encoded in ampx's blocks; the bias's float32 as they were. The
// fourth step then gives torchao's weights within 1e-6 (the quantized
// weight and the bias: float32 arithmetic in another order) and within a
// tenth of the step's size for the parameter ampx codes and torchao does
// not (its moments rounded to 8 bits: 3% and 5% of the step here).
TEST(OptimStateFileTest, TorchaosAdamW8bitAndFp8StatesLoadAndStepAsTorchaos) {
  const auto ref = ampx::test::load_reference("optim_interop.json");
  if (ref.is_null() || ref["torchao"].is_null()) {
    GTEST_SKIP() << "no torchao reference on this leg: "
                 << (ref.is_null() ? std::string("none written")
                                   : ref["reason"].get<std::string>());
  }
  for (const std::string kind : {"8bit", "fp8"}) {
    SCOPED_TRACE(kind);
    const auto dir = ampx::test::reference_dir() + "/optim_interop_" + kind;
    const auto expected = ampx::read_safetensors(dir + "_reference.safetensors");
    std::map<std::string, torch::Tensor> start;
    for (const std::string n : {"w", "odd", "b"}) start[n] = expected.at(n + ".param3");
    Named model(start);
    const auto format = aopt::state_format_from_name(kind);
    aopt::AdamW opt(model->parameters(), aopt::AdamWOptions(1e-2)
                                             .betas({0.9, 0.999})
                                             .eps(1e-8)
                                             .weight_decay(0.01)
                                             .state_format(format));
    aopt::load_optimizer_safetensors(opt, *model, dir + ".safetensors");
    const auto theirs = ampx::read_safetensors(dir + ".safetensors");
    const auto ours = opt.state_tensors(aopt::param_names(opt, *model)).tensors;
    for (const std::string e : {"w.exp_avg", "w.exp_avg.scale", "w.exp_avg_sq",
                                "w.exp_avg_sq.scale", "b.exp_avg", "b.exp_avg_sq", "w.step"}) {
      EXPECT_TRUE(torch::equal(ours.at(e), theirs.at(e))) << e;
    }
    EXPECT_EQ(ours.at("odd.exp_avg").scalar_type(), torch::kByte);  // coded here, not there
    const auto params = model->named_parameters();
    for (const std::string n : {"w", "odd", "b"}) {
      const auto& p = params[n];
      EXPECT_EQ(opt.step_count(p), 3);
      for (const std::string m : {"exp_avg", "exp_avg_sq"}) {
        const auto mine = m == "exp_avg" ? opt.exp_avg(p) : opt.exp_avg_sq(p);
        const torch::Tensor torchaos = expected.at(n + "." + m + "3");
        const auto gap = (mine - torchaos).abs().max().item<double>();
        const double largest = torchaos.abs().max().item<double>();
        if (n == "odd") {  // ampx's blocks: within the format's rounding of each block
          EXPECT_LE(gap, (kind == "fp8" ? 0.07 : 0.1) * largest) << n << "." << m;
        } else {
          EXPECT_LE(gap, 3e-7 * largest) << n << "." << m;
        }
      }
      p.mutable_grad() = expected.at(n + ".grad4").clone();
    }
    opt.step();
    for (const std::string n : {"w", "odd", "b"}) {
      const torch::Tensor before = expected.at(n + ".param3");
      const torch::Tensor after = expected.at(n + ".param4");
      const double stride = (after - before).abs().max().item<double>();
      const double gap = (params[n] - after).abs().max().item<double>();
      EXPECT_LE(gap, n == "odd" ? 0.1 * stride : 1e-6) << n << " after the fourth step";
      RecordProperty(kind + "_" + n + "_gap", std::to_string(gap));
    }
  }
}

}  // namespace state_file_test
}  // namespace
