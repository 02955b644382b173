#include "ampx/debug/range_stats.h"

#include "../files/json/writer.h"
#include "fraction.h"
#include "observer.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <tuple>
#include <utility>

namespace ampx {
namespace debug {
namespace {

using detail::fraction;

size_t format_index(Format f) {
  const auto it = std::find(kAllFormats.begin(), kAllFormats.end(), f);
  TORCH_CHECK(it != kAllFormats.end(), "ampx::debug: unknown format ", static_cast<int>(f));
  return static_cast<size_t>(it - kAllFormats.begin());
}

}  // namespace

const FormatCounts& RangeRecord::counts(Format f) const {
  return formats[format_index(f)];
}

double RangeRecord::fraction_overflow(Format f) const {
  return fraction(counts(f).overflow, nonzero_finite());
}
double RangeRecord::fraction_to_zero(Format f) const {
  return fraction(counts(f).to_zero, nonzero_finite());
}
double RangeRecord::fraction_subnormal(Format f) const {
  return fraction(counts(f).subnormal, nonzero_finite());
}

void RangeRecord::merge(const RangeRecord& o) {
  const bool had = nonzero_finite() > 0;
  calls += o.calls;
  numel += o.numel;
  zeros += o.zeros;
  non_finite += o.non_finite;
  abs_max = std::max(abs_max, o.abs_max);
  if (o.nonzero_finite() > 0)
    min_nonzero = had ? std::min(min_nonzero, o.min_nonzero) : o.min_nonzero;
  for (int i = 0; i < kBins; ++i) histogram[i] += o.histogram[i];
  for (size_t f = 0; f < formats.size(); ++f) {
    formats[f].overflow += o.formats[f].overflow;
    formats[f].to_zero += o.formats[f].to_zero;
    formats[f].subnormal += o.formats[f].subnormal;
  }
}

void RangeStats::merge(const RangeStats& other) {
  std::map<std::tuple<std::string, std::string, Direction>, size_t> index;
  for (size_t i = 0; i < records.size(); ++i) {
    index.emplace(std::make_tuple(records[i].scope, records[i].op, records[i].direction), i);
  }
  for (const auto& r : other.records) {
    const auto [it, added] =
        index.try_emplace(std::make_tuple(r.scope, r.op, r.direction), records.size());
    if (added) {
      records.push_back(r);
    } else {
      records[it->second].merge(r);
    }
  }
  ops_seen += other.ops_seen;
}

RangeRecord RangeStats::merged(const std::string& scope, Direction direction) const {
  RangeRecord out;
  out.scope = scope;
  out.op = "*";
  out.direction = direction;
  for (const auto& r : records) {
    if (r.scope == scope && r.direction == direction) out.merge(r);
  }
  return out;
}

std::vector<std::string> RangeStats::scopes() const {
  std::vector<std::string> out;
  for (const auto& r : records) {
    if (std::find(out.begin(), out.end(), r.scope) == out.end()) out.push_back(r.scope);
  }
  return out;
}

std::string RangeStats::to_json() const {
  using ampx::detail::json_number;
  using ampx::detail::json_string;
  std::ostringstream o;
  o << "{\"ops_seen\": " << ops_seen
    << ", \"histogram_min_exponent\": " << RangeRecord::kMinExponent << ", \"records\": [";
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& r = records[i];
    o << (i ? ",\n" : "\n") << "{\"scope\": " << json_string(r.scope)
      << ", \"op\": " << json_string(r.op)
      << ", \"direction\": " << json_string(to_string(r.direction)) << ", \"calls\": " << r.calls
      << ", \"numel\": " << r.numel << ", \"zeros\": " << r.zeros
      << ", \"non_finite\": " << r.non_finite << ", \"abs_max\": " << json_number(r.abs_max)
      << ", \"min_nonzero\": " << json_number(r.min_nonzero) << ", \"formats\": {";
    for (size_t f = 0; f < kAllFormats.size(); ++f) {
      const auto& c = r.formats[f];
      o << (f ? ", " : "") << json_string(to_string(kAllFormats[f]))
        << ": {\"overflow\": " << c.overflow << ", \"to_zero\": " << c.to_zero
        << ", \"subnormal\": " << c.subnormal << "}";
    }
    // The histogram as [exponent, count] pairs of its non-empty bins.
    o << "}, \"log2_histogram\": [";
    bool first = true;
    for (int b = 0; b < RangeRecord::kBins; ++b) {
      if (r.histogram[b] == 0) continue;
      o << (first ? "" : ", ") << "[" << (RangeRecord::kMinExponent + b) << ", " << r.histogram[b]
        << "]";
      first = false;
    }
    o << "]}";
  }
  o << "\n]}";
  return o.str();
}

struct RangeStatsCollector::Impl : detail::Observer {
  explicit Impl(const RangeStatsOptions& o) : Observer(o.forward(), o.backward()) {}

  void on_op(const detail::OpEvent& event) override {
    for (const auto& out : event.tensors) {
      RangeRecord r = scan_range(out.tensor);
      std::lock_guard<std::mutex> lock(mutex);
      ++stats.ops_seen;
      auto key = std::make_tuple(*event.scope, *event.name, event.direction);
      auto it = index.find(key);
      if (it == index.end()) {
        r.scope = *event.scope;
        r.op = *event.name;
        r.direction = event.direction;
        index.emplace(std::move(key), stats.records.size());
        stats.records.push_back(std::move(r));
      } else {
        stats.records[it->second].merge(r);
      }
    }
  }

  mutable std::mutex mutex;
  RangeStats stats;
  std::map<std::tuple<std::string, std::string, Direction>, size_t> index;
};

RangeStatsCollector::RangeStatsCollector(RangeStatsOptions options)
    : impl_(std::make_unique<Impl>(options)) {
  detail::attach(impl_.get());
}

RangeStatsCollector::~RangeStatsCollector() {
  detail::detach(impl_.get());
}

RangeStats RangeStatsCollector::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return impl_->stats;
}

}  // namespace debug
}  // namespace ampx
