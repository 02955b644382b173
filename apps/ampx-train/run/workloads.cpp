#include "workloads.h"

#include "data.h"
#include "gpt_nn.h"
#include "models.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <cstdio>

namespace ampx::train {
namespace {

// A generator for one (seed, stream, index): batches never touch torch's
// global generator, so their order survives a resume without saving it.
at::Generator generator_for(uint64_t seed, uint64_t stream, uint64_t index) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull ^ (stream + 1) * 0xBF58476D1CE4E5B9ull ^
               (index + 1) * 0x94D049BB133111EBull;
  x ^= x >> 31;  // splitmix64 finaliser: nearby inputs give unrelated seeds
  x *= 0xD6E8FEB86763A9D5ull;
  x ^= x >> 29;
  return at::detail::createCPUGenerator(x);
}

torch::Tensor cross_entropy(const torch::Tensor& logits, const torch::Tensor& target) {
  const auto classes = logits.size(-1);
  return torch::nn::functional::cross_entropy(logits.reshape({-1, classes}).to(torch::kFloat),
                                              target.reshape({-1}));
}

class GptWorkload final : public Workload {
 public:
  GptWorkload(const TrainConfig& c, TextData data)
      : name_(c.workload),
        seed_(c.seed),
        batch_(c.batch_size),
        eval_batches_(c.eval_batches),
        data_(std::move(data)) {
    cfg_.vocab = static_cast<int64_t>(data_.vocab.size());
    cfg_.block = c.block_size;
    cfg_.layers = c.layers;
    cfg_.heads = c.heads;
    cfg_.d = c.d_model;
    cfg_.attention = gpt_attention_named(c.attention);
    cfg_.recompute = gpt_recompute_named(c.recompute);
    TORCH_CHECK(data_.train.numel() > cfg_.block + 1 && data_.val.numel() > cfg_.block + 1,
                "ampx-train: the text is too short for --block-size ", cfg_.block, ": ",
                data_.train.numel(), " training and ", data_.val.numel(), " held-out characters");
  }
  std::string name() const override { return name_; }
  std::string unit() const override { return "tokens"; }
  std::string metric_name() const override { return "bpc"; }
  bool metric_is_percent() const override { return false; }
  int64_t items_per_step() const override { return batch_ * cfg_.block; }
  int64_t steps_per_epoch() const override {
    return std::max<int64_t>(1, data_.train.numel() / items_per_step());
  }
  nlohmann::json identity() const override {
    return {{"workload", name_},     {"vocab", cfg_.vocab}, {"block_size", cfg_.block},
            {"layers", cfg_.layers}, {"heads", cfg_.heads}, {"d_model", cfg_.d},
            {"batch_size", batch_},  {"seed", seed_}};
  }
  torch::nn::AnyModule build(const torch::Device& device) override {
    torch::nn::AnyModule model =
        name_ == "gpt-nn" ? torch::nn::AnyModule(GPTNN(cfg_)) : torch::nn::AnyModule(GPT(cfg_));
    model.ptr()->to(device);
    return model;
  }
  std::vector<std::shared_ptr<torch::nn::Module>> units(torch::nn::Module& model) const override {
    for (const auto& child : model.named_children()) {
      if (child.key() == "blocks") return child.value()->children();  // the transformer blocks
    }
    return {};
  }
  Batch batch(int64_t step, const torch::Device& device) override {
    // B windows of T + 1 characters at random offsets of the training split.
    auto gen = generator_for(seed_, /*stream=*/0, static_cast<uint64_t>(step));
    const int64_t T = cfg_.block;
    // The offsets come from the CPU generator (the same windows on every
    // device); the text is on the device, so only they cross to it.
    auto starts = torch::randint(data_.train.numel() - T - 1, {batch_, 1}, gen, torch::kLong);
    const auto& text = train_on(device);
    auto windows =
        text.index({starts.to(device) + torch::arange(T + 1, text.options())});  // [B, T + 1]
    return {windows.slice(1, 0, T), windows.slice(1, 1), step};
  }
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override {
    return cross_entropy(output, target);
  }
  EvalResult evaluate(const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                      const torch::Device& device) override {
    // Consecutive non-overlapping windows from the start of the held-out split.
    const int64_t T = cfg_.block;
    const int64_t windows =
        std::min((data_.val.numel() - 1) / T, std::max<int64_t>(1, eval_batches_) * batch_);
    double total = 0;
    int64_t count = 0;
    for (int64_t w0 = 0; w0 < windows; w0 += batch_) {
      const int64_t n = std::min(batch_, windows - w0);
      auto starts = (torch::arange(w0, w0 + n) * T).unsqueeze(1);
      auto win = data_.val.index({starts + torch::arange(T + 1)});
      auto logits = forward(win.slice(1, 0, T).to(device));
      total += cross_entropy(logits, win.slice(1, 1).to(device)).item<double>() * n * T;
      count += n * T;
    }
    EvalResult r;
    r.loss = total / static_cast<double>(count);
    r.metric = r.loss / std::log(2.0);
    return r;
  }

 private:
  /// The training text on `device` (copied there once).
  const torch::Tensor& train_on(const torch::Device& device) {
    if (device.is_cpu()) return data_.train;
    if (!train_device_.defined() || train_device_.device() != device) {
      train_device_ = data_.train.to(device);
    }
    return train_device_;
  }

  std::string name_;  // gpt or gpt-nn (the model built)
  uint64_t seed_;
  int64_t batch_, eval_batches_;
  TextData data_;
  torch::Tensor train_device_;  // data_.train on the training device (not the CPU)
  GPTConfig cfg_;
};

// MNIST's and Fashion-MNIST's pixels scaled to [0, 1] and standardised with
// the training split's own mean and deviation.
class ImageWorkload final : public Workload {
 public:
  ImageWorkload(const TrainConfig& c, ImageData data)
      : workload_(c.workload), seed_(c.seed), batch_(c.batch_size) {
    auto train = data.train.images.to(torch::kFloat).div_(255);
    const auto mean = train.mean().item<double>(), std = train.std().item<double>();
    train_x_ = train.sub_(mean).div_(std);
    test_x_ = data.test.images.to(torch::kFloat).div_(255).sub_(mean).div_(std);
    train_y_ = data.train.labels;
    test_y_ = data.test.labels;
    TORCH_CHECK(train_x_.size(0) >= batch_, "ampx-train: --batch-size ", batch_,
                " is larger than the training split (", train_x_.size(0), " images)");
  }
  std::string name() const override { return workload_; }
  std::string unit() const override { return "samples"; }
  std::string metric_name() const override { return "accuracy"; }
  bool metric_is_percent() const override { return true; }
  int64_t items_per_step() const override { return batch_; }
  int64_t steps_per_epoch() const override { return train_x_.size(0) / batch_; }
  nlohmann::json identity() const override {
    return {{"workload", workload_}, {"batch_size", batch_}, {"seed", seed_}};
  }
  torch::nn::AnyModule build(const torch::Device& device) override {
    torch::nn::AnyModule model = workload_ == "mnist-cnn" ? torch::nn::AnyModule(MnistCNN())
                                                          : torch::nn::AnyModule(FashionMLP());
    model.ptr()->to(device);
    return model;
  }
  Batch batch(int64_t step, const torch::Device& device) override {
    // Epoch e visits a permutation drawn from (seed, e); the last partial
    // batch of an epoch is dropped.
    const int64_t epoch = step / steps_per_epoch(), pos = step % steps_per_epoch();
    if (epoch != perm_epoch_) {
      auto gen = generator_for(seed_, /*stream=*/1, static_cast<uint64_t>(epoch));
      perm_ = torch::randperm(train_x_.size(0), gen, torch::kLong);
      perm_epoch_ = epoch;
    }
    auto idx = perm_.slice(0, pos * batch_, (pos + 1) * batch_);
    return {shape(train_x_.index_select(0, idx)).to(device),
            train_y_.index_select(0, idx).to(device), step};
  }
  torch::Tensor loss(const torch::Tensor& output, const torch::Tensor& target) override {
    return cross_entropy(output, target);
  }
  EvalResult evaluate(const std::function<torch::Tensor(const torch::Tensor&)>& forward,
                      const torch::Device& device) override {
    const int64_t n = test_x_.size(0), chunk = 1000;
    double total = 0;
    int64_t correct = 0;
    for (int64_t i = 0; i < n; i += chunk) {
      auto x = shape(test_x_.slice(0, i, std::min(n, i + chunk))).to(device);
      auto y = test_y_.slice(0, i, std::min(n, i + chunk)).to(device);
      auto logits = forward(x).to(torch::kFloat);
      total += cross_entropy(logits, y).item<double>() * y.size(0);
      correct += logits.argmax(1).eq(y).sum().item<int64_t>();
    }
    return {total / static_cast<double>(n), 100.0 * static_cast<double>(correct) / n};
  }

 private:
  torch::Tensor shape(const torch::Tensor& images) const {  // [N, 28, 28] -> model input
    return workload_ == "mnist-cnn" ? images.unsqueeze(1) : images.flatten(1);
  }
  std::string workload_;
  uint64_t seed_;
  int64_t batch_;
  torch::Tensor train_x_, train_y_, test_x_, test_y_;
  torch::Tensor perm_;
  int64_t perm_epoch_ = -1;
};

}  // namespace

std::string Workload::describe_metric(double value) const {
  char buf[64];
  std::snprintf(buf, sizeof(buf), metric_is_percent() ? "%.2f%%" : "%.3f", value);
  return metric_name() + " " + buf;
}

std::unique_ptr<Workload> make_workload(const TrainConfig& c) {
  const std::filesystem::path dir = c.data_dir;
  if (is_gpt_workload(c.workload)) return std::make_unique<GptWorkload>(c, load_moby_dick(dir));
  if (c.workload == "mnist-cnn") return std::make_unique<ImageWorkload>(c, load_mnist(dir));
  TORCH_CHECK(c.workload == "fashion-mlp", "ampx-train: unknown --workload '", c.workload, "'");
  return std::make_unique<ImageWorkload>(c, load_fashion_mnist(dir));
}

}  // namespace ampx::train
