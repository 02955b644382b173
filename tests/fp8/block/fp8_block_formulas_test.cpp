// The block-scaled formats and recipes (ampx/fp8/block.h, block_recipe.h)
// against tests/reference/block_reference.py's block_formulas.json, which
// needs no float8 dtype nor safetensors and so is written on every leg, the
// host's torch 1.13 included: NVFP4's Hadamard matrix (TE's sign vector),
// and a layer under Float8BlockScaling, forward and backward, bit for bit.

#include "ampx/fp8/block.h"
#include "ampx/fp8/linear.h"

#include "../../test_util.h"

#include <torch/torch.h>

#include <cstdint>
#include <iomanip>
#include <string>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

// A float32 [rows, cols] of a JSON list of rows (each number a float32,
// written exactly as a double).
at::Tensor json_matrix(const nlohmann::json& rows) {
  std::vector<float> v;
  for (const auto& row : rows) {
    for (const auto& e : row) v.push_back(e.get<float>());
  }
  return torch::tensor(v).view({static_cast<int64_t>(rows.size()), -1});
}

class BlockFormulasTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ref_ = test::load_reference("block_formulas.json");
    ASSERT_TRUE(ref_.is_object()) << "block_formulas.json is not a JSON object";
  }
  at::Tensor ref(const std::string& group, const std::string& name) const {
    return json_matrix(ref_.at(group).at(name));
  }
  nlohmann::json ref_;
};

// `got` is `want` bit for bit (but -0 and 0 alike).
void expect_bits(const at::Tensor& got, const at::Tensor& want, const char* what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const auto differ = got.detach().ne(want).flatten();
  if (!differ.any().item<bool>()) return;
  const int64_t first = differ.nonzero()[0][0].item<int64_t>(), cols = want.size(-1);
  ADD_FAILURE() << what << ": " << differ.sum().item<int64_t>() << " of " << want.numel()
                << " differ, the first at [" << first / cols << ", " << first % cols << "]: got "
                << std::setprecision(9) << got.detach().flatten()[first].item<float>() << ", want "
                << want.flatten()[first].item<float>();
}

// H = S H16 / 4, the reference's from its own copy of TE's sign vector
// (get_wgrad_sign_vector): the transform of the identity is H exactly (each
// entry +-1/4, a sum of one nonzero term), its inverse H^T, down the
// columns H^T too; a random tensor's transform within float32's sums.
TEST_F(BlockFormulasTest, Hadamard16IsTheReferencesSignedMatrix) {
  const auto h = ref("hadamard16", "matrix");
  ASSERT_EQ(h.sizes(), (c10::IntArrayRef{16, 16}));
  const auto eye = torch::eye(16);
  expect_bits(hadamard16(eye), h, "hadamard16(I)");
  expect_bits(hadamard16(eye, /*inverse=*/true), h.t(), "hadamard16(I, inverse)");
  expect_bits(hadamard16(eye, /*inverse=*/false, /*dim=*/0), h.t(), "hadamard16(I, dim 0)");
  const auto x = ref("hadamard16", "x"), want = ref("hadamard16", "values");
  EXPECT_TRUE(torch::allclose(hadamard16(x), want, 1e-6, 1e-6 * x.abs().max().item<float>()));
}

// A layer [256 -> 256] under Float8BlockScaling() (TE's defaults): y from x
// in 1 x 128 blocks and the weight in 128 x 128 blocks; the input gradient
// from the output gradient in 1 x 128 blocks and the forward's weight codes
// (quantized once for both products, not again in other blocks); the
// weight gradient from both in blocks of 128 x 1, down the tokens. The
// reference's weight rows span 12 binades, so that other weight blocks round
// differently. Each row of its x and g has two nonzeros: every output is a
// sum of at most two exact products, the same float32 in any order of the
// sums, so the reference's float64 products rounded once are every bit.
TEST_F(BlockFormulasTest, Float8BlockScalingLayerIsTheFormulasBitForBit) {
  const auto x = ref("fp8block_linear", "x"), w = ref("fp8block_linear", "weight");
  const auto g = ref("fp8block_linear", "grad_y");
  ASSERT_TRUE(x.ne(0).sum(1).le(2).all().item<bool>() && g.ne(0).sum(1).le(2).all().item<bool>())
      << "exact sums need at most two nonzeros a row";
  Linear fc(
      LinearOptions(256, 256).bias(false).recipe(Float8BlockScaling()).output_dtype(torch::kFloat));
  {
    torch::NoGradGuard no_grad;
    fc->weight.copy_(w);
  }
  const auto xi = x.clone().requires_grad_(true);
  at::Tensor y;
  {
    Fp8AutocastGuard fp8;
    y = fc->forward(xi);
  }
  y.backward(g);
  expect_bits(y, ref("fp8block_linear", "y"), "y = x w^T");
  expect_bits(xi.grad(), ref("fp8block_linear", "grad_x"), "grad_x = g w");
  expect_bits(fc->weight.grad(), ref("fp8block_linear", "grad_w"), "grad_w = g^T x");
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
