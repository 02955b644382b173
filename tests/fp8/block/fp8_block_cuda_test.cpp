// ampx/fp8/block.h on CUDA (src/fp8/block/cuda/block_kernels.cu): every cast of a
// CUDA tensor gives the CPU's codes, scales and global amax bit for bit, for
// every element format and scale rule, 1 x N, N x N and N x 1 blocks (cut
// short at the edges), float32, bfloat16 and float16 inputs, on random
// tensors and on the edge cases (zeros of both signs, subnormals, each
// format's maximum, ties, FLT_MAX, inf, NaN); stochastic rounding draws the
// same codes for the same seed and offset; block values, dequantize, the
// Hadamard transform and FP4 packing are the CPU's too. Without a CUDA
// device these tests skip.

#include "ampx/fp8/block.h"

#include "../../test_util.h"

#include <torch/torch.h>

#include <cfloat>
#include <cmath>
#include <string>
#include <vector>

namespace ampx {
namespace fp8 {
namespace {

bool has_cuda() {
  return torch::cuda::is_available();
}

// Float32 values as their bits (int32): NaNs and signed zeros told apart.
at::Tensor bits_of(const at::Tensor& t) {
  return t.cpu().to(torch::kFloat).contiguous().view(torch::kInt);
}

// The same NaNs in the same places (any payload), the same bits elsewhere.
void expect_same_values(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.cpu(), nan = want.isnan();
  ASSERT_TRUE(g.isnan().equal(nan));
  EXPECT_TRUE(bits_of(g.masked_fill(nan, 0)).equal(bits_of(want.masked_fill(nan, 0))));
}

void expect_same_blocks(const BlockTensor& got, const BlockTensor& want) {
  ASSERT_TRUE(got.codes.is_cuda() && got.scales.is_cuda());
  ASSERT_EQ(got.codes.sizes(), want.codes.sizes());
  ASSERT_EQ(got.scales.sizes(), want.scales.sizes());
  EXPECT_TRUE(got.codes.cpu().equal(want.codes)) << "codes";
  if (want.scales.scalar_type() == torch::kFloat) {
    EXPECT_TRUE(bits_of(got.scales).equal(bits_of(want.scales))) << "float32 scales";
  } else {
    EXPECT_TRUE(got.scales.cpu().equal(want.scales)) << "scale bytes";
  }
  EXPECT_EQ(test::to_bits(got.global_amax), test::to_bits(want.global_amax)) << "global amax";
  expect_same_values(got.dequantize(), want.dequantize());
}

// Every format and scale rule, with blocks of 1 x bc.
std::vector<BlockFormat> every_format() {
  std::vector<BlockFormat> formats;
  for (const ElementFormat e : {ElementFormat::kE4M3, ElementFormat::kE5M2, ElementFormat::kE3M2,
                                ElementFormat::kE2M3, ElementFormat::kE2M1}) {
    for (const ScaleRule r :
         {ScaleRule::kFloor, ScaleRule::kCeil, ScaleRule::kEven, ScaleRule::kRceil}) {
      formats.push_back(BlockFormat(e, r));
    }
  }
  formats.push_back(BlockFormat::nvfp4());
  for (const ElementFormat e : {ElementFormat::kE4M3, ElementFormat::kE5M2}) {
    formats.push_back(BlockFormat(e, ScaleRule::kFloat32).block_cols(128));
    formats.push_back(BlockFormat(e, ScaleRule::kFloat32Pow2).block_cols(128));
  }
  formats.push_back(BlockFormat::fp8_blockwise().amax_epsilon(1e-3));
  return formats;
}

// The block shapes of a format: its own 1 x bc, bc x bc (2-D), bc x 1
// (columns), and blocks that divide neither dimension.
std::vector<BlockFormat> shapes_of(const BlockFormat& f) {
  const int64_t bc = f.block_cols();
  return {f, BlockFormat(f).block_rows(bc), BlockFormat(f).block_rows(bc).block_cols(1),
          BlockFormat(f).block_rows(3).block_cols(7), BlockFormat(f).block_cols(1)};
}

// Rows of every binade from 2^-40 to 2^40, and a block of each element
// format's largest value in a row.
at::Tensor random_input(int64_t seed) {
  torch::manual_seed(seed);
  auto x = torch::randn({67, 300}) *
           torch::exp2(torch::randint(-40, 40, {67, 1}).to(torch::kFloat));
  x[5].fill_(0.0f);
  x[6].slice(0, 0, 100).fill_(-0.0f);
  return x;
}

// The edge cases, each in several blocks: zeros of both signs, float32
// subnormals, each element format's maximum and the halfway points between
// neighbouring codes (ties) at scale 1, FLT_MAX, inf and NaN of both signs.
at::Tensor edge_input() {
  std::vector<float> v = {0.0f,     -0.0f,  1e-40f,   -1e-40f,  1.4e-45f, 6.0f,   -6.0f,
                          7.5f,     28.0f,  448.0f,   -448.0f,  57344.0f, 0.25f,  0.75f,
                          1.25f,    2.5f,   -2.5f,    5.0f,     3.5f,     0.125f, 1.0625f,
                          17.0f,    464.0f, 61440.0f, FLT_MAX,  -FLT_MAX, 1e-30f, 3e-39f};
  const float specials[] = {INFINITY, -INFINITY, NAN, -NAN};
  auto x = torch::tensor(v).repeat({48, 12}).slice(1, 0, 320).contiguous();  // [48, 320]
  torch::manual_seed(17);
  x.mul_(torch::exp2(torch::randint(-3, 4, {48, 1}).to(torch::kFloat)));
  // Specials in some rows only: other blocks keep finite amaxes.
  for (int64_t r = 0; r < 48; r += 7) x[r][(r * 13) % 320] = specials[(r / 7) % 4];
  x[47].fill_(-0.0f);
  x[46].fill_(1e-41f);
  return x;
}

TEST(BlockCudaTest, QuantizeGivesTheCpusCodesAndScalesForEveryFormatRuleAndBlockShape) {
  if (!has_cuda()) GTEST_SKIP() << "CUDA not available";
  const at::Tensor inputs[] = {random_input(1), edge_input(), random_input(2).view({67, 3, 100})};
  for (const BlockFormat& base : every_format()) {
    for (const BlockFormat& f : shapes_of(base)) {
      for (size_t k = 0; k < 3; ++k) {
        if (f.block_rows() > 1 && inputs[k].dim() != 2) continue;
        for (const auto dtype : {torch::kFloat, torch::kBFloat16, torch::kHalf}) {
          SCOPED_TRACE(f.to_string() + " input " + std::to_string(k) + " " +
                       c10::toString(dtype));
          const at::Tensor x = inputs[k].to(dtype);
          expect_same_blocks(BlockTensor::quantize(x.cuda(), f), BlockTensor::quantize(x, f));
        }
      }
    }
  }
}

TEST(BlockCudaTest, StochasticRoundingDrawsTheCpusCodesForASeedAndOffset) {
  if (!has_cuda()) GTEST_SKIP() << "CUDA not available";
  const at::Tensor x = random_input(3);
  const StochasticRounding streams[] = {{7, 0}, {(uint64_t{1} << 40) + 3, 12345}};
  for (const BlockFormat& base : every_format()) {
    for (const BlockFormat& f : shapes_of(base)) {
      for (const StochasticRounding& s : streams) {
        SCOPED_TRACE(f.to_string() + " seed " + std::to_string(s.seed));
        const auto got = BlockTensor::quantize(x.cuda(), f, s);
        const auto want = BlockTensor::quantize(x, f, s);
        expect_same_blocks(got, want);
        // And not nearest rounding's codes: the stream was used.
        if (f.element() == ElementFormat::kE2M1) {
          EXPECT_FALSE(got.codes.cpu().equal(BlockTensor::quantize(x, f).codes));
        }
      }
    }
  }
}

TEST(BlockCudaTest, BlockValuesOfCpuCodesMovedToTheDeviceAreTheCpus) {
  if (!has_cuda()) GTEST_SKIP() << "CUDA not available";
  const at::Tensor x = edge_input();
  for (const BlockFormat& base : every_format()) {
    for (const BlockFormat& f : shapes_of(base)) {
      SCOPED_TRACE(f.to_string());
      const BlockTensor cpu = BlockTensor::quantize(x, f);
      BlockTensor moved = cpu;
      moved.codes = cpu.codes.cuda();
      moved.scales = cpu.scales.cuda();
      expect_same_values(moved.block_values(), cpu.block_values());
      expect_same_values(moved.dequantize(torch::kBFloat16).to(torch::kFloat),
                         cpu.dequantize(torch::kBFloat16).to(torch::kFloat));
      if (f.block_rows() > 1 && f.block_cols() > 1) {
        expect_same_blocks(moved.transposed(), cpu.transposed());
      }
    }
  }
}

TEST(BlockCudaTest, Hadamard16AndFp4PackingAreTheCpusBitForBit) {
  if (!has_cuda()) GTEST_SKIP() << "CUDA not available";
  torch::manual_seed(4);
  const auto x =
      torch::randn({96, 80}) * torch::exp2(torch::randint(-20, 20, {96, 1}).to(torch::kFloat));
  for (const bool inverse : {false, true}) {
    for (const int64_t dim : {int64_t{-1}, int64_t{0}}) {
      SCOPED_TRACE("inverse " + std::to_string(inverse) + " dim " + std::to_string(dim));
      const auto got = hadamard16(x.cuda(), inverse, dim);
      ASSERT_TRUE(got.is_cuda());
      EXPECT_TRUE(bits_of(got).equal(bits_of(hadamard16(x, inverse, dim))));
      const auto half = x.to(torch::kBFloat16);
      EXPECT_TRUE(bits_of(hadamard16(half.cuda(), inverse, dim))
                      .equal(bits_of(hadamard16(half, inverse, dim))));
    }
  }
  const auto codes = BlockTensor::quantize(x, BlockFormat::nvfp4()).codes;
  const auto packed = pack_fp4(codes.cuda());
  EXPECT_TRUE(packed.cpu().equal(pack_fp4(codes)));
  EXPECT_TRUE(unpack_fp4(packed).cpu().equal(codes));
}

}  // namespace
}  // namespace fp8
}  // namespace ampx
