// ampx's safetensors files against Python's safetensors package, both ways
// (ctest interop.safetensors_*; tests/reference/safetensors_interop.py is the
// Python side, making the same tensors):
//
//   interop_safetensors write PATH   // ampx writes the expected tensors
//   interop_safetensors check PATH   // ampx reads Python's file: exit 0 if equal
//
// The tensors: for each dtype, arange(n) * 0.37 - 1.5 in float64 cast to it
// (integers: arange(n) - 3; bool: arange(n) % 3 == 0), in a shape of its own.
// Exit status 77 (ctest's skip) when `check` finds no file: Python without
// safetensors wrote none.

#include "ampx/safetensors.h"

#include <torch/torch.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <string>

namespace {

std::map<std::string, torch::Tensor> expected() {
  const auto floats = [](int64_t n, torch::ScalarType t, std::vector<int64_t> shape) {
    return (torch::arange(n, torch::kDouble) * 0.37 - 1.5).to(t).reshape(shape);
  };
  const auto ints = [](int64_t n, torch::ScalarType t, std::vector<int64_t> shape) {
    return (torch::arange(n, torch::kLong) - 3).to(t).reshape(shape);
  };
  return {
      {"blocks.0.fc.weight", floats(12, torch::kFloat, {3, 4})},
      {"f64", floats(6, torch::kDouble, {6})},
      {"f16", floats(10, torch::kHalf, {2, 5})},
      {"bf16", floats(8, torch::kBFloat16, {2, 2, 2})},
      {"i64", ints(5, torch::kLong, {5})},
      {"i32", ints(4, torch::kInt, {2, 2})},
      {"i16", ints(3, torch::kShort, {3})},
      {"i8", ints(7, torch::kChar, {7})},
      {"u8", (torch::arange(9, torch::kLong) * 29).to(torch::kByte)},
      {"bool", torch::arange(7, torch::kLong).remainder(3).eq(0)},
      {"scalar", floats(1, torch::kFloat, {})},
  };
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: interop_safetensors write|check PATH\n");
    return 2;
  }
  const std::string mode = argv[1], path = argv[2];
  if (mode == "write") {
    ampx::save_safetensors(expected(), path, {{"written_by", "ampx"}});
    return 0;
  }
  if (!std::filesystem::exists(path)) {
    std::printf("no %s: Python's safetensors did not write one\n", path.c_str());
    return 77;
  }
  std::map<std::string, std::string> meta;
  const auto got = ampx::read_safetensors(path, &meta);
  int bad = 0;
  for (const auto& [name, want] : expected()) {
    const auto it = got.find(name);
    if (it == got.end() || it->second.scalar_type() != want.scalar_type() ||
        it->second.sizes() != want.sizes() || !torch::equal(it->second, want)) {
      std::fprintf(stderr, "tensor '%s' differs from what Python wrote\n", name.c_str());
      ++bad;
    }
  }
  if (got.size() != expected().size() || meta["written_by"] != "python") {
    std::fprintf(stderr, "%zu tensors and metadata written_by='%s'; expected %zu and 'python'\n",
                 got.size(), meta["written_by"].c_str(), expected().size());
    ++bad;
  }
  if (bad == 0) std::printf("ampx read Python's file: %zu tensors, equal\n", got.size());
  return bad == 0 ? 0 : 1;
}
