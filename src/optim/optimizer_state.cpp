// MixedPrecisionOptimizer::save / load. Keys are positions, never tensor
// identities:
//   ampx_optim_version  int (2)          ampx_optim_type  "AdamW" | "SGD" | "LAMB"
//   seed                int (uint64 bits) num_groups      int
//   state_format        "fp32" | "bf16" | "fp8" | "8bit"
//   state_block         int              kahan_summation  int (0, 1)
//   group<g>.num_params int              group<g>.lr       float
//   group<g>.param<i>.step int
//   group<g>.param<i>.{master,captured}  fp32 tensors of the param's shape
//   group<g>.param<i>.{exp_avg,exp_avg_sq}  the param's shape: fp32, or bf16 /
//                                        uint8 codes (state_format, params of
//                                        at least state_min_numel elements)
//   group<g>.param<i>.{exp_avg,exp_avg_sq}_scale  fp32 [ceil(numel / state_block)]
//   group<g>.param<i>.compensation       the param's dtype and shape (Kahan)
// each when present. Version 1 (fp32 moments, no Kahan) is read too.
// load() reads and checks everything into a copy first and swaps it in last,
// so a mismatch leaves the optimizer exactly as it was.

#include "ampx/optim/optimizer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cstring>
#include <string>

namespace ampx {
namespace optim {
namespace {

constexpr int64_t kStateVersion = 2;
constexpr int kSlots = 7;
const char* const kTensorNames[kSlots] = {"master",      "captured",      "exp_avg",
                                          "exp_avg_sq",  "exp_avg_scale", "exp_avg_sq_scale",
                                          "compensation"};

at::Tensor* slot(detail::ParamState& st, int k) {
  switch (k) {
    case 0:
      return &st.master;
    case 1:
      return &st.captured;
    case 2:
      return &st.exp_avg;
    case 3:
      return &st.exp_avg_sq;
    case 4:
      return &st.exp_avg_scale;
    case 5:
      return &st.exp_avg_sq_scale;
    default:
      return &st.compensation;
  }
}

std::string param_key(size_t g, size_t i) {
  return "group" + std::to_string(g) + ".param" + std::to_string(i);
}

c10::IValue read_value(torch::serialize::InputArchive& archive, const std::string& key,
                       const char* who) {
  c10::IValue v;
  TORCH_CHECK(archive.try_read(key, v), who, ": the archive has no '", key,
              "' (not an ampx::optim state, or a corrupt one)");
  return v;
}

int64_t read_int(torch::serialize::InputArchive& archive, const std::string& key, const char* who) {
  const auto v = read_value(archive, key, who);
  TORCH_CHECK(v.isInt(), who, ": '", key, "' should be an int, got ", v.tagKind());
  return v.toInt();
}

}  // namespace

void MixedPrecisionOptimizer::save(torch::serialize::OutputArchive& archive) const {
  archive.write("ampx_optim_version", c10::IValue(kStateVersion));
  archive.write("ampx_optim_type", c10::IValue(std::string(name())));
  int64_t seed_bits;
  std::memcpy(&seed_bits, &config_.seed, sizeof(seed_bits));
  archive.write("seed", c10::IValue(seed_bits));
  archive.write("num_groups", c10::IValue(static_cast<int64_t>(param_groups_.size())));
  archive.write("state_format", c10::IValue(std::string(state_format_name(config_.state_format))));
  archive.write("state_block", c10::IValue(config_.state_block));
  archive.write("kahan_summation", c10::IValue(static_cast<int64_t>(config_.kahan_summation)));
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto prefix = "group" + std::to_string(g);
    const auto n = param_groups_[g].params().size();
    archive.write(prefix + ".num_params", c10::IValue(static_cast<int64_t>(n)));
    archive.write(prefix + ".lr", c10::IValue(param_groups_[g].options().get_lr()));
    for (size_t i = 0; i < n; ++i) {
      detail::ParamState st =
          (g < states_.size() && i < states_[g].size()) ? states_[g][i] : detail::ParamState();
      const int64_t step =
          st.step_t.defined() ? static_cast<int64_t>(st.step_t.item<double>()) : st.step;
      archive.write(param_key(g, i) + ".step", c10::IValue(step));
      for (int k = 0; k < kSlots; ++k) {
        const auto* t = slot(st, k);
        if (t->defined()) {
          archive.write(param_key(g, i) + "." + kTensorNames[k], t->detach().cpu(),
                        /*is_buffer=*/true);
        }
      }
    }
  }
}

void MixedPrecisionOptimizer::check_slot(const at::Tensor& t, int k, const at::Tensor& param,
                                         const std::string& key, const char* who) const {
  const std::string name = key + "." + kTensorNames[k];
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape = param.sizes().vec();
  if (k == 2 || k == 3) {  // moments
    if (coded_moments(param)) {
      dtype = config_.state_format == StateFormat::kBf16 ? at::kBFloat16 : at::kByte;
    }
  } else if (k == 4 || k == 5) {  // block scales
    shape = {(param.numel() + config_.state_block - 1) / config_.state_block};
  } else if (k == 6) {
    dtype = param.scalar_type();
  }
  TORCH_CHECK(t.scalar_type() == dtype, who, ": ", name, " is ", t.scalar_type(), ", expected ",
              dtype);
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), who, ": ", name, " has shape ", t.sizes(),
              ", expected ", at::IntArrayRef(shape));
  if (k == 4 || k == 5) {
    TORCH_CHECK(at::isfinite(t).all().item<bool>() && t.ge(0).all().item<bool>(), who, ": ", name,
                " has a negative or non-finite scale");
  }
}

void MixedPrecisionOptimizer::check_saved_format(torch::serialize::InputArchive& archive,
                                                 int64_t version, const char* who) const {
  // How the state is kept: version 1 had fp32 moments and no Kahan.
  std::string format = "fp32";
  int64_t block = config_.state_block, kahan_saved = 0;
  if (version >= 2) {
    const auto f = read_value(archive, "state_format", who);
    TORCH_CHECK(f.isString(), who, ": 'state_format' should be a string, got ", f.tagKind());
    format = f.toStringRef();
    block = read_int(archive, "state_block", who);
    kahan_saved = read_int(archive, "kahan_summation", who);
  }
  const std::string this_format = state_format_name(config_.state_format);
  TORCH_CHECK(format == this_format, who, ": the state was saved with state_format ", format,
              ", this optimizer has state_format ", this_format);
  TORCH_CHECK(!block_scaled() || block == config_.state_block, who,
              ": the state was saved with state_block ", block, ", this optimizer has state_block ",
              config_.state_block);
  TORCH_CHECK((kahan_saved != 0) == config_.kahan_summation, who,
              ": the state was saved with kahan_summation(", kahan_saved != 0 ? "true" : "false",
              "), this optimizer has kahan_summation(", config_.kahan_summation ? "true" : "false",
              ")");
}

void MixedPrecisionOptimizer::load(torch::serialize::InputArchive& archive) {
  const std::string who_s = std::string("ampx::optim::") + name() + "::load";
  const char* who = who_s.c_str();
  const int64_t version = read_int(archive, "ampx_optim_version", who);
  TORCH_CHECK(version == 1 || version == kStateVersion, who, ": state version ", version,
              " is not supported (this build reads versions 1 and ", kStateVersion, ")");
  const auto type = read_value(archive, "ampx_optim_type", who);
  TORCH_CHECK(type.isString() && type.toStringRef() == name(), who, ": the state was saved by ",
              type.isString() ? "ampx::optim::" + type.toStringRef() : std::string("?"),
              ", not ampx::optim::", name());
  const int64_t seed_bits = read_int(archive, "seed", who);
  check_saved_format(archive, version, who);
  const int64_t num_groups = read_int(archive, "num_groups", who);
  TORCH_CHECK(num_groups == static_cast<int64_t>(param_groups_.size()), who, ": the state has ",
              num_groups, " param groups, this optimizer has ", param_groups_.size());

  std::vector<std::vector<detail::ParamState>> loaded(param_groups_.size());
  std::vector<double> lrs(param_groups_.size());
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    const auto prefix = "group" + std::to_string(g);
    const auto& params = param_groups_[g].params();
    const int64_t n = read_int(archive, prefix + ".num_params", who);
    TORCH_CHECK(n == static_cast<int64_t>(params.size()), who, ": group ", g, " of the state has ",
                n, " params, this optimizer's has ", params.size());
    const auto lr = read_value(archive, prefix + ".lr", who);
    TORCH_CHECK(lr.isDouble(), who, ": '", prefix, ".lr' should be a float");
    lrs[g] = lr.toDouble();
    loaded[g].resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) {
      auto& st = loaded[g][i];
      const auto key = param_key(g, i);
      st.step = read_int(archive, key + ".step", who);
      TORCH_CHECK(st.step >= 0, who, ": ", key, ".step is ", st.step, ", must be >= 0");
      for (int k = 0; k < kSlots; ++k) {
        at::Tensor t;
        if (!archive.try_read(key + "." + kTensorNames[k], t, /*is_buffer=*/true)) {
          continue;
        }
        check_slot(t, k, params[i], key, who);
        *slot(st, k) = t.to(params[i].device()).contiguous().clone();
      }
      TORCH_CHECK(!(st.master.defined() && !config_.master_weights), who, ": ", key,
                  " has an fp32 master but this optimizer has master_weights(false)");
      TORCH_CHECK(st.exp_avg_sq.defined() == (st.step > 0 && uses_exp_avg_sq()), who, ": ", key,
                  (uses_exp_avg_sq() ? " lacks exp_avg_sq or has it before its first step"
                                     : " has an exp_avg_sq this optimizer does not use"));
      const bool scaled = block_scaled() && coded_moments(params[i]);
      TORCH_CHECK(st.exp_avg_scale.defined() == (scaled && st.exp_avg.defined()) &&
                      st.exp_avg_sq_scale.defined() == (scaled && st.exp_avg_sq.defined()),
                  who, ": ", key, "'s block scales do not match its moments");
      TORCH_CHECK(st.compensation.defined() == (st.step > 0 && kahan(params[i])), who, ": ", key,
                  (kahan(params[i]) ? " lacks its Kahan compensation"
                                    : " has a Kahan compensation this param does not keep"));
    }
  }
  uint64_t seed;
  std::memcpy(&seed, &seed_bits, sizeof(seed));
  // Everything checked: commit.
  states_ = std::move(loaded);
  config_.seed = seed;  // stochastic rounding continues the saved stream
  for (size_t g = 0; g < param_groups_.size(); ++g) {
    param_groups_[g].options().set_lr(lrs[g]);
  }
}

}  // namespace optim
}  // namespace ampx
