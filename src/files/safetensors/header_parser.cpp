// parse_safetensors_header (header_parser.h): nlohmann-json reads the JSON
// and hands its events, one token at a time, to HeaderEvents, which holds
// them to the safetensors grammar as they come (nothing is built that the
// grammar would refuse). The reader takes the header's bytes through
// CountingIterator, so that every refusal, the JSON's and the grammar's,
// names the byte of the header where the reading stopped.

#include "header_parser.h"

#include <c10/util/Exception.h>

#include <nlohmann/json.hpp>

#include <cstddef>
#include <iterator>
#include <limits>
#include <set>

namespace ampx {
namespace detail {
namespace {

/// The header's bytes for nlohmann-json's reader, counting those it took.
class CountingIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  CountingIterator(const char* at, size_t* taken) : at_(at), taken_(taken) {}
  reference operator*() const { return *at_; }
  CountingIterator& operator++() {
    ++at_;
    ++*taken_;
    return *this;
  }
  CountingIterator operator++(int) {
    CountingIterator before = *this;
    ++*this;
    return before;
  }
  bool operator==(const CountingIterator& o) const { return at_ == o.at_; }
  bool operator!=(const CountingIterator& o) const { return at_ != o.at_; }

 private:
  const char* at_;
  size_t* taken_;
};

using Json = nlohmann::json;
using Entries = std::vector<std::pair<std::string, SafetensorsHeaderEntry>>;

/// `text` for an error: its first 200 bytes and "...", so that a hostile
/// header's 100 MB string (which nlohmann-json's reason quotes whole) makes
/// no 100 MB message.
std::string shown(const std::string& text) {
  constexpr size_t kMost = 200;
  return text.size() <= kMost ? text : text.substr(0, kMost) + "...";
}

/// nlohmann-json's SAX events of the header, held to its grammar: one object
/// of tensor entries (each an object of "dtype", a string, "shape" and
/// "data_offsets", arrays of non-negative integers) and "__metadata__", an
/// object of strings.
class HeaderEvents {
 public:
  HeaderEvents(const std::string& where, const size_t& taken, Entries& entries,
               std::map<std::string, std::string>& metadata)
      : where_(where), taken_(taken), entries_(entries), metadata_(metadata) {}

  bool null() { return unexpected(); }
  bool boolean(bool) { return unexpected(); }
  // The reader gives a number with a '-' here alone ("-0" too), and every
  // other integer to number_unsigned.
  bool number_integer(Json::number_integer_t) { return unexpected(); }
  bool number_unsigned(Json::number_unsigned_t v) { return integer(v); }
  bool number_float(Json::number_float_t, const Json::string_t& text) {
    // Digits alone: an integer past uint64, which the reader made a float.
    const bool digits = text.find_first_not_of("0123456789") == std::string::npos;
    if (digits && (in_ == In::kShape || in_ == In::kOffsets)) fail("an integer too large");
    return unexpected();
  }
  bool binary(Json::binary_t&) { return unexpected(); }  // not made from JSON text

  bool string(Json::string_t& s) {
    if (in_ == In::kDtype) {
      entries_.back().second.dtype = s;
      in_ = In::kEntry;
    } else if (in_ == In::kMetadataValue) {
      metadata_[key_] = s;
      in_ = In::kMetadata;
    } else {
      return unexpected();
    }
    return true;
  }

  bool start_object(std::size_t) {
    if (in_ == In::kStart) {
      in_ = In::kNames;
    } else if (in_ == In::kEntryObject) {
      in_ = In::kEntry;
    } else if (in_ == In::kMetadataObject) {
      in_ = In::kMetadata;
    } else {
      return unexpected();
    }
    return true;
  }

  bool key(Json::string_t& k) {
    switch (in_) {
      case In::kNames:
        if (!names_.insert(k).second) fail("the header names '" + shown(k) + "' twice");
        if (k == "__metadata__") {
          in_ = In::kMetadataObject;
        } else {
          entries_.emplace_back(k, SafetensorsHeaderEntry{});
          dtype_ = shape_ = offsets_ = false;
          in_ = In::kEntryObject;
        }
        break;
      case In::kMetadata:
        key_ = k;
        in_ = In::kMetadataValue;
        break;
      default:  // In::kEntry: the reader gives keys in objects alone
        entry_key(k);
    }
    return true;
  }

  bool end_object() {
    if (in_ == In::kEntry && !(dtype_ && shape_ && offsets_)) {
      fail("a tensor entry without dtype, shape and data_offsets");
    }
    in_ = in_ == In::kNames ? In::kDone : In::kNames;  // from an entry or the metadata
    return true;
  }

  bool start_array(std::size_t) {
    if (in_ == In::kShapeArray) {
      in_ = In::kShape;
    } else if (in_ == In::kOffsetsArray) {
      in_ = In::kOffsets;
      offsets_read_ = 0;
    } else {
      return unexpected();
    }
    return true;
  }

  bool end_array() {  // of a shape or data_offsets: nothing else holds an array
    if (in_ == In::kOffsets && offsets_read_ != 2) fail("data_offsets that are not [begin, end]");
    in_ = In::kEntry;
    return true;
  }

  bool parse_error(std::size_t position, const std::string&, const Json::exception& e) {
    // position: the bytes read, the one the reader stopped at included.
    const size_t at = position > 0 ? position - 1 : 0;
    if (in_ == In::kDone) fail_at(at, "text after the header's object");
    const std::string what = e.what();
    const size_t says = what.find("syntax error");  // past "[json.exception...] ... column C: "
    fail_at(at, "not valid JSON: " + shown(says == std::string::npos ? what : what.substr(says)));
  }

 private:
  // Where the reader is: what the next event may be.
  enum class In {
    kStart,           // the header's object
    kNames,           // its names
    kEntryObject,     // a tensor entry, an object
    kEntry,           // its keys
    kDtype,           // "dtype"'s string
    kShapeArray,      // "shape"'s array
    kShape,           // its integers
    kOffsetsArray,    // "data_offsets"'s array
    kOffsets,         // its integers
    kMetadataObject,  // "__metadata__"'s object
    kMetadata,        // its keys
    kMetadataValue,   // a key's string
    kDone,            // after the header's object: nothing
  };

  void entry_key(const std::string& k) {
    if (k == "dtype" && !dtype_) {
      dtype_ = true;
      in_ = In::kDtype;
    } else if (k == "shape" && !shape_) {
      shape_ = true;
      in_ = In::kShapeArray;
    } else if (k == "data_offsets" && !offsets_) {
      offsets_ = true;
      in_ = In::kOffsetsArray;
    } else {
      fail("an unexpected or repeated key '" + shown(k) + "' in a tensor entry");
    }
  }

  bool integer(uint64_t v) {
    if (in_ != In::kShape && in_ != In::kOffsets) return unexpected();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      fail("an integer too large");
    }
    SafetensorsHeaderEntry& e = entries_.back().second;
    if (in_ == In::kShape) {
      if (e.shape.size() >= 64) fail("more than 64 dimensions");
      e.shape.push_back(static_cast<int64_t>(v));
    } else {
      (offsets_read_ == 0 ? e.begin : e.end) = v;
      if (++offsets_read_ > 2) fail("data_offsets that are not [begin, end]");
    }
    return true;
  }

  /// The refusal of an event the grammar has no place for here: what it
  /// expected instead.
  bool unexpected() {
    switch (in_) {
      case In::kDtype:
      case In::kMetadataValue:
        fail("expected a string");
      case In::kShapeArray:
      case In::kOffsetsArray:
        fail("expected '['");
      case In::kShape:
      case In::kOffsets:
        fail("expected a non-negative integer");
      default:  // kStart, kEntryObject, kMetadataObject: the reader gives values only there
        fail("expected '{'");
    }
  }

  [[noreturn]] void fail(const std::string& what) const {
    // The reader has read the token, and past a number the byte after it.
    fail_at(taken_ > 0 ? taken_ - 1 : 0, what);
  }
  [[noreturn]] void fail_at(size_t at, const std::string& what) const {
    TORCH_CHECK(false, where_, ": ", what, " at byte ", at, " of its header");
  }

  const std::string& where_;
  const size_t& taken_;
  Entries& entries_;
  std::map<std::string, std::string>& metadata_;
  In in_ = In::kStart;
  std::set<std::string> names_;
  std::string key_;                                       // the metadata key whose value is next
  bool dtype_ = false, shape_ = false, offsets_ = false;  // the entry's keys seen
  int offsets_read_ = 0;
};

}  // namespace

void parse_safetensors_header(std::string_view text, const std::string& where, Entries& entries,
                              std::map<std::string, std::string>& metadata) {
  // Two things nlohmann-json's reader lets by that JSON text never holds: a
  // NUL (its end of input: anything after one would be ignored) and a
  // byte-order mark (skipped). The reference reader refuses both.
  const size_t nul = text.find('\0');
  TORCH_CHECK(nul == std::string_view::npos, where, ": a NUL byte, which JSON text never holds, ",
              "at byte ", nul, " of its header");
  TORCH_CHECK(text.substr(0, 3) != "\xEF\xBB\xBF", where,
              ": a byte-order mark, which JSON text must not start with, at byte 0 of its header");
  size_t taken = 0;
  HeaderEvents events(where, taken, entries, metadata);
  // Strict: one value, then white space alone; every refusal throws from
  // `events`, so the parse never returns false.
  Json::sax_parse(CountingIterator(text.data(), &taken),
                  CountingIterator(text.data() + text.size(), &taken), &events,
                  Json::input_format_t::json, true);
}

}  // namespace detail
}  // namespace ampx
