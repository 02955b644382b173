// ampx-train's data loaders, on small IDX and text files generated here (the
// real datasets are not needed): exact bytes and labels from plain and gzip
// files, the folder layout, every error text, and the data folder's lookup.

#include "run/data.h"

#include <c10/util/Exception.h>
#include "test_support.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <zlib.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using ampx::train::ImageData;
using ampx::train::ImageSplit;
using ampx::train::TextData;

using Bytes = std::vector<uint8_t>;
using namespace ampx::train::test;

void put_be32(Bytes& out, uint32_t v) {
  for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<uint8_t>(v >> shift));
}

/// An IDX image file: magic 0x00000803, n, rows, cols, then the pixels.
Bytes idx_images(uint32_t n, uint32_t rows, uint32_t cols, const Bytes& pixels,
                 uint32_t magic = 0x00000803) {
  Bytes out;
  for (uint32_t v : {magic, n, rows, cols}) put_be32(out, v);
  out.insert(out.end(), pixels.begin(), pixels.end());
  return out;
}

/// An IDX label file: magic 0x00000801, n, then the labels.
Bytes idx_labels(const Bytes& labels, uint32_t magic = 0x00000801) {
  Bytes out;
  put_be32(out, magic);
  put_be32(out, static_cast<uint32_t>(labels.size()));
  out.insert(out.end(), labels.begin(), labels.end());
  return out;
}

void write_plain(const fs::path& path, const Bytes& bytes) {
  fs::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

void write_gzip(const fs::path& path, const Bytes& bytes) {
  fs::create_directories(path.parent_path());
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr) << path;
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
              static_cast<int>(bytes.size()));
  }
  ASSERT_EQ(gzclose(f), Z_OK);
}

void write_text(const fs::path& path, const std::string& text) {
  write_plain(path, Bytes(text.begin(), text.end()));
}

Bytes read_file_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Three 3x2 images: bytes 1..16 in order, framed by 255 and 128 (high bit set:
// they must read back unsigned); labels cover 0 and 9, the ends of the range.
Bytes pixels() {
  return {255, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 128};
}
const Bytes kLabels = {9, 0, 4};

void expect_split(const ImageSplit& split, const Bytes& pixels, const Bytes& labels, int64_t n) {
  ASSERT_EQ(split.images.scalar_type(), torch::kUInt8);
  ASSERT_EQ(split.images.sizes(), (std::vector<int64_t>{n, 3, 2}));
  ASSERT_EQ(split.labels.scalar_type(), torch::kLong);
  ASSERT_EQ(split.labels.sizes(), (std::vector<int64_t>{n}));
  const uint8_t* img = split.images.contiguous().data_ptr<uint8_t>();
  EXPECT_EQ(Bytes(img, img + n * 6), Bytes(pixels.begin(), pixels.begin() + n * 6));
  // Spot checks through indexing, so the [N, rows, cols] layout is right too.
  EXPECT_EQ(split.images[0][0][0].item<int64_t>(), pixels[0]);
  EXPECT_EQ(split.images[0][1][0].item<int64_t>(), pixels[2]);
  EXPECT_EQ(split.images[n - 1][2][1].item<int64_t>(), pixels[n * 6 - 1]);
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(split.labels[i].item<int64_t>(), labels[i]) << i;
}

class TrainDataTest : public testing::Test {
 protected:
  void SetUp() override {
    std::random_device rd;
    dir_ = fs::temp_directory_path() / ("ampx-data-test-" + std::to_string(rd()));
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  /// Writes <dir>/<name>, gzip-compressed if `gz`.
  fs::path write(const std::string& name, const Bytes& bytes, bool gz = false) {
    const fs::path p = dir_ / name;
    if (gz) {
      write_gzip(p, bytes);
    } else {
      write_plain(p, bytes);
    }
    return p;
  }

  /// Writes a 3-image train split and a 2-image test split in IDX layout.
  void write_dataset(const fs::path& subdir, bool gz) {
    const std::string ext = gz ? ".gz" : "";
    const Bytes p = pixels();
    write(subdir / ("train-images-idx3-ubyte" + ext), idx_images(3, 3, 2, p), gz);
    write(subdir / ("train-labels-idx1-ubyte" + ext), idx_labels(kLabels), gz);
    write(subdir / ("t10k-images-idx3-ubyte" + ext),
          idx_images(2, 3, 2, Bytes(p.rbegin(), p.rbegin() + 12)), gz);
    write(subdir / ("t10k-labels-idx1-ubyte" + ext), idx_labels({1, 8}), gz);
  }

  fs::path dir_;
};

// ---- IDX ------------------------------------------------------------------

TEST_F(TrainDataTest, ReadsPlainIdx) {
  const auto images = write("img", idx_images(3, 3, 2, pixels()));
  const auto labels = write("lbl", idx_labels(kLabels));
  expect_split(ampx::train::read_idx(images, labels), pixels(), kLabels, 3);
}

TEST_F(TrainDataTest, ReadsGzippedIdx) {
  const auto images = write("img.gz", idx_images(3, 3, 2, pixels()), /*gz=*/true);
  const auto labels = write("lbl.gz", idx_labels(kLabels), /*gz=*/true);
  ASSERT_NE(read_file_bytes(images), idx_images(3, 3, 2, pixels()));  // really compressed
  expect_split(ampx::train::read_idx(images, labels), pixels(), kLabels, 3);
}

TEST_F(TrainDataTest, ReadsGzippedImagesWithPlainLabels) {
  const auto images = write("img.gz", idx_images(3, 3, 2, pixels()), /*gz=*/true);
  const auto labels = write("lbl", idx_labels(kLabels));
  expect_split(ampx::train::read_idx(images, labels), pixels(), kLabels, 3);
}

TEST_F(TrainDataTest, ReadsEmptySplit) {
  const auto images = write("img", idx_images(0, 3, 2, {}));
  const auto labels = write("lbl", idx_labels({}));
  const ImageSplit split = ampx::train::read_idx(images, labels);
  EXPECT_EQ(split.images.sizes(), (std::vector<int64_t>{0, 3, 2}));
  EXPECT_EQ(split.labels.numel(), 0);
}

TEST_F(TrainDataTest, LoadMnistReadsPlainFilesUnderMnist) {
  write_dataset("mnist", /*gz=*/false);
  const ImageData data = ampx::train::load_mnist(dir_);
  EXPECT_EQ(data.num_classes, 10);
  expect_split(data.train, pixels(), kLabels, 3);
  const Bytes p = pixels();
  expect_split(data.test, Bytes(p.rbegin(), p.rbegin() + 12), {1, 8}, 2);
}

TEST_F(TrainDataTest, LoadFashionMnistReadsGzipFilesUnderFashionMnist) {
  write_dataset("fashion-mnist", /*gz=*/true);
  const ImageData data = ampx::train::load_fashion_mnist(dir_);
  EXPECT_EQ(data.num_classes, 10);
  expect_split(data.train, pixels(), kLabels, 3);
  const Bytes p = pixels();
  expect_split(data.test, Bytes(p.rbegin(), p.rbegin() + 12), {1, 8}, 2);
}

TEST_F(TrainDataTest, MissingMnistFileNamesPathAndInstallCommand) {
  const std::string err = error_text([&] { (void)ampx::train::load_mnist(dir_); });
  EXPECT_EQ(err,
            "ampx-train: MNIST file '" + (dir_ / "mnist" / "train-images-idx3-ubyte").string() +
                "' not found; install the data with: scripts/install-data.sh " + dir_.string());
}

TEST_F(TrainDataTest, MissingMnistTestFileIsReportedToo) {
  write_dataset("mnist", /*gz=*/false);
  fs::remove(dir_ / "mnist" / "t10k-labels-idx1-ubyte");
  EXPECT_TRUE(contains(
      error_text([&] { (void)ampx::train::load_mnist(dir_); }),
      {"MNIST file '" + (dir_ / "mnist" / "t10k-labels-idx1-ubyte").string() + "' not found",
       "install the data with: scripts/install-data.sh " + dir_.string()}));
}

TEST_F(TrainDataTest, MissingFashionMnistFileNamesPathAndInstallCommand) {
  write_dataset("mnist", /*gz=*/false);  // the wrong dataset: no help
  EXPECT_EQ(error_text([&] { (void)ampx::train::load_fashion_mnist(dir_); }),
            "ampx-train: Fashion-MNIST file '" +
                (dir_ / "fashion-mnist" / "train-images-idx3-ubyte.gz").string() +
                "' not found; install the data with: scripts/install-data.sh " + dir_.string());
}

TEST_F(TrainDataTest, MissingIdxFileIsReported) {
  const auto labels = write("lbl", idx_labels(kLabels));
  EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(dir_ / "nope", labels); }),
            "ampx-train: IDX file '" + (dir_ / "nope").string() + "' not found");
}

TEST_F(TrainDataTest, RejectsWrongImageMagic) {
  const auto images = write("img", idx_labels(kLabels));  // a label file in its place
  const auto labels = write("lbl", idx_labels(kLabels));
  EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
            "ampx-train: '" + images.string() +
                "' is not an IDX image file: magic 0x00000801, expected 0x00000803");
}

TEST_F(TrainDataTest, RejectsWrongLabelMagicInGzip) {
  const auto images = write("img", idx_images(3, 3, 2, pixels()));
  const auto labels = write("lbl.gz", idx_labels(kLabels, 0x1f8b0801), /*gz=*/true);
  EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
            "ampx-train: '" + labels.string() +
                "' is not an IDX label file: magic 0x1f8b0801, expected 0x00000801");
}

TEST_F(TrainDataTest, RejectsFileTooShortForMagic) {
  const auto images = write("img", {0, 0});
  const auto labels = write("lbl", idx_labels(kLabels));
  EXPECT_EQ(
      error_text([&] { (void)ampx::train::read_idx(images, labels); }),
      "ampx-train: '" + images.string() + "' is not an IDX image file: it holds only 2 bytes");
}

TEST_F(TrainDataTest, RejectsTruncatedHeader) {
  Bytes header = idx_images(3, 3, 2, {});
  header.resize(10);
  const auto images = write("img", header);
  const auto labels = write("lbl", idx_labels(kLabels));
  EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
            "ampx-train: '" + images.string() +
                "' is truncated: expected a 16-byte IDX header, got 10 bytes");
}

TEST_F(TrainDataTest, RejectsTruncatedPixels) {
  Bytes short_pixels = pixels();
  short_pixels.pop_back();
  const auto labels = write("lbl", idx_labels(kLabels));
  for (bool gz : {false, true}) {
    SCOPED_TRACE(gz ? "gzip" : "plain");
    const auto images = write(gz ? "img.gz" : "img", idx_images(3, 3, 2, short_pixels), gz);
    EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
              "ampx-train: '" + images.string() +
                  "' is truncated: expected 18 bytes of pixel data, got 17");
  }
}

TEST_F(TrainDataTest, RejectsTruncatedLabels) {
  const auto images = write("img", idx_images(3, 3, 2, pixels()));
  Bytes labels_bytes = idx_labels(kLabels);
  labels_bytes.pop_back();
  const auto labels = write("lbl", labels_bytes);
  EXPECT_EQ(
      error_text([&] { (void)ampx::train::read_idx(images, labels); }),
      "ampx-train: '" + labels.string() + "' is truncated: expected 3 bytes of labels, got 2");
}

TEST_F(TrainDataTest, RejectsHeaderAnnouncingMoreThanAGzipCanHold) {
  // 2^31-1 images of 28x28 would be 1.7 TB; refused before allocating.
  const auto images = write("img.gz", idx_images(0x7fffffff, 28, 28, pixels()), /*gz=*/true);
  // A matching label count, so that the size check is what fires.
  Bytes big_labels_header;
  put_be32(big_labels_header, 0x00000801);
  put_be32(big_labels_header, 0x7fffffff);
  const auto labels_many = write("lbl-many", big_labels_header);
  EXPECT_TRUE(contains(error_text([&] { (void)ampx::train::read_idx(images, labels_many); }),
                       {"'" + images.string() + "' is truncated: expected ",
                        std::to_string(int64_t{0x7fffffff} * 28 * 28) + " bytes of pixel data",
                        "cannot hold them"}));
}

TEST_F(TrainDataTest, RejectsCutOffGzipStream) {
  const auto full = write("full.gz", idx_images(3, 3, 2, pixels()), /*gz=*/true);
  Bytes cut = read_file_bytes(full);
  cut.resize(cut.size() - 8);  // drop the CRC-32 and size trailer
  const auto images = write("img.gz", cut);
  const auto labels = write("lbl", idx_labels(kLabels));
  EXPECT_TRUE(contains(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
                       {"ampx-train: '" + images.string() + "' is not a valid gzip file"}));
}

TEST_F(TrainDataTest, RejectsCorruptGzipStream) {
  const auto full = write("full.gz", idx_images(3, 3, 2, pixels()), /*gz=*/true);
  Bytes bad = read_file_bytes(full);
  bad[bad.size() - 6] ^= 0xff;  // inside the CRC-32: the data no longer matches
  const auto images = write("img.gz", bad);
  const auto labels = write("lbl", idx_labels(kLabels));
  EXPECT_TRUE(contains(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
                       {"ampx-train: '" + images.string() + "' is not a valid gzip file"}));
}

TEST_F(TrainDataTest, RejectsTrailingBytes) {
  Bytes long_pixels = pixels();
  long_pixels.push_back(7);
  const auto labels = write("lbl", idx_labels(kLabels));
  for (bool gz : {false, true}) {
    SCOPED_TRACE(gz ? "gzip" : "plain");
    const auto images = write(gz ? "img.gz" : "img", idx_images(3, 3, 2, long_pixels), gz);
    EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
              "ampx-train: '" + images.string() +
                  "' holds more than the 18 bytes of pixel data its IDX header announces");
  }
}

TEST_F(TrainDataTest, RejectsImageLabelCountMismatch) {
  const auto images = write("img", idx_images(3, 3, 2, pixels()));
  const auto labels = write("lbl", idx_labels({1, 2}));
  EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
            "ampx-train: '" + images.string() + "' has 3 images but '" + labels.string() +
                "' has 2 labels");
}

TEST_F(TrainDataTest, RejectsLabelOutOfRange) {
  const auto images = write("img", idx_images(3, 3, 2, pixels()));
  const auto labels = write("lbl", idx_labels({9, 10, 3}));
  EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
            "ampx-train: label file '" + labels.string() +
                "' has label 10 at index 1; labels must be < 10");
}

TEST_F(TrainDataTest, RejectsZeroImageSize) {
  const auto images = write("img", idx_images(3, 0, 2, {}));
  const auto labels = write("lbl", idx_labels(kLabels));
  EXPECT_EQ(error_text([&] { (void)ampx::train::read_idx(images, labels); }),
            "ampx-train: '" + images.string() + "' has dimension 1 of size 0 in its IDX header");
}

TEST_F(TrainDataTest, RejectsTrainAndTestOfDifferentImageSizes) {
  write_dataset("mnist", /*gz=*/false);
  write("mnist/t10k-images-idx3-ubyte", idx_images(2, 2, 3, Bytes(12, 0)));
  EXPECT_TRUE(contains(error_text([&] { (void)ampx::train::load_mnist(dir_); }),
                       {"MNIST training images are 3x2 but test images are 2x3"}));
}

// ---- data folder ------------------------------------------------------------

TEST_F(TrainDataTest, ResolveDataDirPrecedence) {
  EnvGuard ampx_dir("AMPX_DATA_DIR", "/env/ampx");
  EnvGuard xdg("XDG_CACHE_HOME", "/env/xdg");
  EnvGuard home("HOME", "/env/home");
  EXPECT_EQ(ampx::train::resolve_data_dir("/flag"), fs::path("/flag"));
  EXPECT_EQ(ampx::train::resolve_data_dir(""), fs::path("/env/ampx"));
  {
    EnvGuard no_ampx("AMPX_DATA_DIR", nullptr);
    EXPECT_EQ(ampx::train::resolve_data_dir(""), fs::path("/env/xdg/ampx/data"));
    {
      EnvGuard empty_xdg("XDG_CACHE_HOME", "");  // empty counts as unset
      EXPECT_EQ(ampx::train::resolve_data_dir(""), fs::path("/env/home/.cache/ampx/data"));
      EXPECT_EQ(ampx::train::resolve_data_dir("rel/dir"), fs::path("rel/dir"));
      EnvGuard no_home("HOME", nullptr);
      EXPECT_TRUE(contains(error_text([] { (void)ampx::train::resolve_data_dir(""); }),
                           {"AMPX_DATA_DIR, XDG_CACHE_HOME and HOME are all unset"}));
    }
  }
  EXPECT_EQ(ampx::train::resolve_data_dir(""), fs::path("/env/ampx"));  // restored
}

TEST_F(TrainDataTest, InstallDataHintQuotesOnlyWhenNeeded) {
  EXPECT_EQ(ampx::train::install_data_hint("/x"), "scripts/install-data.sh /x");
  EXPECT_EQ(ampx::train::install_data_hint("/home/me/.cache/ampx/data"),
            "scripts/install-data.sh /home/me/.cache/ampx/data");
  EXPECT_EQ(ampx::train::install_data_hint("/my data/it's"),
            "scripts/install-data.sh '/my data/it'\\''s'");
}

// ---- text -------------------------------------------------------------------

TEST_F(TrainDataTest, LoadTextBuildsSortedVocabAndSplits) {
  // 20 bytes, two of them above 127 (UTF-8 "é"): they sort after ASCII.
  const std::string text = "call me Ishmael. \xc3\xa9!";
  ASSERT_EQ(text.size(), 20u);
  const auto file = write("t.txt", Bytes(text.begin(), text.end()));
  const TextData data = ampx::train::load_text(file, 0.25);

  EXPECT_EQ(data.vocab, std::string(" !.Iacehlms") + "\xa9\xc3");
  EXPECT_EQ(data.train.scalar_type(), torch::kLong);
  EXPECT_EQ(data.val.scalar_type(), torch::kLong);
  EXPECT_EQ(data.train.numel(), 15);  // first 75%
  EXPECT_EQ(data.val.numel(), 5);     // round(20 * 0.25)

  std::string decoded;
  for (const auto& part : {data.train, data.val}) {
    for (int64_t i = 0; i < part.numel(); ++i) {
      const int64_t id = part[i].item<int64_t>();
      ASSERT_GE(id, 0);
      ASSERT_LT(id, static_cast<int64_t>(data.vocab.size()));
      decoded += data.vocab[static_cast<size_t>(id)];
    }
  }
  EXPECT_EQ(decoded, text);
  EXPECT_EQ(data.train[0].item<int64_t>(), 5);  // 'c'
  EXPECT_EQ(data.val[4].item<int64_t>(), 1);    // '!'
  EXPECT_EQ(data.val[3].item<int64_t>(), 11);   // 0xa9
}

TEST_F(TrainDataTest, LoadTextDefaultHoldsOutATenth) {
  const std::string text(1000, 'a');
  const auto file = write("t.txt", Bytes(text.begin(), text.end()));
  const TextData data = ampx::train::load_text(file);
  EXPECT_EQ(data.vocab, "a");
  EXPECT_EQ(data.train.numel(), 900);
  EXPECT_EQ(data.val.numel(), 100);
  EXPECT_EQ(data.train.sum().item<int64_t>(), 0);
}

TEST_F(TrainDataTest, LoadMobyDickReadsDataTxtUnderMobyDick) {
  std::string text;
  for (int i = 0; i < 10; ++i) text += "Call me Ishmael. ";
  write_text(dir_ / "moby-dick" / "data.txt", text);
  const TextData data = ampx::train::load_moby_dick(dir_);
  EXPECT_EQ(data.train.numel() + data.val.numel(), static_cast<int64_t>(text.size()));
  EXPECT_EQ(data.val.numel(), 17);  // round(170 * 0.1)
  EXPECT_EQ(data.vocab, " .CIaehlms");
}

TEST_F(TrainDataTest, LoadTextErrors) {
  const auto file = write("t.txt", Bytes(100, 'x'));
  for (double bad : {0.0, 1.0, -0.5, 1.5}) {
    EXPECT_EQ(error_text([&] { (void)ampx::train::load_text(file, bad); }),
              "ampx-train: val_fraction must be in (0, 1), got " + c10::str(bad));
  }
  EXPECT_TRUE(contains(error_text([&] { (void)ampx::train::load_text(file, std::nan("")); }),
                       {"val_fraction must be in (0, 1), got nan"}));

  EXPECT_EQ(error_text([&] { (void)ampx::train::load_text(dir_ / "none.txt"); }),
            "ampx-train: text file '" + (dir_ / "none.txt").string() + "' not found");

  const auto empty = write("empty.txt", {});
  EXPECT_EQ(error_text([&] { (void)ampx::train::load_text(empty); }),
            "ampx-train: text file '" + empty.string() + "' is empty");

  const auto tiny = write("tiny.txt", Bytes(3, 'y'));  // round(1.5) = 2 held out, 1 left
  EXPECT_EQ(error_text([&] { (void)ampx::train::load_text(tiny, 0.5); }),
            "ampx-train: text file '" + tiny.string() +
                "' is too short: its 3 bytes split at val_fraction 0.5 into 1 training and 2 "
                "validation tokens, and each split needs at least 2");
  EXPECT_TRUE(contains(error_text([&] { (void)ampx::train::load_text(file, 0.01); }),
                       {"into 99 training and 1 validation tokens"}));
  const auto four = write("four.txt", Bytes(4, 'z'));
  EXPECT_EQ(ampx::train::load_text(four, 0.5).val.numel(), 2);  // the smallest that works
}

TEST_F(TrainDataTest, MissingMobyDickNamesPathAndInstallCommand) {
  EXPECT_EQ(error_text([&] { (void)ampx::train::load_moby_dick(dir_); }),
            "ampx-train: Moby Dick file '" + (dir_ / "moby-dick" / "data.txt").string() +
                "' not found; install the data with: scripts/install-data.sh " + dir_.string());
}

}  // namespace
