// What the data-parallel wrappers share (model_check.h).

#include "model_check.h"

#include "process_group_impl.h"
#include "rank_values.h"

#include <c10/util/Exception.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {

std::vector<std::pair<std::string, std::string>> describe_module(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, std::string>> out;
  const auto tensor = [](const at::Tensor& t) {
    std::ostringstream s;
    s << t.scalar_type() << " " << t.sizes() << " on "
      << c10::DeviceTypeName(t.device().type(), true);
    return s.str();
  };
  for (const auto& p : module.named_parameters()) {
    out.emplace_back("parameter '" + p.key() + "'",
                     tensor(p.value()) + (p.value().requires_grad() ? "" : ", frozen"));
  }
  for (const auto& b : module.named_buffers()) {
    out.emplace_back("buffer '" + b.key() + "'", tensor(b.value()));
  }
  return out;
}

void check_same_on_every_rank(const std::vector<std::pair<std::string, std::string>>& mine,
                              const dist::ProcessGroup& group, const std::string& who) {
  std::string text;
  for (const auto& [key, value] : mine) text += key + "\t" + value + "\n";
  const auto all = group.all_gather_bytes(text);
  if (std::all_of(all.begin(), all.end(), [&](const std::string& t) { return t == all[0]; })) {
    return;
  }
  std::vector<std::vector<std::pair<std::string, std::string>>> by_rank(all.size());
  std::vector<std::string> keys;  // in the order of first appearance
  for (size_t r = 0; r < all.size(); ++r) {
    std::istringstream in(all[r]);
    std::string line;
    while (std::getline(in, line)) {
      const auto tab = line.find('\t');
      by_rank[r].emplace_back(line.substr(0, tab), line.substr(tab + 1));
      if (std::find(keys.begin(), keys.end(), by_rank[r].back().first) == keys.end()) {
        keys.push_back(by_rank[r].back().first);
      }
    }
  }
  std::vector<std::string> differences;
  for (const auto& key : keys) {
    std::vector<std::string> values;  // rank r's at r
    for (const auto& entries : by_rank) {
      const auto it = std::find_if(entries.begin(), entries.end(),
                                   [&](const auto& kv) { return kv.first == key; });
      values.push_back(it == entries.end() ? "absent" : it->second);
    }
    const auto seen = ranks_by_value(values);
    if (seen.size() < 2) continue;
    std::string d = key + " is ";
    for (size_t k = 0; k < seen.size(); ++k) {
      d += (k == 0 ? "" : " but ") + seen[k].first + " on rank(s) " + seen[k].second;
    }
    differences.push_back(std::move(d));
  }
  std::string list;
  constexpr size_t kShown = 3;
  for (size_t k = 0; k < std::min(differences.size(), kShown); ++k) {
    list += (k == 0 ? "" : "; ") + differences[k];
  }
  if (differences.size() > kShown) {
    list += "; and " + std::to_string(differences.size() - kShown) + " more";
  }
  if (differences.empty()) {  // the same entries, registered in another order
    list = "the same parameters and buffers, registered in a different order";
  }
  TORCH_CHECK(false, who,
              ": the ranks were given different models or options (every "
              "rank must build the same model, with the same shapes and dtypes, and wrap it with "
              "the same options): ",
              list, " (this is rank ", group.rank(), " of ", group.world_size(), ")");
}

void broadcast_from_rank_zero(torch::nn::Module& module, const dist::ProcessGroup& group) {
  torch::NoGradGuard no_grad;
  for (auto& p : module.parameters()) {
    auto wire = dist::as_wire(p.data());
    group.broadcast(wire, 0);
  }
  for (auto& b : module.buffers()) {
    auto wire = dist::as_wire(b.data());
    group.broadcast(wire, 0);
  }
}

// The padding of a flat space is zero and each element lives in one shard,
// so the squared norms add up across ranks.
double clip_sharded_grad_norm(const std::vector<at::Tensor>& grads, const dist::ProcessGroup& group,
                              double max_norm, double unscale) {
  torch::NoGradGuard no_grad;
  double sum_sq = 0.0;
  for (const auto& g : grads) {
    const double n = at::linalg_vector_norm(g, 2, c10::nullopt, false, at::kFloat).item<double>();
    sum_sq += n * n;
  }
  auto total = torch::full({1}, sum_sq, torch::kDouble);
  group.all_reduce_sum(total);
  const double norm = std::sqrt(total.item<double>()) * unscale;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto g : grads) g.mul_(coef);
  }
  return norm;
}

}  // namespace detail
}  // namespace ampx
