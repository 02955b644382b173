#pragma once

// ampx-train's datasets, read whole into CPU tensors: MNIST and Fashion-MNIST
// (IDX files, plain or gzip-compressed) for the image workloads, and Moby Dick
// (one text file, byte-level tokens) for the language-model workload. The
// files come from scripts/install-data.sh; training itself needs no network.
//
//   auto dir = ampx::train::resolve_data_dir(flag);      // --data-dir, env, cache
//   auto mnist = ampx::train::load_mnist(dir);           // images uint8 [60000, 28, 28]
//   auto text = ampx::train::load_moby_dick(dir);        // ids int64, 90% train / 10% val
//
// Every problem with a file (missing, wrong magic, truncated, inconsistent)
// throws c10::Error whose message names the file and the offending values; a
// missing dataset's message ends with the command that installs it.

#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <string>

namespace ampx {
namespace train {

/// Data folder: `flag` if non-empty, else $AMPX_DATA_DIR, else
/// $XDG_CACHE_HOME/ampx/data, else $HOME/.cache/ampx/data (empty variables
/// count as unset). Throws if none of them is set.
[[nodiscard]] std::filesystem::path resolve_data_dir(const std::string& flag);

/// The command that installs the data, for error messages:
/// "scripts/install-data.sh /x" (the folder shell-quoted when it needs it).
[[nodiscard]] std::string install_data_hint(const std::filesystem::path& data_dir);

/// One split of an image dataset, as stored in its IDX files.
struct ImageSplit {
  torch::Tensor images;  // uint8 [N, rows, cols], as stored
  torch::Tensor labels;  // int64 [N]
};

/// An image classification dataset: train and test splits of equal image size.
struct ImageData {
  ImageSplit train, test;
  int64_t num_classes = 10;
};

/// Reads one IDX image file + its IDX label file. Plain or gzip-compressed
/// (read through zlib's gzopen/gzread, which handles both transparently).
/// Images: big-endian int32 magic 0x00000803, then N, rows, cols, then
/// N*rows*cols bytes; labels: magic 0x00000801, then N, then N bytes, each
/// < 10. Anything else (missing file, other magic, truncated or trailing
/// data, count mismatch, label >= 10) throws c10::Error naming the file.
[[nodiscard]] ImageSplit read_idx(const std::filesystem::path& images,
                                  const std::filesystem::path& labels);

/// MNIST from <data>/mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.
[[nodiscard]] ImageData load_mnist(const std::filesystem::path& data_dir);

/// Fashion-MNIST from <data>/fashion-mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz.
[[nodiscard]] ImageData load_fashion_mnist(const std::filesystem::path& data_dir);

/// A text tokenized by bytes, split into a training head and a held-out tail.
struct TextData {
  std::string vocab;    // sorted distinct bytes of the text; token id = index in vocab
  torch::Tensor train;  // int64 [n_train] token ids, first (1 - val_fraction) of the text
  torch::Tensor val;    // int64 [n_val], the rest (held out)
};

/// Reads `file` as bytes (unsigned char). vocab is sorted by unsigned byte
/// value. n_val = round(n * val_fraction), n_train = n - n_val. Throws if the
/// file is missing or empty, if val_fraction is not in (0, 1), or if either
/// split would be shorter than 2 tokens (one input and one target).
[[nodiscard]] TextData load_text(const std::filesystem::path& file, double val_fraction = 0.1);

/// Moby Dick from <data>/moby-dick/data.txt, 10% held out.
[[nodiscard]] TextData load_moby_dick(const std::filesystem::path& data_dir);

}  // namespace train
}  // namespace ampx
