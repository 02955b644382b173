#include "rank_agreement.h"

#include "dist/rank_values.h"  // ampx's src/: which ranks hold which value

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>

namespace ampx::train {

nlohmann::json run_fingerprint(const nlohmann::json& identity, const torch::nn::Module& model,
                               int64_t steps) {
  nlohmann::json out = identity;
  out["steps"] = steps;
  int64_t values = 0;
  std::map<std::string, int64_t> dtypes;  // "BFloat16" -> tensors
  const auto parameters = model.parameters();
  for (const auto& p : parameters) {
    values += p.numel();
    ++dtypes[c10::toString(p.scalar_type())];
  }
  std::string kinds;
  for (const auto& [dtype, n] : dtypes) {
    kinds += (kinds.empty() ? "" : ", ") + std::to_string(n) + " " + dtype;
  }
  out["parameters"] = std::to_string(parameters.size()) + " tensors of " + std::to_string(values) +
                      " values (" + kinds + ")";
  return out;
}

std::string disagreement(const std::vector<nlohmann::json>& by_rank) {
  std::set<std::string> keys;
  for (const auto& f : by_rank) {
    for (auto it = f.begin(); it != f.end(); ++it) keys.insert(it.key());
  }
  std::string out;
  for (const auto& key : keys) {
    // value -> ranks, in the order of first appearance
    std::vector<std::string> values;  // rank r's at r
    for (const auto& fingerprint : by_rank) {
      const auto it = fingerprint.find(key);
      values.push_back(it == fingerprint.end() ? "(none)"
                       : it->is_string()       ? it->get<std::string>()
                                               : it->dump());
    }
    const auto seen = ampx::detail::ranks_by_value(values);
    if (seen.size() < 2) continue;
    out += (out.empty() ? "" : "; ") + key + ": ";
    for (size_t k = 0; k < seen.size(); ++k) {
      out += (k == 0 ? "" : " vs ") + seen[k].first + " on rank(s) " + seen[k].second;
    }
  }
  return out;
}

void check_ranks_agree(const ampx::dist::ProcessGroup& group, const nlohmann::json& fingerprint) {
  std::vector<nlohmann::json> by_rank;
  for (const auto& text : group.all_gather_bytes(fingerprint.dump())) {
    by_rank.push_back(nlohmann::json::parse(text));
  }
  const std::string differs = disagreement(by_rank);
  TORCH_CHECK(differs.empty(),
              "ampx-train: the ranks of this run were started with different settings (every "
              "rank must get the same command line and data): ",
              differs, " (this is rank ", group.rank(), " of ", group.world_size(), ")");
}

std::string from_rank0(const ampx::dist::ProcessGroup* group,
                       const std::function<std::string()>& fn) {
  if (group == nullptr) return fn();
  std::string bytes;
  int64_t failed = 0;
  if (group->rank() == 0) {
    try {
      bytes = fn();
    } catch (const c10::Error& e) {
      bytes = e.what_without_backtrace();
      failed = 1;
    }
  }
  auto header = torch::tensor({failed, static_cast<int64_t>(bytes.size())}, torch::kLong);
  group->broadcast(header);
  failed = header[0].item<int64_t>();
  auto data = torch::empty({header[1].item<int64_t>()}, torch::kByte);
  if (group->rank() == 0 && !bytes.empty())
    std::memcpy(data.data_ptr(), bytes.data(), bytes.size());
  if (data.numel() > 0) group->broadcast(data);
  bytes.assign(static_cast<const char*>(data.data_ptr()), static_cast<size_t>(data.numel()));
  TORCH_CHECK(!failed, group->rank() == 0 ? "" : "rank 0: ", bytes);
  return bytes;
}

std::string weights_checksum(torch::nn::Module& model) {
  return weights_checksum(model.parameters());
}

namespace {

constexpr uint64_t kFnvStart = 1469598103934665603ull, kFnvPrime = 1099511628211ull;

uint64_t fnv1a(uint64_t h, const unsigned char* bytes, size_t n) {
  for (size_t i = 0; i < n; ++i) h = (h ^ bytes[i]) * kFnvPrime;
  return h;
}

}  // namespace

uint64_t tensor_hash(const torch::Tensor& t) {
  const auto c = t.detach().to(torch::kCPU).contiguous();
  return fnv1a(kFnvStart, static_cast<const unsigned char*>(c.data_ptr()),
               static_cast<size_t>(c.numel()) * c.element_size());
}

std::string weights_checksum(const std::vector<uint64_t>& hashes) {
  uint64_t h = kFnvStart;
  for (const uint64_t t : hashes) h = fnv1a(h, reinterpret_cast<const unsigned char*>(&t), 8);
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(h));
  return text;
}

std::string weights_checksum(const std::vector<torch::Tensor>& tensors) {
  std::vector<uint64_t> hashes;
  for (const auto& t : tensors) hashes.push_back(tensor_hash(t));
  return weights_checksum(hashes);
}

}  // namespace ampx::train
