// ampx's safetensors files against Python's safetensors package, both ways
// (ctest interop.safetensors_*; tests/reference/safetensors_interop.py is the
// Python side, making the same tensors):
//
//   interop_safetensors write PATH   // ampx writes the expected tensors
//   interop_safetensors check PATH   // ampx reads Python's file: exit 0 if equal
//
// The tensors: for each dtype, arange(n) * 0.37 - 1.5 in float64 cast to it
// (integers: arange(n) - 3; bool: arange(n) % 3 == 0), in a shape of its own.
// FP8: x = arange(24) * 0.37 - 4.5 (float32, [4, 6]) cast with scale 100 / 3
// to E4M3 ("e4m3", its scale_inv "e4m3_scale") and with scale 0.7 to E5M2;
// ampx's file adds "<name>_values", the values ampx's dequantize() gives,
// which Python's one-liner codes.float() * scale must equal bitwise.
// Exit status 77 (ctest's skip) when `check` finds no file: Python without
// safetensors wrote none.

#include "ampx/fp8/cast.h"
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

using ampx::fp8::Fp8Format;

// The FP8 tensors, as ampx quantizes them.
std::map<std::string, ampx::fp8::Fp8Tensor> expected_fp8() {
  const auto x = (torch::arange(24, torch::kDouble) * 0.37 - 4.5).to(torch::kFloat).reshape({4, 6});
  const auto scale = [](double s) { return torch::full({1}, s, torch::kFloat); };
  return {
      {"e4m3", ampx::fp8::Fp8Tensor::quantize(x, Fp8Format::kE4M3, scale(100.0 / 3.0))},
      {"e5m2", ampx::fp8::Fp8Tensor::quantize(x, Fp8Format::kE5M2, scale(0.7))},
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
    ampx::SafetensorsContents out;
    out.tensors = expected();
    out.fp8 = expected_fp8();
    for (const auto& [name, t] : out.fp8) out.tensors[name + "_values"] = t.dequantize();
    out.metadata = {{"written_by", "ampx"}};
    ampx::save_safetensors(out, path);
    return 0;
  }
  if (!std::filesystem::exists(path)) {
    std::printf("no %s: Python's safetensors did not write one\n", path.c_str());
    return 77;
  }
  auto contents = ampx::read_safetensors_contents(path);
  const auto& got = contents.tensors;
  auto& meta = contents.metadata;
  int bad = 0;
  for (const auto& [name, want] : expected_fp8()) {
    const auto it = contents.fp8.find(name);
    if (it == contents.fp8.end() || it->second.format != want.format ||
        !torch::equal(it->second.codes, want.codes) ||
        !torch::equal(it->second.scale_inv.reshape({1}), want.scale_inv)) {
      std::fprintf(stderr, "FP8 tensor '%s' differs from what Python wrote\n", name.c_str());
      ++bad;
    }
  }
  for (const auto& [name, want] : expected()) {
    const auto it = got.find(name);
    if (it == got.end() || it->second.scalar_type() != want.scalar_type() ||
        it->second.sizes() != want.sizes() || !torch::equal(it->second, want)) {
      std::fprintf(stderr, "tensor '%s' differs from what Python wrote\n", name.c_str());
      ++bad;
    }
  }
  if (got.size() != expected().size() || contents.fp8.size() != expected_fp8().size() ||
      meta["written_by"] != "python") {
    std::fprintf(stderr,
                 "%zu tensors, %zu FP8 and metadata written_by='%s'; expected %zu, %zu and "
                 "'python'\n",
                 got.size(), contents.fp8.size(), meta["written_by"].c_str(), expected().size(),
                 expected_fp8().size());
    ++bad;
  }
  if (bad == 0) {
    std::printf("ampx read Python's file: %zu tensors and %zu FP8 ones with their scales, equal\n",
                got.size(), contents.fp8.size());
  }
  return bad == 0 ? 0 : 1;
}
