#include "ampx/serialize.h"

#include "archive_check.h"
#include "atomic_file.h"

#include <caffe2/serialize/inline_container.h>
#include <c10/util/Exception.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/serialize.h>

#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

namespace ampx {
namespace {

std::string errno_text() { return std::strerror(errno); }

// Only plain values: what Python's torch.load(weights_only=True) accepts.
void check_plain(const c10::IValue& v, const std::string& key) {
  if (v.isNone() || v.isBool() || v.isInt() || v.isDouble() || v.isString()) {
    return;
  }
  if (v.isList()) {
    for (const auto& item : v.toListRef()) check_plain(item, key);
    return;
  }
  TORCH_CHECK_VALUE(false, "save_state_dict: value of '", key, "' is a ", v.tagKind(),
                    "; state dicts hold None, bool, int, float, str or lists of them");
}

// torch.save's zip layout (data.pkl in an archive folder), pickled without
// TorchScript's type tags: torch::pickle_save tags dicts with
// torch.jit._pickle.restore_type_tag, which torch.load(weights_only=True), the
// default since PyTorch 2.6, refuses.
std::vector<char> to_torch_save_bytes(const StateDict& dict) {
  c10::impl::GenericDict generic(c10::StringType::get(), c10::AnyType::get());
  for (const auto& entry : dict) {
    check_plain(entry.second, entry.first);
    generic.insert(entry.first, entry.second);
  }
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* data, size_t n) { pickled.insert(pickled.end(), data, data + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(generic);
  pickler.stop();
  std::vector<char> zip;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) -> size_t {
    const auto* bytes = static_cast<const char*>(data);
    zip.insert(zip.end(), bytes, bytes + n);
    return n;
  });
  writer.writeRecord("data.pkl", pickled.data(), pickled.size());
  writer.writeEndOfFile();
  return zip;
}

}  // namespace

void save_state_dict(const StateDict& dict, const std::string& path) {
  const std::vector<char> bytes = to_torch_save_bytes(dict);
  detail::write_file_atomically(path, bytes.data(), bytes.size(), "save_state_dict");
}

StateDict load_state_dict(const std::string& path) {
  const auto file = detail::read_file(path);
  TORCH_CHECK(file, "load_state_dict: cannot open '", path, "': ", errno_text());
  const std::vector<char> bytes(file->begin(), file->end());
  TORCH_CHECK(!bytes.empty(), "load_state_dict: '", path, "' is empty");
  c10::IValue value;
  const std::string where = "load_state_dict: '" + path + "'";
  try {
    // LibTorch allocates what the file's length fields say: bound them first.
    detail::check_torch_archive(bytes.data(), bytes.size(), where);
    value = torch::pickle_load(bytes);
  } catch (const c10::Error& e) {
    std::string why = e.what_without_backtrace();
    if (why.rfind(where + ": ", 0) == 0) why.erase(0, where.size() + 2);  // the path once
    TORCH_CHECK(false, where, " is not a readable torch.save file (", why, ")");
  }
  TORCH_CHECK(value.isGenericDict(), "load_state_dict: '", path,
              "' holds a ", value.tagKind(), ", not a dict");
  StateDict dict;
  for (const auto& entry : value.toGenericDict()) {
    TORCH_CHECK(entry.key().isString(), "load_state_dict: '", path,
                "' has a non-string key of type ", entry.key().tagKind());
    dict.emplace(entry.key().toStringRef(), entry.value());
  }
  return dict;
}

void save_archive(torch::serialize::OutputArchive& archive, const std::string& path) {
  std::ostringstream bytes;
  archive.save_to(bytes);
  const std::string data = bytes.str();
  detail::write_file_atomically(path, data.data(), data.size(), "save_archive");
}

void load_archive(torch::serialize::InputArchive& archive, const std::string& path) {
  const auto file = detail::read_file(path);
  TORCH_CHECK(file, "load_archive: cannot open '", path, "': ", errno_text());
  const std::string& bytes = *file;
  const std::string where = "load_archive: '" + path + "'";
  TORCH_CHECK(!bytes.empty(), where, " is empty");
  detail::load_output_archive(bytes, archive, where);
}

}  // namespace ampx
