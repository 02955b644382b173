// ampx-train's datasets: IDX image files (plain or gzip) and byte-level text.

#include "data.h"

#include "cli/shell.h"

#include <torch/torch.h>
#include <zlib.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <memory>
#include <system_error>
#include <vector>

namespace ampx {
namespace train {

namespace fs = std::filesystem;

namespace {

constexpr uint32_t kImageMagic = 0x00000803;  // unsigned byte data, 3 dimensions
constexpr uint32_t kLabelMagic = 0x00000801;  // unsigned byte data, 1 dimension
constexpr int64_t kNumClasses = 10;
// Deflate cannot expand data more than 1032:1, so a gzip file of S bytes holds
// at most 1032 * S bytes: a header announcing more is refused before allocating.
constexpr int64_t kMaxDeflateRatio = 1032;

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "0x%08x", v);
  return buf;
}

uint32_t big_endian32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

/// Throws unless `path` exists and is not a folder. `what` names the file in
/// the message ("MNIST file"); `hint`, if non-empty, is the install command.
void check_file(const fs::path& path, const std::string& what, const std::string& hint) {
  std::error_code ec;
  const bool exists = fs::exists(path, ec);
  if (!exists && !hint.empty()) {
    TORCH_CHECK(false, "ampx-train: ", what, " '", path.string(),
                "' not found; install the data with: ", hint);
  }
  TORCH_CHECK(exists, "ampx-train: ", what, " '", path.string(), "' not found");
  TORCH_CHECK(!fs::is_directory(path, ec), "ampx-train: ", what, " '", path.string(),
              "' is a folder, not a file");
}

/// A gzopen'ed file: reads gzip-compressed and plain files alike.
class GzFile {
 public:
  explicit GzFile(const fs::path& path) : path_(path) {
    check_file(path, "IDX file", "");
    std::error_code ec;
    size_ = static_cast<int64_t>(fs::file_size(path, ec));
    TORCH_CHECK(!ec, "ampx-train: cannot read the size of '", path.string(), "': ", ec.message());
    errno = 0;
    file_ = gzopen(path.c_str(), "rb");
    TORCH_CHECK(file_ != nullptr, "ampx-train: cannot open '", path.string(),
                "': ", errno ? std::strerror(errno) : "out of memory");
    gzbuffer(file_, 1 << 17);  // before the first read; large reads bypass it anyway
  }
  ~GzFile() { gzclose(file_); }
  GzFile(const GzFile&) = delete;
  GzFile& operator=(const GzFile&) = delete;

  /// Reads up to n bytes into dst; fewer only at the end of the data. A corrupt
  /// gzip stream throws; a cut-off one just ends early (the caller reports it).
  int64_t read(void* dst, int64_t n) {
    auto* out = static_cast<char*>(dst);
    int64_t total = 0;
    while (total < n) {
      const auto chunk = static_cast<unsigned>(std::min<int64_t>(n - total, int64_t{1} << 30));
      const int got = gzread(file_, out + total, chunk);
      // zlib 1.3.2 clears "unexpected end of file" at the next read (1.2.13
      // keeps it): remember it for check_stream.
      int err = Z_OK;
      const char* msg = gzerror(file_, &err);
      if (err == Z_BUF_ERROR && cut_off_.empty()) cut_off_ = msg;
      if (got <= 0) {
        check_stream(/*end_is_error=*/false);
        break;
      }
      total += got;
    }
    return total;
  }

  /// Throws if zlib saw an error; with end_is_error, also if a gzip stream
  /// ended before its trailer (so its CRC was never checked).
  void check_stream(bool end_is_error) {
    int err = Z_OK;
    const char* msg = gzerror(file_, &err);
    if (end_is_error && err == Z_OK && !cut_off_.empty()) {
      err = Z_BUF_ERROR;
      msg = cut_off_.c_str();
    }
    if (err == Z_OK || (err == Z_BUF_ERROR && !end_is_error)) return;
    TORCH_CHECK(false, "ampx-train: '", path_.string(), "' is not a valid gzip file: ", msg);
  }

  /// True if the file is not gzip-compressed (valid after the first read).
  bool plain() const { return gzdirect(file_) == 1; }
  /// Size on disk, in bytes.
  int64_t size() const { return size_; }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
  int64_t size_ = 0;
  gzFile file_ = nullptr;
  std::string cut_off_;  // zlib's "unexpected end of file", once seen
};

/// An open IDX file whose header has been read; the payload comes next.
struct IdxFile {
  std::unique_ptr<GzFile> file;
  std::vector<int64_t> dims;
  int64_t header_bytes = 0;
};

IdxFile open_idx(const fs::path& path, uint32_t magic, size_t ndims, const char* kind) {
  IdxFile idx{std::make_unique<GzFile>(path), {}, static_cast<int64_t>(4 + 4 * ndims)};
  std::array<unsigned char, 4 + 4 * 3> header{};
  const int64_t got = idx.file->read(header.data(), idx.header_bytes);
  TORCH_CHECK(got >= 4, "ampx-train: '", path.string(), "' is not an IDX ", kind,
              " file: it holds only ", got, " bytes");
  const uint32_t found = big_endian32(header.data());
  TORCH_CHECK(found == magic, "ampx-train: '", path.string(), "' is not an IDX ", kind,
              " file: magic ", hex32(found), ", expected ", hex32(magic));
  TORCH_CHECK(got == idx.header_bytes, "ampx-train: '", path.string(),
              "' is truncated: expected a ", idx.header_bytes, "-byte IDX header, got ", got,
              " bytes");
  for (size_t i = 0; i < ndims; ++i) {
    const auto d = static_cast<int32_t>(big_endian32(header.data() + 4 + 4 * i));
    TORCH_CHECK(d >= (i == 0 ? 0 : 1), "ampx-train: '", path.string(), "' has dimension ", i,
                " of size ", d, " in its IDX header");
    idx.dims.push_back(d);
  }
  return idx;
}

/// Throws unless the file can hold the `n` payload bytes its header announces;
/// called before allocating them, so a corrupt header cannot ask for terabytes.
void check_payload_fits(const IdxFile& idx, int64_t n, const char* what) {
  const GzFile& f = *idx.file;
  if (f.plain()) {
    const int64_t available = f.size() - idx.header_bytes;
    TORCH_CHECK(available >= n, "ampx-train: '", f.path().string(), "' is truncated: expected ", n,
                " bytes of ", what, ", got ", available);
  } else {
    TORCH_CHECK(n <= kMaxDeflateRatio * f.size(), "ampx-train: '", f.path().string(),
                "' is truncated: expected ", n, " bytes of ", what, ", but a gzip file of ",
                f.size(), " bytes cannot hold them");
  }
}

/// Reads the `n` payload bytes that follow the header into `dst`, refusing
/// a payload that is shorter or longer than the header says.
void read_payload(IdxFile& idx, void* dst, int64_t n, const char* what) {
  GzFile& f = *idx.file;
  const std::string path = f.path().string();
  const int64_t got = f.read(dst, n);
  TORCH_CHECK(got == n, "ampx-train: '", path, "' is truncated: expected ", n, " bytes of ", what,
              ", got ", got);
  char extra = 0;
  TORCH_CHECK(f.read(&extra, 1) == 0, "ampx-train: '", path, "' holds more than the ", n,
              " bytes of ", what, " its IDX header announces");
  f.check_stream(/*end_is_error=*/true);
}

std::string dims_text(const std::vector<int64_t>& dims) {
  std::string s;
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? "x" : "") + std::to_string(dims[i]);
  return s;
}

/// Loads <data>/<subdir>/{train,t10k}-{images-idx3,labels-idx1}-ubyte<suffix>.
ImageData load_image_data(const fs::path& data_dir, const std::string& name,
                          const std::string& subdir, const std::string& suffix) {
  const fs::path dir = data_dir / subdir;
  auto file = [&](const std::string& stem) { return dir / (stem + "-ubyte" + suffix); };
  const fs::path files[4] = {file("train-images-idx3"), file("train-labels-idx1"),
                             file("t10k-images-idx3"), file("t10k-labels-idx1")};
  const std::string hint = install_data_hint(data_dir);
  for (const auto& f : files) check_file(f, name + " file", hint);

  ImageData data;
  data.train = read_idx(files[0], files[1]);
  data.test = read_idx(files[2], files[3]);
  data.num_classes = kNumClasses;
  const auto train_hw = data.train.images.sizes().slice(1);
  const auto test_hw = data.test.images.sizes().slice(1);
  TORCH_CHECK(train_hw.equals(test_hw), "ampx-train: ", name, " training images are ",
              dims_text(train_hw.vec()), " but test images are ", dims_text(test_hw.vec()), " ('",
              files[0].string(), "', '", files[2].string(), "')");
  return data;
}

}  // namespace

fs::path resolve_data_dir(const std::string& flag) {
  if (!flag.empty()) return fs::path(flag);
  if (auto dir = env_or_empty("AMPX_DATA_DIR"); !dir.empty()) return fs::path(dir);
  if (auto cache = env_or_empty("XDG_CACHE_HOME"); !cache.empty()) {
    return fs::path(cache) / "ampx" / "data";
  }
  if (auto home = env_or_empty("HOME"); !home.empty()) {
    return fs::path(home) / ".cache" / "ampx" / "data";
  }
  TORCH_CHECK(false,
              "ampx-train: no data folder: none was given and AMPX_DATA_DIR, XDG_CACHE_HOME and "
              "HOME are all unset");
}

std::string install_data_hint(const fs::path& data_dir) {
  return "scripts/install-data.sh " + shell_quote(data_dir.string());
}

ImageSplit read_idx(const fs::path& images, const fs::path& labels) {
  IdxFile image_file = open_idx(images, kImageMagic, 3, "image");
  IdxFile label_file = open_idx(labels, kLabelMagic, 1, "label");
  const int64_t n = image_file.dims[0], rows = image_file.dims[1], cols = image_file.dims[2];
  TORCH_CHECK(label_file.dims[0] == n, "ampx-train: '", images.string(), "' has ", n,
              " images but '", labels.string(), "' has ", label_file.dims[0], " labels");
  // rows * cols < 2^62; n * rows * cols may overflow int64 on a corrupt header.
  const int64_t per_image = rows * cols;
  TORCH_CHECK(n == 0 || per_image <= std::numeric_limits<int64_t>::max() / n, "ampx-train: '",
              images.string(), "' announces ", n, " images of ", rows, "x", cols,
              ", more bytes than any file holds");

  check_payload_fits(image_file, n * per_image, "pixel data");
  check_payload_fits(label_file, n, "labels");

  ImageSplit split;
  split.images = torch::empty({n, rows, cols}, torch::kUInt8);  // read straight into it
  read_payload(image_file, split.images.data_ptr<uint8_t>(), n * per_image, "pixel data");

  auto raw_labels = torch::empty({n}, torch::kUInt8);
  uint8_t* label = raw_labels.data_ptr<uint8_t>();
  read_payload(label_file, label, n, "labels");
  const uint8_t* bad = std::find_if(label, label + n, [](uint8_t v) { return v >= kNumClasses; });
  TORCH_CHECK(bad == label + n, "ampx-train: label file '", labels.string(), "' has label ",
              int{*bad}, " at index ", bad - label, "; labels must be < ", kNumClasses);
  split.labels = raw_labels.to(torch::kLong);
  return split;
}

ImageData load_mnist(const fs::path& data_dir) {
  return load_image_data(data_dir, "MNIST", "mnist", "");
}

ImageData load_fashion_mnist(const fs::path& data_dir) {
  return load_image_data(data_dir, "Fashion-MNIST", "fashion-mnist", ".gz");
}

TextData load_text(const fs::path& file, double val_fraction) {
  TORCH_CHECK(val_fraction > 0.0 && val_fraction < 1.0,
              "ampx-train: val_fraction must be in (0, 1), got ", val_fraction);
  check_file(file, "text file", "");
  std::ifstream in(file, std::ios::binary);
  TORCH_CHECK(in, "ampx-train: cannot open text file '", file.string(),
              "': ", std::strerror(errno));
  std::error_code ec;
  const auto size = fs::file_size(file, ec);
  TORCH_CHECK(!ec, "ampx-train: cannot read the size of '", file.string(), "': ", ec.message());
  std::string text(size, '\0');
  in.read(text.data(), static_cast<std::streamsize>(size));
  TORCH_CHECK(static_cast<uint64_t>(in.gcount()) == size, "ampx-train: could read only ",
              in.gcount(), " of the ", size, " bytes of text file '", file.string(), "'");
  TORCH_CHECK(!text.empty(), "ampx-train: text file '", file.string(), "' is empty");

  const auto n = static_cast<int64_t>(text.size());
  const auto n_val = static_cast<int64_t>(std::llround(static_cast<double>(n) * val_fraction));
  const int64_t n_train = n - n_val;
  // Each split needs one input and one target token at least.
  TORCH_CHECK(n_train >= 2 && n_val >= 2, "ampx-train: text file '", file.string(),
              "' is too short: its ", n, " bytes split at val_fraction ", val_fraction, " into ",
              n_train, " training and ", n_val,
              " validation tokens, and each split needs at least 2");

  std::array<bool, 256> present{};
  for (char c : text) present[static_cast<unsigned char>(c)] = true;
  TextData data;
  std::array<int64_t, 256> id{};
  for (int b = 0; b < 256; ++b) {
    if (!present[b]) continue;
    id[b] = static_cast<int64_t>(data.vocab.size());
    data.vocab.push_back(static_cast<char>(b));
  }
  auto ids = torch::empty({n}, torch::kLong);
  int64_t* out = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) out[i] = id[static_cast<unsigned char>(text[i])];
  data.train = ids.slice(0, 0, n_train).clone();
  data.val = ids.slice(0, n_train, n).clone();
  return data;
}

TextData load_moby_dick(const fs::path& data_dir) {
  const fs::path file = data_dir / "moby-dick" / "data.txt";
  check_file(file, "Moby Dick file", install_data_hint(data_dir));
  return load_text(file, 0.1);
}

}  // namespace train
}  // namespace ampx
