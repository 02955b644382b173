// check_output_archive: the whole check of a file torch::serialize::
// OutputArchive wrote (torch::save of a module, an optimizer, a
// ZeroRedundancyOptimizer shard, ampx-train's checkpoint payload) before
// LibTorch reads it, and load_output_archive, which then reads it.
// src/files/archive/ holds the parsers it runs (archive_check.h).

#include "archive_check.h"

#include "archive/module_source.h"
#include "archive/pickle_lengths.h"
#include "archive/pickle_machine.h"

#include <c10/util/Exception.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace ampx {
namespace detail {
namespace {

bool ends_with(const std::string& name, const char* tail) {
  const size_t n = std::strlen(tail);
  return name.size() >= n && name.compare(name.size() - n, n, tail) == 0;
}

}  // namespace

void check_output_archive(const std::string& bytes, const std::string& what) {
  const auto records = check_torch_archive(bytes.data(), bytes.size(), what);
  // Deflated records (LibTorch deflates TorchScript code) are read through
  // LibTorch's own zip reader, over `bytes` in place: check_torch_archive
  // has bounded their sizes and ratios, so inflating them allocates at most
  // what the file promises.
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> reader;
  const auto inflated = [&](const ArchiveRecord& r) {
    std::tuple<at::DataPtr, size_t> record;
    try {
      if (!reader) {
        reader = std::make_unique<caffe2::serialize::PyTorchStreamReader>(
            std::make_shared<caffe2::serialize::MemoryReadAdapter>(
                bytes.data(), static_cast<off_t>(bytes.size())));
      }
      // The reader names records without the archive's top folder.
      const auto slash = r.name.find('/');
      record = reader->getRecord(slash == std::string::npos ? r.name : r.name.substr(slash + 1));
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, what, ": zip record '", r.name, "' does not inflate (",
                  e.what_without_backtrace(), ")");
    }
    TORCH_CHECK(std::get<1>(record) == r.inflated_size, what, ": zip record '", r.name,
                "' does not inflate to its ", r.inflated_size, " bytes");
    return std::string(static_cast<const char*>(std::get<0>(record).get()), std::get<1>(record));
  };
  std::map<std::string, uint64_t> storages;  // data/<key> -> bytes
  const ArchiveRecord* data_pkl = nullptr;
  for (const auto& r : records) {
    const size_t data = r.name.find("/data/");
    if (data != std::string::npos && !r.deflated) storages[r.name.substr(data + 6)] = r.size;
    if (ends_with(r.name, "/data.pkl")) data_pkl = &r;
    if (ends_with(r.name, "/constants.pkl")) {
      // OutputArchive's modules have no constants: an empty tuple.
      TORCH_CHECK(bytes.compare(r.offset, r.size, std::string("\x80\x02).", 4)) == 0, what,
                  ": zip record '", r.name, "' is not the empty constants table ",
                  "torch::serialize::OutputArchive writes");
    }
    if (r.name.find("/code/") == std::string::npos) continue;
    if (ends_with(r.name, ".debug_pkl")) {
      TORCH_CHECK(!r.deflated, what, ": zip record '", r.name, "' is deflated; LibTorch stores ",
                  "debug pickles as they are");
      check_pickle(bytes.data() + r.offset, r.size, what + " (" + r.name + ")");
    } else {
      const std::string source = r.deflated ? inflated(r) : bytes.substr(r.offset, r.size);
      check_attribute_module_source(r.name, source, what);
    }
  }
  TORCH_CHECK(data_pkl != nullptr, what, ": no data.pkl record: not an archive ",
              "torch::serialize::OutputArchive writes");
  check_output_archive_pickle(bytes.data() + data_pkl->offset, data_pkl->size, storages, what);
}

void load_output_archive(const std::string& bytes, torch::serialize::InputArchive& archive,
                         const std::string& what) {
  check_output_archive(bytes, what);
  try {
    archive.load_from(bytes.data(), bytes.size());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, " holds no readable LibTorch archive: ", e.what_without_backtrace());
  }
}

}  // namespace detail
}  // namespace ampx
