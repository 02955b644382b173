#pragma once

// The JSON header of a safetensors file, parsed by a parser of the format's
// own subset of JSON: one object of tensor entries and an optional
// "__metadata__" object of strings; arrays of integers. A fixed grammar of
// bounded depth is simpler to make safe against hostile files than a general
// parser (tests/fuzz: target safetensors), and its errors name the byte of
// the header where each went wrong, which nlohmann-json's events do not
// (the plan files' reader, src/plan/json_value.cpp, uses nlohmann-json).
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
/// with `where` and naming the byte offset in the header on anything outside
/// the grammar: a repeated name, an entry without dtype, shape and
/// data_offsets, more than 64 dimensions, an integer past int64, text after
/// the object.
void parse_safetensors_header(std::string_view text, const std::string& where,
                              std::vector<std::pair<std::string, SafetensorsHeaderEntry>>& entries,
                              std::map<std::string, std::string>& metadata);

}  // namespace detail
}  // namespace ampx
