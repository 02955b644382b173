#pragma once

// The JSON header of a safetensors file: one object of tensor entries and an
// optional "__metadata__" object of strings; arrays of integers. Read by
// nlohmann-json (a header-only dependency of the library's sources, not of
// its headers), whose events the grammar checks as they come, so a hostile
// file is refused at its first wrong token (tests/fuzz: target
// safetensors); every error names the byte of the header where the reading
// stopped.
//
//   std::vector<std::pair<std::string, SafetensorsHeaderEntry>> entries;
//   std::map<std::string, std::string> metadata;
//   parse_safetensors_header(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
//                            "read_safetensors: 'x.safetensors'", entries, metadata);
//   entries[0].second.end;  // 8

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ampx {
namespace detail {

/// One tensor entry of the header, as written (checked against the data by
/// the reader).
struct SafetensorsHeaderEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // data_offsets
};

/// Appends the entries of the header `text` to `entries`, in the header's
/// order, and its "__metadata__" to `metadata`. Throws c10::Error starting
/// with `where` and naming the byte offset in the header (the last byte read:
/// a token's last, the byte after a number) on text that is not JSON (with
/// nlohmann-json's reason, ill-formed UTF-8 included) and on anything outside
/// the grammar: a repeated name, an entry without dtype, shape and
/// data_offsets, more than 64 dimensions, an integer past int64, text after
/// the object.
void parse_safetensors_header(std::string_view text, const std::string& where,
                              std::vector<std::pair<std::string, SafetensorsHeaderEntry>>& entries,
                              std::map<std::string, std::string>& metadata);

}  // namespace detail
}  // namespace ampx
