#include "ampx/debug/advisor.h"

#include "../files/json/writer.h"
#include "ampx/debug/scope.h"
#include "fraction.h"

#include <algorithm>
#include <cmath>
#include <iomanip>
#include <sstream>
#include <utility>

namespace ampx {
namespace debug {
namespace {

using detail::fraction;

// v with three significant digits: "65536" -> "6.55e+04", "0.000123".
std::string three_digits(double v) {
  std::ostringstream s;
  s << std::setprecision(3) << v;
  return s.str();
}

std::string percent(double f) {
  std::ostringstream s;
  s << std::setprecision(3) << 100.0 * f << "%";
  return s.str();
}

// Values of `r` that fall at or below 2^limit_exp, read from whole histogram
// bins: a bin [2^e, 2^(e+1)) counts when 2^(e+1) <= 2^limit_exp.
int64_t below_power_of_two(const RangeRecord& r, int limit_exp) {
  int64_t n = 0;
  for (int b = 0; b < RangeRecord::kBins; ++b) {
    if (RangeRecord::kMinExponent + b + 1 <= limit_exp) n += r.histogram[b];
  }
  return n;
}

// Power-of-two exponent of the zero boundary of `f`: min_subnormal / 2.
int zero_exponent(Format f) {
  return std::ilogb(format(f).zero_up_to);
}

// Ops outside every named scope (data preparation, the loss, the seed
// gradient of backward) are not the model's: autocast keeps losses in fp32.
// They are judged only when nothing is named at all.
bool judged(const RangeStats& stats, const std::string& scope) {
  if (!scope.empty()) return true;
  const auto scopes = stats.scopes();
  return std::all_of(scopes.begin(), scopes.end(), [](const std::string& s) { return s.empty(); });
}

std::vector<RangeRecord> per_scope(const RangeStats& stats, Direction d) {
  std::vector<RangeRecord> out;
  for (const auto& scope : stats.scopes()) {
    if (!judged(stats, scope)) continue;
    auto r = stats.merged(scope, d);
    if (r.numel > 0) out.push_back(std::move(r));
  }
  return out;
}

void sort_findings(std::vector<ScopeFinding>* v, bool by_overflow) {
  std::stable_sort(v->begin(), v->end(), [&](const ScopeFinding& a, const ScopeFinding& b) {
    return by_overflow ? a.abs_max > b.abs_max : a.fraction_to_zero > b.fraction_to_zero;
  });
}

std::string list_scopes(const std::vector<ScopeFinding>& v, bool with_max) {
  std::ostringstream s;
  const size_t shown = std::min<size_t>(v.size(), 3);
  for (size_t i = 0; i < shown; ++i) {
    s << (i ? ", " : "") << scope_label(v[i].scope)
      << (with_max ? " max " + three_digits(v[i].abs_max)
                   : " " + percent(v[i].fraction_to_zero) + " to zero");
  }
  if (v.size() > shown) s << " and " << v.size() - shown << " more";
  return s.str();
}

std::string layers(size_t n) {
  return std::to_string(n) + (n == 1 ? " layer's" : " layers'");
}

// fp16 and bf16: activations as they are, gradients at the loss scale.
FormatAdvice advise_16bit(Format f, const RangeStats& stats, const AdvisorOptions& o) {
  FormatAdvice a;
  a.format = f;
  const auto& lim = format(f);
  const auto acts = per_scope(stats, Direction::kForward);
  const auto grads = per_scope(stats, Direction::kBackward);
  for (const auto& r : acts) {
    ScopeFinding s{r.scope,       Direction::kForward,    r.abs_max,
                   r.min_nonzero, r.fraction_overflow(f), r.fraction_to_zero(f)};
    if (r.counts(f).overflow > 0) a.overflows.push_back(s);
  }
  // Loss scale: fp16 takes the largest power of two that keeps the largest
  // gradient below max / headroom; bf16 has fp32's range and needs none.
  double grad_max = 0;
  for (const auto& r : grads) grad_max = std::max(grad_max, r.abs_max);
  int k = 0;
  if (f == Format::kFloat16 && !grads.empty()) {
    k = grad_max > 0 ? static_cast<int>(std::floor(std::log2(lim.max / o.headroom() / grad_max)))
                     : 16;
    k = std::max(-24, std::min(k, 64));
  }
  a.loss_scale = std::ldexp(1.0, k);
  int64_t lost = 0, total = 0;
  for (const auto& r : grads) {
    // Scaling by 2^k moves every value k binades up: exact on the histogram.
    // At k = 0 the exact per-format count is used.
    const int64_t to_zero =
        k == 0 ? r.counts(f).to_zero : below_power_of_two(r, zero_exponent(f) - k);
    const int64_t overflow = k == 0 ? r.counts(f).overflow : 0;
    lost += to_zero;
    total += r.nonzero_finite();
    ScopeFinding s{r.scope,
                   Direction::kBackward,
                   r.abs_max,
                   r.min_nonzero,
                   fraction(overflow, r.nonzero_finite()),
                   fraction(to_zero, r.nonzero_finite())};
    if (overflow > 0) a.overflows.push_back(s);
    if (s.fraction_to_zero > o.underflow_tolerance()) a.underflows.push_back(s);
  }
  sort_findings(&a.overflows, true);
  sort_findings(&a.underflows, false);
  const std::string name = lim.name;
  const double lost_fraction = fraction(lost, total);
  if (!a.overflows.empty()) {
    a.verdict = Verdict::kOverflows;
    a.reasons.push_back(name + ": " + layers(a.overflows.size()) + " values exceed " +
                        three_digits(lim.max) + " (" + list_scopes(a.overflows, true) +
                        "); use a wider format or keep those layers in fp32 with a cast policy "
                        "(ampx::policy)");
  }
  if (!grads.empty() && lost_fraction > o.underflow_tolerance()) {
    if (a.verdict == Verdict::kSafe) a.verdict = Verdict::kUnderflows;
    a.reasons.push_back(
        name + ": " + percent(lost_fraction) + " of gradient values round to zero" +
        (k != 0 ? " even at loss scale " + three_digits(a.loss_scale) : std::string()) + " (" +
        list_scopes(a.underflows, false) + ")");
  }
  if (f == Format::kFloat16 && a.verdict == Verdict::kSafe && !grads.empty()) {
    a.verdict = Verdict::kNeedsScaling;
    a.reasons.push_back(name + ": largest gradient " + three_digits(grad_max) + "; loss scale " +
                        three_digits(a.loss_scale) + " keeps it below " +
                        three_digits(lim.max / o.headroom()) + " and loses " +
                        percent(lost_fraction) + " of gradient values to zero (GradScaler finds " +
                        "such a scale by itself)");
  }
  if (a.verdict == Verdict::kSafe) {
    a.reasons.push_back(name + ": no value overflows; " + percent(lost_fraction) +
                        " of gradient values round to zero");
  }
  return a;
}

// fp8 as Transformer Engine uses it: each tensor scaled so that its amax
// meets the format's max (e4m3 for activations, e5m2 for gradients).
FormatAdvice advise_fp8(Format f, const RangeStats& stats, const AdvisorOptions& o) {
  FormatAdvice a;
  a.format = f;
  const auto& lim = format(f);
  const Direction d = f == Format::kFloat8E4M3 ? Direction::kForward : Direction::kBackward;
  // Per scope: merge the op records' losses, each op scaled on its own amax.
  std::vector<std::string> order;
  std::vector<std::pair<int64_t, int64_t>> lost;  // (to zero, non-zero)
  std::vector<RangeRecord> merged;
  bool raw_problem = false;
  for (const auto& r : stats.records) {
    if (r.direction != d || r.nonzero_finite() == 0 || !judged(stats, r.scope)) continue;
    if (r.counts(f).overflow > 0 || r.fraction_to_zero(f) > o.underflow_tolerance())
      raw_problem = true;
    const int shift = static_cast<int>(std::floor(std::log2(lim.max / r.abs_max)));
    const int64_t to_zero = below_power_of_two(r, zero_exponent(f) - shift);
    auto it = std::find(order.begin(), order.end(), r.scope);
    if (it == order.end()) {
      order.push_back(r.scope);
      lost.emplace_back(0, 0);
      merged.push_back(r);
      it = order.end() - 1;
    } else {
      merged[it - order.begin()].merge(r);
    }
    auto& l = lost[it - order.begin()];
    l.first += to_zero;
    l.second += r.nonzero_finite();
  }
  int64_t all_lost = 0, all = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    all_lost += lost[i].first;
    all += lost[i].second;
    const double frac = fraction(lost[i].first, lost[i].second);
    if (frac > o.underflow_tolerance()) {
      a.underflows.push_back(
          ScopeFinding{order[i], d, merged[i].abs_max, merged[i].min_nonzero, 0.0, frac});
    }
  }
  sort_findings(&a.underflows, false);
  const std::string what = d == Direction::kForward ? "activations" : "gradients";
  const std::string name = lim.name;
  if (!a.underflows.empty()) {
    a.verdict = Verdict::kUnderflows;
    a.reasons.push_back(name + " (" + what +
                        ", scaled per tensor to its amax): " + layers(a.underflows.size()) +
                        " values lose more than " + percent(o.underflow_tolerance()) +
                        " to zero (" + list_scopes(a.underflows, false) + ")");
  } else if (raw_problem) {
    a.verdict = Verdict::kNeedsScaling;
    a.reasons.push_back(name + " (" + what +
                        "): unscaled values leave its range; scaled per tensor " +
                        "to its amax they lose " + percent(fraction(all_lost, all)) + " to zero");
  } else {
    a.reasons.push_back(name + " (" + what + "): in range even unscaled; " +
                        percent(fraction(all_lost, all)) + " to zero when scaled to amax");
  }
  return a;
}

}  // namespace

std::string to_string(Verdict v) {
  switch (v) {
    case Verdict::kSafe:
      return "safe";
    case Verdict::kNeedsScaling:
      return "needs scaling";
    case Verdict::kOverflows:
      return "overflows";
    case Verdict::kUnderflows:
      return "underflows";
  }
  return "?";
}

const FormatAdvice& PrecisionAdvice::at(Format f) const {
  for (const auto& a : formats) {
    if (a.format == f) return a;
  }
  TORCH_CHECK(false, "PrecisionAdvice: unknown format ", static_cast<int>(f));
}

PrecisionAdvice advise(const RangeStats& stats, const AdvisorOptions& options) {
  TORCH_CHECK(options.underflow_tolerance() >= 0 && options.underflow_tolerance() < 1,
              "advise: underflow_tolerance must be in [0, 1), got ", options.underflow_tolerance());
  TORCH_CHECK(options.headroom() >= 1, "advise: headroom must be >= 1, got ", options.headroom());
  PrecisionAdvice p;
  p.formats[0] = advise_16bit(Format::kFloat16, stats, options);
  p.formats[1] = advise_16bit(Format::kBFloat16, stats, options);
  p.formats[2] = advise_fp8(Format::kFloat8E4M3, stats, options);
  p.formats[3] = advise_fp8(Format::kFloat8E5M2, stats, options);
  const auto bf16 = p.verdict(Format::kBFloat16);
  const auto fp16 = p.verdict(Format::kFloat16);
  if (bf16 == Verdict::kSafe) {
    p.recommended = Format::kBFloat16;
    p.recommendation = "bf16: fp32's range, no loss scaling needed";
    if (fp16 == Verdict::kOverflows) p.recommendation += "; fp16 would overflow";
  } else if (fp16 == Verdict::kSafe || fp16 == Verdict::kNeedsScaling) {
    p.recommended = Format::kFloat16;
    p.recommendation = "fp16 with loss scaling (" +
                       three_digits(p.at(Format::kFloat16).loss_scale) +
                       "): bf16 loses gradients to zero";
  } else {
    p.recommended = Format::kBFloat16;
    p.recommendation =
        "neither 16-bit format is safe for every layer: keep the layers named above in fp32 "
        "(a cast policy) and run the rest in bf16";
  }
  return p;
}

std::string PrecisionAdvice::to_markdown() const {
  std::ostringstream m;
  m << "| format | verdict | loss scale | overflowing layers | underflowing layers |\n"
    << "| --- | --- | --- | --- | --- |\n";
  for (const auto& a : formats) {
    m << "| " << to_string(a.format) << " | " << to_string(a.verdict) << " | "
      << (a.format == Format::kFloat16 ? three_digits(a.loss_scale) : std::string("-")) << " | "
      << (a.overflows.empty() ? "-" : list_scopes(a.overflows, true)) << " | "
      << (a.underflows.empty() ? "-" : list_scopes(a.underflows, false)) << " |\n";
  }
  m << "\n";
  for (const auto& a : formats) {
    for (const auto& r : a.reasons) m << "- " << r << "\n";
  }
  m << "\n**Recommendation:** " << recommendation << "\n";
  return m.str();
}

std::string PrecisionAdvice::to_json() const {
  using ampx::detail::json_number;
  using ampx::detail::json_string;
  auto findings = [](const std::vector<ScopeFinding>& v) {
    std::ostringstream o;
    o << "[";
    for (size_t i = 0; i < v.size(); ++i) {
      o << (i ? ", " : "") << "{\"scope\": " << json_string(v[i].scope)
        << ", \"direction\": " << json_string(to_string(v[i].direction))
        << ", \"abs_max\": " << json_number(v[i].abs_max)
        << ", \"min_nonzero\": " << json_number(v[i].min_nonzero)
        << ", \"fraction_overflow\": " << json_number(v[i].fraction_overflow)
        << ", \"fraction_to_zero\": " << json_number(v[i].fraction_to_zero) << "}";
    }
    o << "]";
    return o.str();
  };
  std::ostringstream o;
  o << "{\"recommended\": " << json_string(to_string(recommended))
    << ", \"recommendation\": " << json_string(recommendation) << ", \"formats\": [";
  for (size_t i = 0; i < formats.size(); ++i) {
    const auto& a = formats[i];
    o << (i ? ", " : "") << "{\"format\": " << json_string(to_string(a.format))
      << ", \"verdict\": " << json_string(to_string(a.verdict))
      << ", \"loss_scale\": " << json_number(a.loss_scale)
      << ", \"overflows\": " << findings(a.overflows)
      << ", \"underflows\": " << findings(a.underflows) << ", \"reasons\": [";
    for (size_t r = 0; r < a.reasons.size(); ++r) o << (r ? ", " : "") << json_string(a.reasons[r]);
    o << "]}";
  }
  o << "]}";
  return o.str();
}

}  // namespace debug
}  // namespace ampx
